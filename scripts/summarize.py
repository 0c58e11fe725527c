"""The README's benchmark table, from the CSVs ``scripts/benchmark.py`` wrote.

Per workload and mesh: cfp's median step, then cfp's time over each plan's (median of per-round
ratios, bootstrap 95% interval; ``tie`` where the compiled programs are the same), and whether
the done-bar holds against the best manual baseline (upper end <= 1.05, or a tie); then, where
the CSV has ``cfp_own``, the method's two questions (``questions``).

    python scripts/summarize.py scripts/results/2026-11-22-cpu.csv
    python scripts/summarize.py scripts/results/2026-11-22-enum-cpu-summary.csv
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark import NOT_MANUAL, bootstrap_ratio, same_program_as_cfp  # noqa: E402


def main(path: str) -> None:
    import pandas as pd
    df = pd.read_csv(path, dtype={"mesh": str})
    same = same_program_as_cfp(path)
    cols = [c for c in dict.fromkeys(df.plan) if c != "cfp"]
    tally = {c: [0, 0, 0] for c in cols}  # cfp faster, tie or within noise, slower
    print("| workload | mesh | cfp step (ms) | " + " | ".join(cols) + " | best mesh baseline: bar |")
    print("|---|---|---|" + "---|" * len(cols) + "---|")
    for (w, m), sub in df.groupby(["workload", "mesh"], sort=False):
        c = sub[sub.plan == "cfp"].sort_values("round").step_s.values
        cells, best = [], None
        for plan in cols:
            b = sub[sub.plan == plan].sort_values("round").step_s.values
            if len(b) == 0:
                cells.append("n/a")
                continue
            med, lo, hi = bootstrap_ratio(c, b)
            tie = (w, m, plan) in same
            cells.append("tie" if tie else f"{med:.2f} [{lo:.2f}, {hi:.2f}]")
            tally[plan][0 if hi < 1 and not tie else 2 if lo > 1 and not tie else 1] += 1
            if plan not in NOT_MANUAL:
                t = float(pd.Series(b).median())
                if best is None or t < best[1]:
                    best = (plan, t, hi, tie)
        bar = f"{best[0]}: {'tie' if best[3] else ('met' if best[2] <= 1.05 else 'missed')}"
        print(f"| {w} | {m} | {1e3 * pd.Series(c).median():.2f} | " + " | ".join(cells)
              + f" | {bar} |")
    print("\n| against | cfp faster | tie or within noise | cfp slower |\n|---|---|---|---|")
    for plan, (f, t, sl) in tally.items():
        print(f"| {plan} | {f} | {t} | {sl} |")
    if "cfp_own" in set(df.plan):
        questions(path, df)
    time_and_memory(path, df)


def time_and_memory(path: str, df) -> None:
    """Per row, each plan's median step (ms) beside its compiled peak per device (MiB, the
    state donated), from the ``-plans.csv`` beside the CSV."""
    import pandas as pd
    plans_csv = Path(path).with_name(Path(path).stem + "-plans.csv")
    if not plans_csv.exists():
        return
    p = pd.read_csv(plans_csv, dtype={"mesh": str})
    if "peak_bytes" not in p:
        return
    peak = {(r.workload, r.mesh, r.plan): r.peak_bytes for r in p.itertuples()}
    cols = list(dict.fromkeys(df.plan))
    print("\nmedian step ms / compiled peak MiB per device\n")
    print("| workload | mesh | " + " | ".join(cols) + " |\n|---|---|" + "---|" * len(cols))
    for (w, m), sub in df.groupby(["workload", "mesh"], sort=False):
        cells = []
        for plan in cols:
            t = sub[sub.plan == plan].step_s
            cells.append("n/a" if t.empty else f"{1e3 * t.median():.1f} / "
                         f"{peak.get((w, m, plan), float('nan')) / 2**20:.1f}")
        print(f"| {w} | {m} | " + " | ".join(cells) + " |")


def questions(path: str, df) -> None:
    """The method's two questions per row: does profiling beat the cost model (``cfp_own``
    over ``analytic``, and over its unmeasured ``analytic_top1``), and does it beat what users
    write (``cfp_own`` over the best manual baseline; the bar: upper end at most 1.05); with
    the launch overhead's share of ``cfp_own``'s step."""
    import pandas as pd
    same = same_program_as_cfp(path, "cfp_own")
    overheads = Path(path).with_name(Path(path).stem + "-overheads.csv")
    launch = {}
    if overheads.exists():
        o = pd.read_csv(overheads, dtype={"mesh": str})
        if "launch_s" in o:
            launch = {(r.workload, r.mesh): r.launch_s for r in o.itertuples()}
    print("\n| workload | mesh | launch share | cfp_own / analytic | cfp_own / analytic_top1 "
          "| best manual | cfp_own / best manual: bar |\n|---|---|---|---|---|---|---|")
    faster = rows = 0
    for (w, m), sub in df.groupby(["workload", "mesh"], sort=False):
        if "cfp_own" not in set(sub.plan):
            continue
        steps = {p: sub[sub.plan == p].sort_values("round").step_s.values
                 for p in dict.fromkeys(sub.plan)}
        own = steps["cfp_own"]

        def ratio(plan):
            if (w, m, plan) in same:
                return "tie", None
            med, lo, hi = bootstrap_ratio(own, steps[plan])
            return f"{med:.2f} [{lo:.2f}, {hi:.2f}]", hi
        manual = min((p for p in steps if p not in NOT_MANUAL),
                     key=lambda p: float(pd.Series(steps[p]).median()))
        vs_analytic, hi_a = ratio("analytic")
        vs_manual, hi_m = ratio(manual)
        rows += 1
        faster += hi_a is not None and hi_a < 1
        share = (f"{launch[(w, m)] / float(pd.Series(own).median()):.1%}"
                 if (w, m) in launch else "n/a")
        bar = "tie" if hi_m is None else "met" if hi_m <= 1.05 else "missed"
        print(f"| {w} | {m} | {share} | {vs_analytic} | {ratio('analytic_top1')[0]} | {manual} "
              f"| {vs_manual}: {bar} |")
    print(f"\ncfp_own faster than analytic (upper end below 1) on {faster} of {rows} rows")


def enum_table(path: str) -> None:
    """The exhaustive check's summary CSV as a table."""
    import pandas as pd
    df = pd.read_csv(path, dtype={"mesh": str})
    print("| workload | mesh | space | plans | cfp rank | cfp / best (95% CI) | among the best "
          "| ordering accuracy (pairs) | Spearman | volume model: accuracy, Spearman "
          "| fitted weights: windows, reshardings |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in df.itertuples():
        weights = (f"{r.fit_windows_weight:.2f}, {r.fit_reshard_weight:.2f}"
                   if "fit_windows_weight" in df and pd.notna(r.fit_windows_weight) else "n/a")
        print(f"| {r.workload} | {r.mesh} | {r.space_def} | {r.space} | {r.cfp_rank} | "
              f"{r.cfp_over_best:.3f} [{r.cfp_over_best_lo:.3f}, {r.cfp_over_best_hi:.3f}] | "
              f"{'yes' if r.cfp_among_best else 'no'} ({r.tied_with_best} tied) | "
              f"{r.ordering_accuracy:.0%} ({r.pairs_outside_10pct}) | {r.spearman:.2f} | "
              f"{r.volume_ordering_accuracy:.0%}, {r.volume_spearman:.2f} | {weights} |")


if __name__ == "__main__":
    if "-enum-" in Path(sys.argv[1]).name:
        enum_table(sys.argv[1])
    else:
        main(sys.argv[1])
