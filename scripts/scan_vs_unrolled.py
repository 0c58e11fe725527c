"""A scanned (and remat) Flax transformer next to its unrolled twin: profile time, plan compile
time, step time and memory, at 4 and 8 layers, on 8 virtual CPU devices.

Each (model, layers) runs the three passes from scratch in its own process (fresh work dir,
compilation cache off), so the pass times are cold ones. Writes a CSV (one row per run) and
prints it.

Usage: python scripts/scan_vs_unrolled.py [--out scripts/results/<date>-scan-cpu.csv]
"""
from __future__ import annotations

import argparse
import csv
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODELS = ["flax_unrolled", "flax_scan", "flax_remat", "flax_scan_remat"]
PATTERNS = {
    "combinations": r"combinations to measure: (\d+)",
    "profile_s": r"profile pass: ([\d.]+) s",
    "search_s": r"search pass: ([\d.]+) s",
    "plan_compile_s": r"search pass: [\d.]+ s \(.*?compiling ([\d.]+)",
}
REPORT = {"step_ms": ("measured_median_s", 1e3), "compiled_gb": ("memory_gb", 1),
          "composed_gb": ("composed_memory_gb", 1)}  # from debug_search/report.json


def run(model: str, layers: int) -> dict:
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(ROOT / "cfp_test"), str(ROOT)]))
    with tempfile.TemporaryDirectory() as workdir:
        out = subprocess.run(
            [sys.executable, "-m", "cfp", "--model", f"scanned_models:{model}", "--num-layers",
             str(layers), "--mesh", "8", "--memory-budget", "1", "--validate-top", "1",
             "--workdir", workdir, "--compilation-cache", "none", "-v"],
            env=env, cwd=ROOT, capture_output=True, text=True, check=True).stdout
        report = json.loads((Path(workdir) / "debug_search" / "report.json").read_text())
    row = {"model": model, "layers": layers}
    for key, pattern in PATTERNS.items():
        m = re.search(pattern, out)
        row[key] = m.group(1) if m else ""
    for key, (field, scale) in REPORT.items():
        row[key] = f"{report[field] * scale:.6g}"
    row["scans"] = ("rolled" if "scans run as lax.scan" in out else
                    "unrolled" if "scans run unrolled" in out else "none")
    row["backend"], row["devices"] = "cpu", 8
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(ROOT / "scripts" / "results" /
                                        f"{datetime.date.today()}-scan-cpu.csv"))
    args = p.parse_args()
    rows = [run(model, layers) for layers in (4, 8) for model in MODELS]
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    for r in rows:
        print(",".join(str(v) for v in r.values()))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    from cfp.host_memory import run_pooled
    run_pooled()  # timing measures programs, not the host allocator
    main()
