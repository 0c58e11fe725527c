"""cfp's plans against the cost model's and the plans people use, timed side by side.

For one workload and mesh, in one process: run cfp's three passes (timing each), then time
- ``cfp``: the plan search ships (its own predictions and the baselines validated together);
- ``cfp_own``: the fastest of search's own predictions as search measured them, no baseline
  among the candidates: what profiling alone finds;
- ``analytic``: CP-SAT over ``--cost model`` profiles of the same windows (alpha-beta fitted
  here; of a whole segment, the combinations the measured profile chose), its top K plans
  (K as many as search's own) measured the same way, the fastest kept;
- ``analytic_top1``: the cost model's one pick, taken without measuring, as Alpa does;
- every baseline in ``cfp/baseline_rules/`` that applies, and the single-device step.
All plans are compiled, then timed in rounds in which they take turns one step at a time (the
order shuffled on every pass; ``cfp.execute.time_interleaved``), so drift hits every plan alike;
a round's figure per plan is the median of its steps there. Appends one row per timed
round to ``<out>/<date>-<backend>.csv`` (workload, mesh, plan, round, step_s, backend,
devices), the pass overheads and the launch
overhead to ``<date>-<backend>-overheads.csv``, each plan's compiled collectives to
``<date>-<backend>-plans.csv``, and prints each plan's time against cfp's, then the two
questions: does profiling beat the cost model (``cfp_own`` over ``analytic``), and does it beat
what users write (``cfp_own`` over the best manual baseline), each as the median of per-round
ratios with a bootstrap 95% interval; a plan whose compiled program equals the other's (names
aside) is a tie. ``--plot`` redraws the chart from the CSVs.

    python scripts/benchmark.py --model gpt --mesh 2x4 --hidden-size 128 --num-heads 8
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cfp.bench import (FIELDS, NOT_MANUAL, OVERHEAD_FIELDS, PLAN_FIELDS,  # noqa: E402
                       append_rows, bootstrap_ratio, plot)


def workload_parser(doc: str, *, model: str, rounds: int, min_seconds: float,
                    max_combinations: int) -> argparse.ArgumentParser:
    """The flags the benchmark scripts share: the workload, as cfp takes it, and the timing."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model", default=model)
    p.add_argument("--config", default="tiny")
    p.add_argument("--mesh", default="8")
    for name in ("num-layers", "batch-size", "seq-len", "hidden-size", "num-heads",
                 "vocab-size", "num-experts"):
        p.add_argument(f"--{name}", type=int, default=None)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--memory-budget", type=float, default=None, help="GiB per device")
    p.add_argument("--budget-of", default=None, metavar="PLAN",
                   help="set the memory budget from this hand plan's compiled peak (its state "
                        "donated), times --budget-factor: where memory binds")
    p.add_argument("--budget-factor", type=float, default=1.1)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--min-seconds", type=float, default=min_seconds,
                   help="per plan and round: at least 5 steps and this long")
    p.add_argument("--max-combinations", type=int, default=max_combinations)
    p.add_argument("--whole-segments", action="store_true",
                   help="profile whole segments, measured in part (cfp --whole-segments)")
    p.add_argument("--out", default=str(ROOT / "scripts" / "results"))
    p.add_argument("--date", default=datetime.date.today().isoformat())
    return p


def parse_args(argv=None):
    p = workload_parser(__doc__, model="gpt", rounds=15, min_seconds=0.3, max_combinations=128)
    p.add_argument("--plot", action="store_true", help="only redraw the chart from the CSVs")
    return p.parse_args(argv)


def start(a, modes=("analysis", "profile", "search")):
    """Set up the devices (before JAX starts), run cfp's passes in the benchmark's work dir
    (``modes``; what is already there is resumed) and return (mesh shape, backend, label,
    work dir, spec, run fingerprint, analysis, {mode: seconds})."""
    mesh_shape = tuple(int(x) for x in a.mesh.split("x"))
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count="
                               f"{math.prod(mesh_shape)}").strip()
    import jax
    from cfp.workdir import WorkDir
    from cfp.workloads import WorkloadSpec, run_fingerprint
    backend = jax.devices()[0].platform
    label = workload_label(a)
    workdir = ROOT / "profiles" / (f"bench-{label}-{a.mesh}"
                                   + (f"-budget-{a.budget_of}" if a.budget_of else ""))
    flags = cfp_flags(a) + ["--workdir", str(workdir)]
    print(f"== {label} on mesh {a.mesh} ({backend}, {math.prod(mesh_shape)} devices)")
    spec = WorkloadSpec(a.model, preset(a), a.batch_size, a.dtype, tuple(
        (k, getattr(a, k)) for k in ("num_layers", "seq_len", "hidden_size", "num_heads",
                                     "vocab_size", "num_experts") if getattr(a, k) is not None)
    ).resolved()
    run_fp = run_fingerprint(spec, mesh_shape)
    seconds = {"analysis": run_cfp(flags, "analysis")}
    analysis = WorkDir(workdir, run_fp).read_analysis()
    if getattr(a, "budget_of", None):
        peak = hand_plan_peak(a.budget_of, analysis, spec, mesh_shape)
        a.memory_budget = a.budget_factor * peak / 2**30
        print(f"memory budget: {a.budget_factor} x {a.budget_of}'s compiled peak "
              f"({peak / 2**20:.1f} MiB) = {a.memory_budget * 2**10:.1f} MiB per device")
        flags = cfp_flags(a) + ["--workdir", str(workdir)]
    seconds.update({mode: run_cfp(flags, mode) for mode in modes if mode != "analysis"})
    return mesh_shape, backend, label, workdir, spec, run_fp, analysis, seconds


def hand_plan_peak(name: str, analysis, spec, mesh_shape) -> int:
    """Compiled peak bytes per device of the rule-file plan ``name``, its state donated."""
    from cfp.baselines import applies, baseline_plan, load_rules
    from cfp.execute import PlannedStep
    from cfp.measure import memory_of
    from cfp.mesh import make_mesh
    from cfp.tracing import trace_step
    rule = load_rules()[name]
    if not applies(rule, analysis):
        raise SystemExit(f"benchmark: the hand plan {name} does not apply to {spec.model}")
    bp = baseline_plan(rule, analysis)
    step = PlannedStep(trace_step(spec.build()), analysis, bp.strategies,
                       make_mesh(mesh_shape), bp.storage)
    return memory_of(step.compile())["peak_bytes"]


def cfp_flags(a) -> list[str]:
    flags = (["--model", a.model] + (["--config", a.config] if preset(a) else [])
             + ["--mesh", a.mesh, "--dtype", a.dtype])
    for name in ("num_layers", "batch_size", "seq_len", "hidden_size", "num_heads",
                 "vocab_size", "num_experts"):
        if getattr(a, name) is not None:
            flags += [f"--{name.replace('_', '-')}", str(getattr(a, name))]
    if a.memory_budget is not None:
        flags += ["--memory-budget", str(a.memory_budget)]
    return flags + ["--max-combinations", str(a.max_combinations)] + (
        ["--whole-segments"] if a.whole_segments else [])


def preset(a) -> str | None:
    """``--config``, a preset of cfp's own models (a user's factory takes none)."""
    return None if ":" in a.model else a.config


def workload_label(a) -> str:
    parts = [a.model.rsplit(":", 1)[-1], a.config]
    for key, name in (("L", "num_layers"), ("b", "batch_size"), ("s", "seq_len"),
                      ("h", "hidden_size"), ("nh", "num_heads"), ("e", "num_experts")):
        if getattr(a, name) is not None:
            parts.append(f"{key}{getattr(a, name)}")
    if getattr(a, "whole_segments", False):
        parts.append("whole")
    return "-".join(parts)


def run_cfp(flags: list[str], mode: str) -> float:
    from cfp.cli import main
    t0 = time.perf_counter()
    rc = main(flags + ["--mode", mode])
    if rc:
        raise SystemExit(f"benchmark: cfp --mode {mode} failed (exit {rc})")
    return time.perf_counter() - t0


def _has_row(path: Path, workload: str, mesh: str) -> bool:
    if not path.exists():
        return False
    with path.open(newline="") as f:
        return any(r["workload"] == workload and r["mesh"] == mesh for r in csv.DictReader(f))


def normalized_hlo(compiled) -> str:
    """``cfp.measure.normalized_hlo``, imported only once JAX's devices are set up."""
    from cfp.measure import normalized_hlo as normalize
    return normalize(compiled)



def budget_bytes(a) -> int | None:
    """``--memory-budget`` in bytes per device; None without one."""
    return int(a.memory_budget * 2**30) if a.memory_budget else None


def own_pick(workdir: Path, run_fp, budget) -> tuple[tuple, int]:
    """((block strategies, storage) of ``cfp_own``'s pick: the measured fastest of search's own
    predictions within the budget, how many top predictions search measured, not counting
    the best without reshardings)."""
    from cfp.problem import fastest_within_budget
    from cfp.records import read_record
    from cfp.workdir import SEARCH_FORMAT
    rec = read_record(workdir / "search.pkl", SEARCH_FORMAT, run_fp, hint="run search first")
    own = [c for c in rec.candidates if c.source.startswith("predicted")]
    top = sum(c.source == "predicted" for c in own)
    from cfp.errors import CfpError
    try:
        pick = own[fastest_within_budget(own, budget)]
    except CfpError as e:  # none fits: the fastest is timed, marked over the budget
        print(f"cfp_own: {e}")
        pick = min(own, key=lambda c: c.median_s)
    return (tuple(pick.strategies), pick.storage), top


def build_plans(a, workdir: Path, mesh, analysis, program, run_fp, host):
    """Plan name -> PlannedStep (see the module docstring for the names)."""
    from cfp.baselines import applies, baseline_plan, load_rules
    from cfp.execute import PlannedStep
    from cfp.records import read_record
    from cfp.workdir import SEARCH_FORMAT
    kept = read_record(workdir / "search.pkl", SEARCH_FORMAT, run_fp, hint="run search").plan
    budget = budget_bytes(a)
    own, n_own = own_pick(workdir, run_fp, budget)
    analytic = analytic_plans(a, workdir, analysis, run_fp, n_own)
    step = lambda plan: PlannedStep(program, analysis, plan[0], mesh, plan[1])  # noqa: E731
    plans = {"cfp": step((kept.strategies, kept.storage)), "cfp_own": step(own),
             "analytic": step(fastest_measured(analytic, program, analysis, mesh, host, budget)),
             "analytic_top1": step(analytic[0])}
    for name, rule in load_rules().items():
        if applies(rule, analysis):
            bp = baseline_plan(rule, analysis)
            plans[name] = PlannedStep(program, analysis, bp.strategies, mesh, bp.storage)
    return plans


def analytic_plans(a, workdir: Path, analysis, run_fp, k: int) -> list:
    """The plans search would validate over the ``--cost model`` profiles: the ``k`` best
    CP-SAT finds, best first, and the best without reshardings when all of those reshard
    (``predicted_plans``)."""
    from cfp.workdir import WorkDir
    from cfp.problem import build_problem, plan_storage, predicted_plans
    profile = WorkDir(workdir, run_fp).read_profile(analysis, "model", a.max_combinations,
                                                      a.whole_segments)
    budget = budget_bytes(a)
    problem, _ = build_problem(analysis, profile, budget)
    return [(sol.strategies, plan_storage(analysis, problem, profile.windows, sol.choices))
            for sol in predicted_plans(problem, k, 60.0)]


def fastest_measured(plans: list, program, analysis, mesh, host, budget) -> list:
    """Of ``plans``, the measured fastest whose compiled peak fits ``budget``, timed the way
    search validates its own."""
    import statistics
    from cfp.measure import memory_of
    from cfp.passes.search import SearchOptions, measure_plans
    steps, times = measure_plans(program, analysis, plans, mesh, host, SearchOptions(budget))
    fits = [i for i, ps in enumerate(steps)
            if budget is None or memory_of(ps.compiled)["peak_bytes"] <= budget] or [0]
    return plans[min(fits, key=lambda i: statistics.median(times[i]))]


class SingleDevice:
    """The unsharded step, jitted on one device, its state donated."""

    def __init__(self, workload):
        import jax
        w = workload
        self.abstract = jax.tree_util.tree_flatten(
            (w.abstract_params(), w.abstract_opt_state(), w.abstract_batch()))
        step, tree = w.train_step(), self.abstract[1]
        self.state_count = len(jax.tree_util.tree_leaves(
            (w.abstract_params(), w.abstract_opt_state())))
        self.step = jax.jit(lambda *leaves: jax.tree_util.tree_leaves(
            step(*jax.tree_util.tree_unflatten(tree, leaves))),
            donate_argnums=tuple(range(self.state_count)))

    def compile(self):
        t0 = time.perf_counter()
        self.compiled = self.step.lower(*self.abstract[0]).compile()
        self.compile_s = time.perf_counter() - t0
        return self.compiled

    def place(self, flat):
        import jax
        dev = jax.devices()[0]
        return [jax.device_put(x, dev) for x in flat]

    def loop(self, flat):
        from cfp.execute import StepLoop
        return StepLoop(self.compiled, self.place(flat), self.state_count)


def benchmark(a) -> None:
    mesh_shape, backend, label, workdir, spec, run_fp, analysis, sec = start(a)
    import jax
    import numpy as np
    from cfp.execute import real_inputs, time_interleaved
    from cfp.measure import memory_of
    from cfp.timing import CpuShare
    from cfp.collectives import collectives
    from cfp.mesh import make_mesh
    from cfp.tracing import trace_step
    n_dev = math.prod(mesh_shape)
    t_an, t_pr, t_se = sec["analysis"], sec["profile"], sec["search"]
    t_model = run_cfp(cfp_flags(a) + ["--workdir", str(workdir), "--cost", "model",
                                      "--device-preset", "here"], "profile")
    from cfp.workdir import WorkDir
    prof = WorkDir(workdir, run_fp).read_profile(analysis, "measure", a.max_combinations,
                                                    a.whole_segments)
    timed = sum(m.status == "ok" for seg in prof.window_profiles.values()
                for m in seg.results.values())
    prof_busy = (f"{sum(prof.busy_window_types().values())} of {timed} combinations timed on a "
                 f"busy machine")
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{a.date}-{backend}"
    # A rerun over finished profiles (nothing compiled) keeps the first run's pass overheads.
    if prof.compiled or not _has_row(out / f"{stem}-overheads.csv", label, a.mesh):
        append_rows(out / f"{stem}-overheads.csv", OVERHEAD_FIELDS, [dict(
            workload=label, mesh=a.mesh, analysis_s=f"{t_an:.2f}", profile_s=f"{t_pr:.2f}",
            search_s=f"{t_se:.2f}", compiled=prof.compiled, model_profile_s=f"{t_model:.2f}",
            launch_s=f"{prof.launch_overhead_s:.3e}", backend=backend, devices=n_dev)])

    workload = spec.build()
    mesh = make_mesh(mesh_shape)
    program = trace_step(workload)
    host = real_inputs(workload)
    plans = build_plans(a, workdir, mesh, analysis, program, run_fp, host)
    plans["single_device"] = SingleDevice(workload)
    for name, ps in plans.items():
        ps.compile()
        ps.run = ps.loop(host)
        jax.block_until_ready(ps.run())
    hlo = {name: normalized_hlo(ps.compiled) for name, ps in plans.items()}
    names = list(plans)
    cpu = CpuShare().start()
    per_round = time_interleaved([plans[n].run for n in names],
                                 rounds=a.rounds, min_seconds=a.min_seconds)
    times = dict(zip(names, per_round))
    others, stolen = cpu.share()
    rows = [dict(workload=label, mesh=a.mesh, plan=n, round=r, step_s=f"{t:.6e}",
                 backend=backend, devices=n_dev) for n in names for r, t in enumerate(times[n])]
    append_rows(out / f"{stem}.csv", FIELDS, rows)
    source = {"cfp": json.loads((workdir / "plan.json").read_text()).get("source", ""),
              "cfp_own": "search's own predictions", "analytic": "cost model, top K measured",
              "analytic_top1": "cost model, unmeasured", "single_device": "unsharded"}
    plan_rows = []
    for n in names:
        cs = collectives(plans[n].compiled.as_text(), mesh_shape)
        kinds: dict = {}
        for c in cs:
            kinds[c.kind] = kinds.get(c.kind, 0) + 1
        plan_rows.append(dict(workload=label, mesh=a.mesh, plan=n, source=source.get(n, ""),
                              collectives=" ".join(f"{k}:{v}" for k, v in sorted(kinds.items())),
                              comm_bytes=sum(c.bytes for c in cs),
                              compile_s=f"{plans[n].compile_s:.2f}",
                              peak_bytes=memory_of(plans[n].compiled)["peak_bytes"],
                              same_program_as_cfp=hlo[n] == hlo["cfp"],
                              same_program_as_cfp_own=hlo[n] == hlo["cfp_own"], backend=backend,
                              devices=n_dev))
    append_rows(out / f"{stem}-plans.csv", PLAN_FIELDS, plan_rows)

    budget = budget_bytes(a)
    fits = {row["plan"]: budget is None or row["peak_bytes"] <= budget for row in plan_rows}
    print(f"\n{label} mesh {a.mesh}, {backend} x{n_dev}, {a.rounds} interleaved rounds"
          + (f", budget {budget / 2**20:.1f} MiB per device (* over it)" if budget else ""))
    print(f"{'plan':<14}{'median s':>12}{'peak MiB':>11}  {'cfp / plan (95% CI)':<26} collectives")
    for row, n in zip(plan_rows, names):
        med = float(np.median(times[n]))
        if n == "cfp":
            rel = "-"
        elif hlo[n] == hlo["cfp"]:
            rel = "tie (same program)"
        else:
            m, lo, hi = bootstrap_ratio(times["cfp"], times[n])
            rel = f"{m:.3f} [{lo:.3f}, {hi:.3f}]"
        print(f"{n:<14}{med:>12.6f}{row['peak_bytes'] / 2**20:>10.1f}{' ' if fits[n] else '*'}"
              f"  {rel:<26} {row['collectives']}")
    manual = min((n for n in names if n not in NOT_MANUAL and fits[n]),
                 key=lambda n: float(np.median(times[n])))
    for question, other in (("profiling against the cost model", "analytic"),
                            (f"profiling against the best manual plan that fits ({manual})",
                             manual)):
        if hlo["cfp_own"] == hlo[other]:
            print(f"{question}: cfp_own / {other} tie (same program)")
        else:
            m, lo, hi = bootstrap_ratio(times["cfp_own"], times[other])
            print(f"{question}: cfp_own / {other} {m:.3f} [{lo:.3f}, {hi:.3f}]")
    print(f"while the rounds ran, others took {others:.0%} of the cores ({stolen:.0%} stolen by "
          f"the hypervisor); the profile: {prof_busy}")
    print(f"launch overhead: {prof.launch_overhead_s * 1e3:.3f} ms, "
          f"{prof.launch_overhead_s / float(np.median(times['cfp_own'])):.1%} of cfp_own's step")
    print(f"passes: analysis {t_an:.1f} s, profile {t_pr:.1f} s ({prof.compiled} compiled), "
          f"search {t_se:.1f} s; analytic profile {t_model:.1f} s")



if __name__ == "__main__":
    from cfp.host_memory import run_pooled
    run_pooled()  # timing measures programs, not the host allocator
    args = parse_args()
    if args.plot:
        for chart in plot(Path(args.out), args.date):
            print(f"wrote {chart}")
    else:
        benchmark(args)
        plot(Path(args.out), args.date)
