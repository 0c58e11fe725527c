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
compiled peak with their live ranges in XLA's schedule (from XLA's dump): what
the step holds that its windows, compiled alone, free at their end.

``--search WORKDIR...`` instead lists, for every candidate search ran end to end in those
work dirs, its composed memory and time against its compiled peak and measured median.
"""
from __future__ import annotations

import glob
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

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
            _print_peak(dump, a.peak_top)
            shutil.rmtree(dump)
    print(f"median absolute error {statistics.median(errors):.1%} over {len(errors)} "
          f"plans")


def _print_peak(dump: str, top: int) -> None:
    """The largest temporaries live at the peak of the heap XLA simulated, from its dump."""
    assignment = open(glob.glob(f"{dump}/*after_optimizations-buffer-assignment.txt")[0]).read()
    live_range = open(glob.glob(f"{dump}/*after_optimizations-live-range.txt")[0]).read()
    hlo = open(glob.glob(f"{dump}/*after_optimizations.txt")[0]).read()
    size, shape, in_output, in_parameter, live_out = {}, {}, set(), False, False
    for line in assignment.splitlines():
        if line.startswith("allocation"):
            in_parameter, live_out = "parameter" in line, "maybe-live-out" in line
        m = re.match(r"\s*value: <\d+ (\S+) @0> \(size=(\d+)[^)]*\): (\S+)", line)
        if m and not in_parameter:
            size[m.group(1)] = int(m.group(2))
            shape[m.group(1)] = m.group(3)
            if live_out:
                in_output.add(m.group(1))
    # A tuple element's buffer is named with its index (an async collective's result on GPU).
    ranges = [(name, int(s), int(e)) for name, s, e in (
        (n if i == "{}" else n + i, s, e) for n, i, s, e in re.findall(
            r"^\s+(\S+?)(\{[\d,]*\}):(\d+)-(\d+)", live_range.split("BufferLiveRange:")[1], re.M))
        if name in size]
    end = max(e for _, _, e in ranges)
    # A value in an output's buffer that dies before the step ends is a temporary placed there
    # before the output is written.
    placed = [(n, s, e) for n, s, e in ranges if n in in_output and e < end]
    placed_names = {n for n, _, _ in placed}
    at_once = [sum(size[n] for n, s, e in placed if s <= t <= e) for t in range(end + 1)]
    t_most = max(range(end + 1), key=at_once.__getitem__)
    print(f"  temporaries placed in step outputs' buffers before the outputs are written: "
          f"{len(placed)}, at most {at_once[t_most] / 1e6:.1f} MB live at once (instruction "
          f"{t_most} of {end})")
    live = [sum(size[n] for n, s, e in ranges if s <= t <= e) for t in range(end + 1)]
    t_peak = max(range(end + 1), key=live.__getitem__)
    print(f"  at the compiled peak (instruction {t_peak} of {end}): {live[t_peak] / 1e6:.1f} MB "
          f"live in non-parameter buffers (step outputs included); the largest:")
    for name, s, e in sorted((r for r in ranges if r[1] <= t_peak <= r[2]),
                             key=lambda r: -size[r[0]])[:top]:
        m = re.search(r"\n\s*(?:ROOT )?%?" + re.escape(name.split("{")[0]) + r" = (\S+)([^\n]*)",
                      hlo)
        op = re.search(r'op_name="([^"]*)"', m.group(2)) if m else None
        op = op.group(1) if op else ""
        where = " [in an output's buffer]" if name in placed_names else ""
        print(f"    {size[name] / 1e6:5.2f} MB {name} {shape[name]} live {s}-{e} ({op}){where}")


if __name__ == "__main__":
    main()
