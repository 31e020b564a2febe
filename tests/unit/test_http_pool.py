"""The one rule that sorts a provider's answer for a job (``LazyPool.call``): what each answer,
or each way a call ends without one, means for the claim, for an irreversible provider and for
an idempotent one."""

from __future__ import annotations

from typing import Any

import pytest
import urllib3

from infrai_jobs.errors import EffectUncertain, PermanentJobError
from infrai_jobs.jobs.http_pool import LazyPool


class _Answering(LazyPool):
    """A pool whose every request is answered with ``status``, or ends by raising ``raises``."""

    def __init__(self, status: int = 200, raises: Exception | None = None) -> None:
        super().__init__(connect_s=1.0, read_s=1.0)
        self.status = status
        self.raises = raises

    def request(self, method: str, url: str, **kwargs: Any) -> urllib3.BaseHTTPResponse:
        if self.raises is not None:
            raise self.raises
        return urllib3.HTTPResponse(body=b"{}", status=self.status)


def _call(pool: LazyPool, *, idempotent: bool) -> int:
    return pool.call("POST", "http://127.0.0.1:9/x", provider="p", idempotent=idempotent).status


# (status, what an irreversible provider's answer raises, what an idempotent one's raises);
# None: the answer is returned.
ANSWERS = [
    (200, None, None),
    (201, None, None),
    (302, None, RuntimeError),
    (400, PermanentJobError, PermanentJobError),
    (404, PermanentJobError, PermanentJobError),
    (409, PermanentJobError, RuntimeError),
    (429, PermanentJobError, RuntimeError),
    (500, EffectUncertain, RuntimeError),
    (503, EffectUncertain, RuntimeError),
]


@pytest.mark.parametrize(("status", "irreversible", "idempotent"), ANSWERS)
def test_an_answer_is_returned_or_raised_as_what_it_means(
    status: int, irreversible: type[Exception] | None, idempotent: type[Exception] | None
) -> None:
    for is_idempotent, expected in ((False, irreversible), (True, idempotent)):
        pool = _Answering(status)
        if expected is None:
            assert _call(pool, idempotent=is_idempotent) == status
            continue
        with pytest.raises(expected, match=f"^p .*{status}") as raised:
            _call(pool, idempotent=is_idempotent)
        assert type(raised.value) is expected


def test_a_refused_connection_sent_nothing_and_stays_transient() -> None:
    refused = urllib3.exceptions.NewConnectionError(None, "refused")  # type: ignore[arg-type]
    for idempotent in (False, True):
        with pytest.raises(urllib3.exceptions.NewConnectionError):
            _call(_Answering(raises=refused), idempotent=idempotent)


def test_a_call_ended_without_an_answer_is_uncertain_unless_the_provider_is_idempotent() -> None:
    lost = urllib3.exceptions.ReadTimeoutError(None, "/x", "read timed out")  # type: ignore[arg-type]
    with pytest.raises(EffectUncertain, match="p call ended without an answer") as raised:
        _call(_Answering(raises=lost), idempotent=False)
    assert raised.value.__cause__ is lost
    with pytest.raises(urllib3.exceptions.ReadTimeoutError):
        _call(_Answering(raises=lost), idempotent=True)
