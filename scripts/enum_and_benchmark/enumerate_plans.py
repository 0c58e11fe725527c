"""Exhaustive check: run every plan of a small space end to end and see where cfp's pick lands.

Two spaces (``--space``), both defined over the profile pass's window types:

- ``uniform``: one measured combination per *window type*, used by every instance of that type
  (a layer-uniform plan); its size is the product over window types of their feasible
  combinations. Small enough only for small models (the mlp: 4 plans on mesh 8, 64 on 2-D).
- ``around``: cfp's plan, and every plan that differs from it in one window type only (that type
  takes one of its measured combinations at every instance, every other window keeps cfp's
  choice); its size is the sum over window types of their feasible combinations, so it can be
  enumerated for a transformer too. It checks that no single change of cfp's plan is faster,
  and how well the composed predictions order the alternatives search weighed.

cfp's pick is ``cfp_own``'s of ``benchmark.py``: the measured fastest of search's own
predictions within the budget, whether or not search kept it or a baseline it validated
(the summary's ``search_kept`` says which).

Every plan of the space, and cfp's own pick (which may lie outside the uniform space, since its
choices may differ between instances), is compiled and timed in interleaved rounds. Plans with
the same block strategies are timed once. A space larger than ``--chunk`` runs in chunks, cfp's
plan in each: a plan's time counts relative to cfp's in the same round, so plans of different
chunks compare through cfp's plan. Reported:

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
    python scripts/enum_and_benchmark/enumerate_plans.py --model gpt --num-heads 8 --space around
"""
from __future__ import annotations

import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from cfp.bench import (append_rows, bootstrap_ratio, distinct_plans,  # noqa: E402
                       ordering_accuracy, plan_space, spearman, term_weights, time_in_chunks)
from benchmark import (budget_bytes,  # noqa: E402
                       normalized_hlo, own_pick, start, workload_parser)


def parse_args(argv=None):
    p = workload_parser(__doc__, model="mlp", rounds=9, min_seconds=0.1, max_combinations=64)
    p.add_argument("--space", choices=("uniform", "around"), default="uniform")
    p.add_argument("--max-plans", type=int, default=120,
                   help="refuse larger spaces (each plan is compiled once: 5 to 10 s a plan "
                        "at the compute-bound size here)")
    p.add_argument("--chunk", type=int, default=60,
                   help="plans compiled and timed together, cfp's among them; a larger space "
                        "runs in chunks, each plan timed against cfp's in the same rounds. On "
                        "this machine XLA's CPU JIT failed holding about 150 to 200 8-device "
                        "steps at once (LLVM 'Cannot allocate memory', with RAM free)")
    return p.parse_args(argv)



def main(a) -> None:
    mesh_shape, backend, label, workdir, spec, run_fp, analysis, _ = start(a)
    import jax
    import numpy as np
    from cfp.execute import PlannedStep, real_inputs, time_steps
    from cfp.collectives import collectives
    from cfp.solver import evaluate
    from cfp.mesh import make_mesh
    from cfp.tracing import trace_step
    from cfp.workdir import WorkDir
    from cfp.problem import SCALE, build_problem, predicted_seconds
    n_dev = math.prod(mesh_shape)
    prof = WorkDir(workdir, run_fp).read_profile(analysis, "measure", a.max_combinations,
                                                 a.whole_segments)
    budget = budget_bytes(a)
    problem, _ = build_problem(analysis, prof, budget)
    cfp_strats, kept = own_pick_and_kept(workdir, run_fp, budget)
    space_def, counts, size, picks = plan_space(problem, prof.windows,
                                                _choices_of(problem, cfp_strats), a.space)
    print(f"cfp's pick: the fastest of search's own predictions; search kept {kept}")
    print(f"space: {space_def}; feasible combinations per window type {counts}: {size} plans")
    if size > a.max_plans:
        raise SystemExit(f"enumerate: {size} plans is over --max-plans {a.max_plans}")
    plans, over_budget = distinct_plans(problem, picks)
    print(f"{len(plans)} distinct plans to run ({over_budget} over the memory budget left out)")

    mesh = make_mesh(mesh_shape)
    program = trace_step(spec.build())
    host = real_inputs(spec.build())
    predicted, windows_s = {}, {}
    for name, choices in plans.items():
        predicted[name] = predicted_seconds(problem, choices, prof.launch_overhead_s)
        windows_s[name] = sum(g.options[c].cost for g, c in zip(problem.groups, choices)) / SCALE

    names, hlo, comm, steps = list(plans), {}, {}, {}

    def load(name):
        ps = steps[name] = PlannedStep(program, analysis, evaluate(problem, plans[name])[2],
                                       mesh)
        ps.compile()
        ps.run = ps.loop(host)
        jax.block_until_ready(ps.run())
        hlo[name] = normalized_hlo(ps.compiled)
        comm[name] = sum(c.bytes for c in collectives(ps.compiled.as_text(), mesh_shape))

    def unload(name):
        del steps[name]  # its executable goes before the next chunk compiles

    def measure(name):
        return time_steps(steps[name].run, min_seconds=a.min_seconds)

    t0 = time.perf_counter()
    times, chunk_of = time_in_chunks(names, a.chunk, a.rounds, load, unload, measure)
    print(f"compiled and timed {len(names)} plans in {max(chunk_of.values())} chunk(s) in "
          f"{time.perf_counter() - t0:.0f} s")
    med = {n: float(np.median(times[n])) for n in names}
    best = min(names, key=med.get)
    same_as = [m for m in names if m != "cfp" and hlo[m] == hlo["cfp"]]
    rows, tied = [], set()
    ranked = sorted(names, key=med.get)
    for n in names:
        m, lo, hi = bootstrap_ratio(times[n], times[best])
        if lo <= 1.0 or hlo[n] == hlo[best]:
            tied.add(n)
        rows.append(dict(workload=label, mesh=a.mesh, space_def=space_def, plan=n,
                         predicted_s=f"{predicted[n]:.6e}", windows_s=f"{windows_s[n]:.6e}",
                         reshard_s=f"{predicted[n] - windows_s[n] - prof.launch_overhead_s:.6e}",
                         median_s=f"{med[n]:.6e}", over_best=f"{m:.4f}",
                         over_best_lo=f"{lo:.4f}", over_best_hi=f"{hi:.4f}",
                         indistinguishable_from_best=n in tied, comm_bytes=comm[n],
                         chunk=chunk_of[n],
                         rank=ranked.index(n) + 1, backend=backend, devices=n_dev))
    enum = names
    acc, pairs = ordering_accuracy([predicted[n] for n in enum], [med[n] for n in enum])
    vacc, _ = ordering_accuracy([comm[n] for n in enum], [med[n] for n in enum])
    rho = spearman([predicted[n] for n in enum], [med[n] for n in enum])
    vrho = spearman([comm[n] for n in enum], [med[n] for n in enum])
    w_win, w_resh = term_weights([windows_s[n] for n in enum],
                                 [predicted[n] - windows_s[n] for n in enum],
                                 [med[n] for n in enum])
    gap, glo, ghi = bootstrap_ratio(times["cfp"], times[best])
    summary = dict(workload=label, mesh=a.mesh, space=len(enum), space_def=space_def,
                   cfp_rank=ranked.index("cfp") + 1,
                   cfp_over_best=f"{gap:.4f}", cfp_over_best_lo=f"{glo:.4f}",
                   cfp_over_best_hi=f"{ghi:.4f}", cfp_among_best="cfp" in tied,
                   cfp_same_program_as=" ".join(same_as), search_kept=kept,
                   tied_with_best=len(tied),
                   ordering_accuracy=f"{acc:.4f}", pairs_outside_10pct=pairs,
                   spearman=f"{rho:.4f}", volume_ordering_accuracy=f"{vacc:.4f}",
                   volume_spearman=f"{vrho:.4f}", fit_windows_weight=f"{w_win:.3f}",
                   fit_reshard_weight=f"{w_resh:.3f}", rounds=a.rounds, backend=backend,
                   devices=n_dev)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{a.date}-enum-{backend}"
    keys = ("workload", "mesh", "space_def")
    append_rows(out / f"{stem}.csv", list(rows[0]), rows, keys)
    append_rows(out / f"{stem}-summary.csv", list(summary), [summary], keys)
    for k, v in summary.items():
        print(f"{k:>26}: {v}")
    _plot(out / f"{stem}-{label}-{a.mesh}-{a.space}.png", names, predicted, med, comm, label,
          a.mesh, space_def, backend, n_dev)


def own_pick_and_kept(workdir: Path, run_fp, budget) -> tuple[tuple, str]:
    """Block strategies of ``cfp_own``'s pick (``benchmark.own_pick``), and what search kept:
    ``its own prediction`` when the pick is the kept plan, else the kept plan's source
    (``baseline dp``, ...)."""
    import json
    pick, _ = own_pick(workdir, run_fp, budget)
    plan = json.loads((workdir / "plan.json").read_text())
    if tuple(b["strategy_index"] for b in plan["blocks"]) == pick:
        return pick, "its own prediction"
    return pick, plan["source"]



def _choices_of(problem, strategies):
    """Option index per group that gives ``strategies`` (cfp's pick is made of options)."""
    out = []
    for g in problem.groups:
        want = tuple(strategies[b] for b in g.blocks)
        out.append(next(i for i, o in enumerate(g.options) if o.strategies == want))
    return tuple(out)


def _plot(path, names, predicted, med, comm, label, mesh, space_def, backend, n_dev):
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
    fig.suptitle(f"{label} mesh {mesh}, every plan of the space '{space_def}' "
                 f"({backend}, {n_dev} devices)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    from cfp.host_memory import run_pooled
    run_pooled()  # timing measures programs, not the host allocator
    main(parse_args())
