"""How the fixture jobs reach their provider: the layer's pool, one per job, without retries."""

from __future__ import annotations

from infrai_jobs.jobs.http_pool import LazyPool
from infrai_jobs.jobs.registry import JobContext


class Provider(LazyPool):
    """The endpoint a job's setting names. The pool is built once, on first use or by ``warm``
    (the job's ``prepare``: what a rate-limited job runs before its first start is reserved)."""

    def __init__(self, setting: str, read_timeout: float, connect_timeout: float = 2.0) -> None:
        super().__init__(connect_s=connect_timeout, read_s=read_timeout)
        self.setting = setting

    def url(self, ctx: JobContext, path: str) -> str:
        return f"{ctx.settings[self.setting]}{path}"
