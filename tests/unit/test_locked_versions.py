"""The tests run on the versions the layer ships: `make venv` installs under the layer's lock."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

LOCK = Path(__file__).resolve().parents[2] / "layers" / "common" / "requirements.txt"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", re.M)


def test_every_package_the_layer_locks_is_installed_here_at_its_locked_version() -> None:
    pins = dict(PIN.findall(LOCK.read_text(encoding="utf-8")))
    # The layer's own dependencies are all here, and so are what they bring
    assert {"boto3", "botocore", "psycopg", "aws-lambda-powertools"} <= set(pins)
    installed = {}
    for name in pins:
        try:
            installed[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            installed[name] = "(not installed)"
    assert installed == pins
