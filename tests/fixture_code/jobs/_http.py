"""The pool a job ``infrai-jobs new-job`` scaffolds imports (``from jobs._http import
LazyPool``): a team's package holds it beside the example jobs, so this one, laid out as a
team's, holds it too, built on the fixture jobs' own provider client."""

from __future__ import annotations

from typing import Any

from fixture_jobs.provider import Provider


class LazyPool(Provider):
    """A pool without retries, built on first use or by ``warm``."""

    def __init__(self, *, connect_s: float, read_s: float) -> None:
        super().__init__("", read_timeout=read_s, connect_timeout=connect_s)

    def warm(self) -> Any:
        return self.prepare()
