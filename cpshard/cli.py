"""The ``cpshard`` command line: one sub-command per job (``demo`` now; ``check`` and ``bench`` later).

Exit status: 0 on success, 1 when a check fails, 2 on bad usage (one line on stderr saying why).
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

from cpshard.demo import DemoConfig, config_fields, flag, run_demo

USAGE_ERROR = 2


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line, exit status 2."""

    def error(self, message: str):
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _add_demo(commands) -> None:
    parser = commands.add_parser(
        "demo",
        help="train a small model with its sequence split over local CPU ranks; print parity, bytes, memory",
        description="Train a random Llama-shaped model for a few functional steps with its sequence split "
        "over local CPU ranks; print parity against one process, bytes communicated against the "
        "analytic optimum, and per-rank memory and step time. Exit status 1 when parity fails.",
    )
    for name, (kind, default, help) in config_fields().items():
        parser.add_argument(flag(name), type=kind, default=default, help=f"{help} (default {default})")
    parser.set_defaults(run=partial(_run_demo, parser=parser))


def _run_demo(args, parser: argparse.ArgumentParser) -> int:
    try:
        config = DemoConfig(**{name: getattr(args, name) for name in config_fields()})
    except ValueError as error:
        parser.error(str(error))
    return 0 if run_demo(config) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cpshard", description="Exact context parallelism for transformers models.")
    commands = parser.add_subparsers(title="commands", metavar="COMMAND", parser_class=_Parser)
    _add_demo(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the process's arguments) and run the command; its exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "run"):
        parser.error("choose a command: demo")
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
