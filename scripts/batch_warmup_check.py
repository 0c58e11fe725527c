"""How much a window's measured time moves between timing passes, and whether warming a whole
batch up before timing it helps.

For one window type of a profiled work dir: compiles every combination (in two threads, as
the profile's worker does), then times each in order three times over: ``cold`` right after
compiling, each program with one warm-up run of its own (as the profile does); ``warm`` after
every program of the batch has run once; and ``again``, the same a second time. Prints the
median per combination (ms) and what the work dir's profile recorded.

    python scripts/batch_warmup_check.py profiles/bench-gpt-tiny-s128-h256-nh8-8 3
"""
from __future__ import annotations

import argparse
import itertools
import os
import pickle
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _record(path: Path):
    with open(path, "rb") as f:
        pickle.load(f)  # the header
        return pickle.load(f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("workdir")
    ap.add_argument("window_type", type=int)
    a = ap.parse_args()
    analysis = _record(Path(a.workdir) / "analysis.pkl")
    profile = _record(Path(a.workdir) / "profile.pkl")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                               f"device_count={len(analysis.mesh_shape) and 8}").strip()
    import jax
    from cfp.measure import WindowProgram, time_runs, valid_inputs
    from cfp.workloads import make_mesh, trace_step
    window = profile.windows[profile.representatives[a.window_type]]
    wp = WindowProgram(trace_step(analysis.spec.build()), analysis, window,
                       make_mesh(analysis.mesh_shape))
    host = valid_inputs(wp.graph, wp.sub, seed=window.type)
    combos = list(itertools.product(*map(range, profile.window_profiles[a.window_type].space)))
    with ThreadPoolExecutor(2) as pool:
        compiled = [(c, f.result()) for c, f in [(c, pool.submit(wp.compile, c)) for c in combos]]

    def timed(warm_batch: bool) -> list[float]:
        placed = [[jax.device_put(x, s) for x, s in zip(host, sh)] for _, (_, sh) in compiled]
        if warm_batch:
            for (_, (exe, _)), args in zip(compiled, placed):
                jax.block_until_ready(exe(*args))
        return [statistics.median(time_runs(exe, args, best_s=None)[0]) * 1e3
                for (_, (exe, _)), args in zip(compiled, placed)]

    cold, warm, again = timed(False), timed(True), timed(True)
    print(f"{a.workdir}, window type {a.window_type}, {jax.devices()[0].platform} "
          f"x{len(jax.devices())}: median ms per combination")
    print("| combination | cold | warm | again | in the profile |\n|---|---|---|---|---|")
    for i, c in enumerate(combos):
        recorded = profile.window_profiles[a.window_type].results[c].time_s * 1e3
        print(f"| {list(c)} | {cold[i]:.1f} | {warm[i]:.1f} | {again[i]:.1f} | {recorded:.1f} |")
    print(f"| median over the batch | {statistics.median(cold):.1f} | "
          f"{statistics.median(warm):.1f} | {statistics.median(again):.1f} | |")


if __name__ == "__main__":
    main()
