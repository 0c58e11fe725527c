"""Composed memory of the hand plans against their compiled peaks (the state donated).

For one workload and mesh, each rule-file baseline whose blocks are all on strategies the
analysis kept (``dp``, ``megatron``, ``zero1``, ``fsdp``, ...) is composed as search composes a
plan: its windows (split as the profile splits them) are compiled one by one under its block
strategies and its state layout (a window holding state takes and returns it split as the
plan stores it), donating what they update, and their memory terms add up
(``cfp.window_memory.option_memory``, ``cfp.solver.evaluate``). The whole step is compiled under the
same plan, and the two peaks are printed side by side. Nothing is timed.

    python scripts/composed_memory.py --model gpt --mesh 8 --num-layers 2 --num-heads 8 \
        --hidden-size 256 --seq-len 128 --batch-size 8 --max-combinations 32

``--peak-top N`` also lists, per plan, the N largest temporaries live at the whole step's
compiled peak with their live ranges in XLA's schedule (``diagnostics/memory_gap.py``): what
the step holds that its windows, compiled alone, free at their end.

``--search WORKDIR...`` instead lists, for every candidate search ran end to end in those
work dirs, its composed memory and time against its compiled peak and measured median.
"""
from __future__ import annotations

import math
import os
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent / "diagnostics"))

from benchmark import workload_parser  # noqa: E402


def searched(workdirs) -> None:
    """Composed memory and time against the compiled and measured, for every candidate the
    search pass ran end to end in each work dir (``search.pkl``)."""
    from cfp.records import read_record
    from cfp.workdir import SEARCH_FORMAT
    mem_errors, time_errors = [], []
    for d in workdirs:
        rec = read_record(Path(d) / "search.pkl", SEARCH_FORMAT, None, hint="run search")
        print(f"{Path(d).name}: candidate, state, composed / compiled MiB, predicted / "
              f"measured ms")
        for c in rec.candidates:
            mem_errors.append(abs(c.composed_memory_bytes / c.compiled_peak_bytes - 1))
            time_errors.append(abs(c.predicted_s / c.median_s - 1))
            print(f"  {c.source:<34} {c.storage.describe():<30} "
                  f"{c.composed_memory_bytes / 2**20:7.2f} / {c.compiled_peak_bytes / 2**20:7.2f}"
                  f"  {c.predicted_s * 1e3:8.2f} / {c.median_s * 1e3:8.2f}")
    print(f"median absolute error over {len(mem_errors)} candidates: memory "
          f"{statistics.median(mem_errors):.1%}, time {statistics.median(time_errors):.1%}")


def main(argv=None) -> None:
    if argv is None and sys.argv[1:2] == ["--search"]:
        return searched(sys.argv[2:])
    a = workload_parser(__doc__, model="gpt", rounds=1, min_seconds=0.0,
                        max_combinations=32)
    a.add_argument("--peak-top", type=int, default=0, metavar="N")
    a = a.parse_args(argv)
    mesh_shape = tuple(int(x) for x in a.mesh.split("x"))
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count="
                               f"{math.prod(mesh_shape)}").strip()
    from cfp.baselines import baseline_strategy_indices
    from cfp.execute import PlannedStep
    from cfp.measure import WindowProgram, memory_of
    from cfp.passes.analysis import run_analysis
    from cfp.solver import Group, Option, Problem, evaluate
    from cfp.windows import inputs_read_earlier, split_windows
    from cfp.window_memory import COMBINED_REDUCTION_BYTES, held_for_backward
    from cfp.mesh import make_mesh
    from cfp.tracing import trace_step
    from cfp.workloads import WorkloadSpec
    spec = WorkloadSpec(a.model, a.config, a.batch_size, a.dtype, tuple(
        (k, getattr(a, k)) for k in ("num_layers", "seq_len", "hidden_size", "num_heads",
                                     "vocab_size", "num_experts") if getattr(a, k) is not None)
                        ).resolved()
    analysis = run_analysis(spec, mesh_shape)
    program, mesh = trace_step(spec.build()), make_mesh(mesh_shape)
    windows, _ = split_windows(analysis, a.max_combinations, a.whole_segments)
    held = held_for_backward(analysis.graph, platform=mesh.devices.flat[0].platform)
    earlier = inputs_read_earlier(analysis, windows)
    blocks = analysis.blocks.blocks
    print(f"{spec.label} mesh {a.mesh}: composed from {len(windows)} windows against the whole "
          f"step compiled, MiB per device, the state donated")
    from cfp.execute import Storage
    from cfp.sharding import STATE_LAYOUTS
    from cfp.windows import held_state
    errors = []
    for name, (idx, layout) in baseline_strategy_indices(analysis, storage=True).items():
        if None in idx:
            continue
        groups = []
        for k, w in enumerate(windows):
            combo = tuple(idx[b] for b in range(w.start, w.end))
            combo += (STATE_LAYOUTS.index(layout),) if held_state(analysis, w) else ()
            groups.append(Group(tuple(range(w.start, w.end)), [Option(
                combo, 0, *WindowProgram(program, analysis, w, mesh).option_memory(
                    combo, earlier[k], held))]))
        composed = evaluate(Problem(groups, [len(b.strategies) for b in blocks],
                                    waiting_cap=COMBINED_REDUCTION_BYTES),
                            [0] * len(groups))[1]
        step = PlannedStep(program, analysis, idx, mesh, Storage(layout))
        dump = tempfile.mkdtemp(prefix="cfp-composed-memory-") if a.peak_top else None
        peak = memory_of(step.compile({"xla_dump_to": dump} if dump else None))["peak_bytes"]
        errors.append(abs(composed / peak - 1))
        print(f"{name:10} composed {composed / 2**20:7.2f}  compiled {peak / 2**20:7.2f}  "
              f"error {composed / peak - 1:+.1%}", flush=True)
        if dump:
            from memory_gap import _print_peak
            _print_peak(dump, a.peak_top)
            shutil.rmtree(dump)
    print(f"median absolute error {statistics.median(errors):.1%} over {len(errors)} "
          f"plans")


if __name__ == "__main__":
    main()
