"""Recompute's memory: per device, the temporaries and peak of a bf16 step with every layer
under each ``jax.checkpoint_policies`` policy (``cfp.recompute``, applied to the traced step),
beside the same stack under its own ``jax.checkpoint`` on every layer; dp over 8, compiled for
8 A100s (no GPU here: the gpu-compile extra) and for the 8 CPU devices here. Nothing runs.

    python scripts/recompute_memory.py scripts/results/DATE-recompute-memory-cpu

writes ``.csv`` and ``.png`` beside that prefix.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "cfp_test"))  # scanned_models

POLICIES = ("none", "dots_saveable", "nothing_saveable")
SIZE, BATCH = (("num_layers", 4), ("seq_len", 512)), 32
MODELS = {  # model: (its overrides, the same model under its own jax.checkpoint)
    "scanned_models:jax_unrolled": (SIZE + (("hidden", 512), ("batch_size", BATCH)),
                                    "scanned_models:jax_checkpoint"),
    "gpt": (SIZE + (("hidden_size", 512), ("num_heads", 8)), None),
    "llama": (SIZE + (("hidden_size", 512), ("num_heads", 8)), None),
}


def main(prefix: str) -> None:
    import pandas as pd
    from cfp.execute import PlannedStep
    from cfp.gpu_compile import gpu_mesh
    from cfp.measure import memory_of
    from cfp.mesh import make_mesh
    from cfp.passes.analysis import run_analysis
    from cfp.recompute import forced, recomputed
    from cfp.tracing import trace_step
    from cfp.workloads import WorkloadSpec
    targets = {"a100": gpu_mesh("a100", (8,), ("m0",)), "cpu": make_mesh((8,))}
    rows = []
    for model, (overrides, own) in MODELS.items():
        runs = [(model, policy) for policy in POLICIES] + ([(own, "jax.checkpoint")] if own
                                                           else [])
        for name, policy in runs:
            zoo = ":" not in name
            spec = WorkloadSpec(name, "tiny" if zoo else None, BATCH if zoo else None,
                                "bfloat16", overrides).resolved()
            analysis = run_analysis(spec, (8,))
            program = trace_step(spec.build())
            if policy in POLICIES[1:]:
                program = recomputed(program, forced(analysis, policy))
            for target, mesh in targets.items():
                step = PlannedStep(program, analysis, [0] * len(analysis.blocks.blocks), mesh)
                memory = memory_of(step.compile())
                rows.append({"model": model, "recompute": policy, "compiled_for": target,
                             "temp_mib": memory["temp_bytes"] / 2**20,
                             "peak_mib": memory["peak_bytes"] / 2**20})
                print(rows[-1], flush=True)
    table = pd.DataFrame(rows)
    table.to_csv(f"{prefix}.csv", index=False, float_format="%.1f")
    _plot(table, f"{prefix}.png")


def _plot(table, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, target in zip(axes, ("a100", "cpu")):
        table[table.compiled_for == target].pivot(
            index="model", columns="recompute", values="temp_mib").plot.bar(ax=ax, rot=0)
        ax.set(title=f"temporaries per device, compiled for 8 {target.upper()}", ylabel="MiB")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1])
