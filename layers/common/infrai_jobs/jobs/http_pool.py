"""A job's HTTP pool to its provider, built on the first call or by ``warm``.

Importing ``urllib3`` costs 20-25 ms of cold start, which a drain of ``database`` jobs never
pays. A rate-limited job passes ``warm`` as its ``prepare``, so the import never stands between
a reserved start and the call.
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
        return (self._pool or self.warm()).request(method, url, **kwargs)

    def warm(self) -> urllib3.PoolManager:
        """Import urllib3 and build the pool, once; the pool."""
        with self._lock:
            if self._pool is None:
                import urllib3  # noqa: PLC0415 (on first use: see the module's docstring)

                timeout = urllib3.Timeout(connect=self._connect_s, read=self._read_s)
                self._pool = urllib3.PoolManager(retries=False, timeout=timeout)
            return self._pool
