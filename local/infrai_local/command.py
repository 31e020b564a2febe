"""The ``infrai-jobs`` console script.

It imports the command line itself, so that a Ctrl-C while the command's modules load (the
first few hundred milliseconds of every command) ends as any other interrupt does: one line and
exit 130, never a traceback.
"""

from __future__ import annotations

import sys

# cli.EXIT_INTERRUPTED, which cannot be imported before the interrupt this catches.
_EXIT_INTERRUPTED = 130


def main() -> int:
    try:
        from infrai_local.cli import main as run  # noqa: PLC0415 - the import is what is guarded
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return _EXIT_INTERRUPTED
    return run()
