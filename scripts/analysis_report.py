"""Evidence that the blocks are real: analysis figures per model, as quoted in the README.

Runs the analysis pass in-process for each workload and prints one markdown table row each:
FLOPs share inside blocks, blocks per layer, unique segments, one segment's operator count next
to one layer's, analysis time and the process's peak memory. Usage:

    python scripts/analysis_report.py            # tiny presets, users' models, 8-layer GPT, LLaMA-2-13B
    python scripts/analysis_report.py --quick    # tiny presets only
"""
from __future__ import annotations

import argparse
import os
import resource
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cfp_test"))

from cfp.report import segment_op_count  # noqa: E402
from cfp.workloads import WorkloadSpec  # noqa: E402
from cfp.passes.analysis import run_analysis  # noqa: E402

TINY = [("mlp", "tiny", ()), ("gpt", "tiny", (("num_layers", 4),)),
        ("llama", "tiny", (("num_layers", 4),)), ("moe", "tiny", ()),
        ("bert", "tiny", (("num_layers", 4),))]
BIG = [("gpt", "350m", (("num_layers", 8),)), ("llama", "13b", ())]
# Written outside the zoo, the way users write them (cfp_test/users_models.py, zoo_extra.py):
# heads split by reshape, dropout keys in the batch.
USERS = [("users_models:equinox_attention", None, (("num_layers", 4),)),
         ("zoo_extra:reshape_attention", None, (("num_layers", 4),)),
         ("users_models:flax_dropout", None, (("num_layers", 4),))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--mesh", default="8")
    args = ap.parse_args()
    mesh = tuple(int(x) for x in args.mesh.split("x"))
    print(f"backend cpu, {len(mesh) and __import__('math').prod(mesh)} virtual devices, mesh {args.mesh}")
    print("| workload | ops | blocks | blocks/layer | FLOPs in blocks | unique segments | "
          "ops/layer | ops in segment 0 | analysis s | peak RSS GB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for model, config, overrides in TINY + USERS + ([] if args.quick else BIG):
        spec = WorkloadSpec(model, config, None, "float32", overrides).resolved()
        rec = run_analysis(spec, mesh)
        layers = rec.stats.num_layers or dict(overrides).get("num_layers") or 1
        peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        name = f"{model}-{config}" if config else model
        print(f"| {name} {dict(overrides) or ''} | {len(rec.graph.ops)} | "
              f"{len(rec.blocks.blocks)} | {len(rec.blocks.blocks) / layers:.2f} | "
              f"{100 * rec.stats.flops_share:.2f}% | {rec.segments.num_types} | "
              f"{len(rec.graph.ops) / layers:.0f} | {segment_op_count(rec, 0)} | "
              f"{rec.stats.time_s:.2f} | {peak_gb:.2f} |", flush=True)


if __name__ == "__main__":
    main()
