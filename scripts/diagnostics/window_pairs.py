"""The windows where two plans differ, timed again side by side in one batch.

A profile times a window type's combinations in batches, minutes apart, and puts the batches
on one scale by the speed anchor (Profile, *Measurement*). For a finished
``scripts/benchmark.py`` row, this takes the windows where ``cfp_own``'s pick and the fastest
baseline search ran differ (``bench_predictions.py`` lists them), and times each window's two
combinations again in one batch of the profile's own worker, in the same rounds. It prints
the profile's times and the paired ones: if the pair's ratio differs from the profile's, the
profile's batches, not the windows, decided which plan the composition ranks ahead.

Then, for each of the two plans and the cost model's top plan (``benchmark.analytic_plans``),
its whole step and every one of its window instances,
compiled here and each timed back to back (``step_vs_windows.py``'s way), with the
collectives of the step and of its windows counted by kind: where a step runs faster than
its windows add up to, this shows which collectives the whole program merged.

    python scripts/diagnostics/window_pairs.py --model gpt --config tiny --num-layers 2 --num-heads 8 \
      --hidden-size 256 --seq-len 128 --memory-budget 2 --mesh 8 --max-combinations 32 \
      --out scripts/results/compute-bound
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # scripts/
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_predictions import compared_plans  # noqa: E402
from benchmark import analytic_plans, budget_bytes, parse_args, start  # noqa: E402
from step_vs_windows import _costs, _run, windows_back_to_back  # noqa: E402


def main(argv=None) -> None:
    a = parse_args(argv)
    mesh_shape, backend, label, workdir, spec, run_fp, analysis, _ = start(a, ("analysis",))
    from cfp.workdir import WorkDir
    from cfp.worker import Worker, WorkerOptions
    profile = WorkDir(workdir, run_fp).read_profile(analysis, "measure", a.max_combinations,
                                                    a.whole_segments)
    budget = budget_bytes(a)
    _, (mine, _), base = compared_plans(workdir, run_fp, budget)
    other = base.source.split()[-1]
    worker = Worker(analysis, WorkerOptions("measure", budget or 2**40, 16))
    print(f"{label} mesh {a.mesh} ({backend}): windows where cfp_own's pick and {other} "
          f"differ, ms (paired: both in one batch, raw, not rescaled)")
    print(f"{'window':<10}{'blocks':<10}{'profile cfp_own':>16}{other:>10}{'ratio':>8}"
          f"{'paired cfp_own':>16}{other:>10}{'ratio':>8}")
    seen = set()
    try:
        for w in profile.windows:
            pair = [tuple(plan[b] for b in range(w.start, w.end))
                    for plan in (mine, base.strategies)]
            if pair[0] == pair[1] or (w.type, *pair) in seen:
                continue
            seen.add((w.type, *pair))
            results = profile.window_profiles[w.type].results
            if any(c not in results or results[c].status != "ok" for c in pair):
                continue
            was = [results[c].time_s * 1e3 for c in pair]
            now = dict(worker.measure_window(w, pair, None))
            if any(now[c].status != "ok" for c in pair):
                print(f"{w.type:<10}{f'{w.start}..{w.end - 1}':<10} not ok when paired")
                continue
            paired = [now[c].time_s * 1e3 for c in pair]
            print(f"{w.type:<10}{f'{w.start}..{w.end - 1}':<10}{was[0]:>16.2f}{was[1]:>10.2f}"
                  f"{was[0] / was[1]:>8.3f}{paired[0]:>16.2f}{paired[1]:>10.2f}"
                  f"{paired[0] / paired[1]:>8.3f}")
    finally:
        worker.close()
    steps_against_windows(analysis, profile, mesh_shape, {
        "cfp_own": mine, other: base.strategies,
        "cost model top 1": analytic_plans(a, workdir, analysis, run_fp, 1)[0]})


def steps_against_windows(analysis, profile, mesh_shape, plans: dict) -> None:
    """Per plan (name -> block strategies; the first is the reference): the blocks where it
    differs from the first, its step and its windows' sum (and each window), each timed back
    to back (ms), their CPU seconds per run and XLA's flops and bytes accessed (the windows'
    summed), and their collectives by kind."""
    import collections
    from cfp.execute import PlannedStep, real_inputs
    from cfp.sharding import collectives
    from cfp.workloads import make_mesh, trace_step
    mesh = make_mesh(mesh_shape)
    workload = analysis.spec.build()
    program, host = trace_step(workload), real_inputs(workload)

    def kinds(compiled) -> collections.Counter:
        return collections.Counter(c.kind for c in collectives(compiled.as_text(), mesh_shape))

    blocks = analysis.blocks.blocks
    first_name, first = next(iter(plans.items()))
    for name, strategies in list(plans.items())[1:]:
        print(f"{name} against {first_name}, blocks that differ: " + "; ".join(
            f"{b}: {blocks[b].strategies[x].name} against {blocks[b].strategies[y].name}"
            for b, (x, y) in enumerate(zip(strategies, first)) if x != y))
    print("whole steps against their windows, each timed back to back, ms; collectives by kind")
    for name, strategies in plans.items():
        step = PlannedStep(program, analysis, list(strategies), mesh, donate=False)
        step.compile()
        step_s, step_cpu_s, _ = _run(step.compiled, step.place(host), 10)
        step_flops, step_bytes = _costs(step.compiled)
        windows = dict.fromkeys(("s", "cpu_s", "flops", "bytes"), 0.0)
        windows_kinds, each_ms = collections.Counter(), []
        for exe, (wall, cpu, _) in windows_back_to_back(program, analysis, profile.windows, mesh,
                                                        strategies, 10):
            flops, nbytes = _costs(exe)
            for key, value in (("s", wall), ("cpu_s", cpu), ("flops", flops), ("bytes", nbytes)):
                windows[key] += value
            windows_kinds += kinds(exe)
            each_ms.append(f"{1e3 * wall:.1f}")
        print(f"{name}: step {1e3 * step_s:.1f}, its {len(profile.windows)} windows "
              f"{1e3 * windows['s']:.1f} ({' + '.join(each_ms)}); CPU s per run {step_cpu_s:.3f} and "
              f"{windows['cpu_s']:.3f}; GFLOP {step_flops / 1e9:.2f} and "
              f"{windows['flops'] / 1e9:.2f}; GB accessed {step_bytes / 1e9:.3f} and "
              f"{windows['bytes'] / 1e9:.3f}; collectives in the step "
              f"{dict(kinds(step.compiled))}, in the windows {dict(windows_kinds)}", flush=True)


if __name__ == "__main__":
    from cfp.host_memory import run_pooled
    run_pooled()  # timing measures programs, not the host allocator
    main()
