"""``infrai-jobs --help`` says which command creates the example jobs' table as docs/jobs.md
does: ``migrate`` creates it (the invoice job's own migration); ``example-data`` only adds draft
invoices to it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from infrai_local.cli import main

ROOT = Path(__file__).resolve().parents[2]


def command_help(shown: str, command: str) -> str:
    """The help line(s) of ``command`` in the top-level help, joined into one line."""
    block = re.search(rf"^    {re.escape(command)}\s(.*?)(?=^    [a-z])", shown, re.M | re.S)
    assert block is not None, command
    return " ".join(block.group(1).split())


def test_help_and_docs_agree_that_migrate_creates_the_examples_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given the top-level help
    with pytest.raises(SystemExit):
        main(["--help"])
    shown = capsys.readouterr().out
    # Then example-data says it adds draft invoices to a table migrate creates
    example_data = command_help(shown, "example-data")
    assert "create" not in example_data
    assert "draft invoices" in example_data
    assert "`migrate`" in example_data
    # And migrate says it creates the examples' table among the jobs' own
    assert "invoices table" in command_help(shown, "migrate")
    # And docs/jobs.md says the same
    jobs_doc = " ".join((ROOT / "docs" / "jobs.md").read_text().split())
    assert "`infrai-jobs example-data` only adds draft invoices" in jobs_doc
    assert "its table comes from `migrate`" in jobs_doc
