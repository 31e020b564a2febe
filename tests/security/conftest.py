"""Fixtures the security tests share: the project a test invokes (``fixture_project``)."""

from __future__ import annotations

from fixture_project import project  # noqa: F401 - the fixture, for this tier's tests
