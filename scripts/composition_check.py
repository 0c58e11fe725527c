"""The claim the method rests on: composed segment profiles predict whole-model plans.

For a workload and mesh (analysed and profiled first if the work dir lacks them), draws random
whole-model plans (one measured combination per window instance), predicts each plan's step
time (window times + boundary reshardings + one launch) and per-device memory from the
profiles, then compiles and runs every plan on the mesh, interleaved over rounds, and compares:
step time by medians, memory against the full step's ``memory_analysis()``.

    python scripts/composition_check.py --model gpt --num-layers 4 --mesh 8 --plans 20
    python scripts/composition_check.py --model gpt --num-layers 2 --hidden-size 256 \
        --seq-len 128 --num-heads 8 --mesh 8          # the compute-bound size

Besides the errors, fits measured on predicted step time: the slope of one regressor with no
intercept, and the weights of the prediction's terms (window times, reshardings between
windows; the launch is subtracted first), each with a 95% bootstrap interval over the plans.

Two more lines follow the summary: the time error and slope composed from the window times as
timed (each profile batch at its own speed: ``as_timed``), and, with the profile's speed anchor
(``timing.speed_anchor``, timed in every round of the profile) timed at the start of every
round of steps too, its time then against its time over the profile and the figures with the
predictions scaled by that ratio: the composition at the speed the machine ran the steps.

Writes ``scripts/results/<date>-composition-<backend>.csv`` (appending) and a PNG.
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import random
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def plan_arguments() -> argparse.ArgumentParser:
    """The options of a check that runs random whole-model plans."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gpt")
    ap.add_argument("--config", default="tiny")
    ap.add_argument("--num-layers", type=int, default=4)
    for name in ("batch-size", "seq-len", "hidden-size", "num-heads", "num-experts"):
        ap.add_argument(f"--{name}", type=int, default=None)
    ap.add_argument("--max-combinations", type=int, default=32)
    ap.add_argument("--whole-segments", action="store_true")
    ap.add_argument("--mesh", default="8")
    ap.add_argument("--plans", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    return ap


def plan_setup(args) -> tuple[tuple[int, ...], str, Path]:
    """(mesh shape, workload label, work dir) of ``plan_arguments``' ``args``, with the host
    platform's device count set for the mesh (before JAX starts)."""
    from benchmark import workload_label
    mesh_shape = tuple(int(x) for x in args.mesh.split("x"))
    os.environ.setdefault("XLA_FLAGS",
                          f"--xla_force_host_platform_device_count={math.prod(mesh_shape)}")
    label = workload_label(args)
    return mesh_shape, label, ROOT / "profiles" / f"{label}-{args.mesh}"


def main() -> None:
    ap = plan_arguments()
    ap.add_argument("--out", default=None,
                    help="CSV to append to (default scripts/results/<date>-composition-<backend>.csv)")
    args = ap.parse_args()
    mesh_shape, label, workdir = plan_setup(args)
    n_dev = math.prod(mesh_shape)
    from cfp.cli import main as cli
    base = ["--model", args.model, *(["--config", args.config] if ":" not in args.model
                                     else []), "--mesh", args.mesh,
            "--workdir", str(workdir), "--max-combinations", str(args.max_combinations)]
    for name in ("num_layers", "batch_size", "seq_len", "hidden_size", "num_heads",
                 "num_experts"):
        if getattr(args, name) is not None:
            base += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    if args.whole_segments:
        base.append("--whole-segments")
    if not (workdir / "analysis.pkl").exists():
        assert cli(base + ["--mode", "analysis"]) == 0
    if not (workdir / "profile.pkl").exists():
        assert cli(base + ["--mode", "profile", "-v"]) == 0

    import jax
    from cfp.measure import memory_of
    from cfp.timing import CpuShare
    from cfp.records import read_record
    from cfp.mesh import make_mesh
    from cfp.workloads import run_fingerprint
    from cfp.workdir import ANALYSIS_FORMAT, WorkDir
    from cfp.problem import SCALE, build_problem

    analysis = read_record(workdir / "analysis.pkl", ANALYSIS_FORMAT, None, hint="")
    run_fp = run_fingerprint(analysis.spec, mesh_shape)
    profile = WorkDir(workdir, run_fp).read_profile(analysis, "measure", args.max_combinations,
                                                    args.whole_segments)
    problem, _ = build_problem(analysis, profile, None)
    cpu = CpuShare().start()
    steps, times, anchor_s = random_plan_steps(analysis, problem, make_mesh(mesh_shape), args)
    others, stolen = cpu.share()
    for ps in steps:
        ps.predicted_s = ps.cost / SCALE + profile.launch_overhead_s
        ps.windows_s = sum(g.options[c].cost for g, c in zip(problem.groups, ps.choices)) / SCALE
        ps.predicted_mem = ps.mem
        ps.compiled_mem = memory_of(ps.compiled)["peak_bytes"]
    backend = jax.devices()[0].platform
    date = datetime.date.today().isoformat()
    out = (Path(args.out).resolve() if args.out
           else ROOT / "scripts" / "results" / f"{date}-composition-{backend}.csv")
    new = not out.exists()
    rows = []
    with open(out, "a") as f:
        if new:
            f.write("workload,mesh,backend,devices,plan,predicted_s,measured_s,time_err,"
                    "composed_mem_bytes,compiled_mem_bytes,mem_err\n")
        for i, ps in enumerate(steps):
            meas = statistics.median(times[i])
            terr = (ps.predicted_s - meas) / meas
            merr = (ps.predicted_mem - ps.compiled_mem) / ps.compiled_mem
            rows.append((ps.predicted_s, meas, terr, merr, ps.windows_s,
                         ps.predicted_s - ps.windows_s - profile.launch_overhead_s))
            f.write(f"{label},{args.mesh},{backend},{n_dev},{i},"
                    f"{ps.predicted_s:.6g},{meas:.6g},{terr:.4f},{ps.predicted_mem},"
                    f"{ps.compiled_mem},{merr:.4f}\n")
    time_abs, time_max, slope, slope_ci = time_figures([r[0] for r in rows],
                                                       [r[1] for r in rows])
    abs_m = sorted(abs(r[3]) for r in rows)
    pairs = [(a, b) for a in rows for b in rows if a is not b]
    agree = sum((a[0] < b[0]) == (a[1] < b[1]) for a, b in pairs) / max(1, len(pairs))
    weights, weights_ci = fit_with_interval(
        [[r[4], r[5]] for r in rows], [r[1] - profile.launch_overhead_s for r in rows])
    print(f"{label} mesh {args.mesh} ({backend}, {n_dev} devices), "
          f"{len(rows)} random plans: median |time error| {100 * time_abs:.1f}% "
          f"(max {100 * time_max:.1f}%), median |memory error| "
          f"{100 * statistics.median(abs_m):.1f}% (max {100 * abs_m[-1]:.1f}%), pairwise "
          f"order agreement {100 * agree:.0f}%; slope of measured on predicted "
          f"{slope[0]:.2f} [{slope_ci[0][0]:.2f}, {slope_ci[0][1]:.2f}]; term weights: "
          f"windows {weights[0]:.2f} [{weights_ci[0][0]:.2f}, {weights_ci[0][1]:.2f}], "
          f"reshardings {weights[1]:.2f} [{weights_ci[1][0]:.2f}, {weights_ci[1][1]:.2f}]; "
          f"rows appended to {out}")
    _speed_lines(rows, [as_timed_s(ps, problem, profile) for ps in steps],
                 statistics.median(anchor_s), profile.anchor_s)
    print(f"while the plans were compiled and run, others took {others:.0%} of the cores "
          f"({stolen:.0%} stolen by the hypervisor)")
    busy = profile.busy_window_types()
    if busy:
        print(f"warning: {sum(busy.values())} profiled combinations (window types "
              f"{sorted(busy)}) were timed while the machine was busy: their times read high")
    _plot(rows, out.with_name(f"{out.stem}-{label}-{args.mesh}.png"), args)


def as_timed_s(ps, problem, profile) -> float:
    """``ps``'s composed step seconds with each window time back at its batch's own speed:
    the rescaling to the speed anchor's median over the profile
    (``passes.profile.on_one_scale``) undone."""
    from cfp.problem import SCALE
    seconds = ps.predicted_s
    for window, group, c in zip(profile.windows, problem.groups, ps.choices):
        option = group.options[c]
        m = profile.window_profiles[window.type].results[option.strategies]
        if m.anchor_s > 0 and profile.anchor_s > 0:
            seconds += option.cost / SCALE * (m.anchor_s / profile.anchor_s - 1)
    return seconds


def time_figures(predicted_s, measured_s):
    """(median and largest |time error|, slope of measured on predicted with its 95%
    interval) over the plans."""
    errors = [abs(p / m - 1) for p, m in zip(predicted_s, measured_s)]
    slope, ci = fit_with_interval([[p] for p in predicted_s], measured_s)
    return statistics.median(errors), max(errors), slope, ci


def _speed_lines(rows, unscaled_s, steps_anchor_s: float, profile_anchor_s: float) -> None:
    """Prints how the speed anchor bears on the time figures: composed from the window times
    as timed (``unscaled_s`` per plan, each batch at its own speed: ``as_timed``), and with
    every prediction scaled by the anchor's time during the steps over its time during the
    profile (``ProfileRecord.anchor_s``): the composition at the speed the machine ran the
    steps. ``rows``: (predicted s, measured s, ...) per plan."""
    if not profile_anchor_s > 0:  # NaN: a profile without the anchor
        print("the profile has no speed anchor: no figures at another scale")
        return

    def figures(predicted):
        median, most, slope, ci = time_figures(predicted, [r[1] for r in rows])
        return (f"median |time error| {100 * median:.1f}% (max {100 * most:.1f}%), slope "
                f"{slope[0]:.2f} [{ci[0][0]:.2f}, {ci[0][1]:.2f}]")
    ratio = steps_anchor_s / profile_anchor_s
    print(f"composed from the window times as timed, not rescaled by the speed anchor: "
          f"{figures(unscaled_s)}")
    print(f"speed anchor {1e3 * steps_anchor_s:.2f} ms during the steps, "
          f"{1e3 * profile_anchor_s:.2f} ms over the profile (x{ratio:.3f}); predictions "
          f"scaled by it: {figures([r[0] * ratio for r in rows])}")


def fit_with_interval(x, y, *, resamples: int = 2000, seed: int = 0):
    """Least-squares coefficients of ``y`` on the columns of ``x`` (no intercept) and a 95%
    bootstrap interval of each, resampling the rows."""
    import numpy as np
    x, y = np.asarray(x, float), np.asarray(y, float)
    coef = np.linalg.lstsq(x, y, rcond=None)[0]
    rng = np.random.default_rng(seed)
    draws = []
    for _ in range(resamples):
        k = rng.integers(0, len(y), len(y))
        draws.append(np.linalg.lstsq(x[k], y[k], rcond=None)[0])
    low, high = np.percentile(draws, [2.5, 97.5], axis=0)
    return coef.tolist(), list(zip(low.tolist(), high.tolist()))


def random_plans(problem, count: int, seed: int) -> list[tuple[int, ...]]:
    """``count`` random plans of ``problem``: one option index per group."""
    rng = random.Random(seed)
    return [tuple(rng.randrange(len(g.options)) for g in problem.groups) for _ in range(count)]


ANCHOR_RUNS = 3  # speed-anchor runs per round of steps


def random_plan_steps(analysis, problem, mesh, args):
    """``args.plans`` random plans of ``problem`` (one option per group), each compiled
    (``PlannedStep`` with ``cost`` and ``mem`` as composed) and timed on ``mesh`` in
    ``args.rounds`` interleaved rounds: (steps, seconds per step of each round, seconds of the
    profile's speed anchor, ``ANCHOR_RUNS`` runs at the start of each round)."""
    from cfp.execute import PlannedStep, real_inputs, time_steps
    from cfp.timing import run_once_s, speed_anchor
    from cfp.solver import evaluate
    from cfp.tracing import trace_step
    plans = random_plans(problem, args.plans, args.seed)
    workload = analysis.spec.build()
    program, host = trace_step(workload), real_inputs(workload)
    steps = []
    for choices in plans:
        cost, mem, strategies = evaluate(problem, choices)
        ps = PlannedStep(program, analysis, strategies, mesh)
        ps.compile()
        ps.run = ps.loop(host)
        time_steps(ps.run, iters=2)
        ps.cost, ps.mem, ps.choices = cost, mem, choices
        steps.append(ps)
    anchor = speed_anchor(mesh)
    times, anchor_s = [[] for _ in steps], []
    for _ in range(args.rounds):
        anchor_s += [run_once_s(*anchor) for _ in range(ANCHOR_RUNS)]
        for i, ps in enumerate(steps):
            times[i].append(time_steps(ps.run, iters=args.iters))
    return steps, times, anchor_s



def _plot(rows, path, args, xlabel="predicted step s (composed profiles)") -> None:
    """Measured against predicted step time, one dot per plan (rows: (predicted, measured))."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(4, 4))
    pred, meas = [r[0] for r in rows], [r[1] for r in rows]
    ax.scatter(pred, meas, s=12)
    hi = max(pred + meas) * 1.1
    ax.plot([0, hi], [0, hi], "k--", lw=0.5)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("measured step s")
    ax.set_title(f"{args.model} L{args.num_layers} mesh {args.mesh}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


if __name__ == "__main__":
    from cfp.host_memory import run_pooled
    run_pooled()  # timing measures programs, not the host allocator
    main()
