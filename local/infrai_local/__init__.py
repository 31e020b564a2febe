"""Local-only tools, never deployed, split by audience.

The top level holds the shared plumbing and the public entry points (``cli`` and its console
script ``command``, ``testkit``, ``public_imports``, ``project``); ``operator`` the on-call
commands and the console; ``authoring`` the scaffold that writes jobs; ``sandbox`` the local
stand-ins (emulator, local invoke, demo, embedded Postgres helper); ``checks`` the checks
``make build`` runs.
"""
