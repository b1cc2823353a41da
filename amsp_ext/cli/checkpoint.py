"""``amsp checkpoint convert --trust SRC DST``: rewrite an old checkpoint (formats before
amsp-checkpoint/3, with pickled parts) in the current pickle-free format.

Reading the old format unpickles it, which can run any code: without ``--trust`` the command
refuses before it reads anything (runtime/state/convert.py: [Note: converting a trusted
checkpoint]). One process, no process group, no GPU.
"""

from __future__ import annotations

import argparse

HELP = "checkpoint tools: convert an old checkpoint with pickled parts that you trust to the current format"


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    c = sub.add_parser("convert", help="rewrite an old (pickled) checkpoint you trust in the current format",
                       description="Rewrite an amsp-checkpoint/1 or /2 folder (pickled .metadata and state) as "
                                   "the current pickle-free format. Reading the old folder unpickles it: only "
                                   "for checkpoints you trust (--trust).")
    c.add_argument("src", metavar="SRC", help="the old checkpoint folder")
    c.add_argument("dst", metavar="DST", help="the new checkpoint folder (must not exist)")
    c.add_argument("--trust", action="store_true",
                   help="I trust SRC: unpickling it may run code (required)")
    c.add_argument("--checkpoint-key", default=None, metavar="KEY",
                   help="sign the new checkpoint with this key (default: $AMSP_CHECKPOINT_KEY, if set)")


def run(args) -> int:
    import os

    from amsp_ext.runtime.state.checkpoint_files import KEY_ENV

    if args.checkpoint_key is not None:
        if not args.checkpoint_key:
            raise ValueError("--checkpoint-key must not be empty")
        os.environ[KEY_ENV] = args.checkpoint_key
    from amsp_ext.runtime.state.convert import convert_checkpoint

    meta = convert_checkpoint(args.src, args.dst, trust=args.trust)
    print(f"amsp checkpoint convert: {args.src} ({meta['info'].get('converted_from')}) -> {args.dst} "
          f"({meta['format']}, step {meta.get('step')}, {len(meta['files'])} files"
          f"{', signed' if 'signature' in meta else ''})")
    return 0
