"""``python -m amsp_ext.train --config FILE``: one rank of `amsp train` (amsp_ext/train/loop.py)."""

from amsp_ext.train.loop import exit_rank, main

if __name__ == "__main__":
    exit_rank(main())  # see [Note: a rank that finished exits at once]
