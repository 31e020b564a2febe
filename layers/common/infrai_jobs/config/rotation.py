"""Fetching a rotated secret again, once, after it stopped working (a failed ledger connection,
a 401 from the queue): past the secret store's cache, and used only if it actually changed."""

from __future__ import annotations

import logging
from collections.abc import Callable

from infrai_jobs.errors import InfraiJobsError

logger = logging.getLogger(__name__)


def fetch_again(refresh: Callable[[], str] | None, current: str, what: str) -> str | None:
    """A different value from the secret store, or None when there is nothing new to try."""
    if refresh is None:
        return None
    try:
        fresh = refresh()
    except InfraiJobsError as exc:
        logger.warning(
            "could not fetch the %s again",
            what,
            extra={"action": "secret_refresh_failed", "detail": str(exc)},
        )
        return None
    return fresh if fresh and fresh != current else None
