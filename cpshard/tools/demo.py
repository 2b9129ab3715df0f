"""``cpshard demo``: the main job on an embedded default, with what it proves printed.

A random Llama-shaped model trains for a few functional steps with its sequence split over
``nprocs`` local CPU ranks: ``value_and_grad(cp_forward)``, then AdamW over the params
pytree. It reports parity against one process, the bytes each rank puts into collectives
against the analytic Ulysses optimum, and each rank's peak memory and step time.

The pieces are small so that tests and later commands (``bench``) can reuse them:
:mod:`cpshard.debug.optimum` has the byte formula, :mod:`cpshard.optim` the optimizer;
:func:`demo_job` is what each rank runs, :func:`format_report` what the parent prints.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field, fields

from cpshard.comm.record import recording
from cpshard.debug.optimum import CommOptimum, optimum_of
from cpshard.optim import adamw_init, adamw_update
from cpshard.parallel.mesh import cp_rank, make_mesh
from cpshard.parallel.processes import launch
from cpshard.runtime.forward import make_cp_forward, params_of
from cpshard.runtime.grad import value_and_grad
from cpshard.tools.memory import current_rss, peak_rss, reset_peak_rss
from cpshard.tools.parity import RTOL, Parity, check_parity, failing_rows, format_rows
from cpshard.tools.tiny import tiny_batch, tiny_model
from cpshard.tools.usage import check_predicts, llama_sizes, say


def flag(name: str) -> str:
    """The command-line flag of a :class:`DemoConfig` field."""
    return "--" + name.replace("_", "-")


def _opt(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class DemoConfig:
    """The demo's options; each field is also a ``cpshard demo --<field>`` flag."""

    seq: int = _opt(4096, "tokens per sequence (any length; padded to a multiple of nprocs)")
    batch: int = _opt(1, "sequences per batch")
    steps: int = _opt(4, "timed training steps")
    nprocs: int = _opt(2, "local CPU ranks, all on the cp axis")
    layers: int = _opt(4, "decoder layers")
    hidden: int = _opt(128, "hidden size (the MLP is 4x wider)")
    heads: int = _opt(8, "attention heads (Ulysses splits them: nprocs must divide them)")
    kv_heads: int = _opt(4, "key/value heads (must divide heads)")
    vocab: int = _opt(1024, "vocabulary size")
    lr: float = _opt(1e-3, "AdamW learning rate")
    seed: int = _opt(0, "seed of the weights and of the tokens")

    def __post_init__(self):
        for name in ("seq", "batch", "steps", "nprocs", "layers", "hidden", "heads", "kv_heads", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{flag(name)}={getattr(self, name)} must be at least 1")
        check_predicts(self.seq)
        if self.vocab < 4:
            raise ValueError(f"--vocab={self.vocab} must be at least 4 (ids 0, 1, 2 are the special tokens)")
        if not self.lr > 0:
            raise ValueError(f"--lr={self.lr} must be positive")
        for small, big in (("heads", "hidden"), ("kv_heads", "heads"), ("nprocs", "heads")):
            if getattr(self, big) % getattr(self, small):
                raise ValueError(
                    f"{flag(small)}={getattr(self, small)} must divide {flag(big)}={getattr(self, big)}"
                )

    def model_sizes(self) -> dict:
        """The transformers config overrides of the demo model."""
        return llama_sizes(
            vocab=self.vocab, hidden=self.hidden, layers=self.layers, heads=self.heads, kv_heads=self.kv_heads
        )


# ---------------------------------------------------------------- what each rank runs


@dataclass(frozen=True)
class Step:
    """One training step on one rank: its loss, wall time, and bytes put into collectives by op."""

    loss: float
    seconds: float
    bytes_by_op: dict


@dataclass(frozen=True)
class RankReport:
    """What one rank measured."""

    rank: int
    parity: Parity
    steps: tuple[Step, ...]
    optimum: CommOptimum
    #: resident memory when the training steps began, and its peak during them
    start_rss: int
    peak_rss: int

    @property
    def median_step_seconds(self) -> float:
        return statistics.median(step.seconds for step in self.steps)


def _speaker(rank: int):
    """Progress lines from rank 0 only, flushed at once (the parent waits for all ranks)."""

    def say(text: str) -> None:
        if rank == 0:
            print(f"  [rank 0] {text}", flush=True)

    return say


def train(
    cp_forward, params: dict, batch: dict, mesh, config: DemoConfig, say
) -> tuple[dict, tuple[Step, ...]]:
    """``config.steps`` functional steps; each one's loss, time and bytes by collective."""
    step_fn, state, steps = value_and_grad(cp_forward), adamw_init(params), []
    for index in range(config.steps):
        start = time.perf_counter()
        with recording() as log:
            output, grads = step_fn(params, batch, mesh)
        params, state = adamw_update(params, grads, state, lr=config.lr)
        step = Step(output.loss.item(), time.perf_counter() - start, log.bytes_by("op"))
        steps.append(step)
        say(f"step {index + 1}/{config.steps}: loss {step.loss:.4f}, {step.seconds:.2f} s")
    return params, tuple(steps)


def demo_job(config: DemoConfig) -> RankReport:
    """One rank's demo: build, check parity on the first step, train, measure."""
    mesh = make_mesh(cp=config.nprocs)
    rank = cp_rank(mesh)
    say = _speaker(rank)
    model = tiny_model("llama", seed=config.seed, **config.model_sizes())
    params = params_of(model)
    batch = tiny_batch(config.vocab, config.batch, config.seq, seed=config.seed)  # the same on every rank
    count = sum(p.numel() for p in params.values())
    say(f"built a {count / 1e6:.2f} M parameter llama; checking parity against one process ...")
    cp_forward = make_cp_forward(model)
    start = time.perf_counter()
    parity = check_parity(model, batch, mesh, cp_forward, params)
    say(
        f"parity checked in {time.perf_counter() - start:.1f} s (worst |diff| {parity.worst:.2e}); "
        "training ..."
    )
    reset_peak_rss()
    start_rss = current_rss()
    _, steps = train(cp_forward, params, batch, mesh, config, say)
    optimum = optimum_of(model, config.batch, config.seq, config.nprocs)
    return RankReport(rank, parity, steps, optimum, start_rss, peak_rss())


# ---------------------------------------------------------------- what the parent prints


def demo_passed(reports: list[RankReport]) -> bool:
    """Every parity row passes on every rank."""
    return not failing_rows([r.parity for r in reports])


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.0f} MiB"


def _ratio(measured: int, optimum: int) -> str:
    return f"{measured / optimum:.4f}" if optimum else "-"


def format_parity(reports: list[RankReport]) -> list[str]:
    """One row per tensor group: the worst difference over the ranks, the scale, pass/fail."""
    parities = [r.parity for r in reports]
    lines = [f"parity against one process (fp32; a row passes when max |diff| <= {RTOL:g} x scale):"]
    lines += format_rows(parities)
    verdict = "PASS" if demo_passed(reports) else "FAIL"
    lines.append(f"  {verdict}: {len(parities[0].diffs)} rows on {len(reports)} ranks")
    return lines


def format_comms(report: RankReport, layers: int, same_on_all: bool) -> list[str]:
    """Bytes per step by collective, measured on one rank, against the analytic optimum."""
    measured, optimum = report.steps[-1].bytes_by_op, report.optimum
    expected = {"all_to_all": optimum.all_to_all, "all_reduce": optimum.all_reduce}
    notes = {
        "all_to_all": f"q, k, v, out x {layers} layers, forward and backward",
        "all_reduce": f"gradients {optimum.gradients:,} + loss {optimum.loss}",
        "all_gather": "batch fingerprint (same batch on every cp rank?)",
    }
    where = "every rank" if same_on_all else f"rank {report.rank} (ranks differ!)"
    lines = [f"communication per training step, {where} (bytes = input sizes of its collectives):"]
    lines.append(f"  {'op':<11} {'measured':>13} {'optimum':>13} {'ratio':>7}")
    for op in sorted(set(measured) | set(expected), key=lambda o: -measured.get(o, 0)):
        got, best = measured.get(op, 0), expected.get(op, 0)
        lines.append(f"  {op:<11} {got:13,} {best:13,} {_ratio(got, best):>7}  {notes.get(op, '')}")
    total = sum(measured.values())
    lines.append(f"  {'total':<11} {total:13,} {optimum.total:13,} {_ratio(total, optimum.total):>7}")
    return lines


def format_memory_and_time(reports: list[RankReport]) -> list[str]:
    """Per rank: peak and starting resident memory around the training steps, and the median step."""
    lines = ["memory and time per rank (peak resident memory during the training steps):"]
    lines.append(f"  {'rank':<5} {'peak RSS':>9} {'at start':>9} {'growth':>8} {'median step':>12}")
    for r in reports:
        peak, start, growth = _mib(r.peak_rss), _mib(r.start_rss), _mib(r.peak_rss - r.start_rss)
        lines.append(f"  {r.rank:<5} {peak:>9} {start:>9} {growth:>8} {r.median_step_seconds:11.2f}s")
    losses = ", ".join(f"{step.loss:.4f}" for step in reports[0].steps)
    lines.append(f"  losses by step: {losses}")
    return lines


def format_report(config: DemoConfig, reports: list[RankReport]) -> str:
    """The demo's summary, from every rank's report."""
    same = all(r.steps[-1].bytes_by_op == reports[0].steps[-1].bytes_by_op for r in reports)
    sections = [
        format_parity(reports),
        format_comms(reports[0], config.layers, same),
        format_memory_and_time(reports),
    ]
    return "\n\n".join("\n".join(section) for section in sections)


def describe(config: DemoConfig) -> str:
    """The first line the demo prints: what runs, and where."""
    return (
        f"cpshard demo: random llama ({config.layers} layers, hidden {config.hidden}, {config.heads} heads, "
        f"{config.kv_heads} kv heads, vocab {config.vocab}), batch {config.batch} x {config.seq} tokens, "
        f"{config.steps} AdamW steps, sequence split over cp={config.nprocs} local CPU ranks (gloo)"
    )


def run_demo(config: DemoConfig, out=say) -> bool:
    """Run the demo on fresh local ranks and print its report; True when parity passes."""
    out(describe(config))
    out(f"  starting {config.nprocs} ranks ...")
    start = time.perf_counter()
    reports = launch(demo_job, config, nprocs=config.nprocs)
    out("")
    out(format_report(config, reports))
    passed = demo_passed(reports)
    out(f"\ndemo finished in {time.perf_counter() - start:.0f} s: parity {'PASS' if passed else 'FAIL'}")
    return passed


def config_fields() -> dict[str, tuple[type, object, str]]:
    """Each option's type, default and help, for the command line."""
    defaults = asdict(DemoConfig())
    return {
        f.name: (type(defaults[f.name]), defaults[f.name], f.metadata["help"]) for f in fields(DemoConfig)
    }
