"""A cluster plan's composed memory against XLA's, at true shapes: GPT-6.7B in bfloat16, batch
16, on ``a100-8`` (80 GB per device), where data parallelism cannot fit.

1. Plans the full model for the cluster (32 layers, priced analytically whatever the load
   here, nothing runs) and prints its plan beside the hand plans priced the same way.
2. Takes the same plan onto 2- and 4-layer models: each window gets the combination the full
   plan gave the window computing the same operators (the first layer, a middle one, the
   head), so the state layouts and block strategies are the full plan's.
3. Composes that plan's memory from the small models' analytic profiles and compiles their
   steps on 8 virtual CPU devices (compile only: ``Compiled.memory_analysis``, exact on CPU);
   the per-layer growth is the 4-layer figure less the 2-layer one, over 2.
   It composes the plan a second time with each window's memory from its program compiled
   here at true shapes (what a measured profile counts: temporaries and weight copies), in
   place of the analytic temporaries, which tells the composition's error from theirs.
4. Does both at 2 layers in float32 with the same strategies and state layouts: XLA on
   CPU computes bfloat16 dots and their neighbours in float32 (its temporaries are float32
   either way), which a GPU does not, so float32 compares like with like.
5. Lists the largest buffers live at the 2-layer bfloat16 step's compiled peak (XLA's dump).

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
CASE = ["--model", "gpt", "--config", "6.7b", "--batch-size", "16",
        "--cluster", "a100-8", "--mesh", "8"]


def records(workdir: Path, layers: int | None, dtype: str = "bfloat16"):
    """(analysis, analytic profile, prediction) of the case at ``layers`` (None: the
    config's) in ``dtype``."""
    from cfp.cli import main
    from cfp.cluster import load_cluster
    from cfp.passes.search import predict_plan
    from cfp.workdir import WorkDir
    from cfp.workloads import WorkloadSpec, run_fingerprint
    from cfp.passes.profile import ProfileOptions, run_profile
    extra = ["--dtype", dtype] + ([] if layers is None else ["--num-layers", str(layers)])
    if main(CASE + extra + ["--workdir", str(workdir), "--mode", "analysis"]):
        raise SystemExit("cfp --mode analysis failed")
    spec = WorkloadSpec("gpt", "6.7b", 16, dtype,
                        () if layers is None else (("num_layers", layers),)).resolved()
    cluster = load_cluster("a100-8")
    wd = WorkDir(workdir, run_fingerprint(spec, (8,)) + (("cluster", repr(cluster)),))
    analysis = wd.read_analysis()
    # Priced analytically whatever the load here (the CLI compiles the windows instead where
    # that looks quick, and how quick depends on the load).
    profile = run_profile(analysis, ProfileOptions(
        cost="analytic", max_combinations=32, cost_model=cluster.cost_model((8,))))
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


def in_dtype(small, other) -> tuple:
    """``other`` (the small model in another dtype, the same blocks and windows) and the
    combinations ``small`` = (problem, choices, analysis, profile) gives its windows."""
    from cfp.passes.search import build_problem
    sprob, choices, _, sp = small
    oa, op = other[:2]
    if [(w.start, w.end) for w in op.windows] != [(w.start, w.end) for w in sp.windows]:
        raise SystemExit("the two dtypes split the model into different windows")
    oprob, _ = build_problem(oa, op, None)
    picked = tuple(next(i for i, o in enumerate(grp.options)
                        if o.strategies == sgrp.options[c].strategies)
                   for grp, sgrp, c in zip(oprob.groups, sprob.groups, choices))
    return oprob, picked, oa, op


def composed_and_compiled(problem, choices, analysis, profile, dump: str | None = None):
    """(composed bytes, compiled peak bytes) of one plan of the small model."""
    from cfp.execute import PlannedStep
    from cfp.measure import memory_of
    from cfp.passes.search import plan_storage
    from cfp.solver import evaluate
    from cfp.workloads import make_mesh, trace_step
    import jax
    jax.config.update("jax_enable_compilation_cache", dump is None)  # a cached program: no dump
    _, composed, strategies = evaluate(problem, choices)
    storage = plan_storage(analysis, problem, profile.windows, choices)
    step = PlannedStep(trace_step(analysis.spec.build()), analysis, strategies,
                       make_mesh((8,)), storage)
    compiled = step.compile({"xla_dump_to": dump, "xla_dump_hlo_as_text": True} if dump
                            else None)
    return composed, memory_of(compiled)["peak_bytes"]


def composed_from_compiled_windows(problem, choices, analysis, profile) -> int:
    """The plan's composed bytes with each window's memory taken from its program compiled
    here at true shapes (compile only), as a measured profile would compose it, in place of
    the analytic temporaries."""
    import dataclasses
    from cfp.measure import WindowProgram
    from cfp.solver import evaluate
    from cfp.windows import inputs_read_earlier
    from cfp.workloads import make_mesh, trace_step
    program, mesh = trace_step(analysis.spec.build()), make_mesh((8,))
    earlier = inputs_read_earlier(analysis, profile.windows)
    groups = []
    for k, (w, grp, c) in enumerate(zip(profile.windows, problem.groups, choices)):
        combo = grp.options[c].strategies
        adding, transient, held, waiting = WindowProgram(
            program, analysis, w, mesh).option_memory(combo, earlier[k])
        options = list(grp.options)
        options[c] = dataclasses.replace(options[c], memory=adding, transient=transient,
                                         held=held, waiting=waiting)
        groups.append(dataclasses.replace(grp, options=options))
    return evaluate(dataclasses.replace(problem, groups=groups), choices)[1]


def largest_at_peak(dump: str, top: int) -> list[str]:
    """The largest buffers live at the compiled peak, from XLA's dump (its debug output)."""
    import contextlib
    import io
    sys.path.insert(0, str(ROOT / "scripts" / "diagnostics"))
    from memory_gap import _print_peak
    text = io.StringIO()
    with contextlib.redirect_stdout(text):
        _print_peak(dump, top)
    return text.getvalue().rstrip().splitlines()[1:]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "scripts" / "results" /
                                        f"{datetime.date.today()}-cluster-memory-cpu.txt"))
    a = p.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
    sys.path.insert(0, str(ROOT))
    lines = []

    def say(text):
        print(text, flush=True)
        lines.append(text)

    gb = lambda n: f"{n / 2**30:.3f} GB"  # noqa: E731
    with tempfile.TemporaryDirectory() as d:
        full = records(Path(d) / "32", None)
        fa, fp, pred = full
        say(f"GPT-6.7B bfloat16, batch 16, a100-8 (80 GB per device), mesh 8, {fp.cost} pricing")
        say(f"cfp: predicted {pred.predicted_s * 1e3:.1f} ms, {pred.memory_bytes / 2**30:.2f} GB "
            f"composed per device; state {pred.storage.describe()}")
        for name, seconds, nbytes in sorted(pred.hand_plans, key=lambda h: h[1]):
            say(f"  {name:<10} predicted {seconds * 1e3:9.1f} ms, {nbytes / 2**30:7.2f} GB, "
                f"{'fits' if nbytes <= pred.memory_budget_bytes else 'does not fit'}")
        fitting = [s for _, s, m in pred.hand_plans if m <= pred.memory_budget_bytes]
        say("cfp over the fastest hand plan that fits: "
            + (f"{pred.predicted_s / min(fitting):.3f}" if fitting else "none fits"))
        say("the same plan at 2 and 4 layers on 8 CPU devices (compile only):")
        at = {}
        for layers in (2, 4):
            small = records(Path(d) / str(layers), layers)
            at[layers] = transfer(full, small) + small[:2]
            dump = str(Path(d) / "dump") if layers == 2 else None
            composed, compiled = composed_and_compiled(*at[layers], dump=dump)
            at[layers] += (composed, compiled)
            say(f"  {layers} layers, bfloat16: composed {gb(composed)}, compiled peak "
                f"{gb(compiled)}, composed/compiled {composed / compiled:.3f}")
        for layers in (2, 4):
            n = composed_from_compiled_windows(*at[layers][:4])
            at[layers] += (n,)
            say(f"  {layers} layers, bfloat16, each window's memory from its program compiled "
                f"here: composed {gb(n)}, composed/compiled {n / at[layers][5]:.3f}")
        f32 = in_dtype(at[2][:4], records(Path(d) / "2f32", 2, "float32"))
        composed, compiled = composed_and_compiled(*f32)
        say(f"  2 layers, float32 (the same strategies and state layouts; XLA on CPU computes "
            f"bfloat16 in float32, so this compares like with like): composed {gb(composed)}, "
            f"compiled peak {gb(compiled)}, composed/compiled {composed / compiled:.3f}")
        n = composed_from_compiled_windows(*f32)
        say(f"  2 layers, float32, each window's memory from its program compiled here: "
            f"composed {gb(n)}, composed/compiled {n / compiled:.3f}")
        say("per layer, from 2 to 4 layers: composed "
            f"{gb((at[4][4] - at[2][4]) / 2)}, compiled {gb((at[4][5] - at[2][5]) / 2)}, "
            f"composed from the windows compiled {gb((at[4][6] - at[2][6]) / 2)}")
        say("the largest buffers live at the 2-layer bfloat16 step's compiled peak:")
        for line in largest_at_peak(str(Path(d) / "dump"), 8):
            say("  " + line.strip())
    per_layer = (pred.memory_bytes - at[2][4]) / 30
    say(f"composed memory grows {per_layer / 2**30:.3f} GB per layer (32 layers: "
        f"{pred.memory_bytes / 2**30:.2f} GB = 2 layers' {at[2][4] / 2**30:.2f} GB + 30 x "
        f"{per_layer / 2**30:.3f} GB)")
    Path(a.out).write_text("python scripts/cluster_memory_check.py\n" + "\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
