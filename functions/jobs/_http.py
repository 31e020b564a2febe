"""The example jobs' HTTP pool to the provider, built on the first call.

``urllib3`` costs DrainFunction about 25 ms of cold start to import. A drain whose batches hold
only ``database`` jobs never calls a provider, so it never pays that.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import urllib3


class LazyPool:
    """A ``urllib3.PoolManager`` without retries, created (once) by the first ``request``."""

    def __init__(self, *, connect_s: float, read_s: float) -> None:
        self._connect_s = connect_s
        self._read_s = read_s
        self._pool: urllib3.PoolManager | None = None
        self._lock = threading.Lock()  # lanes are threads: the first calls may race

    def request(self, method: str, url: str, **kwargs: Any) -> urllib3.BaseHTTPResponse:
        pool = self._pool
        if pool is None:
            with self._lock:
                if self._pool is None:
                    import urllib3  # noqa: PLC0415 (on first use: see the module's docstring)

                    timeout = urllib3.Timeout(connect=self._connect_s, read=self._read_s)
                    self._pool = urllib3.PoolManager(retries=False, timeout=timeout)
                pool = self._pool
        return pool.request(method, url, **kwargs)
