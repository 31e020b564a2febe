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


def printed_help(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    return capsys.readouterr().out


def entry_help(shown: str, entry: str, *, indent: str, until: str) -> str:
    """The help of ``entry`` (a command, or an option and its metavar) in ``shown``, up to the
    next line starting with ``until``, joined into one line."""
    found = re.search(rf"^{indent}{re.escape(entry)}\s(.*?)(?=^{until})", shown, re.M | re.S)
    assert found is not None, entry
    return " ".join(found.group(1).split())


def command_help(shown: str, command: str) -> str:
    return entry_help(shown, command, indent="    ", until="    [a-z]")


def test_help_and_docs_agree_that_migrate_creates_the_examples_table(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given the top-level help
    shown = printed_help(capsys)
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


def test_new_jobs_help_says_the_files_setting_and_secret_edit_as_docs_jobs_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Given new-job's help, and docs/jobs.md's "Adding a job"
    shown = printed_help(capsys, "new-job")
    jobs_doc = " ".join((ROOT / "docs" / "jobs.md").read_text().split())
    assert "No template is edited" in jobs_doc
    for option, parameters in (
        ("--setting", ("JobSettings",)),
        ("--secret", ("JobSettings", "JobSecretArns")),
    ):
        said = entry_help(shown, f"{option} NAME", indent="  ", until="  -")
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
