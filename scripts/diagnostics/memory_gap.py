"""Where the composed memory of random whole-model plans departs from the compiled peak.

For the plans of ``composition_check.py`` (same flags, same seed, its profile work directory),
prints per plan the composed memory split into step inputs, step outputs, held activations and
the largest transient against the compiled program's arguments, outputs and temporaries; the
median error with each held activation sized at its producer's layout, at the largest layout
one of its readers wants, and as the composition sizes it (``windows.MemoryTerms``: the
layout a backward reader in its window wants where a forward reader there wants it too, else
the producer's; and a value the backward pass reads but the held set leaves to recomputation,
a cheap elementwise op's result, held in the layout a backward reader in its window gathers it
to, since a backward fusion cannot recompute past an all-gather). These three count a
window's transient beside the held activations of the windows up to it (the backward pass
has freed the later ones', ``solver``); the composition before counted every window's (printed
next), and before that, over the held set ``windows.held_for_backward`` made before it counted
elementwise residuals (a tanh's result, a bias add's input). Two more rules, printed last:
each held activation at the largest layout a backward reader wants; and cfp's without the
gathered residuals (the rule before 2026-11-26). Then cfp's, with
each held activation placed in a free buffer of a step output (of at least its size, or of its
size exactly), as XLA's buffer assignment reuses an output's buffer until the output is
written. A window's transient loses what its own held activations gain. Last, a
bound from the windows' own programs: every window holding its whole compiled temporaries at
once, plus the held activations that cross windows; a step above it holds more than its
windows compiled alone do (the held set, sized from the graph, can pass it). For
``--peak-plan``, the largest temporaries live at the compiled peak, read from XLA's buffer dump
(``--xla_dump_to``; the files are XLA's debug output, not a stable interface).

    python scripts/diagnostics/memory_gap.py --model gpt --num-layers 2 --hidden-size 256 --seq-len 128 \\
        --num-heads 8 --mesh 2x4 --plans 8 --peak-plan 6
"""
from __future__ import annotations

import glob
import math
import os
import re
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(Path(__file__).resolve().parent))


RULES = ("producer layout", "largest reader layout",
         "backward reader's layout where a forward reader made it, and a cheap residual that "
         "a backward reader gathers held gathered (cfp's)",
         "same, every window's beside the largest transient (as composed earlier on 2026-11-24)",
         "same, of the held set without elementwise residuals (the rule before 2026-11-24)",
         "largest layout a backward reader wants",
         "same, no residual held gathered (the rule before 2026-11-26)",
         "cfp's, each held activation in a free step-output buffer at least its size",
         "cfp's, each held activation in a free step-output buffer of its size")
PREFIX = RULES[:3] + RULES[5:]  # a window's transient beside the held activations up to it
REUSED = RULES[7:]  # XLA places temporaries in output buffers not yet written
GATHERED = RULES[2:4] + RULES[7:]  # cfp's, with the gathered residuals


def main() -> None:
    from composition_check import plan_arguments, random_plans
    ap = plan_arguments()
    ap.add_argument("--peak-plan", type=int, default=None,
                    help="list the temporaries live at this plan's compiled peak")
    ap.add_argument("--peak-top", type=int, default=12,
                    help="how many of the largest live temporaries to list")
    args = ap.parse_args()
    mesh_shape = tuple(int(x) for x in args.mesh.split("x"))
    os.environ.setdefault("XLA_FLAGS",
                          f"--xla_force_host_platform_device_count={math.prod(mesh_shape)}")
    from benchmark import workload_label
    from cfp import dims
    from cfp.execute import PlannedStep
    from cfp.jax_compat import itemsize
    from cfp.measure import memory_of
    from cfp.passes.search import build_problem
    from cfp.records import read_record
    from cfp.solver import evaluate
    from cfp.windows import (held_for_backward, inputs_read_earlier, memory_terms,
                             shard_bytes, term_sizers)
    from cfp.workdir import ANALYSIS_FORMAT, WorkDir
    from cfp.workloads import AXIS_NAMES, make_mesh, run_fingerprint, trace_step

    workdir = ROOT / "profiles" / f"{workload_label(args)}-{args.mesh}"
    analysis = read_record(workdir / "analysis.pkl", ANALYSIS_FORMAT, None,
                           hint="run scripts/composition_check.py with these flags first")
    profile = WorkDir(workdir, run_fingerprint(analysis.spec, mesh_shape)).read_profile(
        analysis, "measure", args.max_combinations, args.whole_segments)
    problem, _ = build_problem(analysis, profile, None)
    g, ba, names = analysis.graph, analysis.blocks, AXIS_NAMES[:len(mesh_shape)]
    held = held_for_backward(g, platform=profile.platform)
    member = {m.op: m for b in ba.blocks for m in b.members}
    read_earlier = inputs_read_earlier(analysis, profile.windows)
    terms = [memory_terms(analysis, w, read_earlier[k], held) for k, w in enumerate(profile.windows)]
    held_before = held_for_backward(g, elementwise_residuals=False, platform=profile.platform)
    terms_before = [memory_terms(analysis, w, read_earlier[k], held_before)
                    for k, w in enumerate(profile.windows)]
    print(f"held activations: {len(held)}; without elementwise residuals: {len(held_before)}")
    loss_op = g.values[g.outputs[-1]].producer
    plans = random_plans(problem, args.plans, args.seed)
    program, mesh = trace_step(analysis.spec.build()), make_mesh(mesh_shape)
    errors: dict[str, list[float]] = {rule: [] for rule in RULES}
    all_held, compiled_peaks = [], []
    for p, choices in enumerate(plans):
        _, composed, strategies = evaluate(problem, choices)

        def nbytes(v, block, labels):
            spec = ((None,) * len(g.values[v].shape) if block is None else dims.spec_axes(
                labels, ba.blocks[block].strategies[strategies[block]].axes, names))
            return shard_bytes(g.values[v].shape, itemsize(g.values[v].dtype), spec,
                               analysis.mesh_shape, names)

        def reader_bytes(v, late_only=False):  # v in each layout one of its readers wants
            return [nbytes(v, ba.owner[u], member[u].ins[pos]) for u in g.users.get(v, ())
                    if u in member and (u > loss_op or not late_only)
                    for pos, x in enumerate(g.ops[u].inputs) if x == v]

        split, output_sizes = {"inputs": 0, "outputs": 0}, []
        for w, t in zip(profile.windows, terms):
            for v, k, labels in t.adding:
                n = nbytes(v, None if k is None else w.start + k, labels)
                split["inputs" if g.values[v].input_index is not None else "outputs"] += n
                if g.values[v].input_index is None:
                    output_sizes.append(n)
        # Each rule sizes every held activation; a window's transient is its compiled
        # temporaries less its own held activations, so what a rule adds to the held bytes it
        # takes from that window's transient.
        peaks, held_bytes, transient = {}, {}, {}
        bound = split["inputs"] + split["outputs"]
        for rule in RULES:
            held_bytes[rule], transients, above, held_sizes = 0, [], [], []
            for k, (w, t) in enumerate(zip(profile.windows,
                                           terms_before if rule == RULES[4] else terms)):
                combo = problem.groups[k].options[choices[k]].strategies
                _, kept, gathered = term_sizers(analysis, w, combo, names)
                sizes = {}
                for term in t.held:
                    v, (pos, labels) = term[0], term[1]
                    made = nbytes(v, w.start + pos, labels)
                    sizes[v] = (made if rule == RULES[0] else max([made] + reader_bytes(v))
                                if rule == RULES[1] else max([made] + reader_bytes(v, True))
                                if rule == RULES[5] else kept(term))  # cfp's, and as cfp's
                if rule in GATHERED:
                    sizes.update((term[0], n) for term in t.gathered if (n := gathered(term)))
                internal = t.internal & sizes.keys()
                held_bytes[rule] += sum(sizes.values())
                held_sizes += sizes.values()
                temp = profile.window_profiles[w.type].results[combo].temp_bytes
                transients.append(max(0, temp - sum(sizes[v] for v in internal)))
                above.append((held_bytes[rule] if rule not in REUSED else _not_placed(
                    held_sizes, output_sizes, exact=rule == RULES[8])) + transients[-1])
                if rule == RULES[2]:  # the bound: the whole temporaries, held at once
                    bound += temp + sum(n for v, n in sizes.items() if v not in t.internal)
            transient[rule] = max(transients, default=0)
            peaks[rule] = split["inputs"] + split["outputs"] + (
                max(above, default=0) if rule in PREFIX else held_bytes[rule] + transient[rule])
        assert peaks[RULES[2]] == composed, (peaks, composed)  # the rule search composes with
        all_held.append(bound)
        step = PlannedStep(program, analysis, strategies, mesh)
        dump = tempfile.mkdtemp(prefix="cfp-memory-gap-") if p == args.peak_plan else None
        step.compile({"xla_dump_to": dump, "xla_dump_hlo_as_text": True} if dump else None)
        compiled = memory_of(step.compiled)
        compiled_peaks.append(compiled["peak_bytes"])
        for rule, peak in peaks.items():
            errors[rule].append(peak / compiled["peak_bytes"] - 1)
        mb = lambda n: f"{n / 1e6:.1f}"  # noqa: E731
        in_out = split["inputs"] + split["outputs"]
        print(f"plan {p}: compiled {mb(compiled['peak_bytes'])} MB = arguments "
              f"{mb(compiled['argument_bytes'])} + outputs {mb(compiled['output_bytes'])} + "
              f"temporaries {mb(compiled['temp_bytes'])}; composed = inputs "
              f"{mb(split['inputs'])} + outputs {mb(split['outputs'])} + held + transient, "
              + "; ".join(f"{rule}: {mb(peaks[rule])} MB = ... + {mb(held_bytes[rule])} + "
                          f"{mb(transient[rule])}" if rule not in PREFIX else
                          f"{rule}: {mb(peaks[rule])} MB = ... + {mb(peaks[rule] - in_out)} "
                          f"(of held {mb(held_bytes[rule])} and transients up to "
                          f"{mb(transient[rule])})" for rule in RULES), flush=True)
        if dump:
            _print_peak(dump, args.peak_top)
    for name, errs in errors.items():
        print(f"held activations sized at the {name}: median |memory error| "
              f"{100 * statistics.median(abs(e) for e in errs):.1f}% (signed median "
              f"{100 * statistics.median(errs):+.1f}%) over {len(errs)} plans")
    errs = [a / c - 1 for a, c in zip(all_held, compiled_peaks)]
    print(f"every window at its own peak at once (its whole compiled temporaries, plus the "
          f"held activations that cross windows): median |memory error| "
          f"{100 * statistics.median(abs(e) for e in errs):.1f}% (signed median "
          f"{100 * statistics.median(errs):+.1f}%); {sum(e < 0 for e in errs)} of {len(errs)} "
          f"plans below the compiled peak")


def _not_placed(held_sizes: list[int], output_sizes: list[int], exact: bool) -> int:
    """The held bytes left over when each held activation, largest first, takes the smallest
    free step-output buffer it fits (of its size exactly, with ``exact``): XLA's buffer
    assignment reuses an output's buffer for temporaries whose lives end before the output is
    written (the optimizer's update writes the outputs at the step's end), largest first. It
    places transients there too, and one whose life overlaps a held activation's keeps that
    buffer from it; this leaves transients out, so it places more than XLA does."""
    free, left = sorted(output_sizes), 0
    for n in sorted(held_sizes, reverse=True):
        j = next((j for j, size in enumerate(free) if size == n or (size > n and not exact)),
                 None)
        if j is None:
            left += n
        else:
            free.pop(j)
    return left


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
    from cfp.host_memory import run_pooled
    run_pooled()  # timing measures programs, not the host allocator
    from cfp.errors import CfpError
    try:
        main()
    except CfpError as e:  # a work dir these flags have not made: one line, exit 2
        print(f"memory_gap: {e}", file=sys.stderr)
        sys.exit(2)
