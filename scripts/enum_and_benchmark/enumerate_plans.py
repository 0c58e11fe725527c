"""Exhaustive check: run every plan of a small space end to end and see where cfp's pick lands.

The space: one measured combination per *window type*, used by every instance of that type (a
layer-uniform plan), so its size is the product over window types of their feasible
combinations. Every plan of it, and cfp's own pick (which may differ between instances, so it
can lie outside the space), is compiled and timed in interleaved rounds. Reported:

- where cfp's pick ranks, its time over the measured best (median of per-round ratios, bootstrap
  95% interval), and whether it is among the plans that cannot be told apart from the best (the
  interval of their ratio to the best reaches 1.0, or the same compiled program);
- ordering accuracy of cfp's composed predictions over the pairs whose measured ratio lies
  outside [0.9, 1.1], and the Spearman rank correlation;
- the same two figures for a communication-volume model (bytes of the compiled collectives), to
  show where a volume model mis-ranks plans.

Writes ``scripts/results/<date>-enum-<backend>.csv`` (one row per plan) and
``<date>-enum-<backend>-summary.csv``, and a PNG per workload.

    python scripts/enum_and_benchmark/enumerate_plans.py --model mlp --mesh 2x4
"""
from __future__ import annotations

import itertools
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from benchmark import (append_rows, bootstrap_ratio, normalized_hlo, start,  # noqa: E402
                       time_plan, workload_parser)


def parse_args(argv=None):
    p = workload_parser(__doc__, model="mlp", rounds=9, min_seconds=0.1, max_combinations=64)
    p.add_argument("--max-plans", type=int, default=200, help="refuse larger spaces")
    return p.parse_args(argv)


def ordering_accuracy(pred, meas, lo=0.9, hi=1.1) -> tuple[float, int]:
    """Share of plan pairs, among those whose measured ratio is outside [lo, hi], that ``pred``
    orders as measured; and how many such pairs there are."""
    good = total = 0
    for i, j in itertools.combinations(range(len(meas)), 2):
        r = meas[i] / meas[j]
        if lo <= r <= hi:
            continue
        total += 1
        good += (pred[i] < pred[j]) == (meas[i] < meas[j])
    return (good / total if total else float("nan")), total


def spearman(a, b) -> float:
    import pandas as pd
    return float(pd.Series(a).rank().corr(pd.Series(b).rank()))


def main(a) -> None:
    import json
    mesh_shape, backend, label, workdir, spec, run_fp, analysis, _ = start(a)
    import jax
    import numpy as np
    from cfp.execute import PlannedStep, real_inputs
    from cfp.sharding import collectives
    from cfp.solver import evaluate
    from cfp.workloads import make_mesh, trace_step
    from passes.profile import ProfileOptions, load_profiles
    from passes.search import build_problem, predicted_seconds
    n_dev = math.prod(mesh_shape)
    prof, segs = load_profiles(workdir, run_fp, analysis,
                               ProfileOptions(max_combinations=a.max_combinations))
    budget = int(a.memory_budget * 2**30) if a.memory_budget else None
    problem, _ = build_problem(analysis, prof, segs, budget)
    types = sorted({w.type for w in prof.windows})
    first = {t: next(i for i, w in enumerate(prof.windows) if w.type == t) for t in types}
    counts = [len(problem.groups[first[t]].options) for t in types]
    size = math.prod(counts)
    print(f"space: one combination per window type, {' x '.join(map(str, counts))} = {size}")
    if size > a.max_plans:
        raise SystemExit(f"enumerate: {size} plans is over --max-plans {a.max_plans}")
    plans = {}
    for pick in itertools.product(*[range(c) for c in counts]):
        choices = tuple(pick[types.index(w.type)] for w in prof.windows)
        plans["p" + "-".join(map(str, pick))] = choices
    cfp_strats = tuple(b["strategy_index"] for b in
                       json.loads((workdir / "plan.json").read_text())["blocks"])

    mesh = make_mesh(mesh_shape)
    program = trace_step(spec.build())
    host = real_inputs(spec.build())
    steps, predicted = {}, {}
    for name, choices in plans.items():
        steps[name] = PlannedStep(program, analysis, evaluate(problem, choices)[2], mesh)
        predicted[name] = predicted_seconds(problem, choices, prof.launch_overhead_s)
    cfp_choices = _choices_of(problem, cfp_strats)
    steps["cfp"] = PlannedStep(program, analysis, cfp_strats, mesh)
    predicted["cfp"] = predicted_seconds(problem, cfp_choices, prof.launch_overhead_s)
    t0 = time.perf_counter()
    for ps in steps.values():
        ps.compile()
        ps.args = ps.place(host)
        jax.block_until_ready(ps.compiled(*ps.args))
    print(f"compiled {len(steps)} plans in {time.perf_counter() - t0:.0f} s")
    names = list(steps)
    times = {n: [] for n in names}
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for n in order:
            times[n].append(time_plan(steps[n], a.min_seconds))
    med = {n: float(np.median(times[n])) for n in names}
    hlo = {n: normalized_hlo(steps[n].compiled) for n in names}
    comm = {n: sum(c.bytes for c in collectives(steps[n].compiled.as_text(), mesh_shape))
            for n in names}
    best = min(names, key=med.get)
    same_as = {n: next((m for m in plans if hlo[m] == hlo[n]), None) for n in ["cfp"]}
    rows, tied = [], set()
    ranked = sorted(names, key=med.get)
    for n in names:
        m, lo, hi = bootstrap_ratio(times[n], times[best])
        if lo <= 1.0 or hlo[n] == hlo[best]:
            tied.add(n)
        rows.append(dict(workload=label, mesh=a.mesh, plan=n, predicted_s=f"{predicted[n]:.6e}",
                         median_s=f"{med[n]:.6e}", over_best=f"{m:.4f}",
                         over_best_lo=f"{lo:.4f}", over_best_hi=f"{hi:.4f}",
                         indistinguishable_from_best=n in tied, comm_bytes=comm[n],
                         rank=ranked.index(n) + 1, backend=backend, devices=n_dev))
    enum = list(plans)
    acc, pairs = ordering_accuracy([predicted[n] for n in enum], [med[n] for n in enum])
    vacc, _ = ordering_accuracy([comm[n] for n in enum], [med[n] for n in enum])
    rho = spearman([predicted[n] for n in enum], [med[n] for n in enum])
    vrho = spearman([comm[n] for n in enum], [med[n] for n in enum])
    gap, glo, ghi = bootstrap_ratio(times["cfp"], times[best])
    summary = dict(workload=label, mesh=a.mesh, space=len(enum),
                   space_def="one combination per window type", cfp_rank=ranked.index("cfp") + 1,
                   cfp_over_best=f"{gap:.4f}", cfp_over_best_lo=f"{glo:.4f}",
                   cfp_over_best_hi=f"{ghi:.4f}", cfp_among_best="cfp" in tied,
                   cfp_same_program_as=same_as["cfp"] or "", tied_with_best=len(tied),
                   ordering_accuracy=f"{acc:.4f}", pairs_outside_10pct=pairs,
                   spearman=f"{rho:.4f}", volume_ordering_accuracy=f"{vacc:.4f}",
                   volume_spearman=f"{vrho:.4f}", rounds=a.rounds, backend=backend,
                   devices=n_dev)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{a.date}-enum-{backend}"
    append_rows(out / f"{stem}.csv", list(rows[0]), rows)
    append_rows(out / f"{stem}-summary.csv", list(summary), [summary])
    for k, v in summary.items():
        print(f"{k:>26}: {v}")
    _plot(out / f"{stem}-{label}-{a.mesh}.png", names, predicted, med, comm, label, a.mesh,
          backend, n_dev)


def _choices_of(problem, strategies):
    """Option index per group that gives ``strategies`` (cfp's pick is made of options)."""
    out = []
    for g in problem.groups:
        want = tuple(strategies[b] for b in g.blocks)
        out.append(next(i for i, o in enumerate(g.options) if o.strategies == want))
    return tuple(out)


def _plot(path, names, predicted, med, comm, label, mesh, backend, n_dev):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, xs, xl in ((axes[0], predicted, "cfp predicted step (s)"),
                       (axes[1], comm, "compiled collective bytes")):
        ax.scatter([xs[n] for n in names if n != "cfp"], [med[n] for n in names if n != "cfp"],
                   s=12, label="enumerated plans")
        ax.scatter([xs["cfp"]], [med["cfp"]], color="red", marker="*", s=120, label="cfp's pick")
        ax.set_xlabel(xl)
        ax.set_ylabel("measured step (s), median")
        ax.legend(fontsize=7)
    fig.suptitle(f"{label} mesh {mesh}: every plan of the space ({backend}, {n_dev} devices)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main(parse_args())
