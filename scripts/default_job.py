"""Where the default job's time goes: ``python -m cfp --memory-budget 2``, timed by phase.

Runs the README's default job (tiny GPT, 8 virtual CPU devices) in a fresh work dir three
times, one after the other: with an empty compilation cache (``cold``), again with the cache
that run filled (``warm``), and with the cache turned off (``no cache``). Each run's wall time
is taken around the whole process; the passes' own phase figures come from their records
(``analysis.pkl``, ``profile.pkl``, ``search.pkl``). Writes ``<out>.csv`` (one row per run,
pass and phase) and prints the table the README shows.

    python scripts/default_job.py --out scripts/results/2026-11-22-default-job-cpu
"""
from __future__ import annotations

import argparse
import csv
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
JOB = ["--memory-budget", "2"]


def run_job(workdir: Path, cache: str) -> float:
    cmd = [sys.executable, "-m", "cfp", *JOB, "--workdir", str(workdir),
           "--compilation-cache", cache]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"the default job failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return wall


def phase_rows(run: str, workdir: Path, wall_s: float) -> list[dict]:
    sys.path.insert(0, str(ROOT))
    from cfp.records import read_record
    from cfp.workdir import ANALYSIS_FORMAT, PROFILE_FORMAT, SEARCH_FORMAT
    analysis = read_record(workdir / "analysis.pkl", ANALYSIS_FORMAT, None, hint="")
    profile = read_record(workdir / "profile.pkl", PROFILE_FORMAT, None, hint="")
    search = read_record(workdir / "search.pkl", SEARCH_FORMAT, None, hint="")
    rows = [{"run": run, "pass": "analysis", "phase": "tracing and grouping",
             "seconds": analysis.stats.time_s}]
    for name, rec in (("profile", profile), ("search", search)):
        for phase, s in sorted(rec.phase_s.items(), key=lambda kv: -kv[1]):
            rows.append({"run": run, "pass": name, "phase": phase, "seconds": s})
        rows.append({"run": run, "pass": name, "phase": "other (I/O, solver set-up, reports)",
                     "seconds": rec.time_s - sum(rec.phase_s.values())})
    passes_s = analysis.stats.time_s + profile.time_s + search.time_s
    rows.append({"run": run, "pass": "-", "phase": "process start, JAX import, file I/O",
                 "seconds": wall_s - passes_s})
    rows.append({"run": run, "pass": "-", "phase": "total (wall)", "seconds": wall_s})
    rows.append({"run": run, "pass": "-", "phase": "combinations compiled",
                 "seconds": profile.compiled})
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output path without extension")
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="cfp-default-job-"))
    cache = tmp / "cache"
    rows = []
    try:
        for run, cache_arg in (("cold", str(cache)), ("warm", str(cache)),
                               ("no cache", "none")):
            workdir = tmp / run.replace(" ", "-")
            wall = run_job(workdir, cache_arg)
            rows += phase_rows(run, workdir, wall)
            print(f"{run}: {wall:.1f} s", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    out = Path(args.out).with_suffix(".csv")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["run", "pass", "phase", "seconds"])
        w.writeheader()
        w.writerows([dict(r, seconds=round(r["seconds"], 2)) for r in rows])
    runs = list(dict.fromkeys(r["run"] for r in rows))
    keys = list(dict.fromkeys((r["pass"], r["phase"]) for r in rows))
    table = {(r["run"], r["pass"], r["phase"]): r["seconds"] for r in rows}
    print(f"\n| pass | phase | {' | '.join(runs)} |\n|---|---|{'---|' * len(runs)}")
    for ps, ph in keys:
        cells = [table.get((r, ps, ph)) for r in runs]
        print(f"| {ps} | {ph} | " + " | ".join("" if c is None else f"{c:.1f}"
                                               if ph != "combinations compiled" else f"{c:.0f}"
                                               for c in cells) + " |")
    print(f"\nwrote {out} ({os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
