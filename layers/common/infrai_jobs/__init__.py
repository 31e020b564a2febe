"""infrai-jobs: process jobs from Infrai's at-least-once queue so that each one takes effect once.

The package is deliberately light at import time: nothing here opens a connection or reads the
environment. Import the module you need (``queue.client``, ``drain.loop``, ...).
"""

__version__ = "0.1.0"
