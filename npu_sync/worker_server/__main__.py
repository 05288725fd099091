"""``python -m npu_sync.worker_server``: run a reference worker (see :func:`main`)."""

from __future__ import annotations

import sys

from npu_sync.worker_server._cli import main

if __name__ == "__main__":
    sys.exit(main())
