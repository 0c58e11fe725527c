"""The same composition-check plans measured twice: how far their steps moved between the two.

Each argument pair names the rows of a first and a later ``composition_check.py`` run on the
same profile and plans, as ``CSV:FIRST-LAST`` (1-based rows, header not counted). Per pair:
the median over the plans of the ratio of their measured step times (later over first) and
both runs' median |time error|; then the medians of the two errors over the pairs. A pair
whose rows do not compose the same predictions is refused: it is not the same plans.

    python scripts/diagnostics/steps_again.py \\
        scripts/results/2026-11-25-composition-cpu.csv:21-40 \\
        scripts/results/2026-11-25-composition-anchor-cpu.csv:61-80
"""
from __future__ import annotations

import statistics
import sys

import pandas as pd


def rows(spec: str) -> pd.DataFrame:
    try:
        path, span = spec.rsplit(":", 1)
        first, last = (int(x) for x in span.split("-"))
        table = pd.read_csv(path)
    except (ValueError, OSError) as e:
        refuse(f"{spec}: not CSV:FIRST-LAST of a readable file ({e})")
    if not 1 <= first <= last <= len(table):
        refuse(f"{spec}: rows {first} to {last} not within the file's {len(table)}")
    return table.iloc[first - 1:last].reset_index(drop=True)


def refuse(why: str) -> None:
    print(f"steps_again: {why}", file=sys.stderr)
    sys.exit(2)


def main(argv: list[str]) -> None:
    if not argv or len(argv) % 2:
        refuse("give pairs of CSV:FIRST-LAST (first run, later run)")
    first_errors, again_errors = [], []
    for first_spec, again_spec in zip(argv[::2], argv[1::2]):
        first, again = rows(first_spec), rows(again_spec)
        if len(first) != len(again) or not (
                (first.predicted_s - again.predicted_s).abs() <= 1e-6 * first.predicted_s).all():
            refuse(f"{first_spec} and {again_spec} are not the same plans")
        ratio = statistics.median(again.measured_s / first.measured_s)
        first_errors.append(first.time_err.abs().median())
        again_errors.append(again.time_err.abs().median())
        print(f"{again.workload[0]} mesh {again.mesh[0]}: steps again x{ratio:.3f}; median "
              f"|time error| first {100 * first_errors[-1]:.1f}%, again "
              f"{100 * again_errors[-1]:.1f}% ({again_spec})")
    print(f"over {len(first_errors)} pairs: median |time error| first "
          f"{100 * statistics.median(first_errors):.1f}%, again "
          f"{100 * statistics.median(again_errors):.1f}%")


if __name__ == "__main__":
    main(sys.argv[1:])
