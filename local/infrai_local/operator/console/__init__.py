"""The operator console (``infrai-jobs console``): one page of what needs a human, served on
127.0.0.1, acting only through the on-call commands. Local tooling: never part of the layer.

``commands`` runs the commands and reads the ledger, ``guard`` decides who may read and act,
``views`` renders the pages, ``chart`` draws the outcomes of the last hour, ``server`` starts it.
"""
