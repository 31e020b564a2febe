"""The operator's commands find the drain's jobs package wherever they are run from, and derive
keys with its registry, as DrainFunction does; without one they stop before reading a message.

``infrai-jobs`` runs in a child process against a real PostgreSQL and the emulator over HTTP.
"""

from __future__ import annotations

import json
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
