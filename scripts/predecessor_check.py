"""Whether a step's time depends on the program run right before it.

Times four copies of one plan (compiled separately, the same program) and one other plan,
each step waited for, in two orders: the order rotating each round, as the benchmark ran
until 2026-11-25 and as the profile's batches still run (``measure.time_rounds``), where copy
0 runs right after the other plan in every pass but each round's first; and the order
shuffled on every pass (``cfp.execute.time_interleaved``). Prints each copy's median over
copy 1's (median of per-round ratios, bootstrap 95% interval): where copy 0 alone lies above 1
in the rotating order, the program before a step slows it, and only an order that changes
the predecessor spreads that over every plan.

    python scripts/predecessor_check.py --other megatron
    python scripts/predecessor_check.py --other single_device

The workload is the compute-bound matrix's gpt on mesh `8` (its work dir, ``benchmark.py``'s;
the passes run first if it has no plan); ``--other`` names a baseline rule or
``single_device``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark import SingleDevice, bootstrap_ratio, parse_args, start  # noqa: E402

COPIES = 4


def rotating(runs, rounds: int, passes: int = 5) -> list[list[float]]:
    """The benchmark's order before 2026-11-25: one step each in turn, rotated each round."""
    from cfp.measure import run_once_s
    times = [[] for _ in runs]
    for r in range(rounds):
        steps = [[] for _ in runs]
        for _ in range(passes):
            for i in [(r + k) % len(runs) for k in range(len(runs))]:
                steps[i].append(run_once_s(runs[i], ()))
        for i, s in enumerate(steps):
            times[i].append(statistics.median(s))
    return times


def main() -> None:
    from cfp.baselines import RULES_DIR
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--other", default="megatron", choices=sorted(
        [p.stem for p in RULES_DIR.glob("*.json")] + ["single_device"]))
    ap.add_argument("--rounds", type=int, default=15)
    own = ap.parse_args()
    a = parse_args(["--model", "gpt", "--config", "tiny", "--num-layers", "2", "--num-heads",
                    "8", "--hidden-size", "256", "--seq-len", "128", "--memory-budget", "2",
                    "--mesh", "8", "--max-combinations", "32"])
    mesh_shape, backend, label, workdir, spec, run_fp, analysis, _ = start(a)
    import jax
    from cfp.baselines import baseline_plan, load_rules
    from cfp.execute import PlannedStep, real_inputs, time_interleaved
    from cfp.plan import load_plan
    from cfp.workloads import make_mesh, trace_step
    strategies = [b["strategy_index"] for b in load_plan(workdir / "plan.json")["blocks"]]
    workload, mesh = spec.build(), make_mesh(mesh_shape)
    program, host = trace_step(workload), real_inputs(workload)
    steps = [PlannedStep(program, analysis, strategies, mesh) for _ in range(COPIES)]
    if own.other == "single_device":
        steps.append(SingleDevice(workload))
    else:
        bp = baseline_plan(load_rules()[own.other], analysis)
        steps.append(PlannedStep(program, analysis, bp.strategies, mesh, bp.storage))
    runs = []
    for ps in steps:
        ps.compile()
        run = ps.loop(host)
        jax.block_until_ready(run())
        runs.append(run)
    print(f"{label} mesh {a.mesh}, {backend}: {COPIES} copies of cfp's plan and {own.other}, "
          f"{own.rounds} rounds each way")
    for order, times in (("rotating", rotating(runs, own.rounds)),
                         ("shuffled", time_interleaved(runs, rounds=own.rounds))):
        for i, t in enumerate(times):
            m, lo, hi = bootstrap_ratio(t, times[1])
            name = own.other if i == COPIES else f"copy {i}"
            print(f"{order}: {name:<14} median {1e3 * statistics.median(t):7.2f} ms, over copy 1 "
                  f"{m:.3f} [{lo:.3f}, {hi:.3f}]")


if __name__ == "__main__":
    from cfp.host_memory import run_pooled
    run_pooled()  # timing measures programs, not the host allocator
    main()
