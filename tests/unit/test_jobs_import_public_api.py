"""Our jobs import only the framework's public job API, so an upgrade cannot break them."""

from infrai_local.testkit import assert_public_imports


def test_the_jobs_import_only_the_public_api() -> None:
    assert_public_imports()
