"""``job_claims`` has one writer: every statement that changes it is in ``work/statements.py``,
and the lease is judged by one rule on one clock (``work.statements``' lease functions), never
by a Python clock or a second copy of the rule. Read from the source, not by review."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STATEMENTS = ROOT / "layers" / "common" / "infrai_jobs" / "work" / "statements.py"
# Everything that is deployed or that an operator runs (tests and benchmarks write rows of their
# own, as the notes' Node worker would).
SOURCES = sorted(
    path
    for folder in ("layers/common/infrai_jobs", "local/infrai_local", "functions")
    for path in (ROOT / folder).rglob("*.py")
)
WRITE = re.compile(
    r"\b(INSERT\s+INTO|UPDATE|DELETE\s+FROM)\s+job_claims\b", re.IGNORECASE | re.MULTILINE
)
# A clock read on the same line as a lease: the rule written again.
LEASE_CLOCK = re.compile(r"lease.*(now\(\)|clock_timestamp\(\)|datetime\.now|time\.time\(\))")
# The lines of statements.py that define the rule (its lease functions' bodies).
RULE_DEFINITIONS = ('    return "(" + lease_end(row) + " ', '    return "least(" + (row')
# Not the claims' lease: the drains' own registrations (drain_leases), and the in-memory fake,
# which restates the rule on the clock a test controls and is held to it by the contract suite.
OTHER_LEASES = {
    ROOT / "layers" / "common" / "infrai_jobs" / "drain" / "fleet.py",
    ROOT / "tests" / "fakes.py",
}


def _id(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def test_the_sources_read_include_the_writer_and_the_tools() -> None:
    assert STATEMENTS in SOURCES
    assert ROOT / "local" / "infrai_local" / "operator" / "verbs.py" in SOURCES


def test_the_write_pattern_finds_each_kind_of_write() -> None:
    for statement in (
        "INSERT INTO job_claims (idem_key) VALUES ('k')",
        "update job_claims set state = 'done'",
        "DELETE FROM job_claims WHERE true",
        "UPDATE\n    job_claims SET x = 1",
    ):
        assert WRITE.search(statement), statement
    assert not WRITE.search("SELECT * FROM job_claims")


@pytest.mark.parametrize("path", SOURCES, ids=_id)
def test_no_module_but_the_statements_writes_job_claims(path: Path) -> None:
    if path == STATEMENTS:
        return
    found = WRITE.findall(path.read_text(encoding="utf-8"))
    assert found == [], f"{_id(path)} writes job_claims: move the statement to work/statements.py"


@pytest.mark.parametrize("path", SOURCES, ids=_id)
def test_no_lease_is_judged_on_a_clock_outside_the_one_rule(path: Path) -> None:
    if path in OTHER_LEASES:
        return
    lines = path.read_text(encoding="utf-8").splitlines()
    found = [
        f"{_id(path)}:{number}: {line.strip()}"
        for number, line in enumerate(lines, start=1)
        if LEASE_CLOCK.search(line.lower()) and not line.startswith(RULE_DEFINITIONS)
    ]
    assert found == []


def test_the_rule_is_defined_once_on_the_transaction_clock() -> None:
    text = STATEMENTS.read_text(encoding="utf-8")
    # Over, live and a new lease each compare or count from now(); a lease-less row's end is
    # its claim time plus the visibility timeout
    assert text.count('" < now())"') == 1
    assert text.count('" >= now())"') == 1
    assert text.count('"now() + make_interval(secs => "') == 1
    assert "claimed_at + " in text
    assert "make_interval(secs => %(visibility)s)" in text
