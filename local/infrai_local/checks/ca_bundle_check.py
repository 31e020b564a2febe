"""Before ``sam build``: the ledger's CA bundle that a deploy would need is in the functions' code.

With ``DatabaseSslMode`` verify-full or verify-ca, every function verifies the ledger's server
against the PEM file ``DatabaseCaBundle`` names (relative to ``functions/``). That file is not
in the repository (it is AWS's, or your own CA's), so a build without it would deploy functions
that cannot connect to their ledger. ``make build`` runs this first: the two parameters are read
as ``sam deploy --config-env ENV`` would take them (``samconfig.toml``'s deploy and global
sections over the template's defaults), and a missing file stops the build with one line that
says where to get it.

``make build CA_BUNDLE_CHECK=off`` skips it, for a build that is never deployed (CI's).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from infrai_jobs.errors import ConfigurationError
from infrai_local.sam_template import deploy_values

# What each check's refusal starts with: the checks' command, which `make build` runs (and this
# repository's `make build` runs as modules): a line read on its own names what refused.
PREFIX = "build-check:"
VERIFYING_MODES = ("verify-full", "verify-ca")
_PEM_CERTIFICATE = b"-----BEGIN CERTIFICATE-----"
CODE_URI = "functions"


def missing_bundle(root: Path, config_env: str = "default") -> str | None:
    """The one line to print when the deploy of ``config_env`` needs a CA bundle that is not in
    the functions' code; None when it is there, or not needed."""
    _, values = deploy_values(root, config_env)
    mode = values.get("DatabaseSslMode", "")
    bundle = values.get("DatabaseCaBundle", "")
    if mode not in VERIFYING_MODES:
        return None
    path = Path(bundle) if Path(bundle).is_absolute() else root / CODE_URI / bundle
    # A failed download can leave an empty file (or none): only a certificate counts.
    if bundle and path.is_file() and _PEM_CERTIFICATE in path.read_bytes():
        return None
    shown = bundle if Path(bundle).is_absolute() else f"{CODE_URI}/{bundle}"
    what = "is empty or holds no certificate" if bundle and path.is_file() else "is missing"
    return (
        f"{PREFIX} DatabaseSslMode={mode} needs the ledger's CA bundle {shown or '(none set)'}, "
        f"which {what}: download AWS's RDS global bundle (or your server's CA) there, as "
        "`infrai-jobs docs configuration` says under 'The ledger's TLS', or set "
        "DatabaseCaBundle to one"
    )


def run_check(
    argv: list[str] | None, check: Callable[[Path, str], tuple[str, str]], description: str
) -> int:
    """One of ``make build``'s checks as a command: ``check(root, config_env)`` answers (the
    line that stops the build, or ""; the line to print when it passes, or ""). Exit 1 on a
    refusal, 2 when the project cannot be read, 0 otherwise; never a traceback."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--root", type=Path, default=Path.cwd())
    parser.add_argument("--config-env", default="default")
    args = parser.parse_args(argv)
    try:
        refusal, passed = check(args.root, args.config_env)
    except ConfigurationError as exc:
        print(f"{PREFIX} {exc}", file=sys.stderr)
        return 2
    if refusal:
        print(refusal, file=sys.stderr)
        return 1
    if passed:
        print(passed)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_check(
        argv, lambda root, env: (missing_bundle(root, env) or "", ""), __doc__.split("\n", 1)[0]
    )


if __name__ == "__main__":
    sys.exit(main())
