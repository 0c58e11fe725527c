"""The README's benchmark table, from the CSVs ``scripts/benchmark.py`` wrote.

Per workload and mesh: cfp's median step, then cfp's time over each plan's (median of per-round
ratios, bootstrap 95% interval; ``tie`` where the compiled programs are the same), and whether
the done-bar holds against the best manual baseline (upper end <= 1.05, or a tie); then, where
the CSV has ``cfp_own``, the method's two questions (``questions``).

    python scripts/summarize.py scripts/results/compute-bound/2026-11-28-cpu.csv
    python scripts/summarize.py scripts/results/2026-11-22-enum-cpu-summary.csv
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cfp.bench import summarize  # noqa: E402

if __name__ == "__main__":
    print(summarize(sys.argv[1]))
