"""Does the profile tell when the machine is busy? Each batch of combinations is marked with
the share of the machine's CPU time that other processes took while it was timed
(``measure.CpuShare``); over ``BUSY_SHARE`` the profile warns. This times a window-like program
(a matmul whose contraction is split over the mesh, then all-reduced) beside 0, 1 and 2 other
processes, each JAX on 8 virtual devices running that matmul in a loop (two cfp runs at once,
say), in interleaved rounds, and reports the share ``CpuShare`` saw and the slowdown.

    python scripts/diagnostics/busy_machine.py      # about a minute

Writes ``scripts/results/<date>-busy-machine-<backend>.txt``.
"""
from __future__ import annotations

import datetime
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")


def matmul_program():
    """A jitted sharded matmul and its arguments on 8 devices."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    from cfp.workloads import make_mesh
    mesh = make_mesh((8,))
    x = jax.device_put(np.ones((512, 2048), np.float32), NamedSharding(mesh, P(None, "m0")))
    w = jax.device_put(np.ones((2048, 1024), np.float32), NamedSharding(mesh, P("m0", None)))
    return jax.jit(lambda a, b: a @ b, out_shardings=NamedSharding(mesh, P())), (x, w)


def main() -> None:
    import jax
    from cfp.measure import BUSY_SHARE, CpuShare, time_runs
    fn, args = matmul_program()
    rows = {n: ([], []) for n in (0, 1, 2)}
    for _ in range(3):
        for n, (shares, times) in rows.items():
            others = [subprocess.Popen([sys.executable, __file__, "--contend"])
                      for _ in range(n)]
            time.sleep(8 if n else 0)  # until they have compiled and run
            try:
                cpu = CpuShare().start()
                times.append(statistics.median(
                    time_runs(fn, args, best_s=None, min_runs=20, max_runs=20)[0]))
                shares.append(cpu.share()[0])
            finally:
                for p in others:
                    p.kill()
                    p.wait()
                time.sleep(1)  # their exit is not the next round's load
    idle_s = statistics.median(rows[0][1])
    lines = [f"# {len(os.sched_getaffinity(0))} cores; jax {jax.__version__}; backend "
             f"{jax.devices()[0].platform}, 8 devices; 3 interleaved rounds of 20 runs, medians",
             f"# python scripts/diagnostics/busy_machine.py; BUSY_SHARE = {BUSY_SHARE}",
             "other JAX processes | others' share of the cores (each round) | matmul ms | "
             "x idle | marked busy"]
    for n, (shares, times) in rows.items():
        run_s = statistics.median(times)
        lines.append(f"{n} | {', '.join(f'{s:.2f}' for s in shares)} | {run_s * 1e3:.2f} | "
                     f"{run_s / idle_s:.2f} | {statistics.median(shares) > BUSY_SHARE}")
    out = (ROOT / "scripts" / "results"
           / f"{datetime.date.today().isoformat()}-busy-machine-{jax.devices()[0].platform}.txt")
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"wrote {out}")


def contend() -> None:
    """Run the matmul forever (``main`` kills it)."""
    import jax
    fn, args = matmul_program()
    while True:
        jax.block_until_ready(fn(*args))


if __name__ == "__main__":
    contend() if sys.argv[1:] == ["--contend"] else main()
