"""``python -m moss_npu.serve``: see ``moss_npu.serve.cli``."""

import sys

from moss_npu.serve.cli import main

sys.exit(main())
