"""Where planning time goes, before and after a change, side by side in one CSV.

Each case is a few ``python -m cfp`` commands run in one fresh work dir; each command's wall
time is taken around its process, and the passes' own split comes from the lines they print
with ``-v``: ``profile pass: 12.8 s (running 8.5, compiling 1.9, ...)``, ``search pass: ...``,
the stage DP line, and the analysis line. ``--before REV`` runs every case first from a git
worktree of ``REV`` (the same commands, that commit's code), then from this checkout, case by
case, so that both meet the same machine. Each version's cases start with an empty JAX
compilation cache, but the warm default job, which reuses the cold one's.

    python scripts/planning_time.py --before fef4d4a --out scripts/results/<date>-planning-time-cpu

Writes ``<out>.csv`` (version, case, command, pass, phase, seconds) and ``<out>.png`` (wall
seconds per case, before and after), and prints the table. A cluster plan's predicted step
and a staged plan's predicted latency are rows too (pass ``plan``), so that the plans before
and after can be compared. Times are of this machine (2
cores, no GPU): the stages and ``--mesh auto`` cases price a described cluster analytically,
so no device is measured there; the default job and the memory-bound row measure on 8 virtual
CPU devices.
"""
from __future__ import annotations

import argparse
import csv
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LLAMA_13B = ["--model", "llama", "--config", "13b", "--dtype", "bfloat16", "--batch-size", "8",
             "--seq-len", "1024", "--cluster", "alpa-50x4"]
CASES = {  # name -> commands, run in order in one fresh work dir
    "default job, cold": [["--memory-budget", "2"]],
    "default job, warm": [["--memory-budget", "2"]],  # the compilation cache the cold one filled
    "memory-bound (default job within 1.5 MB)": [["--memory-budget", "0.0015"]],
    "stages: LLaMA-2-13B on alpa-50x4": [LLAMA_13B + ["--cost", "model", "--mode", m]
                                         for m in ("analysis", "profile", "stages")],
    "--mesh auto: LLaMA-2-13B on alpa-50x4": [LLAMA_13B + ["--mesh", "auto"]],
    "analysis: 80-layer GPT": [["--model", "gpt", "--num-layers", "80", "--mesh", "8",
                                "--mode", "analysis"]],
}
PASS_LINE = re.compile(r"^(profile pass|search pass): ([\d.]+) s \((.*)\)$")
ANALYSIS_LINE = re.compile(r"^analysis: .*\(([\d.]+) s\)$")
# the plan's predicted step (a cluster plan) or latency (stages), which a change must keep
PREDICTED_LINE = re.compile(r"^predicted (?:step time|latency).*: ([\d.]+) ms")
# the kept plan of a measured case, and its step time: which plan, so that a change that
# keeps it shows it kept it
KEPT_LINE = re.compile(r"^searched ParallelBlock Strategies solution \((.*)\): (\[.*\])$")
STEP_LINE = re.compile(r"^step time: ([\d.]+(?:e[+-]\d+)?) ms")
STAGES_LINE = re.compile(r"stage DP: .*?([\d.]+) s; .* in ([\d.]+) s; stages pass ([\d.]+) s"
                         r"(?: \(tracing ([\d.]+) s\))?")


def worktree(rev: str) -> Path:
    """A checkout of ``rev`` beside this one, importable as ``cfp`` (its ``passes/`` linked
    where the installed package puts it)."""
    path = Path(tempfile.gettempdir()) / f"cfp-{rev}"
    if not path.exists():
        subprocess.run(["git", "worktree", "add", "--detach", str(path), rev], cwd=ROOT,
                       check=True, capture_output=True)
        (path / "cfp" / "passes").symlink_to(path / "passes")
    return path


def run_case(tree: Path, commands: list[list[str]], cache: str
             ) -> list[tuple[str, str, str, float]]:
    """(command, pass, phase, seconds) rows; phase ``wall`` is the whole process. ``cache``:
    the JAX compilation cache directory."""
    rows = []
    env = dict(os.environ, PYTHONPATH=str(tree))
    # the line KEPT_LINE reads, which a cfp that has the flag prints only when asked
    drivers = (["--driver-lines"] if "--driver-lines" in (Path(tree) / "cfp" / "cli.py")
               .read_text() else [])
    with tempfile.TemporaryDirectory() as workdir:
        for args in commands:
            cmd = [sys.executable, "-m", "cfp", *args, "--workdir", workdir, "-v",
                   "--compilation-cache", cache] + drivers
            t0 = time.perf_counter()
            proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
            wall = time.perf_counter() - t0
            text = " ".join(args)
            if proc.returncode != 0:
                sys.exit(f"{text} failed:\n{proc.stdout[-1500:]}{proc.stderr[-1500:]}")
            rows.append((text, "process", "wall", wall))
            rows += pass_rows(text, proc.stdout)
    return rows


def pass_rows(command: str, out: str) -> list[tuple[str, str, str, float]]:
    rows, step_ms = [], None
    for line in out.splitlines():
        if m := ANALYSIS_LINE.match(line.strip()):
            rows.append((command, "analysis", "total", float(m.group(1))))
        elif m := PASS_LINE.match(line.strip()):
            name = m.group(1).split()[0]
            rows.append((command, name, "total", float(m.group(2))))
            for part in m.group(3).split(", "):
                if p := re.match(r"(.+) ([\d.]+)$", part):
                    rows.append((command, name, p.group(1), float(p.group(2))))
        elif m := STEP_LINE.match(line.strip()):
            step_ms = float(m.group(1))
        elif (m := KEPT_LINE.match(line.strip())) and step_ms is not None:
            rows.append((command, "plan", f"measured step (s) of {m.group(1)}: {m.group(2)}",
                         step_ms / 1e3))
        elif m := PREDICTED_LINE.match(line.strip()):
            rows.append((command, "plan", "predicted (s, not a time taken)",
                         float(m.group(1)) / 1e3))
        elif m := STAGES_LINE.search(line):
            dp, pricing, total, tracing = m.groups()
            rows += [(command, "stages", "total", float(total)),
                     (command, "stages", "per-submesh analysis, profile and solves",
                      float(pricing)), (command, "stages", "stage DP", float(dp))]
            if tracing:
                rows.append((command, "stages", "tracing", float(tracing)))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="path without extension")
    ap.add_argument("--before", help="a git revision to run first, from a worktree")
    ap.add_argument("--cases", nargs="*", default=list(CASES), help=f"of: {list(CASES)}")
    ap.add_argument("--before-cases", nargs="*", help="the cases --before runs (default all)")
    args = ap.parse_args()
    versions = ([("before", worktree(args.before))] if args.before else []) + [("after", ROOT)]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    caches = {}  # (version, case) -> compilation cache: empty, but the warm job's
    for case in args.cases:
        for version, tree in versions:
            if version == "before" and args.before_cases is not None \
                    and case not in args.before_cases:
                continue
            key = (version, case.replace("warm", "cold"))
            cache = caches.setdefault(key, tempfile.mkdtemp(prefix="cfp-planning-cache-"))
            for command, name, phase, seconds in run_case(tree, CASES[case], cache):
                rows.append({"version": version, "case": case, "command": command,
                             "pass": name, "phase": phase,
                             "seconds": float(f"{seconds:.4g}")})
                if phase in ("wall", "total"):
                    print(f"{version:6} {case:42} {name:8} {phase:6} {seconds:8.1f} s",
                          flush=True)
            with open(out.with_suffix(".csv"), "w", newline="") as f:  # after every case
                w = csv.DictWriter(f, fieldnames=list(rows[0]))
                w.writeheader()
                w.writerows(rows)
    plot(rows, out.with_suffix(".png"))
    print(f"wrote {out.with_suffix('.csv')} and {out.with_suffix('.png')}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 0.7 + 0.6 * len(cases)))
    for k, version in enumerate(("before", "after")):
        wall = [sum(r["seconds"] for r in rows if r["case"] == c and r["version"] == version
                    and r["phase"] == "wall") for c in cases]
        ax.barh([i + 0.4 * k for i in range(len(cases))], wall, height=0.4, label=version)
    ax.set_yticks([i + 0.2 for i in range(len(cases))], cases)
    ax.invert_yaxis()
    ax.set_xlabel("wall seconds, all the case's commands (2-core CPU machine)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
