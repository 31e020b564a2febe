"""A PgBouncer in ``pool_mode = transaction`` in front of the tests' PostgreSQL, started on
127.0.0.1 on a free port as the embedded PostgreSQL is: the proxy RDS Proxy and most hosted
poolers are, so a statement that relies on its session (a server-side prepared statement, a
session ``SET``, ``LISTEN``) meets another server connection in the next transaction.

Debian's ``pgbouncer`` package (``make test`` installs it, as its ``pgbouncer`` target says);
its absence fails the tests that need it, naming that target, never skips them. The many-drains
benchmark (bench/many_drains.py) starts its pooler with this module too, with a pool of its own
size."""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

# Fewer server connections than the drains' clients, so the pooler multiplexes them: a client's
# consecutive transactions meet different server connections, as under load in production.
POOL_SIZE = 3
MAX_CLIENTS = 200
_START_TIMEOUT_S = 15
MISSING = (
    "pgbouncer is not installed, and the pooler tier needs it: run `make pgbouncer` (as root or "
    "with sudo; `make test` runs it), which installs Debian's pgbouncer package"
)


@dataclass
class RunningPooler:
    """The pooler's address, process id and server connections per database, and what it
    logged (``log``), for a test's checks."""

    host: str
    port: int
    pid: int
    pool_size: int
    lines: list[str] = field(default_factory=list)

    def url_for(self, database_url: str) -> str:
        """``database_url`` (a database of the server behind the pooler) through the pooler."""
        return make_conninfo(database_url, host=self.host, port=str(self.port))

    def warm(self, database_url: str) -> None:
        """Open the pool's server connections to ``database_url``'s database at once, so that
        from here a client's consecutive transactions each meet another one of them."""
        clients = [psycopg.connect(self.url_for(database_url)) for _ in range(self.pool_size)]
        try:
            # Each client's open transaction holds a server connection of its own.
            servers = {conn.execute("SELECT pg_backend_pid()").fetchone() for conn in clients}
            assert len(servers) == self.pool_size, servers
        finally:
            for conn in clients:
                conn.commit()  # a client gone mid-transaction would take its server with it
                conn.close()

    @property
    def log(self) -> str:
        return "\n".join(self.lines)


def pgbouncer_binary() -> str | None:
    """Debian's pgbouncer, on PATH or in /usr/sbin (which a user's PATH may lack)."""
    return shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _config(server_url: str, folder: Path, port: int, pool_size: int, max_clients: int) -> Path:
    """pgbouncer.ini and its userlist in ``folder``: every database of the server at
    ``server_url``, its user trusted by the pooler, which logs in to the server as that user
    (with the URL's password, when the server asks for one), through at most ``pool_size``
    server connections per database."""
    server = conninfo_to_dict(server_url)
    host = str(server.get("host") or "127.0.0.1")
    user = str(server.get("user") or pwd.getpwuid(os.getuid()).pw_name)
    userlist = folder / "userlist.txt"
    password = str(server.get("password") or "").replace('"', '""')
    userlist.write_text(f'"{user}" "{password}"\n', encoding="utf-8")
    lines = [
        "[databases]",
        f"* = host={host} port={server.get('port') or 5432}",
        "[pgbouncer]",
        "listen_addr = 127.0.0.1",
        f"listen_port = {port}",
        "unix_socket_dir =",
        "auth_type = trust",
        f"auth_file = {userlist}",
        "pool_mode = transaction",
        f"default_pool_size = {pool_size}",
        f"max_db_connections = {pool_size}",
        f"max_client_conn = {max_clients}",
        # Round robin: a client's next transaction goes to the server connection idle longest,
        # not to the one it just released (``warm``).
        "server_round_robin = 1",
        "log_connections = 0",
        "log_disconnections = 0",
    ]
    if os.getuid() == 0:
        # PgBouncer refuses to run as root: it changes to the owner of a unix socket's folder
        # (the embedded server's), else to nobody.
        owner = os.stat(host).st_uid if host.startswith("/") else pwd.getpwnam("nobody").pw_uid
        lines.append(f"user = {pwd.getpwuid(owner).pw_name}")
        for path in (folder, userlist):
            os.chown(path, owner, -1)
    ini = folder / "pgbouncer.ini"
    ini.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return ini


@contextmanager
def running_pgbouncer(
    server_url: str, *, pool_size: int = POOL_SIZE, max_clients: int = MAX_CLIENTS
) -> Iterator[RunningPooler]:
    """A pgbouncer in transaction mode before the server at ``server_url``, ``pool_size``
    server connections per database shared by up to ``max_clients`` clients, stopped (by its
    own process id) when the block ends."""
    binary = pgbouncer_binary()
    if binary is None:
        raise RuntimeError(MISSING)
    with tempfile.TemporaryDirectory(prefix="infrai-pgbouncer-") as scratch:
        port = _free_port()
        ini = _config(server_url, Path(scratch), port, pool_size, max_clients)
        process = subprocess.Popen(
            [binary, str(ini)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        pooler = RunningPooler("127.0.0.1", port, process.pid, pool_size)
        up = threading.Event()

        def read_log() -> None:
            assert process.stderr is not None
            for line in process.stderr:
                pooler.lines.append(line.rstrip("\n"))
                if "process up" in line:
                    up.set()
            up.set()  # it exited: the check below says so

        reader = threading.Thread(target=read_log, daemon=True)
        reader.start()
        try:
            if not up.wait(_START_TIMEOUT_S) or process.poll() is not None:
                raise RuntimeError(f"pgbouncer did not start:\n{pooler.log}")
            yield pooler
        finally:
            process.terminate()
            process.wait(timeout=10)
            reader.join(timeout=10)
            if process.stderr is not None:
                process.stderr.close()
