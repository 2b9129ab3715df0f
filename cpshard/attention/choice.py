"""Which attention implementation a call runs: Ulysses where the heads allow it, else hybrid, else ring."""

from __future__ import annotations

from cpshard.attention.ulysses import check_heads_split

IMPLEMENTATIONS = ("auto", "ulysses", "ring", "hybrid")


def _proper_divisors(n: int) -> list[int]:
    return [d for d in range(2, n) if n % d == 0]


def choose_implementation(
    requested: str, heads: int, cp: int, ulysses_degree: int | None = None
) -> tuple[str, int]:
    """``(implementation, Ulysses degree)`` for ``heads`` attention heads over ``cp`` ranks.

    auto: Ulysses where cp divides the heads; else hybrid with the largest Ulysses degree that
    divides both; else ring, which has no constraint on heads."""
    if cp == 1 or requested == "ulysses":
        check_heads_split(heads, cp)
        return "ulysses", cp
    if requested == "ring":
        return "ring", 1
    fitting = [d for d in _proper_divisors(cp) if heads % d == 0]
    if requested == "hybrid":
        degree = ulysses_degree if ulysses_degree is not None else max(fitting, default=None)
        if degree not in fitting:
            raise ValueError(
                f"hybrid needs a Ulysses degree that divides cp={cp} and num_attention_heads={heads}, "
                f"and is neither 1 nor cp; {'got ' + str(degree) + '; ' if degree else ''}"
                f"degrees that work: {', '.join(map(str, fitting)) or 'none (use ring)'}"
            )
        return "hybrid", degree
    if heads % cp == 0:
        return "ulysses", cp
    return ("hybrid", max(fitting)) if fitting else ("ring", 1)
