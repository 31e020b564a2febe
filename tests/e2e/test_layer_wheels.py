"""The layer's pins exist as wheels for the Lambda runtime: CPython 3.13 on arm64 Linux.

The code runs on Python 3.11 here, so nothing local proves that a pin also ships for 3.13 on
aarch64; a pin without such a wheel would only fail at `sam build` or, worse, at deploy time.
This asks the package index the way `sam build` does (aws-lambda-builders' pip download for
python3.13 on arm64), dependencies included. It needs the package registry, which CI reaches.

The requirements file is the layer's lock (``make lock``): every package pinned with its hashes,
so pip runs in hash-checking mode. A package the lock misses, or a wheel whose hash it does not
list, fails the download; the download must then bring exactly the locked set.

The project's own wheel, with the ledger's migrations the layer reads its version from, is
built and checked by tests/e2e/test_dist.py (`make dist`).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "layers" / "common" / "requirements.txt"
# Lambda's python3.13 runtime (Amazon Linux 2023, glibc 2.34) on arm64, as sam build asks pip.
LAMBDA_PLATFORMS = (
    "manylinux2014_aarch64",
    "manylinux_2_17_aarch64",
    "manylinux_2_28_aarch64",
    "manylinux_2_34_aarch64",
)
# A lock entry: "name==version \\" (its --hash lines follow, indented).
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)")
WHEEL = re.compile(
    r"^(?P<name>[^-]+)-(?P<version>[^-]+)(-\d[^-]*)?-(?P<tags>[^-]+-[^-]+-[^-]+)\.whl$"
)
RUNTIME_PLATFORM = re.compile(r"^(any|manylinux(2014|_2_(1[7-9]|2\d|3[0-4]))_aarch64)$")
RUNTIME_PYTHON = re.compile(r"^(py3|py313|cp313)$")
RUNTIME_ABI = re.compile(r"^(none|abi3|cp313)$")


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def pins() -> dict[str, str]:
    found = {}
    for line in REQUIREMENTS.read_text().splitlines():
        match = PIN.match(line.strip())
        if match:
            found[normalise(match.group(1))] = match.group(2)
    return found


@pytest.mark.slow
def test_every_pinned_wheel_exists_for_cpython313_on_manylinux_aarch64(tmp_path: Path) -> None:
    # Given the layer's requirements, pinned
    assert pins(), f"no pins in {REQUIREMENTS}"
    platforms = [arg for platform in LAMBDA_PLATFORMS for arg in ("--platform", platform)]
    # When pip resolves them as binary wheels for python3.13 on arm64 Linux, dependencies too
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--quiet",
            "--disable-pip-version-check",
            "--only-binary=:all:",
            *platforms,
            "--python-version",
            "3.13",
            "--implementation",
            "cp",
            "--abi",
            "cp313",
            "--dest",
            str(tmp_path),
            "--requirement",
            str(REQUIREMENTS),
        ],
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    # Then pip finds every one (its error names the pin that has no such wheel)
    errors = [line for line in result.stderr.splitlines() if line.startswith("ERROR")]
    assert result.returncode == 0, (
        "a layer pin has no wheel for CPython 3.13 on manylinux aarch64 (the Lambda runtime); "
        "pick a version that ships one:\n" + "\n".join(errors or [result.stderr])
    )
    wheels = {}
    for wheel in tmp_path.glob("*.whl"):
        match = WHEEL.match(wheel.name)
        assert match, wheel.name
        wheels[normalise(match["name"])] = (match["version"], match["tags"])
    # And what arrived is exactly the lock: every locked package at its version, nothing else
    downloaded = {name: version for name, (version, _) in wheels.items()}
    assert downloaded == pins()
    # And every wheel, dependencies included, runs on CPython 3.13 on arm64 Linux
    assert "psycopg_binary" in wheels, "psycopg[binary] must bring its binary wheel"
    for name, (_, tags) in wheels.items():
        python, abi, platform = tags.split("-")
        assert any(RUNTIME_PYTHON.match(p) for p in python.split(".")), f"{name}: {tags}"
        assert any(RUNTIME_ABI.match(a) for a in abi.split(".")), f"{name}: {tags}"
        assert any(RUNTIME_PLATFORM.match(p) for p in platform.split(".")), f"{name}: {tags}"
