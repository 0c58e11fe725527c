"""Where the whole step and its windows, timed alone, part ways.

The composition check (``composition_check.py``) compares a plan's step with the sum of its
window times and boundary reshardings. This script takes the same random plans (same seed,
same profile) and, per plan, compiles the step and every window instance at the plan's
combination, and measures both sides the same ways:

- wall seconds per run (the step back to back, as the composition check times it; each
  window back to back, as the profile times it; ``windows_s`` is their sum, timed here, and
  ``reshards_s`` the profile's price of the plan's reshardings);
- CPU seconds per run of the whole process (user plus system): work, as against waiting;
  and the system part alone (page faults: ``cfp/host_memory.py``);
- bytes accessed and flops, from XLA's cost analysis of the compiled programs;
- collectives in the compiled programs;
- and from the plan: its reshardings between windows and its blocks whose strategy
  all-reduces a forward result (``(allreduce`` in the strategy's name).

It ends with the correlation over plans of the gap (measured step minus composed prediction)
with each of these.

    python scripts/composition_check.py --model gpt --num-layers 2 --hidden-size 256 \\
        --seq-len 128 --num-heads 8 --mesh 8          # profiles, and the plans' gaps
    python scripts/diagnostics/step_vs_windows.py --model gpt --num-layers 2 --hidden-size 256 \\
        --seq-len 128 --num-heads 8 --mesh 8

``--heap-as-is`` runs without the pooled host allocator settings (``cfp.host_memory``), as
every process timed before they existed.

Writes ``scripts/results/<date>-step-vs-windows-<backend>.csv`` (appending; column ``heap``).
"""
from __future__ import annotations

import datetime
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

COLUMNS = ("step_s", "composed_s", "windows_s", "reshards_s", "step_cpu_s", "windows_cpu_s",
           "step_system_s", "windows_system_s", "step_bytes", "windows_bytes", "step_flops",
           "windows_flops", "step_collectives", "windows_collectives", "reshardings",
           "allreduce_blocks")


def main() -> None:
    from composition_check import plan_arguments, plan_setup
    ap = plan_arguments()
    ap.add_argument("--heap-as-is", action="store_true",
                    help="time without the pooled host allocator settings")
    args = ap.parse_args()
    mesh_shape, label, workdir = plan_setup(args)
    import jax
    import numpy as np
    from composition_check import random_plans
    from cfp.execute import PlannedStep, real_inputs
    from cfp.passes.search import SCALE, build_problem
    from cfp.records import read_record
    from cfp.solver import evaluate
    from cfp.workdir import ANALYSIS_FORMAT, WorkDir
    from cfp.workloads import make_mesh, run_fingerprint, trace_step

    if not (workdir / "profile.pkl").exists():
        sys.exit(f"no profile in {workdir}: run scripts/composition_check.py with these flags")
    analysis = read_record(workdir / "analysis.pkl", ANALYSIS_FORMAT, None, hint="")
    profile = WorkDir(workdir, run_fingerprint(analysis.spec, mesh_shape)).read_profile(
        analysis, "measure", args.max_combinations, args.whole_segments)
    problem, _ = build_problem(analysis, profile, None)
    mesh = make_mesh(mesh_shape)
    workload = analysis.spec.build()
    program, host = trace_step(workload), real_inputs(workload)
    names = mesh.axis_names
    rows = []
    for choices in random_plans(problem, args.plans, args.seed):
        cost, _, strategies = evaluate(problem, choices)
        profiled_s = sum(g.options[c].cost for g, c in zip(problem.groups, choices)) / SCALE
        step = PlannedStep(program, analysis, strategies, mesh, donate=False)
        step.compile()
        step_args = step.place(host)
        row = dict(composed_s=cost / SCALE + profile.launch_overhead_s,
                   reshards_s=cost / SCALE - profiled_s,
                   reshardings=_reshardings(analysis, profile, strategies, names),
                   allreduce_blocks=sum("(allreduce" in b.strategies[s].name for b, s in
                                        zip(analysis.blocks.blocks, strategies)))
        row["step_s"], row["step_cpu_s"], row["step_system_s"] = _run(step.compiled, step_args,
                                                                      args.iters)
        row["step_flops"], row["step_bytes"] = _costs(step.compiled)
        row["step_collectives"] = _collectives(step.compiled, mesh_shape)
        totals = dict.fromkeys(("s", "cpu_s", "system_s", "flops", "bytes", "collectives"), 0.0)
        for exe, (wall, cpu, system) in windows_back_to_back(program, analysis, profile.windows,
                                                             mesh, strategies, args.iters):
            flops, nbytes = _costs(exe)
            for key, value in (("s", wall), ("cpu_s", cpu), ("system_s", system),
                               ("flops", flops),
                               ("bytes", nbytes),
                               ("collectives", _collectives(exe, mesh_shape))):
                totals[key] += value
        row.update({f"windows_{k}": v for k, v in totals.items()})
        rows.append(row)
        print(f"plan {len(rows) - 1}: step {row['step_s'] * 1e3:.1f} ms (composed "
              f"{row['composed_s'] * 1e3:.1f}), windows alone {row['windows_s'] * 1e3:.1f} ms; "
              f"CPU s per run step {row['step_cpu_s']:.3f}, windows {row['windows_cpu_s']:.3f} "
              f"(system {row['step_system_s']:.3f}, {row['windows_system_s']:.3f}); "
              f"MB accessed {row['step_bytes'] / 2**20:.0f} vs {row['windows_bytes'] / 2**20:.0f}; "
              f"collectives {row['step_collectives']} vs {row['windows_collectives']:.0f}; "
              f"{row['reshardings']} reshardings, {row['allreduce_blocks']} all-reducing blocks",
              flush=True)
    backend = jax.devices()[0].platform
    out = ROOT / "scripts" / "results" / f"{datetime.date.today()}-step-vs-windows-{backend}.csv"
    new = not out.exists()
    heap = "as is" if args.heap_as_is else "pooled"
    with open(out, "a") as f:
        if new:
            f.write("workload,mesh,backend,heap,plan," + ",".join(COLUMNS) + "\n")
        for i, r in enumerate(rows):
            f.write(f"{label},{args.mesh},{backend},{heap},{i}," + ",".join(
                f"{r[c]:.6g}" for c in COLUMNS) + "\n")
    gap = np.array([r["step_s"] - r["composed_s"] for r in rows])
    print(f"heap {heap}: median gap (step - composed) {1e3 * float(np.median(gap)):.1f} ms; "
          f"step CPU over windows CPU (median) "
          f"{statistics.median(r['step_cpu_s'] / r['windows_cpu_s'] for r in rows):.2f}; "
          f"step bytes over windows bytes (median) "
          f"{statistics.median(r['step_bytes'] / r['windows_bytes'] for r in rows):.2f}; "
          f"system CPU s per run (median) step "
          f"{statistics.median(r['step_system_s'] for r in rows):.3f}, windows "
          f"{statistics.median(r['windows_system_s'] for r in rows):.3f}")
    for name, values in (
            ("extra CPU s (step - windows)", [r["step_cpu_s"] - r["windows_cpu_s"] for r in rows]),
            ("extra bytes", [r["step_bytes"] - r["windows_bytes"] for r in rows]),
            ("extra collectives", [r["step_collectives"] - r["windows_collectives"]
                                   for r in rows]),
            ("reshardings", [r["reshardings"] for r in rows]),
            ("all-reducing blocks", [r["allreduce_blocks"] for r in rows])):
        print(f"correlation of the gap with {name}: {np.corrcoef(values, gap)[0, 1]:+.2f}")
    print(f"rows appended to {out}")


def windows_back_to_back(program, analysis, windows, mesh, strategies, iters: int):
    """Per window instance of ``windows`` under the block ``strategies``: (its compiled
    program, ``_run``'s figures of it on valid inputs)."""
    import jax
    from cfp.measure import WindowProgram, valid_inputs
    for w in windows:
        wp = WindowProgram(program, analysis, w, mesh)
        exe, shardings = wp.compile(tuple(strategies[b] for b in range(w.start, w.end)))
        inputs = [jax.device_put(x, s) for x, s in
                  zip(valid_inputs(wp.graph, wp.sub, seed=w.type), shardings)]
        yield exe, _run(exe, inputs, iters)


def _run(compiled, args, iters: int) -> tuple[float, float, float]:
    """(median wall seconds, mean CPU seconds of the process, the system part of them) per
    run, back to back."""
    from cfp.measure import run_once_s
    run_once_s(compiled, args)
    walls = []
    before = resource.getrusage(resource.RUSAGE_SELF)
    for _ in range(iters):
        walls.append(run_once_s(compiled, args))
    after = resource.getrusage(resource.RUSAGE_SELF)
    system = after.ru_stime - before.ru_stime
    cpu = (after.ru_utime - before.ru_utime) + system
    time.sleep(0.05)  # what a run leaves behind finishes before the next program starts
    return statistics.median(walls), cpu / iters, system / iters


def _costs(compiled) -> tuple[float, float]:
    from cfp.jax_compat import cost_analysis
    c = cost_analysis(compiled)
    return float(c.get("flops", 0.0)), float(c.get("bytes accessed", 0.0))


def _collectives(compiled, mesh_shape) -> int:
    from cfp.sharding import collectives
    return len(collectives(compiled.as_text(), mesh_shape))


def _reshardings(analysis, profile, strategies, axis_names) -> int:
    """Boundaries whose tensor leaves in another layout than it is read in under the plan."""
    from cfp import dims
    blocks = analysis.blocks.blocks

    def spec(b, labels):
        return dims.spec_axes(labels, blocks[b].strategies[strategies[b]].axes, axis_names)

    return sum(spec(b.src, b.src_labels) != spec(b.dst, b.dst_labels) for b in profile.boundaries)


if __name__ == "__main__":
    if "--heap-as-is" not in sys.argv:
        from cfp.host_memory import run_pooled
        run_pooled()  # timing measures programs, not the host allocator
    main()
