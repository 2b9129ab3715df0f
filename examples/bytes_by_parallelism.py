"""How the bytes of one training step split between cp and the other parallelisms, per combination.

    python examples/bytes_by_parallelism.py --seq 64

Four local CPU ranks; for each mesh, one ``value_and_grad`` step of a small model (Qwen3-MoE for
the meshes with ``ep``, llama otherwise) on whole sequences; rank 0's bytes put into collectives,
counted by :meth:`cpshard.debug.CommsLog.bytes_by_parallelism`.
"""

import argparse

import cpshard

#: name: (mesh sizes, make_cp_forward options)
MESHES = {
    "fsdp2 x cp2": (dict(fsdp=2, cp=2), {}),
    "dp_replicate2 x cp2": (dict(dp_replicate=2, cp=2), {}),
    "tp2 x cp2": (dict(tp=2, cp=2), {}),
    "cp2 x ep2 (fsdp2)": (dict(fsdp=2, cp=2, ep=2), {}),
    "cp2 x fsdp2, ep4": (dict(fsdp=2, cp=2, ep=4), {}),
    "cp2 x tp2 x ep4": (dict(cp=2, tp=2, ep=4), {}),
    "cp2 x tp2, ep2 all-reduce": (dict(cp=2, tp=2, ep=2), {}),
    "cp2 x tp2, ep2 dispatch": (dict(cp=2, tp=2, ep=2), dict(expert_plan="dispatch")),
}


def step_bytes(sizes: dict, options: dict, seq: int) -> dict:
    mesh = cpshard.make_mesh(**sizes)
    model = cpshard.tiny_model("qwen3_moe" if sizes.get("ep", 1) > 1 else "llama")
    batch = cpshard.tiny_batch(model.config.vocab_size, 2, seq, seed=mesh.get_local_rank("fsdp") + 1)
    params = cpshard.params_of(cpshard.parallelize(model, mesh))
    step = cpshard.value_and_grad(cpshard.make_cp_forward(model, **options))
    step(params, batch, mesh)  # the first step: the ranks also agree on the forward, once
    with cpshard.debug.recording() as log:
        step(params, batch, mesh)
    return log.bytes_by_parallelism()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, default=64, help="tokens per sequence (default 64)")
    args = parser.parse_args()
    kinds = ("cp", "fsdp", "replicas", "tp", "ep", "other")
    print(f"{'mesh':26s}" + "".join(f"{k:>10s}" for k in (*kinds, "total")))
    for name, (sizes, options) in MESHES.items():
        counts = cpshard.launch(step_bytes, sizes, options, args.seq, nprocs=4)[0]
        print(f"{name:26s}" + "".join(f"{counts[k]:>10,d}" for k in kinds) + f"{sum(counts.values()):>10,d}")


if __name__ == "__main__":
    main()
