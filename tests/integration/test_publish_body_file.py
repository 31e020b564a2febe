"""``infrai-jobs publish --body-file PATH`` (or ``-`` for stdin): a body too large for a shell
argument is published as the argument form would publish it, checked the same way.

``infrai-jobs`` runs in a child process against the emulator over HTTP, with a jobs package of
the test's own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from child_process import run_captured
from drainkit import INFRAI_JOBS, QUEUE, ROOT, Harness, cli_environment, code_root, run_cli

FIXTURE_JOBS = """
from infrai_jobs.jobs.registry import Effect, JobRegistry


def build_registry() -> JobRegistry:
    registry = JobRegistry()

    @registry.job(
        "refund.issue",
        effect=Effect.DATABASE,
        identity=("refund_id",),
        fields={"refund_id": str, "note": str},
    )
    def issue(payload, ctx):
        return None

    return registry
"""

# Above what a shell passes as one argument on Linux (128 KiB per argument).
LARGE_NOTE = "n" * 200_000


@pytest.fixture
def code(tmp_path: Path) -> Path:
    return code_root(tmp_path / "code", FIXTURE_JOBS)


def _published(kit: Harness) -> list[dict[str, object]]:
    return [message.payload for message in kit.client.consume(QUEUE, max_messages=10)]


def test_a_body_file_larger_than_a_shell_argument_is_published(
    kit: Harness, code: Path, tmp_path: Path
) -> None:
    # Given a 200 KB body in a file
    body = {"job": "refund.issue", "refund_id": "r1", "note": LARGE_NOTE}
    path = tmp_path / "body.json"
    path.write_text(json.dumps(body))
    # When it is published from the file
    finished = run_cli(kit, "publish", "--body-file", str(path), "--jobs-path", str(code))
    # Then one message went out with that body (and its correlation id)
    assert finished.returncode == 0, finished.stderr
    assert len(finished.stdout.split()) == 1
    (payload,) = _published(kit)
    assert payload["note"] == LARGE_NOTE
    assert payload["refund_id"] == "r1"


def test_a_body_from_stdin_is_published(kit: Harness, code: Path) -> None:
    # Given a body on standard input
    body = json.dumps({"job": "refund.issue", "refund_id": "r2", "note": "from a pipe"})
    # When it is published with --body-file -
    finished = run_captured(
        [INFRAI_JOBS, "publish", "--body-file", "-", "--jobs-path", str(code)],
        env=cli_environment(kit),
        cwd=ROOT,
        stdin_text=body,
    )
    # Then it went out
    assert finished.returncode == 0, finished.stderr
    (payload,) = _published(kit)
    assert payload["refund_id"] == "r2"


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
    kit: Harness, code: Path, tmp_path: Path, argv: list[str], message: str
) -> None:
    (tmp_path / "body.json").write_text('{"job": "refund.issue", "refund_id": "r3"}')
    finished = run_cli(kit, "publish", *argv, "--jobs-path", str(code), cwd=tmp_path)
    assert finished.returncode == 2, finished.stderr
    assert message in finished.stderr
    assert "Traceback" not in finished.stderr
    assert kit.client.stats(QUEUE).message_count == 0
