"""What cfp's composition predicted for a benchmark row's plans, beside what they measured.

Reads a finished ``scripts/benchmark.py`` row (its work dir under ``profiles/`` and its rows in
``<out>/<date>-<backend>.csv``; nothing is compiled or timed) and prints, for each plan search
ran end to end (its own predictions and the baselines) and for the cost model's top plans
(``analytic_plans``, solved again), the step time composed from the row's measured profile
(and of it the windows' sum and the boundary reshardings'), and the measured medians of the
benchmark's plans; then the windows where ``cfp_own``'s pick and the fastest baseline search
ran differ, with each side's composed time and strategies. Where the cost model's plan measured
faster than ``cfp_own``, this tells whether the profile priced it higher (the composition
ranked the two the other way) or did not price it (a combination outside the measured set).

    python scripts/diagnostics/bench_predictions.py --model moe --config tiny --num-layers 2 \
      --num-heads 8 --hidden-size 256 --seq-len 128 --memory-budget 2 --mesh 2x4 \
      --whole-segments --max-combinations 128 --out scripts/results/compute-bound
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/
sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark import (analytic_plans, budget_bytes, own_pick, parse_args,  # noqa: E402
                       start, workload_label)


def compared_plans(workdir: Path, run_fp, budget):
    """(the row's search record, ``benchmark.own_pick`` (``cfp_own``'s block strategies, how
    many top predictions search measured), the baseline search measured fastest): the two
    plans whose differing windows this script and ``window_pairs.py`` list."""
    from cfp.records import read_record
    from cfp.workdir import SEARCH_FORMAT
    rec = read_record(workdir / "search.pkl", SEARCH_FORMAT, run_fp, hint="run search first")
    base = min((c for c in rec.candidates if not c.source.startswith("predicted")),
               key=lambda c: c.median_s)
    return rec, own_pick(workdir, run_fp, budget), base


def main(argv=None) -> None:
    a = parse_args(argv)
    mesh_shape, backend, label, workdir, spec, run_fp, analysis, _ = start(a, ("analysis",))
    import pandas as pd
    from cfp.passes.search import SCALE, build_problem, predicted_seconds
    from cfp.workdir import WorkDir
    profile = WorkDir(workdir, run_fp).read_profile(analysis, "measure", a.max_combinations,
                                                    a.whole_segments)
    problem, _ = build_problem(analysis, profile, None)
    index = [{o.strategies: i for i, o in enumerate(g.options)} for g in problem.groups]

    def composed_ms(strategies) -> str:
        """The composed step, and of it the windows' sum and the boundary reshardings'."""
        try:
            choices = [ix[tuple(strategies[b] for b in g.blocks)]
                       for ix, g in zip(index, problem.groups)]
        except KeyError:
            return f"{'not priced':>12}{'':>10}{'':>13}"
        step_s = predicted_seconds(problem, choices, profile.launch_overhead_s)
        windows_s = sum(g.options[c].cost for g, c in zip(problem.groups, choices)) / SCALE
        reshard_s = step_s - windows_s - profile.launch_overhead_s
        return f"{step_s * 1e3:>12.1f}{windows_s * 1e3:>10.1f}{reshard_s * 1e3:>13.1f}"

    rec, (mine, top), base = compared_plans(workdir, run_fp, budget_bytes(a))
    csv = Path(a.out) / f"{a.date}-{backend}.csv"
    rows = pd.read_csv(csv, dtype={"mesh": str})
    rows = rows[(rows.workload == workload_label(a)) & (rows.mesh == a.mesh)]
    medians_ms = (rows.groupby("plan").step_s.median() * 1e3).round(1).to_dict()
    print(f"{label} mesh {a.mesh} ({backend}): composed from the measured profile, ms")
    print(f"{'plan':<32}{'composed':>12}{'windows':>10}{'reshardings':>13}"
          f"{'search measured':>17}")
    for c in rec.candidates:
        print(f"{c.source:<32}{composed_ms(c.strategies)}"
              f"{c.median_s * 1e3:>17.1f}")
    for k, strategies in enumerate(analytic_plans(a, workdir, analysis, run_fp, top)):
        name = f"cost model top {k + 1}" if k < top else "cost model without reshardings"
        print(f"{name:<32}{composed_ms(strategies)}{'-':>17}")
    print(f"benchmark medians ({csv.name}), ms: " + ", ".join(
        f"{p} {m}" for p, m in sorted(medians_ms.items(), key=lambda kv: kv[1])))
    print(f"windows where cfp_own's pick and search's fastest {base.source} differ "
          "(composed ms, strategies):")
    blocks = analysis.blocks.blocks
    for g, ix in zip(problem.groups, index):
        combos = [tuple(plan[b] for b in g.blocks) for plan in (mine, base.strategies)]
        if combos[0] != combos[1] and all(c in ix for c in combos):
            print(f"  blocks {g.blocks[0]}..{g.blocks[-1]}: " + "; ".join(
                f"{who} {g.options[ix[c]].cost / SCALE * 1e3:.2f} "
                f"[{', '.join(blocks[b].strategies[k].name for b, k in zip(g.blocks, c))}]"
                for who, c in zip(("cfp_own", base.source.split()[-1]), combos)))


if __name__ == "__main__":
    main()
