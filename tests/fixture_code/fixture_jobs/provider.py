"""How the fixture jobs reach their provider: one urllib3 pool per job, without retries."""

from __future__ import annotations

import threading
from typing import Any

from infrai_jobs.jobs.registry import JobContext


class Provider:
    """The endpoint a job's setting names. The pool is built once, on first use or by
    ``prepare`` (what a rate-limited job runs before its first start is reserved)."""

    def __init__(self, setting: str, read_timeout: float, connect_timeout: float = 2.0) -> None:
        self.setting = setting
        self._timeouts = {"connect": connect_timeout, "read": read_timeout}
        self._pool: Any = None
        self._building = threading.Lock()  # lanes are threads

    def url(self, ctx: JobContext, path: str) -> str:
        return f"{ctx.settings[self.setting]}{path}"

    def prepare(self) -> Any:
        import urllib3  # noqa: PLC0415 - a drain of database jobs alone never pays for it

        with self._building:
            if self._pool is None:
                timeout = urllib3.Timeout(**self._timeouts)
                self._pool = urllib3.PoolManager(retries=False, timeout=timeout)
        return self._pool

    def request(self, method: str, url: str, **options: Any) -> Any:
        return (self._pool or self.prepare()).request(method, url, **options)
