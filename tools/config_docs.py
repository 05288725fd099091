"""Rewrite (or check) the key tables of docs/configuration.md from the config schema.

    python tools/config_docs.py --write-docs   # after adding or changing a key
    python tools/config_docs.py --check        # exit status 1 when the tables are stale

The tables sit between ``<!-- generated: NAME ... -->`` markers; everything else in the
file is written by hand. tests/test_config_docs.py fails when they are stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# This tree's package, not whichever npu_sync happens to be installed.
sys.path.insert(0, str(ROOT))

from npu_sync._config_docs import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], ROOT / "docs" / "configuration.md"))
