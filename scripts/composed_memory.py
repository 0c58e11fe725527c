"""Composed memory of the hand plans against their compiled peaks (the state donated).

For one workload and mesh, each rule-file baseline whose blocks are all on strategies the
analysis kept (``dp``, ``megatron``, ...; not the state-splitting ones, which cfp's own plans
cannot express yet) is composed as search composes a plan: its windows (split as the profile
splits them) are compiled one by one, donating what they update, and their memory terms add up
(``cfp.windows.option_memory``, ``cfp.solver.evaluate``). The whole step is compiled under the
same plan, and the two peaks are printed side by side. Nothing is timed.

    python scripts/composed_memory.py --model gpt --mesh 8 --num-layers 2 --num-heads 8 \
        --hidden-size 256 --seq-len 128 --batch-size 8 --max-combinations 32
"""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from benchmark import workload_parser  # noqa: E402


def main(argv=None) -> None:
    a = workload_parser(__doc__, model="gpt", rounds=1, min_seconds=0.0,
                        max_combinations=32).parse_args(argv)
    mesh_shape = tuple(int(x) for x in a.mesh.split("x"))
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count="
                               f"{math.prod(mesh_shape)}").strip()
    from cfp.baselines import baseline_strategy_indices
    from cfp.execute import PlannedStep
    from cfp.measure import Measurement, WindowProgram, memory_of
    from cfp.passes.analysis import run_analysis
    from cfp.solver import Group, Option, Problem, evaluate
    from cfp.windows import (held_for_backward, inputs_read_earlier, memory_terms,
                             option_memory, split_windows)
    from cfp.workloads import WorkloadSpec, make_mesh, trace_step
    spec = WorkloadSpec(a.model, a.config, a.batch_size, a.dtype, tuple(
        (k, getattr(a, k)) for k in ("num_layers", "seq_len", "hidden_size", "num_heads",
                                     "vocab_size", "num_experts") if getattr(a, k) is not None)
                        ).resolved()
    analysis = run_analysis(spec, mesh_shape)
    program, mesh = trace_step(spec.build()), make_mesh(mesh_shape)
    windows, _ = split_windows(analysis, a.max_combinations, a.whole_segments)
    held = held_for_backward(analysis.graph)
    earlier = inputs_read_earlier(analysis, windows)
    blocks = analysis.blocks.blocks
    print(f"{spec.label} mesh {a.mesh}: composed from {len(windows)} windows against the whole "
          f"step compiled, MiB per device, the state donated")
    for name, idx in baseline_strategy_indices(analysis).items():
        if None in idx:
            continue
        groups = []
        for k, w in enumerate(windows):
            combo = tuple(idx[b] for b in range(w.start, w.end))
            exe, _ = WindowProgram(program, analysis, w, mesh).compile(combo)
            terms = memory_terms(analysis, w, earlier[k], held)
            mem, transient, held_bytes = option_memory(
                analysis, w, combo, Measurement("ok", **memory_of(exe)), mesh.axis_names,
                terms=terms)
            groups.append(Group(tuple(range(w.start, w.end)),
                                [Option(combo, 0, mem, transient, held_bytes)]))
        composed = evaluate(Problem(groups, [len(b.strategies) for b in blocks]),
                            [0] * len(groups))[1]
        step = PlannedStep(program, analysis, idx, mesh)
        peak = memory_of(step.compile())["peak_bytes"]
        print(f"{name:10} composed {composed / 2**20:7.2f}  compiled {peak / 2**20:7.2f}  "
              f"error {composed / peak - 1:+.1%}", flush=True)


if __name__ == "__main__":
    main()
