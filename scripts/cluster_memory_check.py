"""A cluster plan's composed memory against XLA's, at true shapes: GPT-6.7B in bfloat16, batch
16, on ``a100-8`` (80 GB per device).

1. Plans the full model for the cluster (32 layers, priced analytically whatever the load
   here, nothing runs) and prints its plan beside the hand plans priced the same way, each
   with its whole step compiled (compile only) for the cluster's own GPUs: 8 A100s described
   to XLA's GPU compiler (``cfp.jax_compat.deviceless_gpu_mesh``; no GPU is needed, but JAX's
   CUDA plugin is, see below; with no GPU to time them on, XLA picks its kernels untimed).
   Where the compile is there, a plan fits by its compiled peak.
2. Takes the same plan onto 2- and 4-layer models: each window gets the combination the full
   plan gave the window computing the same operators (the first layer, a middle one, the
   head), so the state layouts and block strategies are the full plan's.
3. Compiles their steps, compile only (``Compiled.memory_analysis``), for the 8 A100s and
   on 8 virtual CPU devices.
   The composition is for the cluster's GPUs; XLA on CPU computes bfloat16 in float32 and
   copies weights into the layouts its dot library wants, which a GPU does not, so the A100
   compile is the like-for-like reference and the CPU one shows how far a CPU compile is
   from it. The per-layer growth is the 4-layer figure less the 2-layer one, over 2.
4. Composes the plan a second time with each window's memory from its program compiled for
   the same target (what a compiled profile composes: temporaries and weight copies), in
   place of the analytic temporaries, which tells the composition's error from theirs.
5. Does the 2-layer comparisons in float32 too, with the same strategies and state layouts.
6. Lists the largest buffers live at the 2-layer bfloat16 step's compiled peak on the A100s
   (XLA's dump).

Without the CUDA plugin it compares with the CPU compile alone and says so. The plugin (about
5 GB with its CUDA libraries; JAX's version) goes into a separate environment, so that the
project's own runs never load it::

    python -m venv --system-site-packages /tmp/gpu-compile
    v=$(python -c 'import jax; print(jax.__version__)')
    /tmp/gpu-compile/bin/pip install "jax-cuda12-plugin[with-cuda]==$v"
    /tmp/gpu-compile/bin/python scripts/cluster_memory_check.py [--out FILE]
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASE = ["--model", "gpt", "--config", "6.7b", "--batch-size", "16",
        "--cluster", "a100-8", "--mesh", "8"]
# The A100-SXM4-80GB as XLA's GPU compiler sees it (``GpuTargetConfigProto``): NVIDIA's
# figures (108 SMs of compute capability 8.0, 164 KiB shared memory each, 40 MiB L2,
# 2039 GB/s, 80 GiB).
A100_TARGET = """
gpu_device_info {
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 167936 threads_per_core_limit: 2048 core_count: 108
  fpus_per_core: 64 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535
  block_dim_limit_z: 65535 memory_bandwidth: 2039000000000 l2_cache_size: 41943040
  clock_rate_ghz: 1.41 device_memory_size: 85899345920
  shared_memory_per_block_optin: 166912 cuda_compute_capability { major: 8 }
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}
platform_name: "CUDA"
dnn_version_info { major: 9 minor: 7 }
runtime_version { major: 12 minor: 8 }
device_description_str: "NVIDIA A100-SXM4-80GB"
"""


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


def program_of(analysis):
    """The analysed step's program, traced once per analysis."""
    from cfp.sharding import memo
    from cfp.workloads import trace_step
    return memo(analysis, "program", lambda: trace_step(analysis.spec.build()))


def problem_of(analysis, profile):
    """The search problem of ``profile`` (no budget), built once per profile."""
    from cfp.passes.search import build_problem
    from cfp.sharding import memo
    return memo(profile, "problem", lambda: build_problem(analysis, profile, None)[0])


def whole_plans(full, mesh) -> list[tuple]:
    """(name, predicted seconds, composed bytes, compiled peak bytes on ``mesh`` or None) of
    cfp's plan and each hand plan of the full model, fastest first."""
    from cfp.execute import PlannedStep
    from cfp.measure import memory_of
    from cfp.passes.search import baseline_candidates, plan_storage
    analysis, profile, pred = full
    problem = problem_of(analysis, profile)
    plans = [("cfp", pred.predicted_s, pred.memory_bytes, pred.strategies, pred.storage)]
    hand = dict(baseline_candidates(analysis, problem, [], within_budget=False))
    for name, seconds, nbytes in pred.hand_plans:
        sol = hand[name]
        plans.append((name, seconds, nbytes, sol.strategies,
                      plan_storage(analysis, problem, profile.windows, sol.choices)))
    out = []
    for name, seconds, nbytes, strategies, storage in sorted(plans, key=lambda p: p[1]):
        peak = None
        if mesh is not None:
            step = PlannedStep(program_of(analysis), analysis, strategies, mesh, storage)
            peak = memory_of(step.compile())["peak_bytes"]
        out.append((name, seconds, nbytes, peak))
    return out


def transfer(full, small) -> tuple:
    """The small model's problem and, per window, the combination ``full``'s plan gives the
    window that computes the same operators (``cfp.windows._operators``)."""
    from cfp.windows import _operators
    (fa, fp, pred), (sa, sp, _) = full, small
    fprob = problem_of(fa, fp)
    by_ops = {}
    for w, grp, c in zip(fp.windows, fprob.groups, pred.choices):
        by_ops.setdefault(_operators(fa, w.start, w.end), grp.options[c].strategies)
    sprob = problem_of(sa, sp)
    choices = [next(i for i, o in enumerate(grp.options)
                    if o.strategies == by_ops[_operators(sa, w.start, w.end)])
               for w, grp in zip(sp.windows, sprob.groups)]
    return sprob, tuple(choices)


def in_dtype(small, other) -> tuple:
    """``other`` (the small model in another dtype, the same blocks and windows) and the
    combinations ``small`` = (problem, choices, analysis, profile) gives its windows."""
    sprob, choices, _, sp = small
    oa, op = other[:2]
    if [(w.start, w.end) for w in op.windows] != [(w.start, w.end) for w in sp.windows]:
        raise SystemExit("the two dtypes split the model into different windows")
    oprob = problem_of(oa, op)
    picked = tuple(next(i for i, o in enumerate(grp.options)
                        if o.strategies == sgrp.options[c].strategies)
                   for grp, sgrp, c in zip(oprob.groups, sprob.groups, choices))
    return oprob, picked, oa, op


def composed_and_compiled(problem, choices, analysis, profile, mesh,
                          dump: str | None = None):
    """(composed bytes, compiled peak bytes on ``mesh``) of one plan of the small model."""
    from cfp.execute import PlannedStep
    from cfp.measure import memory_of
    from cfp.passes.search import plan_storage
    from cfp.solver import evaluate
    _, composed, strategies = evaluate(problem, choices)
    storage = plan_storage(analysis, problem, profile.windows, choices)
    step = PlannedStep(program_of(analysis), analysis, strategies, mesh, storage)
    compiled = step.compile({"xla_dump_to": dump, "xla_dump_hlo_as_text": True} if dump
                            else None)
    return composed, memory_of(compiled)["peak_bytes"]


def composed_from_compiled_windows(problem, choices, analysis, profile, mesh) -> int:
    """The plan's composed bytes with each window's memory taken from its program compiled
    for ``mesh`` at true shapes (compile only), as a compiled profile would compose it, in
    place of the analytic temporaries; the activations held as ``mesh``'s platform holds
    them."""
    from cfp.measure import WindowProgram
    from cfp.solver import evaluate
    from cfp.windows import inputs_read_earlier
    platform = mesh.devices.flat[0].platform
    problem = problem_of(analysis, dataclasses.replace(profile, platform=platform))
    program = program_of(analysis)
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
    # JAX's CUDA plugin, where installed, loads without looking for a GPU (deviceless_gpu_mesh)
    os.environ.update(JAX_PLATFORMS="cpu", JAX_SKIP_CUDA_CONSTRAINTS_CHECK="1")
    sys.path.insert(0, str(ROOT))
    import jax
    from cfp.jax_compat import deviceless_gpu_mesh
    from cfp.workloads import make_mesh
    jax.config.update("jax_enable_compilation_cache", False)  # every program compiled here
    lines = []

    def say(text):
        print(text, flush=True)
        lines.append(text)

    gb = lambda n: f"{n / 2**30:.3f} GB"  # noqa: E731
    targets = {"8 A100s": deviceless_gpu_mesh(A100_TARGET, (8,), ("m0",)),
               "8 CPU devices": make_mesh((8,))}
    if targets["8 A100s"] is None:
        del targets["8 A100s"]
    with tempfile.TemporaryDirectory() as d:
        full = records(Path(d) / "32", None)
        fa, fp, pred = full
        say(f"GPT-6.7B bfloat16, batch 16, a100-8 (80 GB per device), mesh 8, {fp.cost} pricing "
            f"for {fp.platform}")
        gpus = targets.get("8 A100s")
        say("per plan: predicted step, composed memory per device"
            + (", and the whole 32-layer step compiled (compile only) for 8 A100s" if gpus
               else ""))
        rows = whole_plans(full, gpus)
        fits = {name: (nbytes if peak is None else peak) <= pred.memory_budget_bytes
                for name, _, nbytes, peak in rows}
        for name, seconds, nbytes, peak in rows:
            say(f"  {name:<10} predicted {seconds * 1e3:7.1f} ms, composed {nbytes / 2**30:6.2f} GB"
                + (f", compiled {peak / 2**30:6.2f} GB, composed/compiled {nbytes / peak:.3f}"
                   if peak is not None else "")
                + f", {'fits' if fits[name] else 'does not fit'}")
        say(f"cfp's state: {pred.storage.describe()}")
        fitting = [s for name, s, _, _ in rows if name != "cfp" and fits[name]]
        say("cfp over the fastest hand plan that fits: "
            + (f"{pred.predicted_s / min(fitting):.3f}" if fitting else "none fits"))
        if "8 A100s" not in targets:
            say("JAX's CUDA plugin is not installed here: no compile for the A100s (see "
                "the script's docstring); the CPU compile alone follows")
        say("the same plan at 2 and 4 layers, compiled (compile only) for "
            + " and for ".join(targets) + ":")
        plans = {}
        for layers in (2, 4):
            small = records(Path(d) / str(layers), layers)
            plans[("bfloat16", layers)] = transfer(full, small) + small[:2]
        plans[("float32", 2)] = in_dtype(plans[("bfloat16", 2)],
                                         records(Path(d) / "2f32", 2, "float32"))
        compiled, composed = {}, {}
        for (dtype, layers), plan in plans.items():
            for target, mesh in targets.items():
                dump = (str(Path(d) / "dump") if (dtype, layers) == ("bfloat16", 2)
                        and target == next(iter(targets)) else None)
                composed[dtype, layers], compiled[dtype, layers, target] = \
                    composed_and_compiled(*plan, mesh, dump=dump)
            say(f"  {layers} layers, {dtype}: composed {gb(composed[dtype, layers])}; "
                + "; ".join(f"{target}: compiled peak {gb(compiled[dtype, layers, target])}, "
                            f"composed/compiled "
                            f"{composed[dtype, layers] / compiled[dtype, layers, target]:.3f}"
                            for target in targets))
        say("  the same plans composed with each window's memory from its program compiled for "
            "the same target (as a compiled profile composes it):")
        windows = {}
        for (dtype, layers), plan in plans.items():
            for target, mesh in targets.items():
                windows[dtype, layers, target] = n = composed_from_compiled_windows(*plan, mesh)
                say(f"    {layers} layers, {dtype}, {target}: composed {gb(n)}, composed/compiled "
                    f"{n / compiled[dtype, layers, target]:.3f}")
        growth = lambda table, target: gb(  # noqa: E731
            (table["bfloat16", 4, target] - table["bfloat16", 2, target]) / 2)
        say("per layer, from 2 to 4 layers (bfloat16): composed "
            f"{gb((composed['bfloat16', 4] - composed['bfloat16', 2]) / 2)}; "
            + "; ".join(f"{target}: compiled {growth(compiled, target)}, composed from its "
                        f"windows {growth(windows, target)}" for target in targets))
        say(f"the largest buffers live at the 2-layer bfloat16 step's compiled peak for "
            f"{next(iter(targets))}:")
        for line in largest_at_peak(str(Path(d) / "dump"), 12):
            say("  " + line.strip())
    per_layer = (pred.memory_bytes - composed["bfloat16", 2]) / 30
    say(f"composed memory grows {per_layer / 2**30:.3f} GB per layer (32 layers: "
        f"{pred.memory_bytes / 2**30:.2f} GB = 2 layers' {composed['bfloat16', 2] / 2**30:.2f} GB"
        f" + 30 x {per_layer / 2**30:.3f} GB)")
    Path(a.out).write_text("python scripts/cluster_memory_check.py\n" + "\n".join(lines) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
