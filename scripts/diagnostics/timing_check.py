"""How much a window's measured times move between timing passes: timed one program after
another (each to convergence, as the profile used to), or in interleaved rounds (each round
runs every program once, as the profile does now).

For one window type of a profiled work dir: compiles every combination (in two threads, as
the profile's worker does), then times the batch four times, alternating: in sequence, in
rounds, in sequence, in rounds. Prints the median per combination (ms), what the work dir's
profile recorded, and per way of timing how far its two passes differ (per combination,
relative to their mean) and how long a pass took.

    python scripts/diagnostics/timing_check.py profiles/bench-gpt-tiny-s128-h256-nh8-8 3
"""
from __future__ import annotations

import argparse
import itertools
import os
import pickle
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
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
    from cfp.measure import WindowProgram, time_rounds, time_runs, valid_inputs
    from cfp.workloads import make_mesh, trace_step
    window = profile.windows[profile.representatives[a.window_type]]
    wp = WindowProgram(trace_step(analysis.spec.build()), analysis, window,
                       make_mesh(analysis.mesh_shape))
    host = valid_inputs(wp.graph, wp.sub, seed=window.type)
    combos = list(itertools.product(*map(range, profile.window_profiles[a.window_type].space)))
    with ThreadPoolExecutor(2) as pool:
        compiled = [(c, f.result()) for c, f in [(c, pool.submit(wp.compile, c)) for c in combos]]

    placed = [[jax.device_put(x, s) for x, s in zip(host, sh)] for _, (_, sh) in compiled]
    programs = [(exe, args) for (_, (exe, _)), args in zip(compiled, placed)]

    def in_sequence() -> list[float]:
        return [statistics.median(time_runs(fn, args, best_s=None)[0]) * 1e3
                for fn, args in programs]

    def in_rounds() -> list[float]:
        return [statistics.median(t) * 1e3 for t, _ in time_rounds(programs, best_s=None)[0]]

    passes, wall_s = {}, {}
    for name, timer in (("sequence 1", in_sequence), ("rounds 1", in_rounds),
                        ("sequence 2", in_sequence), ("rounds 2", in_rounds)):
        t0 = time.perf_counter()
        passes[name] = timer()
        wall_s[name] = time.perf_counter() - t0
    print(f"{a.workdir}, window type {a.window_type}, {jax.devices()[0].platform} "
          f"x{len(jax.devices())}: median ms per combination")
    print("| combination | " + " | ".join(passes) + " | in the profile |")
    print("|---" * (len(passes) + 2) + "|")
    for i, c in enumerate(combos):
        recorded = profile.window_profiles[a.window_type].results[c].time_s * 1e3
        print(f"| {list(c)} | " + " | ".join(f"{p[i]:.1f}" for p in passes.values())
              + f" | {recorded:.1f} |")
    print("\n| timed | pass-to-pass difference, median | max | seconds per pass |")
    print("|---|---|---|---|")
    for way in ("sequence", "rounds"):
        one, two = passes[f"{way} 1"], passes[f"{way} 2"]
        diff = [abs(x - y) / ((x + y) / 2) for x, y in zip(one, two)]
        print(f"| in {way} | {statistics.median(diff):.0%} | {max(diff):.0%} | "
              f"{(wall_s[f'{way} 1'] + wall_s[f'{way} 2']) / 2:.1f} |")


if __name__ == "__main__":
    from cfp.host_memory import run_pooled
    run_pooled()  # timing measures programs, not the host allocator
    main()
