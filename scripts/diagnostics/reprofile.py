"""How much an exhaustive row's ordering depends on the profile it was composed from.

``enumerate_plans.py`` composes its predictions from one profile, and each window type is
timed in its own stretch of time, so a change of the machine's speed then lands on that type
alone. This profiles the same analysis ``--profiles`` more times (fresh workers, scratch work
dirs, the same combinations measured: the work dir's ``chosen.pkl`` is copied), composes the
row's plans from each, and scores them against the step times the row measured: ordering
accuracy on pairs outside [0.9, 1.1] and Spearman, profile 0 being the row's own. Takes the
row's flags; reads ``<date>-enum-<backend>.csv`` and appends to
``<date>-enum-<backend>-profiles.csv``.

    python scripts/diagnostics/reprofile.py --model gpt --config tiny --num-layers 2 \\
        --num-heads 8 --hidden-size 256 --seq-len 128 --mesh 2x4 --whole-segments \\
        --space around --memory-budget 2 --max-combinations 32 --profiles 3
"""
from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "scripts" / "enum_and_benchmark"))

from benchmark import append_rows, budget_bytes, cfp_flags, own_pick, start  # noqa: E402
from composition_check import predictions_from_profiles  # noqa: E402
from cfp.bench import distinct_plans, ordering_accuracy, plan_space, spearman  # noqa: E402
from enumerate_plans import _choices_of, parse_args  # noqa: E402


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--profiles", type=int, default=3, help="profiles besides the row's own")
    extra, rest = ap.parse_known_args(argv)
    a = parse_args(rest)
    _, backend, label, workdir, _, run_fp, analysis, _ = start(a, modes=())
    from cfp.passes.search import build_problem
    from cfp.workdir import WorkDir
    budget = budget_bytes(a)
    read = lambda d: WorkDir(d, run_fp).read_profile(  # noqa: E731
        analysis, "measure", a.max_combinations, a.whole_segments)
    problem, _ = build_problem(analysis, read(workdir), budget)
    cfp_strats, _ = own_pick(workdir, run_fp, budget)
    space_def, _, _, picks = plan_space(problem, read(workdir).windows,
                                        _choices_of(problem, cfp_strats), a.space)
    plans, _ = distinct_plans(problem, picks)
    out = Path(a.out)
    with open(out / f"{a.date}-enum-{backend}.csv", newline="") as f:
        measured = {r["plan"]: float(r["median_s"]) for r in csv.DictReader(f)
                    if (r["workload"], r["mesh"], r["space_def"]) == (label, a.mesh, space_def)}
    if set(measured) != set(plans):
        raise SystemExit(f"reprofile: the row's plans ({len(measured)}) are not this work dir's "
                         f"space ({len(plans)}): run enumerate_plans.py with these flags first")
    names = list(plans)
    strategies = [[problem.groups[g].options[c].strategies for g, c in enumerate(plans[n])]
                  for n in names]
    meas = [measured[n] for n in names]
    rows = []
    for k, prof, pred in predictions_from_profiles(cfp_flags(a), workdir, analysis, strategies,
                                                   extra.profiles, a.max_combinations,
                                                   a.whole_segments):
        acc, pairs = ordering_accuracy(pred, meas)
        rows.append(dict(workload=label, mesh=a.mesh, space_def=space_def, profile=k,
                         ordering_accuracy=f"{acc:.4f}", pairs_outside_10pct=pairs,
                         spearman=f"{spearman(pred, meas):.4f}",
                         profile_s=f"{prof.time_s:.0f}", backend=backend))
        print(f"profile {k}: ordering accuracy {100 * acc:.1f}% over {pairs} pairs, "
              f"Spearman {spearman(pred, meas):.2f}" + (" (the row's own)" if k == 0 else ""))
    append_rows(out / f"{a.date}-enum-{backend}-profiles.csv", list(rows[0]), rows,
                ("workload", "mesh", "space_def"))


if __name__ == "__main__":  # cfp's workers are spawned: they import this script again
    main()
