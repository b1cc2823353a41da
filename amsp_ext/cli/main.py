"""``amsp``: one console script, one small module per subcommand.

Each subcommand module exposes ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int`` and
must not import torch at module level, so that ``amsp plan`` stays fast and torch-free.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module under amsp_ext.cli
SUBCOMMANDS: dict[str, str] = {
    "plan": "plan",
    "cluster": "cluster",
    "profile": "profile",
    "compare": "compare",
    "simulate": "simulate",
    "train": "train",
    "migrate": "migrate",
    "config": "config",
    "tune": "tune",
    "dryrun": "dryrun",
    "checkpoint": "checkpoint",
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (the usage is one ``--help`` away)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="amsp",
        description="AMSP: per-component sharding of parameters, gradients and optimizer states.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(f"amsp_ext.cli.{module_name}")
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except ValueError as e:  # config / plan / profile errors: one line, no traceback
        print(f"amsp {args.command}: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a file that cannot be read or written: one line naming it
        print(f"amsp {args.command}: error: {e.strerror or e}: {e.filename or ''}".rstrip(": "), file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
