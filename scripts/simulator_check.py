"""How far to trust a plan for hardware you do not have: the analytic model (what ``--cluster``
uses where it cannot compile) against measured steps on the devices here.

For a workload and mesh: alpha, beta and the roofline are fitted on these devices
(``fit_cost_model``), every window combination and resharding is priced analytically
(``cost="analytic"``), random whole-model plans are drawn, each is predicted from those prices
and then compiled and run on the mesh, interleaved over rounds. Reports the rank correlation
(Spearman) of predicted against measured step time and the ordering accuracy on the pairs
whose measured times differ by more than 10%.

    python scripts/simulator_check.py --model gpt --num-layers 4 --mesh 8 --plans 20

Appends to ``scripts/results/<date>-simulator-<backend>.csv`` and writes a PNG.
"""
from __future__ import annotations

import datetime
import math
import os
import statistics
from pathlib import Path

from composition_check import _plot, plan_arguments, random_plan_steps

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = plan_arguments()
    args = ap.parse_args()
    mesh_shape = tuple(int(x) for x in args.mesh.split("x"))
    os.environ.setdefault("XLA_FLAGS",
                          f"--xla_force_host_platform_device_count={math.prod(mesh_shape)}")
    import jax
    from cfp.measure import fit_cost_model
    from cfp.passes.analysis import run_analysis
    from cfp.passes.profile import ProfileOptions, run_profile
    from cfp.passes.search import SCALE, build_problem
    from cfp.workloads import WorkloadSpec, make_mesh

    spec = WorkloadSpec(args.model, "tiny", None, "float32",
                        (("num_layers", args.num_layers),)).resolved()
    analysis = run_analysis(spec, mesh_shape)
    mesh = make_mesh(mesh_shape)
    cost = fit_cost_model(mesh)
    profile = run_profile(analysis, ProfileOptions(cost="analytic", cost_model=cost))
    problem, _ = build_problem(analysis, profile, None)
    steps, times, _ = random_plan_steps(analysis, problem, mesh, args)
    for ps in steps:
        ps.predicted_s = ps.cost / SCALE
    rows = [(ps.predicted_s, statistics.median(t)) for ps, t in zip(steps, times)]
    rho = _spearman([r[0] for r in rows], [r[1] for r in rows])
    apart = [(a, b) for a in rows for b in rows
             if a is not b and a[1] < b[1] and b[1] / a[1] > 1.1]
    accuracy = sum(a[0] < b[0] for a, b in apart) / len(apart) if apart else float("nan")
    backend = jax.devices()[0].platform
    out = ROOT / "scripts" / "results" / f"{datetime.date.today()}-simulator-{backend}.csv"
    new = not out.exists()
    with open(out, "a") as f:
        if new:
            f.write("workload,mesh,backend,devices,plan,predicted_s,measured_s\n")
        for i, (pred, meas) in enumerate(rows):
            f.write(f"{args.model}-L{args.num_layers},{args.mesh},{backend},"
                    f"{math.prod(mesh_shape)},{i},{pred:.6g},{meas:.6g}\n")
    print(f"{args.model}-L{args.num_layers} mesh {args.mesh} ({backend}): {len(rows)} random "
          f"plans, analytic model fitted here (alpha {cost.alpha}, beta {cost.beta}, "
          f"{cost.device_flops:.3g} FLOP/s): Spearman {rho:.2f}, ordering accuracy "
          f"{100 * accuracy:.0f}% on {len(apart)} pairs over 10% apart; "
          f"rows appended to {out.relative_to(ROOT)}")
    _plot(rows, out.with_name(f"{out.stem}-{args.model}-L{args.num_layers}-{args.mesh}.png"),
          args, "predicted step s (analytic, fitted here)")


def _spearman(x, y) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=v.__getitem__)
        r = [0.0] * len(v)
        for rank, i in enumerate(order):
            r[i] = float(rank)
        return r
    rx, ry = ranks(x), ranks(y)
    mx, my = statistics.mean(rx), statistics.mean(ry)
    num = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    den = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return num / den if den else float("nan")


if __name__ == "__main__":
    from cfp.host_memory import run_pooled
    run_pooled()  # timing measures programs, not the host allocator
    main()
