"""The profile search drives, replayed on exhaustive (``--profile-all``) profiles: the pass's
own loop (``_search_driven``) with a worker answering from the exhaustive profile, nothing
compiled or run. Per work dir and way of pricing (``as built``; ``no reshard inside windows``,
the analytic price without the collectives moving tensors between a window's own blocks):
combinations measured, batches, the top plans' time over the exhaustive best, and the band of
measured time over fitted price across the exhaustive profile (``cfp.pricing``)."""
import argparse
import csv
import os
from pathlib import Path
from types import SimpleNamespace

import numpy as np


def replay(workdir: Path, budget_bytes: int) -> dict:
    from cfp import analytic, pricing
    from cfp.cost_model import fit_cost_model_for
    from cfp.mesh import AXIS_NAMES
    from cfp.passes import profile as P
    from cfp.problem import build_problem, evaluate, predicted_plans
    from cfp.records import read_record
    analysis = read_record(workdir / "analysis.pkl", "cfp-analysis", None, hint="")
    full = read_record(workdir / "profile.pkl", "cfp-profile", None, hint="")
    oracle = {k: p.results for k, p in full.window_profiles.items()}
    batches = []
    worker = SimpleNamespace(  # answers from the exhaustive profile
        platform=full.platform, overhead_s=full.launch_overhead_s, device_ids=full.device_ids,
        share=lambda value: value, call=lambda f, *args: f(*args), ensure=lambda: None,
        measure_window=lambda w, combos, best: batches.append(len(combos)) or [
            (c, oracle[w.type][c]) for c in combos])
    checkpoint = P.MemoryCheckpoint()  # every resharding as the exhaustive profile timed it
    checkpoint.load_reshards = lambda: {
        key: None if t is None else (t, *full.reshard_interval_s.get(key, (t, t)))
        for key, t in full.reshard_s.items()}
    windows, reps = P.split_windows(analysis, full.max_combinations, full.whole_segments)
    options = P.ProfileOptions(memory_budget_bytes=budget_bytes)
    known = [P._known(k, windows[rep], analysis, checkpoint, None, budget_bytes)
             for k, rep in enumerate(reps)]
    bounds = P.boundaries(analysis, windows)
    profiles, measured, timed = P._search_driven(analysis, windows, reps, known, bounds, options,
                                                 worker, checkpoint, 0.0,
                                                 lambda *a, **f: None)
    driven = P._record_of(analysis, windows, reps, {k: known[k][0] for k in range(len(reps))},
                          {k: p.results for k, p in profiles.items()}, bounds, timed, options,
                          full.platform)
    problem, combos = build_problem(analysis, driven, budget_bytes)
    whole, whole_combos = build_problem(analysis, full, budget_bytes)
    best = predicted_plans(whole, 1, 10.0)[0].objective
    ratios = [evaluate(whole, [whole_combos[g].index(combos[g][c])
                               for g, c in enumerate(s.choices)])[0] / best
              for s in predicted_plans(problem, options.plans, 10.0)]
    cost = fit_cost_model_for(tuple(analysis.mesh_shape), analysis.device_ids)
    names, parts, seconds = AXIS_NAMES[:len(analysis.mesh_shape)], [], []
    for k, rep in enumerate(full.representatives):
        w, memo = full.windows[rep], {}
        operators = sum(len(analysis.blocks.blocks[b].members) for b in range(w.start, w.end))
        for c, m in ((c, m) for c, m in oracle[k].items() if m.status == "ok"):
            priced = analytic.window_measurement(analysis, w, c, cost, names, memo)
            parts.append(pricing.parts(priced, operators, cost, analysis.mesh_shape))
            seconds.append(m.time_s)
    fit = pricing.fit_prices(np.array(parts), np.array(seconds))
    return {"band_low": round(fit.low_ratio, 3), "band_high": round(fit.high_ratio, 3),
            "measured": measured, "space": sum(map(len, oracle.values())),
            "batches": len(batches), "top_plans_over_best": " ".join(f"{r:.3f}" for r in ratios)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("workdirs", nargs="+", type=Path, help="work dirs profiled --profile-all")
    p.add_argument("--memory-budget", type=float, default=None, help="GiB per device")
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    from cfp import analytic
    budget, inside, rows = int(a.memory_budget * 2**30) if a.memory_budget else 2**62, \
        analytic._resharded_inside, []
    for wd in a.workdirs:
        for way in ("as built", "no reshard inside windows"):
            analytic._resharded_inside = inside if way == "as built" else lambda *a: []
            rows.append({"workdir": wd.name, "pricing": way, "run": 0, **replay(wd, budget)})
            print(rows[-1], flush=True)
    with open(a.out, "w", newline="") as f:
        csv.DictWriter(f, fieldnames=list(rows[0])).writeheader()
        csv.DictWriter(f, fieldnames=list(rows[0])).writerows(rows)


if __name__ == "__main__":
    main()
