"""``python -m infrai_local.sandbox.emulator``."""

from infrai_local.sandbox.emulator.cli import main

raise SystemExit(main())
