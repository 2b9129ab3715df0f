"""Compiled against eager cp training steps, compile time apart, as ratios in one run: the rows of
``cpshard bench --compile`` alone (see :mod:`cpshard.bench.compiled`), on issue 18's small model.

    python benchmarks/compile.py --seqs 1024 4096 --repeats 3 --variants ulysses ring --backend inductor
"""

import argparse

from cpshard.bench.compiled import check_backend, run_compiled_bench
from cpshard.bench.config import BenchConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nprocs", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=["ulysses", "ring"])
    parser.add_argument("--backend", default="inductor")
    args = parser.parse_args()
    check_backend(args.backend)
    config = BenchConfig.of_model(
        "vocab1k",
        seqs=tuple(args.seqs),
        cps=(args.nprocs,),
        repeats=args.repeats,
        variants=tuple(args.variants),
    )
    print(f"cp={args.nprocs}, Llama hidden 256, 2 layers, vocabulary 1,024, B=1")
    run_compiled_bench(config, args.backend)


if __name__ == "__main__":
    main()
