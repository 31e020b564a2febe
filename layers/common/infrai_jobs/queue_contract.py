"""What Infrai's queue promises (docs/infrai-api.md), written down once: the client, the drain, the
settings, the emulator and the in-memory fake all read these; none keeps a copy of its own."""

from __future__ import annotations

from typing import Final

# A consume serves at most this many messages (a larger max_messages is served as this).
CONSUME_CAP: Final = 10
# A message whose third delivery is not acked moves to the queue's dead-letter queue.
MAX_RECEIVE_COUNT: Final = 3
# How long a consumed message stays hidden on a new queue.
DEFAULT_VISIBILITY_TIMEOUT_SECONDS: Final = 300
# (our choice) The longest delay_seconds a publish accepts.
MAX_DELAY_SECONDS: Final = 86_400
