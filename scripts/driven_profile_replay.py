"""The profile search drives, replayed on exhaustive profiles (``--profile-all``): the
profile pass's own loop (``passes/profile.py``, ``_search_driven``) runs with a worker that
answers every measurement from the exhaustive profile, so nothing is compiled or run. Per
work dir and per way of pricing, it gives how many combinations the loop measured, in how
many batches, and how much slower (by the exhaustive profile's times) the top plans it would
hand to search are than the best plan of the exhaustive profile; and the band of the
analytic price's fit over the whole exhaustive profile (``cfp.pricing``): the least and most
ratio of a measured time to its fitted price, which decides how much the loop measures.
Each way of pricing is replayed ``--repeats`` times: the cost model under the prices is
fitted on the mesh anew each time, as a profile does.

    python scripts/driven_profile_replay.py profiles/full-gpt-tiny-8 --memory-budget 2 \
        --out scripts/results/<date>-driven-profile-replay-cpu.csv

Ways of pricing: ``as built`` (this checkout), ``no reshard inside windows`` (the analytic
price without the collectives that move tensors between a window's own blocks).
"""
import argparse
import csv
import os
import time
from pathlib import Path

import numpy as np


def replay(workdir: Path, budget_bytes: int) -> dict:
    from cfp.passes import profile as P
    from cfp.problem import build_problem, evaluate, predicted_plans
    from cfp.records import read_record
    analysis = read_record(workdir / "analysis.pkl", "cfp-analysis", None, hint="")
    full = read_record(workdir / "profile.pkl", "cfp-profile", None, hint="")
    oracle = {k: p.results for k, p in full.window_profiles.items()}
    batches = []

    class Answering:  # the worker, answering from the exhaustive profile
        platform, overhead_s, device_ids = full.platform, full.launch_overhead_s, full.device_ids

        def share(self, value):
            return value

        def call(self, f, *args):
            return f(*args)

        def ensure(self):
            pass

        def measure_window(self, window, combos, best):
            batches.append(len(combos))
            return [(c, oracle[window.type][c]) for c in combos]

    class Timed(P.MemoryCheckpoint):  # every resharding as the exhaustive profile timed it
        def load_reshards(self):
            return {key: None if t is None else (t, *full.reshard_interval_s.get(key, (t, t)))
                    for key, t in full.reshard_s.items()}

    windows, reps = P.split_windows(analysis, full.max_combinations, full.whole_segments)
    checkpoint, options = Timed(), P.ProfileOptions(memory_budget_bytes=budget_bytes)
    known = [P._known(k, windows[rep], analysis, checkpoint, None, budget_bytes)
             for k, rep in enumerate(reps)]
    bounds = P.boundaries(analysis, windows)
    profiles, measured, timed = P._search_driven(analysis, windows, reps, known, bounds, options,
                                                 Answering(), checkpoint, time.perf_counter(),
                                                 lambda *a, **f: None)
    driven = P._record_of(analysis, windows, reps, {k: known[k][0] for k in range(len(reps))},
                          {k: p.results for k, p in profiles.items()}, bounds, timed, options,
                          full.platform)
    problem, combos = build_problem(analysis, driven, budget_bytes)
    whole, whole_combos = build_problem(analysis, full, budget_bytes)
    best = predicted_plans(whole, 1, 10.0)[0].objective

    def on_whole(sol):  # the plan's composed time by the exhaustive profile's times
        return evaluate(whole, [whole_combos[g].index(combos[g][c])
                                for g, c in enumerate(sol.choices)])[0]
    ratios = [on_whole(s) / best for s in predicted_plans(problem, options.plans, 10.0)]
    return {"measured": measured, "space": sum(map(len, oracle.values())),
            "batches": len(batches), "top_plans_over_best": " ".join(f"{r:.3f}" for r in ratios)}


def band(workdir: Path) -> tuple[float, float]:
    """The least and most ratio of a measured time to its fitted analytic price, over every
    combination of the exhaustive profile."""
    from cfp import analytic, pricing
    from cfp.cost_model import fit_cost_model_for
    from cfp.mesh import AXIS_NAMES
    from cfp.records import read_record
    analysis = read_record(workdir / "analysis.pkl", "cfp-analysis", None, hint="")
    full = read_record(workdir / "profile.pkl", "cfp-profile", None, hint="")
    cost = fit_cost_model_for(tuple(analysis.mesh_shape), analysis.device_ids)
    names = AXIS_NAMES[:len(analysis.mesh_shape)]
    parts, seconds = [], []
    for k, rep in enumerate(full.representatives):
        w, memo = full.windows[rep], {}
        operators = sum(len(analysis.blocks.blocks[b].members) for b in range(w.start, w.end))
        for c, m in full.window_profiles[k].results.items():
            if m.status == "ok":
                priced = analytic.window_measurement(analysis, w, c, cost, names, memo)
                parts.append(pricing.parts(priced, operators, cost, analysis.mesh_shape))
                seconds.append(m.time_s)
    fit = pricing.fit_prices(np.array(parts), np.array(seconds))
    return fit.low_ratio, fit.high_ratio


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("workdirs", nargs="+", type=Path, help="work dirs profiled --profile-all")
    p.add_argument("--memory-budget", type=float, default=None, help="GiB per device")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    from cfp import analytic
    budget = int(a.memory_budget * 2**30) if a.memory_budget else 2**62
    inside = analytic._resharded_inside
    rows = []
    for wd in a.workdirs:
        for way in ("as built", "no reshard inside windows"):
            analytic._resharded_inside = inside if way == "as built" else lambda *a: []
            for run in range(a.repeats):
                low, high = band(wd)
                rows.append({"workdir": wd.name, "pricing": way, "run": run,
                             "band_low": round(low, 3), "band_high": round(high, 3),
                             **replay(wd, budget)})
                print(rows[-1], flush=True)
    analytic._resharded_inside = inside
    with open(a.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
