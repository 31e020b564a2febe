"""A login role with a ``CONNECTION LIMIT``, for drains that meet a full database: the
connection-limit tests log in as one, and so does the many-drains benchmark
(bench/many_drains.py)."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo


@contextmanager
def limited_role(database_url: str, limit: int) -> Iterator[str]:
    """``database_url`` as a new login role allowed ``limit`` connections, with the rights a
    drain needs on the database's tables; the role is dropped afterwards."""
    role = f"infrai_limited_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(database_url, autocommit=True) as admin:
        admin.execute(
            sql.SQL("CREATE ROLE {} LOGIN CONNECTION LIMIT {}").format(
                sql.Identifier(role), sql.Literal(limit)
            )
        )
        for objects in ("TABLES", "SEQUENCES"):
            grant = f"GRANT ALL ON ALL {objects} IN SCHEMA public TO {{}}"
            admin.execute(sql.SQL(grant).format(sql.Identifier(role)))
    try:
        yield make_conninfo(database_url, user=role, password="")
    finally:
        with psycopg.connect(database_url, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", [role]
            )
            admin.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))
