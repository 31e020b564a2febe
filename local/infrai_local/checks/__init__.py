"""The checks ``make build`` runs (``python -m infrai_local.checks.<name>``, or
``infrai-jobs build-check``). Never deployed."""
