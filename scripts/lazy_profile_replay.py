"""A lazy profile replayed on full ones (nothing compiled or run): measure the hand plans'
combinations, price the rest from the analysis (``cfp.analytic``, the cost model fitted on
the mesh) put on the measured scale, solve, measure what the best plans use (the top three
and the best that reshards nothing), until they use only measured combinations; each
measurement is read from the full profile (``asked_beyond_full``: ones it did not measure).
Estimates: ``scaled`` (the price times the least measured-over-priced ratio of its window
type), ``affine`` (a least-squares line through the measured ones).

    python scripts/lazy_profile_replay.py profiles/gpt-tiny-8 --memory-budget 2 --out X.csv
"""
import argparse
import csv
import dataclasses
import itertools
import os
from pathlib import Path

import numpy as np


def replay(workdir: Path, estimate: str, budget_bytes: int | None) -> dict:
    from cfp.baselines import baseline_strategy_indices
    from cfp.cost_model import fit_cost_model_for
    from cfp.measure import Measurement
    from cfp.passes.profile import ProfileOptions, run_profile, with_state_layouts
    from cfp.problem import build_problem, predicted_plans
    from cfp.records import read_record
    from cfp.sharding import STATE_LAYOUTS
    analysis = read_record(workdir / "analysis.pkl", "cfp-analysis", None, hint="")
    full = read_record(workdir / "profile.pkl", "cfp-profile", None, hint="")
    windows, oracle = full.windows, {k: p.results for k, p in full.window_profiles.items()}
    priced = {k: p.results for k, p in run_profile(analysis, ProfileOptions(  # every combination
        cost="analytic", cost_model=fit_cost_model_for(tuple(analysis.mesh_shape)),
        max_combinations=full.max_combinations, whole_segments=full.whole_segments)
    ).window_profiles.items()}
    measured = {k: set() for k in priced}
    for idx, layout in baseline_strategy_indices(analysis, storage=True).values():
        for w in windows:
            c = tuple(idx[b] for b in range(w.start, w.end))
            if None not in c:
                measured[w.type].update(with_state_layouts(
                    analysis, w, [c], (STATE_LAYOUTS.index(layout),)))

    def estimated(k):
        xy = np.array([(priced[k][c].time_s, oracle[k][c].time_s) for c in measured[k]
                       if c in oracle[k] and oracle[k][c].status == "ok"]).T
        slope, offset = float(np.min(xy[1] / xy[0])), 0.0
        if estimate == "affine" and xy.shape[1] >= 3 and np.ptp(xy[0]) > 0:
            slope, offset = (float(v) for v in np.polyfit(xy[0], xy[1], 1))
            slope, offset = (slope, offset) if slope >= 0 else (0.0, float(np.median(xy[1])))
        out = {c: dataclasses.replace(m, time_s=max(offset + slope * m.time_s, 1e-9))
               for c, m in priced[k].items()}
        return out | {c: oracle[k].get(c) or Measurement("not_measured") for c in measured[k]}

    def plans(profile):
        problem, table = build_problem(analysis, profile, budget_bytes)
        return [(s.objective, tuple(table[g][c] for g, c in enumerate(s.choices)))
                for s in predicted_plans(problem, 3, 60.0)]

    for rounds in itertools.count(1):
        top = plans(dataclasses.replace(full, window_profiles={
            k: dataclasses.replace(p, results=estimated(k))
            for k, p in full.window_profiles.items()}))
        need = {(w.type, cs[g]) for _, cs in top for g, w in enumerate(windows)
                if cs[g] not in measured[w.type]}
        if not need:
            break
        for k, c in need:
            measured[k].add(c)
    best, beyond = plans(full)[0], sum(c not in oracle[k] for k in measured for c in measured[k])
    return {"workdir": workdir.name, "estimate": estimate, "rounds": rounds,
            "measured": sum(map(len, measured.values())) - beyond, "asked_beyond_full": beyond,
            "full_profile": sum(map(len, oracle.values())), "same_best_plan": top[0][1] == best[1],
            "best_predicted_ms": top[0][0] / 1e4, "full_best_predicted_ms": best[0] / 1e4}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("workdirs", nargs="+", type=Path)
    p.add_argument("--memory-budget", type=float, default=None, help="GiB per device")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    budget = a.memory_budget and int(a.memory_budget * 2**30)
    rows = [replay(wd, e, budget) for wd in a.workdirs for e in ("scaled", "affine")]
    with open(a.out, "w", newline="") as f:
        csv.DictWriter(f, fieldnames=list(rows[0])).writeheader()
        csv.DictWriter(f, fieldnames=list(rows[0])).writerows(rows)
    print(f"wrote {a.out}")
