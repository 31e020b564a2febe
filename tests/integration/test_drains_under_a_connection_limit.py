"""Many drains, one database at its connection limit: twelve ``infrai-jobs drain`` processes of
two lanes each (24 connections wanted) as a role whose ``CONNECTION LIMIT`` is 6. A full
database is no outage: every job is done once, none is dead-lettered, no drain fails, and each
drain says it waited for a connection or shed a lane (docs/configuration.md, "The fleet's
connection budget").

So that the refusals happen on every run rather than when the machine happens to start the
processes close together, the test itself holds the role's six connections until every drain
has said it is waiting, then lets them go.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import psycopg
import pytest
from connection_limit import limited_role
from drainkit import API_KEY, COUNTING_JOBS, DLQ, QUEUE, Harness
from psycopg.conninfo import conninfo_to_dict

from infrai_local.sandbox.fan_out import CLI

DRAINS = 12
LANES = 2
CONNECTION_LIMIT = 6
JOBS = 300


@pytest.fixture
def limited_url(kit: Harness) -> Iterator[str]:
    """The harness's database as a new role allowed ``CONNECTION_LIMIT`` connections, with the
    rights a drain needs; the role is dropped afterwards."""
    with limited_role(kit.database_url, CONNECTION_LIMIT) as url:
        yield url


class DrainProcess:
    """``infrai-jobs drain`` in a child process, its output read as it comes."""

    def __init__(self, kit: Harness, jobs_path: Path, database_url: str) -> None:
        environment = {
            **os.environ,
            "INFRAI_BASE_URL": kit.server.url,
            "INFRAI_API_KEY": API_KEY,
            "INFRAI_QUEUE": QUEUE,
            "DATABASE_URL": database_url,
            "DRAIN_LANES": str(LANES),
        }
        self.process = subprocess.Popen(
            [*CLI, "drain", "--jobs-path", str(jobs_path), "--time-budget-seconds", "120"],
            env=environment,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self.waiting = threading.Event()
        self._readers = [
            threading.Thread(target=self._read, args=(self.process.stdout, self.stdout)),
            threading.Thread(target=self._read, args=(self.process.stderr, self.stderr)),
        ]
        for reader in self._readers:
            reader.start()

    def _read(self, stream: object, lines: list[str]) -> None:
        for line in stream:  # type: ignore[attr-defined]
            lines.append(line)
            if line.startswith("connection_wait"):
                self.waiting.set()
        self.waiting.set()  # the process ended: nothing more to wait for

    def finish(self) -> dict[str, object]:
        """Its exit code checked to be 0, and its summary (the JSON line on stdout)."""
        code = self.process.wait(timeout=180)
        self._close()
        assert code == 0, "".join(self.stderr)[-3000:]
        assert "Traceback" not in "".join(self.stderr)
        summary: dict[str, object] = json.loads(self.stdout[-1])
        return summary

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        self._close()

    def _close(self) -> None:
        for reader in self._readers:
            reader.join(timeout=30)
        for stream in (self.process.stdout, self.process.stderr):
            if stream is not None:
                stream.close()


def test_twelve_drains_of_two_lanes_under_a_six_connection_limit_do_every_job_once(
    kit: Harness, limited_url: str, tmp_path: Path
) -> None:
    # Given 300 database jobs waiting, and the role's six connections all taken
    jobs = tmp_path / "jobs"
    jobs.mkdir()
    (jobs / "__init__.py").write_text(COUNTING_JOBS)
    for number in range(JOBS):
        kit.client.publish(QUEUE, {"job": "test.db", "id": number})
    assert conninfo_to_dict(limited_url)["user"] != conninfo_to_dict(kit.database_url).get("user")
    with ExitStack() as stack:
        held = [stack.enter_context(psycopg.connect(limited_url)) for _ in range(CONNECTION_LIMIT)]
        # When twelve drains of two lanes start, as the role
        drains = [DrainProcess(kit, tmp_path, limited_url) for _ in range(DRAINS)]
        for drain in drains:
            stack.callback(drain.stop)
        # And the six connections are let go once every drain has found the database full
        for drain in drains:
            assert drain.waiting.wait(timeout=120), "".join(drain.stderr)[-3000:]
        for conn in held:
            conn.close()
        summaries = [drain.finish() for drain in drains]

    # Then no drain failed (finish() checked each exit code), and each said it waited
    for drain in drains:
        assert any(line.startswith("connection_wait") for line in drain.stderr), drain.stderr
    # And each either drained or gave up as full, having received nothing
    for summary in summaries:
        assert summary["stopped"] in {"empty", "database_full"}, summary
        if summary["stopped"] == "database_full":
            assert summary["consumed"] == 0
    # And every job was done exactly once, the queue is empty, and nothing was dead-lettered
    effects = kit.sql("SELECT idem_key, count(*) FROM test_effects GROUP BY idem_key")
    assert len(effects) == JOBS
    assert {count for _, count in effects} == {1}
    assert sum(int(str(s["consumed"])) for s in summaries) == JOBS
    stats = kit.client.stats(QUEUE)
    assert (stats.available_count, stats.in_flight_count) == (0, 0)
    assert kit.client.stats(DLQ).message_count == 0
    assert kit.sql("SELECT state, count(*) FROM job_claims GROUP BY state") == [("done", JOBS)]
