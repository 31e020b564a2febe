"""The Powertools bug ``second_layer.redis_store`` works around, watched on a real Redis.

aws-lambda-powertools 3.37.0 (Python), ``aws_lambda_powertools/utilities/idempotency/persistence/
redis.py``: ``RedisCachePersistenceLayer._update_record`` (the class behind the recommended
``CachePersistenceLayer`` alias) writes a completed record as ``data``, ``status`` and
``expiration`` only. The ``validation`` field (``validation_key_attr``) that
``_put_in_progress_record`` wrote is lost, so with ``payload_validation_jmespath`` set and the
local cache off (the default) the next identical call raises ``IdempotencyValidationError``. The
TypeScript port had the same bug (aws-powertools/powertools-lambda-typescript#5705, fixed by
#5706); the DynamoDB layer keeps the field.

The first test fails once an upgraded Powertools keeps the field: then
``ValidatingCachePersistenceLayer`` in ``layers/common/infrai_jobs/aws/second_layer.py`` can go.
"""

from __future__ import annotations

import json
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from aws_lambda_powertools.utilities.idempotency import IdempotencyConfig, idempotent_function
from aws_lambda_powertools.utilities.idempotency.exceptions import IdempotencyValidationError
from aws_lambda_powertools.utilities.idempotency.persistence.cache import CachePersistenceLayer

from infrai_jobs.aws.second_layer import KEY_PREFIX, redis_store

WORK = {"idem_key": "receipt.send:inv_1", "fingerprint": "sha256:of-the-payload"}


class InvocationContext:
    """What Powertools reads from a Lambda context: the time left, for in-progress records."""

    def get_remaining_time_in_millis(self) -> int:
        return 60_000


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    connection = redis.Redis.from_url(redis_url)
    yield connection
    connection.close()


@pytest.fixture
def prefix(client: redis.Redis) -> Iterator[str]:
    """A key prefix of this test's own; only its keys are deleted afterwards."""
    own = f"{KEY_PREFIX}-powertools-bug-{uuid.uuid4().hex}"
    yield own
    for key in client.scan_iter(match=f"{own}#*"):
        client.delete(key)


def guarded(store: Any, prefix: str, calls: list[dict[str, str]]) -> Callable[..., Any]:
    """An effect behind Powertools idempotency, configured as ``SecondLayer`` configures it."""

    def effect(*, work: dict[str, str]) -> dict[str, str]:
        calls.append(work)
        return {"sent": work["idem_key"]}

    config = IdempotencyConfig(
        event_key_jmespath="idem_key",
        payload_validation_jmespath="fingerprint",
        raise_on_no_idempotency_key=True,
        hash_function="sha256",
    )
    config.register_lambda_context(InvocationContext())
    return idempotent_function(
        effect,
        data_keyword_argument="work",
        persistence_store=store,
        config=config,
        key_prefix=prefix,
    )


def stored_record(client: redis.Redis, prefix: str) -> dict[str, Any]:
    (key,) = list(client.scan_iter(match=f"{prefix}#*"))
    raw = client.get(key)
    assert isinstance(raw, bytes)
    record: dict[str, Any] = json.loads(raw)
    return record


def test_powertools_cache_layer_still_drops_the_validation_hash_when_a_record_completes(
    client: redis.Redis, prefix: str
) -> None:
    # Given Powertools' own cache layer, payload validation on, as the second layer uses it
    with warnings.catch_warnings():
        # The class behind the recommended alias is marked deprecated: naming it warns.
        warnings.simplefilter("ignore", DeprecationWarning)
        store = CachePersistenceLayer(client=client)
    calls: list[dict[str, str]] = []
    call = guarded(store, prefix, calls)
    # When an effect completes once
    assert call(work=dict(WORK)) == {"sent": WORK["idem_key"]}
    record = stored_record(client, prefix)
    # Then the completed record has lost its validation field (the bug: when this fails,
    # Powertools keeps it, and ValidatingCachePersistenceLayer in second_layer.py can go)
    assert record["status"] == "COMPLETED"
    assert "validation" not in record, (
        "Powertools' CachePersistenceLayer now keeps the payload hash of a completed record: "
        "remove ValidatingCachePersistenceLayer from infrai_jobs/aws/second_layer.py and the note "
        "in docs/design.md's second-layer section"
    )
    # And the very same work, asked again, fails validation instead of replaying
    with pytest.raises(IdempotencyValidationError):
        call(work=dict(WORK))
    assert len(calls) == 1


def test_the_second_layers_redis_store_keeps_the_hash_and_replays(
    client: redis.Redis, prefix: str
) -> None:
    # Given the second layer's Redis store (the subclass that works around the bug)
    calls: list[dict[str, str]] = []
    call = guarded(redis_store(client=client), prefix, calls)
    # When the same work completes once and is asked again
    first = call(work=dict(WORK))
    record = stored_record(client, prefix)
    second = call(work=dict(WORK))
    # Then the completed record keeps its validation field and the second call is a replay
    assert record["status"] == "COMPLETED"
    assert record["validation"]
    assert first == second == {"sent": WORK["idem_key"]}
    assert len(calls) == 1
    # And different work under the same key still fails validation
    with pytest.raises(IdempotencyValidationError):
        call(work={**WORK, "fingerprint": "sha256:of-other-work"})
