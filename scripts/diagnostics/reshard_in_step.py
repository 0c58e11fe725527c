"""What a resharding costs inside a program, against the price the profile gives it.

The profile prices a resharding alone: an elementwise op writing the value, with its result
resharded, against the same op alone (``measure.time_in_context``; the program's end is a
synchronisation point either way). In a step, a resharding sits between two ops: the device
threads meet at it mid-program, and the ops around it cannot fuse across it. This script
times, per resharding A -> B of one activation-sized value, three chains of ``--ops``
elementwise ops (``a + a``, as the profile's producer):

- ``chain_a``: K ops in layout A;  ``chain_b``: K ops in layout B;
- ``chain_ab``: 2K ops alternating, each result constrained to B, then to A: K reshardings
  A -> B and K back.

in interleaved rounds, and takes the in-program price of one round trip as
``(chain_ab - chain_a - chain_b + launch) / K`` per round (median and 95% bootstrap
interval), against the profile's prices of A -> B plus B -> A.

    python scripts/diagnostics/reshard_in_step.py --mesh 8
    python scripts/diagnostics/reshard_in_step.py --mesh 2x4

An op whose cost depends on the layout (a contraction) does not fit this subtraction: in
``chain_ab`` XLA may run it in either layout, so it is left out.

Writes ``scripts/results/<date>-reshard-in-step-<backend>.csv`` (a rerun replaces the rows of
its mesh).
"""
from __future__ import annotations

import argparse
import datetime
import math
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# (mesh, A, B): specs over the value's dims (batch, sequence, hidden); mesh axes m0, m1.
CASES = {
    (8,): [(("m0", None, None), (None, "m0", None)),  # all-to-all
           (("m0", None, None), (None, None, None)),  # all-gather (back: a local slice)
           ((None, None, "m0"), ("m0", None, None))],
    (2, 4): [((("m0", "m1"), None, None), ("m0", None, "m1")),
             (("m0", None, "m1"), ("m0", "m1", None)),
             (("m0", None, None), ("m0", None, "m1"))],
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mesh", default="8")
    ap.add_argument("--ops", type=int, default=8, help="K: ops per chain")
    ap.add_argument("--shape", default="8,128,256", help="the value's shape (f32)")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    mesh_shape = tuple(int(x) for x in a.mesh.split("x"))
    shape = tuple(int(x) for x in a.shape.split(","))
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={math.prod(mesh_shape)}")
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec
    from cfp.measure import (CpuShare, launch_overhead, median_interval, run_once_s,
                             time_in_context)
    from cfp.workloads import make_mesh
    from cfp.worker import _producer_op
    from benchmark import append_rows

    mesh = make_mesh(mesh_shape)
    sharding = lambda spec: NamedSharding(mesh, PartitionSpec(*spec))  # noqa: E731
    op = _producer_op("float32")

    def chain(specs, k):
        def f(x):
            for _ in range(k):
                for spec in specs:
                    x = jax.lax.with_sharding_constraint(op(x), sharding(spec))
            return x
        return f

    def compiled(f, spec_in, x):
        s = sharding(spec_in)
        return jax.jit(f, in_shardings=s, out_shardings=s).lower(x).compile()

    x_np = np.ones(shape, np.float32) * 0.01
    launch_s = launch_overhead(mesh)
    cpu = CpuShare().start()
    rows = []
    for src, dst in CASES[mesh_shape]:
        xa, xb = jax.device_put(x_np, sharding(src)), jax.device_put(x_np, sharding(dst))
        progs = {"a": (compiled(chain([src], a.ops), src, xa), (xa,)),
                 "b": (compiled(chain([dst], a.ops), dst, xb), (xb,)),
                 "ab": (compiled(chain([dst, src], a.ops), src, xa), (xa,))}
        for fn, args in progs.values():
            for _ in range(2):
                jax.block_until_ready(fn(*args))
        times = {k: [] for k in progs}
        for r in range(a.rounds):
            for k in (list(progs) if r % 2 else list(progs)[::-1]):
                times[k].append(run_once_s(*progs[k]))
        trip = [(ab - ta - tb + launch_s) / a.ops
                for ab, ta, tb in zip(times["ab"], times["a"], times["b"])]
        low, high = median_interval(trip)
        # The profile's price, as passes/profile.py times it (its producer op, its rule).
        prices = []
        for s_from, s_to, x in ((src, dst, xa), (dst, src, xb)):
            arg = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=sharding(s_from))
            alone = jax.jit(op, in_shardings=sharding(s_from),
                            out_shardings=sharding(s_from)).lower(arg).compile()
            moved = jax.jit(op, in_shardings=sharding(s_from),
                            out_shardings=sharding(s_to)).lower(arg).compile()
            prices.append(time_in_context(alone, moved, (x,)))
        priced = sum(t for t, _, _ in prices)
        row = dict(mesh=a.mesh, ops=a.ops, shape="x".join(map(str, shape)),
                   src=str(src), dst=str(dst),
                   chain_a_ms=1e3 * statistics.median(times["a"]),
                   chain_b_ms=1e3 * statistics.median(times["b"]),
                   chain_ab_ms=1e3 * statistics.median(times["ab"]),
                   in_program_trip_ms=1e3 * statistics.median(trip),
                   in_program_low_ms=1e3 * low, in_program_high_ms=1e3 * high,
                   priced_trip_ms=1e3 * priced,
                   priced_there_ms=1e3 * prices[0][0], priced_back_ms=1e3 * prices[1][0])
        rows.append(row)
        print(f"{src} -> {dst}: chains a {row['chain_a_ms']:.2f} ms, b {row['chain_b_ms']:.2f}, "
              f"ab {row['chain_ab_ms']:.2f}; one round trip in a program "
              f"{row['in_program_trip_ms']:.3f} ms [{1e3 * low:.3f}, {1e3 * high:.3f}], "
              f"priced alone {row['priced_trip_ms']:.3f} ms "
              f"({row['priced_there_ms']:.3f} + {row['priced_back_ms']:.3f})", flush=True)
    others, stolen = cpu.share()
    print(f"launch {1e3 * launch_s:.3f} ms; while timing, other work took {others:.0%} of the "
          f"cores and the hypervisor stole {stolen:.0%}")
    backend = jax.devices()[0].platform
    out = Path(a.out) if a.out else (ROOT / "scripts" / "results" /
                                     f"{datetime.date.today().isoformat()}-reshard-in-step-{backend}.csv")
    rows = [{k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}
            | dict(backend=backend, others_cpu_share=round(others, 3),
                   stolen_cpu_share=round(stolen, 3)) for row in rows]
    append_rows(out, list(rows[0]), rows, keys=("mesh", "src", "dst"))
    print(f"rows written to {out}")


if __name__ == "__main__":
    from cfp.host_memory import run_pooled
    run_pooled()  # timing measures programs, not the host allocator
    main()
