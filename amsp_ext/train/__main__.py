"""``python -m amsp_ext.train --config FILE``: one rank of `amsp train` (amsp_ext/train/loop.py)."""

import sys

from amsp_ext.train.loop import main

if __name__ == "__main__":
    sys.exit(main())
