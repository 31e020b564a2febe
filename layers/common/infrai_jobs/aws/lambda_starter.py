"""Starting another DrainFunction invocation: Lambda ``Invoke`` with ``InvocationType=Event``
(the template turns async retries off: the next check or tick looks at the backlog again anyway).
boto3 is imported on the first start, never at cold start: most drains never fan out."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from infrai_jobs.errors import FanOutError, FanOutThrottled

# Lambda's answers that mean "no capacity now" rather than "something is wrong".
_THROTTLE_CODES = frozenset(
    {"TooManyRequestsException", "ThrottlingException", "EC2ThrottledException"}
)


class LambdaDrainStarter:
    """``DrainStarterPort`` on Lambda's Invoke API."""

    def __init__(self, function_name: str) -> None:
        self.function_name = function_name
        self._client: Any = None

    def __repr__(self) -> str:
        return f"LambdaDrainStarter({self.function_name!r})"

    def start(self, event: Mapping[str, Any]) -> None:
        from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415

        try:
            answer = self._lambda().invoke(
                FunctionName=self.function_name,
                InvocationType="Event",
                Payload=json.dumps(event).encode(),
            )
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in _THROTTLE_CODES:
                raise FanOutThrottled(f"Lambda throttled the invoke ({code})") from exc
            raise FanOutError(f"Lambda refused the invoke ({code}): {exc}") from exc
        except BotoCoreError as exc:
            raise FanOutError(f"could not reach Lambda to invoke: {exc}") from exc
        status = answer.get("StatusCode")
        if status != 202:
            raise FanOutError(f"Lambda answered the async invoke with status {status}")

    def _lambda(self) -> Any:
        if self._client is None:
            import boto3  # noqa: PLC0415 - only a drain that fans out needs it
            from botocore.config import Config  # noqa: PLC0415

            # One attempt, short timeouts: a throttled invoke is counted, not waited out.
            config = Config(
                retries={"total_max_attempts": 1, "mode": "standard"},
                connect_timeout=2,
                read_timeout=5,
            )
            self._client = boto3.client("lambda", config=config)
        return self._client
