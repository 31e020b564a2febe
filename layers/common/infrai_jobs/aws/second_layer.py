"""The optional second layer: Powertools idempotency around the effect of external jobs, run
after the ledger claim was won, for when the ledger's row is gone; what it is for and what each
case stores and returns: docs/design.md, "Second layer". Why "uncertain" is stored as COMPLETED:
Powertools deletes its record whenever the wrapped call raises, so a raised ``EffectUncertain``
would leave the key free for a later delivery to repeat the effect. The wrapped call returns an
envelope saying "uncertain" instead, and the guard raises ``EffectUncertain`` again outside, fresh
or replayed: a stuck irreversible job stays stuck (until an operator's ``forget``)."""

from __future__ import annotations

import json
import logging
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, cast

# Importing this imports boto3: only ``factory.make_effect_guard`` does, with a backend on.
from aws_lambda_powertools.utilities.idempotency import (
    DynamoDBPersistenceLayer,
    IdempotencyConfig,
    idempotent_function,
)
from aws_lambda_powertools.utilities.idempotency.exceptions import BaseError as IdempotencyError
from aws_lambda_powertools.utilities.idempotency.exceptions import (
    IdempotencyAlreadyInProgressError,
    IdempotencyValidationError,
)

from infrai_jobs.errors import (
    EffectInProgress,
    EffectUncertain,
    InfraiJobsError,
    PermanentJobError,
    SecondLayerUnavailable,
)

if TYPE_CHECKING:
    from aws_lambda_powertools.utilities.idempotency.persistence.base import BasePersistenceLayer
    from aws_lambda_powertools.utilities.idempotency.persistence.cache import CacheClientProtocol
    from aws_lambda_powertools.utilities.idempotency.persistence.datarecord import DataRecord
    from aws_lambda_powertools.utilities.typing import LambdaContext

logger = logging.getLogger(__name__)

# Fixed, so records keep matching after the function is renamed, moved or redeployed under
# another stack name (Powertools' default prefix is the function's name and module).
KEY_PREFIX = "infrai-jobs"
# Seconds Redis may take to connect or answer before the call fails as transient.
REDIS_TIMEOUT_SECONDS = 2.0

_DONE = "done"
_UNCERTAIN = "uncertain"


def record_expiry_seconds(retention_days: int) -> int:
    """The ledger's retention plus the day the daily prune may lag: a record outlives the
    ledger row it backs up."""
    return (retention_days + 1) * 86_400


@dataclass
class _Attempt:
    """What happened inside one guarded call, seen from outside Powertools."""

    call: Callable[[], Any]
    entered: bool = False
    envelope: dict[str, Any] | None = None
    uncertain: EffectUncertain | None = None
    raised: Exception | None = None


def _run_effect(*, work: dict[str, str], attempt: _Attempt) -> dict[str, Any]:
    """The function Powertools wraps; ``work`` is what it hashes (key) and validates."""
    attempt.entered = True
    try:
        result = attempt.call()
    except EffectUncertain as exc:
        # Returned, not raised: a raise would make Powertools delete the record (see above).
        attempt.uncertain = exc
        attempt.envelope = {"effect": _UNCERTAIN, "error": str(exc)}
    except Exception as exc:
        # Kept, so it still decides the outcome if Powertools then fails to delete its record.
        attempt.raised = exc
        raise
    else:
        # An envelope: Powertools replays an empty result as None, and no handler result can
        # be mistaken for the "uncertain" marker.
        attempt.envelope = {"effect": _DONE, "result": result}
    return attempt.envelope


class SecondLayer:
    """An ``EffectGuard`` backed by a Powertools persistence layer (DynamoDB or Redis)."""

    def __init__(
        self,
        store: BasePersistenceLayer,
        *,
        expires_after_seconds: int,
        key_prefix: str = KEY_PREFIX,
    ) -> None:
        self._store = store
        self._key_prefix = key_prefix
        self._config = IdempotencyConfig(
            event_key_jmespath="idem_key",
            payload_validation_jmespath="fingerprint",
            raise_on_no_idempotency_key=True,
            expires_after_seconds=expires_after_seconds,
            # Keys of jobs without a natural identity come from producer-controlled payloads;
            # MD5 (the default) collisions can be manufactured, SHA-256 ones cannot.
            hash_function="sha256",
        )
        # Any: a replayed answer is whatever JSON the store holds.
        self._guarded: Callable[..., Any] = idempotent_function(
            _run_effect,
            data_keyword_argument="work",
            persistence_store=store,
            config=self._config,
            key_prefix=key_prefix,
        )
        self._lock = threading.Lock()
        self._hits = 0

    def start_invocation(self, time_left_ms: Callable[[], int]) -> None:
        """Let in-progress records expire with this invocation; call at every invocation."""
        context = SimpleNamespace(get_remaining_time_in_millis=time_left_ms)
        self._config.register_lambda_context(cast("LambdaContext", context))

    def take_hits(self) -> int:
        """Calls answered from the store without running the effect, since the last take: what
        one invocation adds to ``SecondLayerHits``."""
        with self._lock:
            fresh, self._hits = self._hits, 0
            return fresh

    def run(self, idem_key: str, fingerprint: str, call: Callable[[], Any]) -> Any:
        attempt = _Attempt(call)
        work = {"idem_key": idem_key, "fingerprint": fingerprint}
        try:
            envelope = self._guarded(work=work, attempt=attempt)
        except IdempotencyError as exc:
            envelope = self._settle_store_error(exc, attempt, idem_key)
        effect = envelope.get("effect") if isinstance(envelope, dict) else None
        if not attempt.entered:
            with self._lock:
                self._hits += 1
            logger.info(
                "second layer replayed a recorded effect; the effect was not repeated",
                extra={"action": "second_layer_hit", "idem_key": idem_key, "replayed": effect},
            )
        return _unwrap(envelope, effect, attempt, idem_key)

    def forget(self, idem_key: str) -> None:
        """Drop a key's record, so its next claim runs the effect again (for an operator who
        releases a stuck job's claim: the stored "uncertain" would park the retry again)."""
        self._store.configure(self._config, key_prefix=self._key_prefix)
        forgotten = InfraiJobsError(f"released by an operator: {idem_key}")
        try:
            self._store.delete_record({"idem_key": idem_key, "fingerprint": ""}, forgotten)
        except Exception as exc:
            # Called directly, Powertools passes the driver's own errors (botocore, redis) up.
            message = f"second layer: could not forget {idem_key}: {exc}"
            raise SecondLayerUnavailable(message) from exc
        logger.info(
            "second layer record forgotten",
            extra={"action": "second_layer_forgotten", "idem_key": idem_key},
        )

    def _settle_store_error(
        self, exc: IdempotencyError, attempt: _Attempt, idem_key: str
    ) -> dict[str, Any]:
        if attempt.raised is not None:
            # The handler's failure is the truth; the in-progress record expires by itself.
            logger.warning(
                "second layer could not clear its record",
                extra={"action": "second_layer_store_failed", "idem_key": idem_key},
            )
            raise attempt.raised from exc
        if attempt.envelope is not None:
            # The effect happened; only recording it failed. Never turn that into a retry.
            logger.warning(
                "second layer could not record a finished effect: %s",
                exc,
                extra={"action": "second_layer_store_failed", "idem_key": idem_key},
            )
            return attempt.envelope
        if isinstance(exc, IdempotencyValidationError):
            raise PermanentJobError(
                f"second layer: same key, different work: {idem_key} was recorded with "
                "another payload fingerprint (its ledger row is gone)"
            ) from exc
        if isinstance(exc, IdempotencyAlreadyInProgressError):
            raise EffectInProgress(
                f"second layer: another call for {idem_key} is running its effect now"
            ) from exc
        raise SecondLayerUnavailable(f"second layer: idempotency store failed: {exc}") from exc


def _unwrap(envelope: Any, effect: Any, attempt: _Attempt, idem_key: str) -> Any:
    if effect == _DONE:
        return envelope.get("result")
    if effect == _UNCERTAIN:
        if attempt.uncertain is not None:
            raise attempt.uncertain
        raise EffectUncertain(
            f"{envelope.get('error')} (replayed by the second layer: the first call's outcome "
            "was uncertain, so the effect is not repeated)"
        )
    # A completed record this code cannot read: something ran, so it must not run again.
    raise EffectUncertain(f"second layer: unreadable record for {idem_key}: {envelope!r}")


def dynamodb_store(table_name: str, *, client: Any = None) -> BasePersistenceLayer:
    """The table the template creates: partition key ``id``, TTL on ``expiration``."""
    return DynamoDBPersistenceLayer(table_name=table_name, boto3_client=client)


def redis_store(
    url: str = "", *, client: CacheClientProtocol | None = None
) -> BasePersistenceLayer:
    """A Redis/Valkey store from a ``redis://`` or ``rediss://`` URL, or a ready client."""
    from aws_lambda_powertools.utilities.idempotency.persistence.cache import (  # noqa: PLC0415
        CachePersistenceLayer,
    )

    if client is None:
        import redis  # noqa: PLC0415

        # Our own client, to bound how long a dead server can hold the drain.
        connection = redis.Redis.from_url(
            url, socket_timeout=REDIS_TIMEOUT_SECONDS, socket_connect_timeout=REDIS_TIMEOUT_SECONDS
        )
        client = cast("CacheClientProtocol", connection)

    with warnings.catch_warnings():
        # Powertools marks the class behind its recommended ``CachePersistenceLayer`` alias as
        # deprecated, so subclassing the recommended name warns.
        warnings.simplefilter("ignore", DeprecationWarning)

        class ValidatingCachePersistenceLayer(CachePersistenceLayer):
            """Keeps the payload hash when a record completes: docs/design.md, "A Powertools
            bug the Redis backend works around"."""

            def _update_record(self, data_record: DataRecord) -> None:
                mapping: dict[str, Any] = {
                    self.data_attr: data_record.response_data,
                    self.status_attr: data_record.status,
                    self.expiry_attr: data_record.expiry_timestamp,
                }
                if self.payload_validation_enabled:
                    mapping[self.validation_key_attr] = data_record.payload_hash
                self.client.set(
                    name=data_record.idempotency_key,
                    value=json.dumps(mapping),
                    ex=self._get_expiry_second(data_record.expiry_timestamp),
                )

        return cast("BasePersistenceLayer", ValidatingCachePersistenceLayer(client=client))
