"""The example jobs' own tests: what a team's project holds for its jobs, apart from the
framework's tests. Deleting the examples deletes this folder, and the framework's suite stays
green.

Two of them run the examples in the framework's drain harness (``tests/integration/drainkit.py``)
with the reconcile tests' seeds; that folder is put on the path for them.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
