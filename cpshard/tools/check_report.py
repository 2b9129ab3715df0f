"""What ``cpshard check`` prints (:mod:`cpshard.tools.check`): the table of rows, the second look's
distances, the verdict and the exit status, and the ranks' failure in a line."""

from __future__ import annotations

from cpshard.parallel.processes import RankError
from cpshard.tools.check_config import DTYPES, SHORT_NAMES, CheckConfig
from cpshard.tools.parity import WIDER, Parity, Rounding, failing_rows, format_rows


def rounding_names(config: CheckConfig) -> tuple[str, str]:
    """The type the check's rows are rounded in (its dtype, or its autocast's) and the wider one its second
    look runs in, by their short names."""
    dtype = DTYPES[config.dtype]
    return SHORT_NAMES[DTYPES[config.autocast] if config.autocast else dtype], SHORT_NAMES[WIDER[dtype]]


def beyond_rounding(
    config: CheckConfig, parities: list[Parity], roundings: list[Rounding] | None
) -> list[str]:
    """The rows that fail on some rank and, where the second look ran (``roundings``), lie beyond the dtype's
    rounding there (:meth:`cpshard.tools.parity.Rounding.beyond`)."""
    failing = failing_rows(parities, config.rtol)
    if roundings is None:
        return failing
    beyond = {row for rounding in roundings for row in rounding.beyond(failing, config.rtol)}
    return [row for row in failing if row in beyond]


def format_report(
    config: CheckConfig, parities: list[Parity], roundings: list[Rounding] | None = None
) -> str:
    """The table (worst difference over the ranks per row) and the verdict naming failing rows; a row that
    fails at the tolerance but lies within the dtype's rounding of a wider run (``roundings``) is marked
    so."""
    under = f" under {config.autocast} autocast, both" if config.autocast else ""
    lines = [
        f"parity against one process ({config.dtype}{under}; a row passes when max |diff| <= "
        f"{config.rtol:g} x scale):"
    ]
    failing, beyond = failing_rows(parities, config.rtol), beyond_rounding(config, parities, roundings)
    rounding = tuple(row for row in failing if row not in beyond)
    narrow, wide = rounding_names(config)
    lines += format_rows(parities, config.rtol, rounding, narrow)
    rows = len(parities[0].diffs)
    if rounding:
        lines.append(
            f"against a run of the same weights and batch in {wide} (largest |diff| / scale, worst rank):"
        )
        for row in rounding:
            cp, own, *arithmetic = (max(sides) for sides in zip(*(r.relative(row) for r in roundings)))
            same = any(r.same_arithmetic(row) for r in roundings) and arithmetic
            tail = f"; cp run in {wide} {arithmetic[0]:.1e} (the same arithmetic)" if same else ""
            lines.append(f"  {row}: cp {cp:.1e}, one process {own:.1e}{tail}")
    if beyond:
        names = ", ".join(beyond)
        lines.append(f"FAIL: {len(beyond)} of {rows} rows differ beyond {config.rtol:g} x scale: {names}")
    elif rounding:
        lines.append(
            f"PASS: {rows} rows on {len(parities)} ranks ({len(rounding)} within {narrow} rounding, as the "
            f"{wide} runs above show)"
        )
    else:
        lines.append(f"PASS: {rows} rows on {len(parities)} ranks")
    return "\n".join(lines)


def exit_status(config: CheckConfig, parities: list[Parity], roundings: list[Rounding] | None = None) -> int:
    """0 when every row passes on every rank (or lies within the dtype's rounding, where ``roundings``
    says), 1 otherwise."""
    return 1 if beyond_rounding(config, parities, roundings) else 0


#: what cpshard raises to refuse a model or an input: its message says it all, without the rank's traceback
REFUSALS = ("LayoutError", "BatchError", "ValueError")


def reported(error: RankError) -> str:
    """The ranks' failure in one line where every rank refused with cpshard's own error, else with the
    blamed rank's traceback (a crash); one of the model's own forward without cp is named as the model's."""
    kinds = {failure.kind for failure in error.failures.values()}
    if kinds <= set(REFUSALS):
        return str(error).split("\n", 1)[0]
    if kinds == {"OneProcessFailed"}:
        first, _, traceback = str(error).partition("\n")
        return (
            f"{first}\nthat is the model's own forward, in one process without cp: the model does not run as "
            f"it is configured (its dtype, a config field), whatever cp does; where, below:\n{traceback}"
        )
    return str(error)
