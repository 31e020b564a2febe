"""infrai-jobs: process jobs from Infrai's at-least-once queue so that each one takes effect once.
Nothing here opens a connection or reads the environment at import time: import the module you
need (``queue.client``, ``drain.loop``, ...)."""

__version__ = "0.2.0"
