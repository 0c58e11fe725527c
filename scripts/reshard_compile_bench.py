"""Compiling the profile's reshardings one at a time against in threads
(``cfp.worker_jobs.compile_reshards``).

The reshardings tiny GPT's 2x4 profile times, shuffled, go in batches of 16 (the profile's
batch); in each round two fresh batches compile, one in one thread and one in a thread per
core (at most 8), the order alternating by round, so no program is compiled twice and
neither way always goes first. Medians of the seconds per resharding; the load average is
recorded with each round (other jobs on the machine slow both ways).

    python scripts/reshard_compile_bench.py --rounds 15

Writes ``scripts/results/<date>-reshard-compile-<backend>.csv`` (one row per way and round)
and a PNG of the rounds and medians.
"""
from __future__ import annotations

import argparse
import csv
import datetime
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BATCH = 16


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--out", default=None, help="CSV path (default: scripts/results/...)")
    args = ap.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT))
    import jax
    from cfp.passes.analysis import run_analysis
    from cfp.passes.profile import needed_reshards
    from cfp.windows import boundaries, split_windows
    from cfp.worker_jobs import compile_reshards
    from cfp.mesh import make_mesh
    from cfp.workloads import WorkloadSpec
    a = run_analysis(WorkloadSpec("gpt", "tiny", None, "float32", ()).resolved(), (2, 4))
    keys = sorted(needed_reshards(boundaries(a, split_windows(a, 32)[0]), a.blocks.blocks,
                                  ("m0", "m1")), key=repr)
    random.Random(0).shuffle(keys)
    mesh = make_mesh((2, 4))
    threads = max(1, min(os.cpu_count() or 1, 8))
    compile_reshards(mesh, keys[:2], 1)  # warm-up: JAX's first compile
    rows, at = [], 2
    for r in range(args.rounds):
        ways = [(1, "one thread"), (threads, f"{threads} threads")][::1 if r % 2 else -1]
        for n, way in ways:
            batch, at = keys[at:at + BATCH], at + BATCH
            t0 = time.perf_counter()
            compile_reshards(mesh, batch, n)
            seconds = time.perf_counter() - t0
            rows.append({"round": r, "way": way, "threads": n, "reshardings": len(batch),
                         "s_per_resharding": seconds / len(batch),
                         "load_1min": os.getloadavg()[0]})
    backend = jax.default_backend()
    out = Path(args.out or ROOT / "scripts" / "results" /
               f"{datetime.date.today()}-reshard-compile-{backend}.csv")
    with open(out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    medians = {way: statistics.median(x["s_per_resharding"] for x in rows if x["way"] == way)
               for way in dict.fromkeys(x["way"] for x in rows)}
    for way, m in medians.items():
        print(f"{way}: median {m * 1e3:.1f} ms per resharding")
    print(f"one thread / threaded: {medians['one thread'] / medians[f'{threads} threads']:.2f}"
          f"; {os.cpu_count()} cores; load average during: "
          f"{min(x['load_1min'] for x in rows):.2f} to {max(x['load_1min'] for x in rows):.2f}")
    _plot(rows, medians, out.with_suffix(".png"))


def _plot(rows, medians, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for way, m in medians.items():
        got = [(x["round"], x["s_per_resharding"] * 1e3) for x in rows if x["way"] == way]
        line, = ax.plot(*zip(*got), "o", label=f"{way} (median {m * 1e3:.1f} ms)")
        ax.axhline(m * 1e3, color=line.get_color(), lw=1)
    ax.set_xlabel("round")
    ax.set_ylabel("compile ms per resharding")
    ax.set_title("tiny GPT's 2x4 reshardings, batches of 16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
