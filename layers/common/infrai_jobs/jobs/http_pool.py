"""A job's HTTP pool to its provider, built on the first call or by ``warm``.

``urllib3`` costs a function about 20-25 ms of cold start to import. A drain whose batches
hold only ``database`` jobs never calls a provider, so it never pays that. A rate-limited job
passes ``warm`` as its ``prepare``: flow control calls it before the job's first start is
reserved, so the import never stands between a reserved start and the call the provider counts.
The layer ships it so that every team's job (and every one ``infrai-jobs new-job`` writes) has
it, whatever the jobs package beside it holds.
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
