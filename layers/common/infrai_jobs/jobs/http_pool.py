"""A job's HTTP pool to its provider, built on the first call or by ``warm``; ``call`` sorts
what the provider answers into done, retried, uncertain or permanent, for every job alike.
Importing ``urllib3`` costs 20-25 ms of cold start, which a drain of ``database`` jobs never
pays. A rate-limited job passes ``warm`` as its ``prepare``, so the import never stands between
a reserved start and the call."""

from __future__ import annotations

import io
import threading
from typing import TYPE_CHECKING, Any

from infrai_jobs.errors import EffectUncertain, PermanentJobError

if TYPE_CHECKING:
    import urllib3


class LazyPool:
    """A ``urllib3.PoolManager`` without retries, created (once) by the first ``request``."""

    def __init__(self, *, connect_s: float, read_s: float, max_answer_bytes: int = 1 << 20) -> None:
        self._connect_s = connect_s
        self._read_s = read_s
        self.max_answer_bytes = max_answer_bytes  # 1 MiB by default; the queue client's: 16 MiB
        self._pool: urllib3.PoolManager | None = None
        self._lock = threading.Lock()  # lanes are threads: the first calls may race

    def request(self, method: str, url: str, **kwargs: Any) -> urllib3.BaseHTTPResponse:
        """The answer, preloaded (decoded) to ``max_answer_bytes``: a longer one raises urllib3's
        ``ProtocolError`` unread, as an answer cut short."""
        import urllib3  # noqa: PLC0415 (on first use: see the module's docstring)

        response = (self._pool or self.warm()).request(method, url, preload_content=False, **kwargs)
        body = response.read(self.max_answer_bytes + 1)  # read to its end, the pool has it back
        if len(body) > self.max_answer_bytes:
            response.close()
            raise urllib3.exceptions.ProtocolError(f"answer over {self.max_answer_bytes:,} bytes")
        kept: dict[str, Any] = {"decode_content": False, "enforce_content_length": False}
        return urllib3.HTTPResponse(io.BytesIO(body), response.headers, response.status, **kept)

    def call(
        self, method: str, url: str, *, provider: str, idempotent: bool = False, **kwargs: Any
    ) -> urllib3.BaseHTTPResponse:
        """``request`` an effect of ``provider`` (named in errors): a refused connection sent
        nothing (retried); a 4xx is refused (permanent); a lost answer or a 5xx may have acted
        (uncertain), unless the provider is ``idempotent`` (our key as ``Idempotency-Key``):
        then they, a 3xx, a 409 (the key's first call still running) and a 429 are retried."""
        import urllib3  # noqa: PLC0415 (on first use: see the module's docstring)

        try:
            response = self.request(method, url, **kwargs)
        except urllib3.exceptions.HTTPError as exc:
            if idempotent or isinstance(exc, urllib3.exceptions.NewConnectionError):
                raise
            raise EffectUncertain(f"{provider} call ended without an answer: {exc}") from exc
        status = response.status
        if 400 <= status < 500 and not (idempotent and status in (409, 429)):
            raise PermanentJobError(f"{provider} refused: HTTP {status}")
        if idempotent and status >= 300:
            raise RuntimeError(f"{provider} answered HTTP {status}; will retry")
        if status >= 500:
            raise EffectUncertain(f"{provider} answered {status}; it may have acted")
        return response

    def warm(self) -> urllib3.PoolManager:
        """Import urllib3 and build the pool, once; the pool."""
        with self._lock:
            if self._pool is None:
                import urllib3  # noqa: PLC0415 (on first use: see the module's docstring)

                timeout = urllib3.Timeout(connect=self._connect_s, read=self._read_s)
                self._pool = urllib3.PoolManager(retries=False, timeout=timeout)
            return self._pool
