"""``infrai-jobs --help`` says what docs/jobs.md says: ``migrate`` creates the example jobs'
table (the invoice job's own migration) and ``example-data`` only adds draft invoices to it;
``new-job --setting`` and ``--secret`` edit samconfig.toml and events/env.json, never a
template."""

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


def option_help(shown: str, option: str) -> str:
    """The help of ``option`` in a command's help, joined into one line."""
    block = re.search(rf"^  {re.escape(option)} \S+\s(.*?)(?=^  -)", shown, re.M | re.S)
    assert block is not None, option
    return " ".join(block.group(1).split())


def test_new_jobs_help_says_the_files_setting_and_secret_edit_as_docs_jobs_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given new-job's help, and docs/jobs.md's "Adding a job"
    with pytest.raises(SystemExit):
        main(["new-job", "--help"])
    shown = capsys.readouterr().out
    jobs_doc = " ".join((ROOT / "docs" / "jobs.md").read_text().split())
    assert "No template is edited" in jobs_doc
    for option, parameters in (
        ("--setting", ("JobSettings",)),
        ("--secret", ("JobSettings", "JobSecretArns")),
    ):
        said = option_help(shown, option)
        # Then each says, as the page does, that no template is edited, and names the
        # parameters of samconfig.toml and the events/env.json entry it adds instead
        assert "No template is edited" in said, said
        assert "samconfig.toml" in said, said
        assert "events/env.json" in said, said
        for parameter in parameters:
            assert parameter in said, said
        # And none of what new-job does not write: a parameter or Environment entry of the
        # template, a grant, a row of a docs page (a team's project has no docs/)
        for unwritten in ("template parameter", "Environment", "grant", "docs/configuration.md"):
            assert unwritten not in said, said
