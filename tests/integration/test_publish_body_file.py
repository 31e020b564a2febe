"""``infrai-jobs publish --body-file PATH`` (or ``-`` for stdin): a body too large for a shell
argument is published as the argument form would publish it, checked the same way.

``infrai-jobs`` runs in a child process against the emulator over HTTP, with the fixture jobs
(``receipt.send`` takes any string as its ``email``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from child_process import run_captured
from drainkit import INFRAI_JOBS, QUEUE, ROOT, TEST_JOBS_CODE, Harness, cli_environment, run_cli

# Above what a shell passes as one argument on Linux (128 KiB per argument).
LARGE_EMAIL = "n" * 200_000
CODE = str(TEST_JOBS_CODE)


def _published(kit: Harness) -> list[dict[str, object]]:
    return [message.payload for message in kit.client.consume(QUEUE, max_messages=10)]


def test_a_body_file_larger_than_a_shell_argument_is_published(
    kit: Harness, tmp_path: Path
) -> None:
    # Given a 200 KB body in a file
    body = {"job": "receipt.send", "invoice_id": "r1", "email": LARGE_EMAIL}
    path = tmp_path / "body.json"
    path.write_text(json.dumps(body))
    # When it is published from the file
    finished = run_cli(kit, "publish", "--body-file", str(path), "--jobs-path", CODE)
    # Then one message went out with that body (and its correlation id)
    assert finished.returncode == 0, finished.stderr
    assert len(finished.stdout.split()) == 1
    (payload,) = _published(kit)
    assert payload["email"] == LARGE_EMAIL
    assert payload["invoice_id"] == "r1"


def test_a_body_from_stdin_is_published(kit: Harness) -> None:
    # Given a body on standard input
    body = json.dumps({"job": "receipt.send", "invoice_id": "r2", "email": "from a pipe"})
    # When it is published with --body-file -
    finished = run_captured(
        [INFRAI_JOBS, "publish", "--body-file", "-", "--jobs-path", CODE],
        env=cli_environment(kit),
        cwd=ROOT,
        stdin_text=body,
    )
    # Then it went out
    assert finished.returncode == 0, finished.stderr
    (payload,) = _published(kit)
    assert payload["invoice_id"] == "r2"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["{}", "--body-file", "body.json"], "either a body or --body-file, not both"),
        ([], "a body to publish: JSON as the argument, or --body-file PATH"),
        (["--body-file", "missing.json"], "cannot read --body-file"),
    ],
    ids=["both", "neither", "missing file"],
)
def test_a_body_given_twice_none_or_unreadable_is_refused_and_nothing_is_sent(
    kit: Harness, tmp_path: Path, argv: list[str], message: str
) -> None:
    (tmp_path / "body.json").write_text('{"job": "receipt.send", "invoice_id": "r3"}')
    finished = run_cli(kit, "publish", *argv, "--jobs-path", CODE, cwd=tmp_path)
    assert finished.returncode == 2, finished.stderr
    assert message in finished.stderr
    assert "Traceback" not in finished.stderr
    assert kit.client.stats(QUEUE).message_count == 0
