"""The benchmarks' results: their CSV tables, per-round ratios with bootstrap intervals, the
chart and the tables the README quotes, and the plan orderings the exhaustive check reports.

``scripts/benchmark.py`` and ``scripts/enum_and_benchmark/enumerate_plans.py`` measure and
write rows with ``append_rows``; ``scripts/summarize.py`` prints ``summarize``'s tables.

Example:
    >>> med, lo, hi = bootstrap_ratio([2.0, 2.2, 1.8], [1.0, 1.0, 1.0])
    >>> round(med, 2), lo <= med <= hi
    (2.0, True)
"""
from __future__ import annotations

import csv
import itertools
import logging
import math
from pathlib import Path

log = logging.getLogger(__name__)

FIELDS = ["workload", "mesh", "plan", "round", "step_s", "backend", "devices"]
OVERHEAD_FIELDS = ["workload", "mesh", "analysis_s", "profile_s", "search_s", "compiled",
                   "model_profile_s", "launch_s", "backend", "devices"]
# Plans that are not a rule users write: what the manual baselines are compared against.
NOT_MANUAL = ("cfp", "cfp_own", "analytic", "analytic_top1", "single_device")
PLAN_FIELDS = ["workload", "mesh", "plan", "source", "collectives", "comm_bytes", "compile_s",
               "peak_bytes", "same_program_as_cfp", "same_program_as_cfp_own", "backend", "devices"]


def bootstrap_ratio(a, b, n=2000, seed=0):
    """Median of per-round ratios a/b and its bootstrap 95% interval."""
    import numpy as np
    r = np.asarray(a) / np.asarray(b)
    rng = np.random.default_rng(seed)
    meds = np.median(r[rng.integers(0, len(r), (n, len(r)))], axis=1)
    return float(np.median(r)), float(np.quantile(meds, 0.025)), float(np.quantile(meds, 0.975))


def append_rows(path: Path, fields, rows, keys=("workload", "mesh")) -> None:
    """Add ``rows``; rows of an earlier run with the same ``keys`` (workload and mesh) are
    replaced."""
    new = {tuple(r[k] for k in keys) for r in rows}
    old = []
    if path.exists():
        with path.open(newline="") as f:
            old = [r for r in csv.DictReader(f) if tuple(r.get(k) for k in keys) not in new]
    tmp = path.with_suffix(".tmp")
    with tmp.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(old + rows)
    tmp.replace(path)


def same_program_as_cfp(results_csv: Path, plan: str = "cfp") -> set:
    """{(workload, mesh, plan)} whose compiled program is ``plan``'s (cfp's or cfp_own's), from
    the ``-plans.csv`` beside a ``<date>-<backend>.csv``."""
    import pandas as pd
    path = Path(results_csv).with_name(Path(results_csv).stem + "-plans.csv")
    column = f"same_program_as_{plan}"
    if not path.exists():
        return set()
    p = pd.read_csv(path, dtype={"mesh": str})
    if column not in p:
        return set()
    return {(r.workload, r.mesh, r.plan) for r in p.itertuples() if getattr(r, column) is True}


def summarize(path: str) -> str:
    """The benchmark's table from ``path`` (a ``<date>-<backend>.csv`` or an exhaustive
    check's ``-summary.csv``): per workload and mesh, cfp's median step, then cfp's time over
    each plan's (median of per-round ratios, bootstrap 95% interval; ``tie`` where the compiled
    programs are the same), and whether the bar holds against the best manual baseline (upper
    end <= 1.05, or a tie); then, where the CSV has ``cfp_own``, the method's two questions.
    Returns the tables as Markdown."""
    if "-enum-" in Path(path).name:
        return enum_table(path)
    import pandas as pd
    df = pd.read_csv(path, dtype={"mesh": str})
    same = same_program_as_cfp(path)
    cols = [c for c in dict.fromkeys(df.plan) if c != "cfp"]
    tally = {c: [0, 0, 0] for c in cols}  # cfp faster, tie or within noise, slower
    table = ["| workload | mesh | cfp step (ms) | " + " | ".join(cols)
             + " | best mesh baseline: bar |"]
    table.append("|---|---|---|" + "---|" * len(cols) + "---|")
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
        table.append(f"| {w} | {m} | {1e3 * pd.Series(c).median():.2f} | "
                     + " | ".join(cells) + f" | {bar} |")
    table.append("\n| against | cfp faster | tie or within noise | cfp slower |\n"
                 "|---|---|---|---|")
    for plan, (f, t, sl) in tally.items():
        table.append(f"| {plan} | {f} | {t} | {sl} |")
    if "cfp_own" in set(df.plan):
        table += questions(path, df)
    return "\n".join(table + time_and_memory(path, df))


def time_and_memory(path: str, df) -> list[str]:
    """Per row, each plan's median step (ms) beside its compiled peak per device (MiB, the
    state donated), from the ``-plans.csv`` beside the CSV."""
    import pandas as pd
    plans_csv = Path(path).with_name(Path(path).stem + "-plans.csv")
    if not plans_csv.exists():
        return []
    p = pd.read_csv(plans_csv, dtype={"mesh": str})
    if "peak_bytes" not in p:
        return []
    peak = {(r.workload, r.mesh, r.plan): r.peak_bytes for r in p.itertuples()}
    cols = list(dict.fromkeys(df.plan))
    table = ["\nmedian step ms / compiled peak MiB per device\n"]
    table.append("| workload | mesh | " + " | ".join(cols) + " |\n|---|---|" + "---|" * len(cols))
    for (w, m), sub in df.groupby(["workload", "mesh"], sort=False):
        cells = []
        for plan in cols:
            t = sub[sub.plan == plan].step_s
            cells.append("n/a" if t.empty else f"{1e3 * t.median():.1f} / "
                         f"{peak.get((w, m, plan), float('nan')) / 2**20:.1f}")
        table.append(f"| {w} | {m} | " + " | ".join(cells) + " |")
    return table


def questions(path: str, df) -> list[str]:
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
    table = ["\n| workload | mesh | launch share | cfp_own / analytic | cfp_own / "
             "analytic_top1 | best manual | cfp_own / best manual: bar |\n"
             "|---|---|---|---|---|---|---|"]
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
        table.append(f"| {w} | {m} | {share} | {vs_analytic} | {ratio('analytic_top1')[0]} "
                     f"| {manual} | {vs_manual}: {bar} |")
    table.append(f"\ncfp_own faster than analytic (upper end below 1) on {faster} of {rows} "
                 f"rows")
    return table


def enum_table(path: str) -> str:
    """The exhaustive check's summary CSV as a table."""
    import pandas as pd
    df = pd.read_csv(path, dtype={"mesh": str})
    table = ["| workload | mesh | space | plans | cfp rank | cfp / best (95% CI) | among the "
             "best | ordering accuracy (pairs) | Spearman | volume model: accuracy, Spearman "
             "| fitted weights: windows, reshardings |"]
    table.append("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in df.itertuples():
        weights = (f"{r.fit_windows_weight:.2f}, {r.fit_reshard_weight:.2f}"
                   if "fit_windows_weight" in df and pd.notna(r.fit_windows_weight) else "n/a")
        table.append(
            f"| {r.workload} | {r.mesh} | {r.space_def} | {r.space} | {r.cfp_rank} | "
            f"{r.cfp_over_best:.3f} [{r.cfp_over_best_lo:.3f}, {r.cfp_over_best_hi:.3f}] | "
            f"{'yes' if r.cfp_among_best else 'no'} ({r.tied_with_best} tied) | "
            f"{r.ordering_accuracy:.0%} ({r.pairs_outside_10pct}) | {r.spearman:.2f} | "
            f"{r.volume_ordering_accuracy:.0%}, {r.volume_spearman:.2f} | {weights} |")
    return "\n".join(table)


def plot(out: Path, date: str) -> list[Path]:
    """One chart per backend: per workload and mesh, each plan's time over cfp's (median of
    per-round ratios, bootstrap 95% interval); hatched where the program is cfp's own.
    Returns the charts written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd
    from matplotlib.patches import Patch
    from matplotlib.ticker import FuncFormatter
    written = []
    for path in sorted(Path(out).glob(f"{date}-*.csv")):
        if path.stem.count("-") != 3:  # <date>-<backend>.csv only
            continue
        df = pd.read_csv(path, dtype={"mesh": str})
        same = same_program_as_cfp(path)
        mesh_order = {m: i for i, m in enumerate(("8", "2x4", "4x2"))}
        cases = sorted(dict.fromkeys(zip(df.workload, df.mesh)),
                       key=lambda c: (c[0], mesh_order.get(c[1], 9), c[1]))
        plans = [p for p in dict.fromkeys(df.plan) if p != "cfp"]
        fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(cases)), 4.8))
        width = 0.8 / len(plans)
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        for j, p in enumerate(plans):
            for i, (w, m) in enumerate(cases):
                sub = df[(df.workload == w) & (df.mesh == m)]
                c, b = sub[sub.plan == "cfp"].step_s.values, sub[sub.plan == p].step_s.values
                if len(b) == 0:
                    continue
                med, lo, hi = bootstrap_ratio(b, c)
                x = i + (j - len(plans) / 2 + 0.5) * width
                ax.bar(x, med, width, yerr=[[med - lo], [hi - med]], capsize=2,
                       color=colors[j % len(colors)],
                       hatch="//" if (w, m, p) in same else None, edgecolor="white")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels([f"{w}\n{m}" for w, m in cases], fontsize=7)
        ax.set_ylabel("plan step time / cfp step time")
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if v in (
            0.2, 0.5, 2, 3) else ""))
        backend = path.stem.split("-")[-1]
        ax.set_title(f"cfp against baselines, {backend}, {int(df.devices.iloc[0])} devices, "
                     f"{date}: above 1, cfp is faster; hatched, the same program as cfp's",
                     fontsize=9)
        handles = [Patch(color=colors[j % len(colors)], label=p) for j, p in enumerate(plans)]
        ax.legend(handles=handles, fontsize=7, ncol=8, loc="upper center",
                  bbox_to_anchor=(0.5, -0.13))
        fig.tight_layout()
        fig.savefig(path.with_suffix(".png"), dpi=120, bbox_inches="tight")
        written.append(path.with_suffix(".png"))
    return written


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


def term_weights(windows, reshards, measured) -> tuple[float, float]:
    """Least-squares weights of the two terms of cfp's composed prediction (window times,
    boundary reshardings) that best explain the measured step times, with an intercept. Both 1:
    the composition adds the terms as they are; far from 1: that term is mispriced end to end."""
    import numpy as np
    x = np.c_[windows, reshards, np.ones(len(windows))]
    coef, *_ = np.linalg.lstsq(x, np.asarray(measured), rcond=None)
    return float(coef[0]), float(coef[1])


def spearman(a, b) -> float:
    import pandas as pd
    return float(pd.Series(a).rank().corr(pd.Series(b).rank()))


def time_in_chunks(names, chunk: int, rounds: int, load, unload, measure):
    """({name: seconds per round}, {name: its chunk}) of the plans ``names`` (cfp's first),
    timed in interleaved rounds, in chunks of at most ``chunk`` plans with cfp's in each:
    ``load`` compiles a plan, ``unload`` drops it at its chunk's end, ``measure`` times one
    run. A plan's time in a round counts relative to cfp's in the same round, scaled by cfp's
    median over all rounds, so plans of different chunks compare through cfp's plan (a
    machine slower during one chunk slows cfp's plan too). cfp's own times are that median,
    every round: each plan's per-round ratio to cfp's is then its ratio in its own rounds."""
    import numpy as np
    anchor, others = names[0], names[1:]
    size = max(1, chunk - 1)
    chunks = [others[i:i + size] for i in range(0, len(others), size)] or [[]]
    relative, anchor_s, chunk_of = {n: [] for n in others}, [], {anchor: 0}
    load(anchor)
    for c, members in enumerate(chunks, 1):
        for n in members:
            load(n)
            chunk_of[n] = c
        log.info("chunk %d of %d: %d plans compiled", c, len(chunks), len(members))
        here = [anchor] + members
        for r in range(rounds):
            seconds = {n: measure(n) for n in here[r % len(here):] + here[:r % len(here)]}
            anchor_s.append(seconds[anchor])
            for n in members:
                relative[n].append(seconds[n] / seconds[anchor])
        for n in members:
            unload(n)
    scale = float(np.median(anchor_s))
    times = {anchor: [scale] * rounds} | {n: [x * scale for x in relative[n]] for n in others}
    return times, chunk_of


def plan_space(problem, windows, cfp_choices, space: str):
    """(its definition, feasible combinations per window type, its size, iterator of (name,
    option index per window instance)) of ``space``; cfp's own plan comes first, named
    ``cfp``."""
    types = sorted({w.type for w in windows})
    first = {t: next(i for i, w in enumerate(windows) if w.type == t) for t in types}
    counts = [len(problem.groups[first[t]].options) for t in types]
    if space == "uniform":
        picks = (("p" + "-".join(map(str, pick)),
                  tuple(pick[types.index(w.type)] for w in windows))
                 for pick in itertools.product(*[range(c) for c in counts]))
        return ("one combination per window type", counts, math.prod(counts),
                itertools.chain([("cfp", cfp_choices)], picks))
    picks = ((f"t{t}o{o}", tuple(o if w.type == t else c for w, c in zip(windows, cfp_choices)))
             for t, n in zip(types, counts) for o in range(n))
    return ("cfp's plan with one window type changed", counts, sum(counts),
            itertools.chain([("cfp", cfp_choices)], picks))


def distinct_plans(problem, picks) -> tuple[dict, int]:
    """{name: choices} of the plans within the memory budget, each set of block strategies
    once (the first name wins), and how many were over the budget."""
    from cfp.solver import evaluate
    plans, seen, over = {}, set(), 0
    for name, choices in picks:
        _, mem, strategies = evaluate(problem, choices)
        if problem.memory_budget is not None and mem > problem.memory_budget:
            over += 1
        elif strategies not in seen:
            seen.add(strategies)
            plans[name] = choices
    return plans, over
