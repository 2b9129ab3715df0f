"""What the command line's subcommands share: their usage error, their printing, their model's sizes."""

from __future__ import annotations


class UsageError(ValueError):
    """Options a subcommand cannot run with: exit status 2 and this one line, before anything starts.
    (cpshard refusing a model it can build, a ``LayoutError``, is exit status 1, as a failed check.)"""


def check_predicts(seq: int) -> None:
    """A UsageError for a ``--seq`` of one token: the loss would be one process's 0 / 0 (NaN) and cp's 0,
    nothing to compare."""
    if seq < 2:
        raise UsageError(
            f"--seq={seq} leaves no token to predict (a causal LM's loss reads each token's next): give 2 or "
            "more"
        )


def say(text: str) -> None:
    """Print at once, even into a pipe: progress comes before the ranks' own lines."""
    print(text, flush=True)


def llama_sizes(
    *, vocab: int, hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int | None = None
) -> dict:
    """The config overrides of a Llama of these sizes (an MLP ``intermediate`` wide, by default 4x the
    hidden size; heads of ``hidden / heads``)."""
    return dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate or 4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=hidden // heads,
    )
