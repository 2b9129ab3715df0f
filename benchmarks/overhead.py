"""cp_forward at cp=1 against the plain model: forward and backward, alternated, medians.

    python benchmarks/overhead.py --seq 2048 --repeats 15

Both sides do the same arithmetic; the ratio is what cpshard's setup, hooks and functional
call cost. Timings alternate in one run, so a noisy machine slows both alike.
"""

import argparse
import statistics
import time

import cpshard
from cpshard.tools.tiny import tiny_batch, tiny_model


def plain_step(model, batch):
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()


def cp_step(grad_fn, params, batch, mesh):
    grad_fn(params, batch, mesh)


def measure(args):
    model = tiny_model(
        "llama",
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 32,
        num_key_value_heads=args.hidden // 64,
        head_dim=32,
        vocab_size=4096,
    )
    batch = tiny_batch(model.config.vocab_size, 1, args.seq)
    mesh = cpshard.make_mesh(cp=1)
    grad_fn = cpshard.value_and_grad(cpshard.make_cp_forward(model))
    params = cpshard.params_of(model)
    runs = {
        "plain": lambda: plain_step(model, batch),
        "cp_forward": lambda: cp_step(grad_fn, params, batch, mesh),
    }
    times = {name: [] for name in runs}
    for _ in range(2):  # warm-up
        for run in runs.values():
            run()
    for _ in range(args.repeats):
        for name, run in runs.items():
            start = time.perf_counter()
            run()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    medians = cpshard.launch(measure, args, nprocs=1)[0]
    ratio = medians["cp_forward"] / medians["plain"]
    print(
        f"seq {args.seq}: plain {medians['plain'] * 1e3:.1f} ms, "
        f"cp_forward(cp=1) {medians['cp_forward'] * 1e3:.1f} ms,"
        f" ratio {ratio:.3f} (median of {args.repeats}, alternated)"
    )


if __name__ == "__main__":
    main()
