"""A cluster plan's composed memory against XLA's, at true shapes: GPT-6.7B in bfloat16, batch
16, on ``a100-8`` (80 GB per device), where data parallelism cannot fit.

1. Plans the full model for the cluster (32 layers, priced analytically, nothing runs) and
   prints its plan beside the hand plans priced the same way.
2. Takes the same plan onto a 2-layer model: each window gets the combination the full plan
   gave the window computing the same operators (the first layer, a middle one, the head),
   so the state layouts and block strategies are the full plan's.
3. Composes that plan's memory from the 2-layer profile and compiles its step on 8 virtual
   CPU devices (compile only: ``Compiled.memory_analysis``, exact on CPU), and says how the
   composed memory grows per layer.

    python scripts/cluster_memory_check.py [--out scripts/results/<date>-cluster-memory-cpu.txt]
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASE = ["--model", "gpt", "--config", "6.7b", "--dtype", "bfloat16", "--batch-size", "16",
        "--cluster", "a100-8", "--mesh", "8"]


def records(workdir: Path, layers: int | None):
    """(analysis, priced profile, prediction) of the case at ``layers`` (None: the config's)."""
    from cfp.cli import main
    from cfp.cluster import load_cluster
    from cfp.passes.search import predict_plan
    from cfp.workdir import WorkDir
    from cfp.workloads import WorkloadSpec, run_fingerprint
    extra = [] if layers is None else ["--num-layers", str(layers)]
    for mode in ("analysis", "profile", "search"):
        if main(CASE + extra + ["--workdir", str(workdir), "--mode", mode]):
            raise SystemExit(f"cfp --mode {mode} failed")
    spec = WorkloadSpec("gpt", "6.7b", 16, "bfloat16",
                        () if layers is None else (("num_layers", layers),)).resolved()
    cluster = load_cluster("a100-8")
    wd = WorkDir(workdir, run_fingerprint(spec, (8,)) + (("cluster", repr(cluster)),))
    analysis = wd.read_analysis()
    try:
        profile = wd.read_profile(analysis, "analytic", 32, False)
    except Exception:
        profile = wd.read_profile(analysis, "model", 32, False)
    return analysis, profile, predict_plan(analysis, profile, cluster.memory_per_device_bytes,
                                           60.0)


def transfer(full, small) -> tuple:
    """The small model's problem and, per window, the combination ``full``'s plan gives the
    window that computes the same operators (``cfp.windows._operators``)."""
    from cfp.passes.search import build_problem
    from cfp.windows import _operators
    (fa, fp, pred), (sa, sp, _) = full, small
    fprob, _ = build_problem(fa, fp, None)
    by_ops = {}
    for w, grp, c in zip(fp.windows, fprob.groups, pred.choices):
        by_ops.setdefault(_operators(fa, w.start, w.end), grp.options[c].strategies)
    sprob, _ = build_problem(sa, sp, None)
    choices = [next(i for i, o in enumerate(grp.options)
                    if o.strategies == by_ops[_operators(sa, w.start, w.end)])
               for w, grp in zip(sp.windows, sprob.groups)]
    return sprob, tuple(choices)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "scripts" / "results" /
                                        f"{datetime.date.today()}-cluster-memory-cpu.txt"))
    a = p.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
    sys.path.insert(0, str(ROOT))
    from cfp.execute import PlannedStep
    from cfp.measure import memory_of
    from cfp.passes.search import plan_storage
    from cfp.solver import evaluate
    from cfp.workloads import make_mesh, trace_step
    lines = []

    def say(text):
        print(text, flush=True)
        lines.append(text)

    with tempfile.TemporaryDirectory() as d32, tempfile.TemporaryDirectory() as d2:
        full = records(Path(d32), None)
        small = records(Path(d2), 2)
    fa, fp, pred = full
    say(f"GPT-6.7B bfloat16, batch 16, a100-8 (80 GB per device), mesh 8, {fp.cost} pricing")
    say(f"cfp: predicted {pred.predicted_s * 1e3:.1f} ms, {pred.memory_bytes / 2**30:.2f} GB "
        f"composed per device; state {pred.storage.describe()}")
    for name, seconds, nbytes in sorted(pred.hand_plans, key=lambda h: h[1]):
        say(f"  {name:<10} predicted {seconds * 1e3:9.1f} ms, {nbytes / 2**30:7.2f} GB, "
            f"{'fits' if nbytes <= pred.memory_budget_bytes else 'does not fit'}")
    fitting = [s for _, s, m in pred.hand_plans if m <= pred.memory_budget_bytes]
    say(f"cfp over the fastest hand plan that fits: "
        + (f"{pred.predicted_s / min(fitting):.3f}" if fitting else "none fits"))
    sprob, choices = transfer(full, small)
    sa, sp, _ = small
    composed = evaluate(sprob, choices)[1]
    strategies = evaluate(sprob, choices)[2]
    storage = plan_storage(sa, sprob, sp.windows, choices)
    step = PlannedStep(trace_step(sa.spec.build()), sa, strategies, make_mesh((8,)), storage)
    compiled = memory_of(step.compile())["peak_bytes"]
    say(f"the same plan at 2 layers on 8 CPU devices: composed {composed / 2**30:.3f} GB, "
        f"compiled peak {compiled / 2**30:.3f} GB (compile only), composed/compiled "
        f"{composed / compiled:.3f}")
    per_layer = (pred.memory_bytes - composed) / 30
    say(f"composed memory grows {per_layer / 2**30:.3f} GB per layer (32 layers: "
        f"{pred.memory_bytes / 2**30:.2f} GB = 2 layers' {composed / 2**30:.2f} GB + 30 x "
        f"{per_layer / 2**30:.3f} GB)")
    Path(a.out).write_text("python scripts/cluster_memory_check.py\n" + "\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
