import sys

from npu_sync.cli import main

sys.exit(main())
