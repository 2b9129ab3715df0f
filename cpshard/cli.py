"""The ``cpshard`` command line: one sub-command per job (``demo``, ``check``, ``bench``, ``layout``).

Exit status, one rule for every command: 0 on success, 1 when a check fails or cpshard refuses the model
(a ``LayoutError``), 2 on bad usage (one line on stderr saying why), 130 when interrupted (^C: one line,
its local ranks ended).
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import sys
from functools import partial
from importlib.metadata import PackageNotFoundError, version

from cpshard.attention.choice import IMPLEMENTATIONS
from cpshard.bench.compiled import check_backend, run_compiled_bench
from cpshard.bench.config import MODELS, BenchConfig
from cpshard.bench.measure import run_bench
from cpshard.bench.packed import packed_report
from cpshard.bench.report import plot, write_json
from cpshard.bench.variants import MEANINGS, VARIANTS
from cpshard.layouts.errors import LayoutError
from cpshard.tools.check import run_check
from cpshard.tools.check_config import ATTNS, AUTOCASTS, DTYPES, PADS, RTOLS, CheckConfig, parse_override
from cpshard.tools.demo import DemoConfig, config_fields, flag, run_demo
from cpshard.tools.layout_file import layout_for
from cpshard.tools.usage import UsageError

USAGE_ERROR = 2
#: the shell's status for a command ended by SIGINT
INTERRUPTED = 130


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line, exit status 2."""

    def error(self, message: str):
        self.exit(USAGE_ERROR, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _command(commands, name: str, run) -> argparse.ArgumentParser:
    """The sub-command ``name``, run by ``run(args, parser)``: its one-line help is the first paragraph of
    ``run``'s docstring, its description the rest (as click reads a command's)."""
    summary, _, details = inspect.cleandoc(run.__doc__).partition("\n\n")
    parser = commands.add_parser(name, help=summary, description=" ".join(details.split()))
    parser.set_defaults(run=partial(run, parser=parser))
    return parser


def _add_demo(commands) -> None:
    parser = _command(commands, "demo", _run_demo)
    for name, (kind, default, help) in config_fields().items():
        parser.add_argument(flag(name), type=kind, default=default, help=f"{help} (default {default})")


def _run_demo(args, parser: argparse.ArgumentParser) -> int:
    """train a small model with its sequence split over local CPU ranks; print parity, bytes, memory

    Train a random Llama-shaped model for a few functional steps with its sequence split over local CPU
    ranks; print parity against one process, bytes communicated against the analytic optimum, and
    per-rank memory and step time. Exit status 1 when parity fails.
    """
    try:
        config = DemoConfig(**{name: getattr(args, name) for name in config_fields()})
    except ValueError as error:
        parser.error(str(error))
    return 0 if run_demo(config) else 1


def _add_check(commands) -> None:
    defaults = CheckConfig("-")
    parser = _command(commands, "check", _run_check)
    add = parser.add_argument
    add("model", metavar="MODEL", help="a local model folder (config.json; weights optional) or a model type")
    add("--cp", type=int, default=defaults.cp, help=f"local CPU ranks on the cp axis (default {defaults.cp})")
    add(
        "--implementation",
        choices=IMPLEMENTATIONS,
        default=defaults.implementation,
        help=f"cp attention (default {defaults.implementation})",
    )
    add("--seq", type=int, default=defaults.seq, help=f"tokens per sequence (default {defaults.seq})")
    add("--batch", type=int, default=defaults.batch, help=f"sequences per batch (default {defaults.batch})")
    add("--pad", choices=PADS, help="pad each row by a different amount on this side (needs --seq >= 4)")
    add("--packed", action="store_true", help="pack documents into each row (position_ids restart at each)")
    rtols = ", ".join(f"{name} {rtol:g}" for name, rtol in RTOLS.items())
    add(
        "--dtype",
        choices=DTYPES,
        default=defaults.dtype,
        help=(
            f"model dtype; a row passes when max |diff| <= rtol x its scale: {rtols} (default "
            f"{defaults.dtype})"
        ),
    )
    add(
        "--autocast",
        choices=AUTOCASTS,
        help="run cp and one process under torch.autocast in this type (an fp32 model; mixed precision): "
        "rows at its tolerance, the second look against float64",
    )
    add(
        "--rtol",
        dest="tolerance",
        metavar="RTOL",
        type=float,
        help="pass a row within this times its scale instead of the dtype's (also the float64 look's floor)",
    )
    add(
        "--attn",
        choices=ATTNS,
        default=defaults.attn,
        help=f"attention kernel (default {defaults.attn}: sdpa where the model supports it, else eager)",
    )
    add(
        "--seed",
        type=int,
        default=defaults.seed,
        help=f"seed of random weights and tokens (default {defaults.seed})",
    )
    add(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set a config field (repeatable; the value is read as JSON, else as a string), e.g. --set "
        "num_hidden_layers=4 --set sliding_window=16",
    )


def _run_check(args, parser: argparse.ArgumentParser) -> int:
    """check loss, logits and gradients of a model under cp=N against one process

    Run MODEL with its sequence split over N local CPU ranks and on one process; print one row per
    tensor group (loss, logits, gradients) with its largest difference and pass/fail. float32 rows
    beyond the tolerance get a second look against a float64 run: where cp is no farther from it than
    twice one process, the row is fp32 rounding and passes. Exit status 0 when every row passes, 1 when
    one differs or cpshard refuses the model, 2 on bad usage.
    """
    options = {name: getattr(args, name) for name in CheckConfig.__dataclass_fields__}
    try:
        options["overrides"] = tuple(parse_override(text) for text in args.overrides)
        return run_check(CheckConfig(**options))
    except UsageError as error:
        parser.error(str(error))
    except LayoutError as error:  # cpshard refuses the model: exit status 1, as a failed check
        print(f"cpshard check: {' '.join(str(error).split())}", file=sys.stderr)
        return 1


def _add_bench(commands) -> None:
    defaults = BenchConfig()
    parser = _command(commands, "bench", _run_bench)
    add = parser.add_argument
    listed = lambda values: " ".join(map(str, values))  # noqa: E731

    def add_list(flag: str, field: str, help: str, shown: str = "", **more) -> None:
        """An option of one or more values whose default is the bench config's ``field`` (in the help:
        ``shown``, else the values)."""
        values = getattr(defaults, field)
        help = f"{help} (default {shown or listed(values)})"
        add(flag, nargs="+", default=list(values), dest=field, help=help, **more)

    add_list("--seqs", "seqs", "sequence lengths", type=int)
    add_list("--cp", "cps", "cp sizes: local CPU ranks", type=int)
    add(
        "--model",
        choices=list(MODELS),
        default="vocab32k",
        help="a Llama of these sizes, which the flags below change (default vocab32k): "
        + "; ".join(
            f"{name}: " + ", ".join(f"{key} {value}" for key, value in sizes.items() if value)
            for name, sizes in MODELS.items()
        ),
    )
    sizes = dict(
        layers="decoder layers",
        hidden="hidden size",
        heads="attention heads",
        kv_heads="key/value heads",
        vocab="vocabulary size",
        intermediate="the MLP's width (4x the hidden size where --model gives none)",
        repeats="timed steps per variant, after a warm-up",
        seed="seed of the weights and tokens",
        budget_mib="per-rank step memory (MiB) within which each variant's longest L is fitted",
    )
    for name, help in sizes.items():
        default = getattr(defaults, name)
        help = f"{help} (default: --model's)" if name in MODELS["vocab1k"] else f"{help} (default {default})"
        add("--" + name.replace("_", "-"), type=int, help=help)
    meanings = "; ".join(f"{name}: {MEANINGS[name]}" for name in VARIANTS)
    add_list("--variants", "variants", f"any of: {meanings}", shown="all that fit", metavar="VARIANT")
    add(
        "--single-rank0-only",
        action="store_true",
        help=(
            "run the one-process baseline on rank 0 alone, the other ranks waiting (half its memory "
            "on this machine)"
        ),
    )
    add(
        "--packed",
        type=int,
        metavar="ROWS",
        help=(
            "instead: ring work on rows packing documents (log-normal around 1K tokens), each sequence "
            "order's tiles per rank counted over ROWS rows of 131,072 tokens at cp=8, and each rank's ring "
            "attention compute timed at every --cp and --seqs"
        ),
    )
    add(
        "--compile",
        nargs="?",
        const="inductor",
        metavar="BACKEND",
        help=(
            "then time each cpshard variant's step with its decoder layers compiled (make_cp_forward("
            "compile=BACKEND), default inductor) against the same step eager: the first compiled call apart, "
            "compiled / eager round by round, graphs and graph breaks"
        ),
    )
    add("--json", metavar="FILE", help="write the rows as JSON")
    add(
        "--plot",
        metavar="FILE.png",
        help="draw CPU time per step and peak memory against the sequence length (needs matplotlib)",
    )


def _run_bench(args, parser: argparse.ArgumentParser) -> int:
    """time and measure cpshard's implementations against one process and other Ulysses implementations

    For each cp size and sequence length, time a training step (forward and backward) of cpshard's
    variants (--variants says what each is), of one process without cp (the plain model, and
    cp_forward at cp=1), and of the peers as their users run them: Ulysses by DTensor redistribute,
    DeepSpeed and yunchang, and DeepSpeed's ALST stack (skipped with a note when not installed),
    alternated on local CPU ranks; print median step time, tokens/s, per-rank peak memory, bytes
    communicated per rank and the longest L within --budget-mib.
    """
    options = {name: getattr(args, name) for name in BenchConfig.__dataclass_fields__}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items() if v is not None}
    try:
        config = BenchConfig.of_model(args.model, **options)
        if args.compile is not None:
            check_backend(args.compile)
    except UsageError as error:
        parser.error(str(error))
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error(
            "--plot needs matplotlib, which is not installed: pip install matplotlib (or cpshard[bench])"
        )
    if args.packed is not None:
        if args.packed < 1:
            parser.error(f"--packed {args.packed}: give at least one row")
        packed_report(config.seqs, config.cps, config.repeats, args.packed)
        return 0
    rows = run_bench(config)
    if args.json:
        write_json(rows, config, args.json)
        print(f"rows written to {args.json}")
    if args.plot:
        plot(rows, args.plot)
        print(f"plot written to {args.plot}")
    if args.compile is not None:
        run_compiled_bench(config, args.compile)
    return 0


def _add_layout(commands) -> None:
    parser = _command(commands, "layout", _run_layout)
    parser.add_argument("model", metavar="MODEL", help="a model type (llama, gpt2, ...) or a config folder")


def _run_layout(args, parser: argparse.ArgumentParser) -> int:
    """print the layout cpshard uses for a model type or config folder, as an editable layout file

    Print the cp layout of MODEL (a model type or a local folder with config.json): its registered file,
    else the layout derived from the model, as Python to save, edit and pass as make_cp_forward(model,
    layout=LAYOUT). Exit status 1 when cpshard cannot serve the model, 2 on bad usage (a model it cannot
    build).
    """
    try:
        print(layout_for(args.model), end="")
    except UsageError as error:
        parser.error(str(error))
    except ValueError as error:  # cpshard refuses the model (a LayoutError): exit status 1
        print(f"cpshard layout: {error}", file=sys.stderr)
        return 1
    return 0


def _version() -> str:
    """The installed distribution's version (a source tree run without installing has none)."""
    try:
        return version("cpshard")
    except PackageNotFoundError:
        return "(not installed: run from a source tree)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cpshard", description="Exact context parallelism for transformers models.")
    parser.add_argument("--version", action="version", version=f"cpshard {_version()}")
    commands = parser.add_subparsers(
        title="commands", metavar="COMMAND", dest="command", parser_class=_Parser
    )
    _add_demo(commands)
    _add_check(commands)
    _add_bench(commands)
    _add_layout(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse ``argv`` (default: the process's arguments) and run the command; its exit status."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # a command's own error names its help (the top level's lists no command's options)
        after_command = hasattr(args, "run") and argv.index(unknown[0]) > argv.index(args.command)
        owner = args.run.keywords["parser"] if after_command else parser
        owner.error(f"unrecognized arguments: {' '.join(unknown)}")
    if not hasattr(args, "run"):
        parser.error("choose a command: demo, check, bench, layout")
    try:
        return args.run(args)
    except KeyboardInterrupt:  # its local ranks are ended on the way out; no traceback for a ^C
        print(f"cpshard {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
