"""``python -m infrai_local.emulator``."""

from infrai_local.emulator.cli import main

raise SystemExit(main())
