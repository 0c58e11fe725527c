"""How many timed window programs hold only the collectives their strategies name.

For each model and mesh: the analysis, the window types of the profile pass, and up to
``--combinations`` combinations per window type (drawn with a fixed seed), each compiled as
the profile pass compiles it; a combination holds only named collectives when
``WindowProgram.unnamed_collectives`` finds none (see its docstring for what is named).

    python scripts/collective_share.py --models mlp,gpt,llama,moe,bert --meshes 4,2x2

Writes ``scripts/results/<date>-collective-share-<backend>.csv``: one row per model and mesh
with the share and the most frequent unnamed collectives.
"""
from __future__ import annotations

import argparse
import collections
import csv
import datetime
import os
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="mlp,gpt,llama,moe,bert")
    ap.add_argument("--meshes", default="4,2x2")
    ap.add_argument("--num-layers", type=int, default=1)
    ap.add_argument("--combinations", type=int, default=8)
    ap.add_argument("--max-combinations", type=int, default=32)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    import jax
    from cfp.measure import WindowProgram
    from cfp.passes.analysis import run_analysis
    from cfp.windows import split_windows, window_space
    from cfp.workloads import WorkloadSpec, make_mesh, trace_step

    backend = jax.default_backend()
    out = Path(args.out or ROOT / "scripts" / "results"
               / f"{datetime.date.today()}-collective-share-{backend}.csv")
    rows = []
    for model in args.models.split(","):
        for mesh_text in args.meshes.split(","):
            mesh_shape = tuple(int(x) for x in mesh_text.split("x"))
            over = () if model == "mlp" else (("num_layers", args.num_layers),)
            analysis = run_analysis(WorkloadSpec(model, "tiny", None, "float32", over).resolved(),
                                    mesh_shape)
            program = trace_step(analysis.spec.build())
            windows, reps = split_windows(analysis, args.max_combinations)
            rng = random.Random(0)
            total = clean = 0
            kinds: collections.Counter = collections.Counter()
            for k in reps:
                wp = WindowProgram(program, analysis, windows[k], make_mesh(mesh_shape))
                space = window_space(analysis, windows[k])
                combos = {tuple(rng.randrange(n) for n in space)
                          for _ in range(args.combinations)}
                for combo in sorted(combos):
                    unnamed = wp.unnamed_collectives(wp.compile(combo)[0], combo)
                    total += 1
                    clean += not unnamed
                    kinds.update(" ".join(u.split()[:1] + u.split(" at op ")[-1:]
                                          if " at op " in u else u.split()[:1] + ["untagged"])
                                 for u in unnamed)
            rows.append({"backend": backend, "model": model, "mesh": mesh_text,
                         "num_layers": args.num_layers, "window_types": len(reps),
                         "combinations": total, "only_named": clean,
                         "share_only_named": round(clean / total, 3),
                         "most_frequent_unnamed": "; ".join(f"{k} x{n}"
                                                            for k, n in kinds.most_common(4))})
            print(rows[-1], flush=True)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
