"""The producers' transactional outbox: enqueue inside a business transaction, relay to Infrai."""

from infrai_jobs.outbox.rows import OutboxRow
from infrai_jobs.outbox.writer import enqueue

__all__ = ["OutboxRow", "enqueue"]
