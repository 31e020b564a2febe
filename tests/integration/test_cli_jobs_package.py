"""The operator's commands find the drain's jobs package wherever they are run from, and derive
keys with its registry, as DrainFunction does; without one they stop before reading a message.

``infrai-jobs`` runs in a child process against a real PostgreSQL and the emulator over HTTP.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from drainkit import DLQ, QUEUE, Harness, run_cli

# receipt.send keys by its own rule (receipt.send:{invoice_id}); the layer knows no such rule.
RECEIPT = {"job": "receipt.send", "invoice_id": "inv_far", "email": "ada@example.com"}


def failed_receipt_in_the_dlq(kit: Harness) -> str:
    """A receipt whose claim failed, dead-lettered; returns its message id."""
    derived = kit.registry.derive(RECEIPT)
    kit.sql(
        "INSERT INTO job_claims (idem_key, state, message_id, effect, payload_sha256, error)"
        " VALUES (%s, 'failed', 'qmsg_first', 'external', %s, 'mailbox full')",
        (derived.idem_key, derived.fingerprint),
    )
    return kit.client.publish(DLQ, RECEIPT)


def test_dlq_away_from_the_project_names_the_claim_by_the_jobs_own_rule(
    kit: Harness, tmp_path: Path
) -> None:
    # Given a failed receipt in the DLQ, and an operator in a folder outside the project
    message_id = failed_receipt_in_the_dlq(kit)
    # When they list the DLQ from there
    listed = run_cli(kit, "dlq", "--json", cwd=tmp_path)
    # Then the key is the job's own, and the ledger's row and reason are shown
    assert listed.returncode == 0, listed.stderr
    (row,) = json.loads(listed.stdout)["messages"]
    assert row["message_id"] == message_id
    assert row["idem_key"] == "receipt.send:inv_far"
    assert row["state"] == "failed"
    assert "mailbox full" in row["reason"]


def test_redrive_by_key_from_a_subfolder_moves_the_jobs_dead_letter(kit: Harness) -> None:
    # Given the failed receipt dead-lettered beside another job's
    failed_receipt_in_the_dlq(kit)
    other = kit.client.publish(DLQ, {"job": "test.db", "id": "stays"})
    # When the operator redrives its key from a folder below the project root
    below = Path(__file__).resolve().parent
    moved = run_cli(
        kit, "redrive", "--key", "receipt.send:inv_far", "--reopen-failed", "--json", cwd=below
    )
    # Then both moved into the ledger, and only the receipt (its failed claim reopened) went
    # back to the queue
    assert moved.returncode == 0, moved.stderr
    summary = json.loads(moved.stdout)
    assert (summary["published"], summary["acked"], summary["not_selected"]) == (1, 2, 1)
    (back,) = kit.client.consume(QUEUE)
    assert back.payload == RECEIPT
    listed = json.loads(run_cli(kit, "dlq", "--json", cwd=below).stdout)["messages"]
    assert [m["message_id"] for m in listed] == [other]


@pytest.mark.parametrize(
    "argv",
    [
        ("dlq",),
        ("dlq", "discard", "--key", "receipt.send:inv_far"),
        ("redrive", "--dry-run"),
        ("redrive", "--key", "receipt.send:inv_far"),
    ],
    ids=" ".join,
)
def test_without_the_jobs_package_key_commands_stop_before_reading_a_message(
    kit: Harness, tmp_path: Path, argv: tuple[str, ...]
) -> None:
    # Given a dead letter, and INFRAI_JOBS_PATH naming a folder with no jobs package
    message_id = failed_receipt_in_the_dlq(kit)
    # When a command that derives keys runs
    finished = run_cli(kit, *argv, cwd=tmp_path, INFRAI_JOBS_PATH=str(tmp_path))
    # Then it is a configuration error naming the variable, in one line, no traceback
    assert finished.returncode == 2, finished.stdout + finished.stderr
    assert "INFRAI_JOBS_PATH" in finished.stderr
    assert "holds no jobs package" in finished.stderr
    assert "Traceback" not in finished.stderr
    # And nothing was consumed: the dead letter is visible in the DLQ at once
    (still,) = kit.client.consume(DLQ)
    assert still.message_id == message_id


def test_drain_with_a_wrong_jobs_path_starts_nothing(kit: Harness, tmp_path: Path) -> None:
    # Given a job in the queue
    kit.client.publish(QUEUE, {"job": "test.db", "id": "waits"})
    # When the drain is pointed at a folder without a jobs package
    finished = run_cli(kit, "drain", "--jobs-path", str(tmp_path), cwd=tmp_path)
    # Then it refuses, naming the option, and the message was not consumed
    assert finished.returncode == 2
    assert "--jobs-path" in finished.stderr
    assert "holds no jobs package" in finished.stderr
    (waiting,) = kit.client.consume(QUEUE)
    assert waiting.payload["id"] == "waits"


# What a team's jobs module holds that fails its import, by how it fails.
BROKEN_MODULES = {
    "raises": 'import os\n\nraise RuntimeError("config missing:\\n  REFUND_API_URL")\n',
    "names_the_database": (
        "import os\n\nraise OSError(f\"no ledger at {os.environ['DATABASE_URL']}\")\n"
    ),
    "syntax": "def register(registry):\n    return registry\n\n\ndef broken(:\n    pass\n",
}


def code_root_with_a_broken_module(root: Path, broken: str) -> Path:
    """A code root whose ``jobs`` imports ``refund_issue``, which fails as ``broken`` says."""
    (root / "jobs").mkdir(parents=True)
    (root / "jobs" / "__init__.py").write_text(
        textwrap.dedent(
            """
            from infrai_jobs.jobs.registry import JobRegistry
            from . import refund_issue


            def build_registry():
                return refund_issue.register(JobRegistry())
            """
        )
    )
    (root / "jobs" / "refund_issue.py").write_text(BROKEN_MODULES[broken])
    return root


# The one line each broken module makes a command print.
BROKEN_LINES = {
    "raises": "error: importing the jobs package failed at jobs/refund_issue.py, line 3: "
    "RuntimeError: config missing: REFUND_API_URL",
    "syntax": "error: importing the jobs package failed at jobs/refund_issue.py, line 5: "
    "SyntaxError: invalid syntax",
}


@pytest.mark.parametrize(
    ("broken", "argv"),
    [
        ("raises", ("drain",)),
        ("raises", ("migrate", "--status")),
        ("raises", ("publish", json.dumps(RECEIPT))),
        ("raises", ("new-job", "foo.bar", "--effect", "database", "--identity", "x", "--dry-run")),
        ("syntax", ("drain",)),
    ],
    ids=lambda value: " ".join(value[:2]) if isinstance(value, tuple) else value,
)
def test_a_broken_jobs_module_is_one_line_naming_it(
    kit: Harness, tmp_path: Path, broken: str, argv: tuple[str, ...]
) -> None:
    # Given a jobs package one of whose modules raises while it is imported, or is not valid
    # Python
    root = code_root_with_a_broken_module(tmp_path / "code", broken)
    # When a command that imports it runs
    finished = run_cli(kit, *argv, cwd=tmp_path, INFRAI_JOBS_PATH=str(root))
    # Then it is a configuration error in one line: the jobs package's import failed, in which
    # module and line, and what was raised (its message on the same line)
    assert finished.returncode == 2, finished.stdout + finished.stderr
    assert finished.stderr.splitlines() == [BROKEN_LINES[broken]]


def test_an_import_error_naming_the_database_url_shows_no_password(
    kit: Harness, tmp_path: Path
) -> None:
    # Given a jobs module whose import fails with a message holding DATABASE_URL
    root = code_root_with_a_broken_module(tmp_path / "code", "names_the_database")
    url = "postgresql://ops:hunter2-secret@127.0.0.1:1/ledger"
    # When the drain starts with that URL
    finished = run_cli(kit, "drain", cwd=tmp_path, INFRAI_JOBS_PATH=str(root), DATABASE_URL=url)
    # Then the line names the module and the error, the password masked
    assert finished.returncode == 2, finished.stdout + finished.stderr
    (line,) = finished.stderr.splitlines()
    assert line.startswith("error: importing the jobs package failed at jobs/refund_issue.py")
    assert "OSError: no ledger at postgresql://ops:" in line
    assert "hunter2" not in line
