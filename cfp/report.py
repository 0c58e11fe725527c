"""What people read: console lines and the text dumps of each pass.

Library code logs; the lines users read come from here.
"""
from __future__ import annotations

import collections
from pathlib import Path



def say(line: str = "") -> None:
    print(line, flush=True)


# ---------------------------------------------------------------------------------------------
# analysis


def analysis_console(rec) -> None:
    g, ba, sa, st = rec.graph, rec.blocks, rec.segments, rec.stats
    say(f"traced {len(g.ops)} operators ({g.dead_ops} dead ones dropped), "
        f"{len(ba.blocks)} ParallelBlocks, {len(ba.unclaimed)} unclaimed operators")
    before = sum(b.strategies_before_pruning for b in ba.blocks)
    after = sum(len(b.strategies) for b in ba.blocks)
    say(f"strategies over all blocks: {before} before pruning, {after} after "
        f"(dominated and non-dividing ones dropped)")
    for b in ba.blocks:
        roles = collections.Counter(m.role for m in b.members)
        say(f"  ParallelBlock {b.index}: {len(b.members)} ops "
            f"({roles['seed'] + roles['input-grad'] + roles['weight-grad']} contractions), "
            f"{len(b.strategies)} strategies  {_short(g.ops[b.seed].hlo)}")
    for seg in sa.instances:
        rep = sa.instances[sa.representatives[seg.type]]
        say(f"ParallelBlocks sequence: ({seg.start}, {seg.end}) mapped to "
            f"({rep.start}, {rep.end})")
    for t in range(sa.num_types):
        say(f"unique segment {t}: search space {rec.segment_space(t)}")
    say(f"FLOPs inside blocks: {100 * st.flops_share:.2f}% of {st.flops_total:.3e}")
    if st.num_layers:
        say(f"blocks per layer: {len(ba.blocks) / st.num_layers:.2f}; "
            f"operators per layer: {len(g.ops) / st.num_layers:.0f}; "
            f"operators in segment type 0: {segment_op_count(rec, 0)}")
    say(f"whole-model plan space: 10^{rec.plan_space_log10():.1f} plans")
    say(f"global analysis time: {st.time_s:.3f}")


def segment_op_count(rec, seg_type: int) -> int:
    seg = rec.segments.instances[rec.segments.representatives[seg_type]]
    return sum(len(rec.blocks.blocks[b].members) for b in range(seg.start, seg.end))


def _short(text: str, width: int = 110) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def write_analysis_dumps(rec, directory: Path) -> None:
    """``parallel_blocks.txt``, ``strategy_map.txt`` and ``segments.txt``."""
    directory.mkdir(parents=True, exist_ok=True)
    g, ba = rec.graph, rec.blocks
    lines = []
    for b in ba.blocks:
        lines.append(f"Parallel Block {b.index}:")
        for m in b.members:
            op = g.ops[m.op]
            lines.append(f"    {m.op} {op.hlo}")
            lines.append(f"    role: {m.role}; plan: {_plan_text(m.outs)}"
                         + (f"; collective-free unless split: {_reqs_text(m.reqs)}"
                            if m.reqs else ""))
    lines.append("")
    lines.append(f"Unclaimed operators ({len(ba.unclaimed)}):")
    lines += [f"    {i} {g.ops[i].hlo}" for i in ba.unclaimed]
    (directory / "parallel_blocks.txt").write_text("\n".join(lines) + "\n")

    lines = []
    for b in ba.blocks:
        lines.append(f"Instruction {b.seed}: {g.ops[b.seed].hlo}")
        lines += [f"Strategy {s.name}" for s in b.strategies]
        lines.append(f"({b.strategies_before_pruning} valid before pruning, "
                     f"{len(b.strategies)} kept)")
    (directory / "strategy_map.txt").write_text("\n".join(lines) + "\n")

    sa = rec.segments
    lines = [f"cut widths between consecutive blocks: {list(sa.cut_widths)}",
             f"pieces start at blocks: {list(sa.piece_starts)}"]
    for seg in sa.instances:
        rep = sa.instances[sa.representatives[seg.type]]
        lines.append(f"ParallelBlocks sequence: ({seg.start}, {seg.end}) mapped to "
                     f"({rep.start}, {rep.end})  type {seg.type}")
    for t in range(sa.num_types):
        lines.append(f"segment type {t}: search space {rec.segment_space(t)}, "
                     f"{segment_op_count(rec, t)} operators")
    (directory / "segments.txt").write_text("\n".join(lines) + "\n")


def _plan_text(outs) -> str:
    return "; ".join(",".join("-" if l is None else str(l) for l in lab) for lab in outs)


def _reqs_text(reqs) -> str:
    return ", ".join(f"loop dim {l}" if d == 0 else f"loop dim {l} (unless it divides {d})"
                     for l, d in reqs)


# ---------------------------------------------------------------------------------------------
# profile


def profile_console(rec, segs, window_space_log10: float, model_space_log10: float) -> None:
    counts = collections.Counter(m.status for seg in segs.values() for m in seg.results.values())
    say(f"combinations: {sum(counts.values())} ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}); "
        f"compiled in this run: {rec.compiled}")
    say(f"launch overhead subtracted: {rec.launch_overhead_s * 1e3:.3f} ms per program")
    say(f"whole-model plan space: 10^{model_space_log10:.1f} plans, covered by "
        f"{len(rec.windows)} window instances of {len(segs)} types")


# ---------------------------------------------------------------------------------------------
# search


def search_console(sol, times, step, flops: float, devices: int) -> None:
    import numpy as np
    from cfp.execute import memory_gb
    say(f"searched ParallelBlock Strategies solution: {list(sol.strategies)}")
    say(f"searched training cost: {np.array(times)}, memory_cost: {memory_gb(step.compiled):.4f}")
    say(f"TFLOP_COUNT: {flops / 1e12:.6g}")
    say(f"tflops (per device): {[flops / t / devices / 1e12 for t in times]}")


def write_search_dumps(workdir, analysis, workload, problem, sols, best, steps, times, flops,
                       numerics, solve_s, mesh, cost, overhead_s: float) -> None:
    """debug_search/: after_ir.txt, input/output_placement_specs.txt, mem_usage.txt,
    report.json, strategy.png, predicted_vs_measured.png; and plan.json in the work dir."""
    import json
    import jax
    from cfp.execute import memory_gb
    from cfp.measure import memory_of
    from cfp.plan import write_plan
    from cfp.sharding import collectives
    from passes.search import predicted_seconds
    out = Path(workdir) / "debug_search"
    out.mkdir(parents=True, exist_ok=True)
    g, blocks = analysis.graph, analysis.blocks.blocks
    sol, step = sols[best], steps[best]
    text = step.compiled.as_text()
    from cfp.dims import spec_axes
    rows = []
    member = {m.op: (b, m) for b in blocks for m in b.members}
    for op in g.ops:
        if op.index in member:
            b, m = member[op.index]
            st = b.strategies[sol.strategies[b.index]]
            specs = [spec_axes(l, st.axes, mesh.axis_names) for l in m.outs]
            where = f"block {b.index} ({m.role})"
        else:
            specs, where = ["(XLA decides)"], "unclaimed"
        rows.append(f"{op.index:6d} {where:28s} {specs}  {op.hlo}")
    (out / "after_ir.txt").write_text(
        "# Per operator: block, sharding of its result(s) under the plan, HLO line\n"
        + "\n".join(rows) + "\n\n# Compiled HLO after partitioning\n" + text)
    params_abs = workload.abstract_params()
    leaves = jax.tree_util.tree_flatten_with_path(
        (params_abs, workload.abstract_opt_state(), workload.abstract_batch()))[0]
    in_lines = [f"{jax.tree_util.keystr(p)}: {s}" for (p, _), s in zip(leaves, step.in_specs)]
    (out / "input_placement_specs.txt").write_text("\n".join(in_lines) + "\n")
    (out / "output_placement_specs.txt").write_text(
        "\n".join(f"output {i}: {s}" for i, s in enumerate(step.out_specs)) + "\n")
    mem = memory_of(step.compiled)
    predicted_mem = sol.memory
    (out / "mem_usage.txt").write_text("\n".join(
        [f"{k}: {v} B ({v / 2**30:.4f} GB)" for k, v in mem.items()]
        + [f"composed from the profiles: {predicted_mem} B ({predicted_mem / 2**30:.4f} GB)"])
        + "\n")
    n_params = len(jax.tree_util.tree_leaves(params_abs))
    param_specs = {jax.tree_util.keystr(p): s for (p, _), s in
                   zip(leaves[:n_params], step.in_specs[:n_params])}
    block_rows = [{"block": b.index, "strategy_index": sol.strategies[b.index],
                   "strategy": b.strategies[sol.strategies[b.index]].name,
                   "seed": g.ops[b.seed].hlo} for b in blocks]
    write_plan(Path(workdir) / "plan.json", mesh_shape=analysis.mesh_shape,
               axis_names=mesh.axis_names, blocks=block_rows, params=param_specs,
               extra={"source": sol.status if sol.status.startswith("baseline")
                      else "predicted"})
    colls = collectives(text, analysis.mesh_shape)
    by_kind: dict = {}
    for c in colls:
        k = by_kind.setdefault(c.kind, {"count": 0, "bytes": 0})
        k["count"] += 1
        k["bytes"] += c.bytes
    med = sorted(times[best])[len(times[best]) // 2]
    report = {
        "backend": jax.devices()[0].platform, "devices": int(__import__("math").prod(
            analysis.mesh_shape)), "mesh": list(analysis.mesh_shape), "cost": cost,
        "solution": list(sol.strategies), "solver_status": sol.status,
        "solve_s": solve_s, "predicted_step_s": predicted_seconds(problem, sol.choices, overhead_s),
        "measured_step_s": times[best], "measured_median_s": med,
        "memory_gb": memory_gb(step.compiled), "composed_memory_gb": predicted_mem / 2**30,
        "tflop_count": flops / 1e12,
        "tflops_per_device": [flops / t / len(mesh.devices.flat) / 1e12 for t in times[best]],
        "collectives": by_kind, "numerics": numerics,
        "candidates": [{"solution": list(s.strategies),
                        "predicted_s": predicted_seconds(problem, s.choices, overhead_s),
                        "measured_s": sorted(t)[len(t) // 2]} for s, t in zip(sols, times)],
        "pass_times_s": {"analysis": analysis.stats.time_s, "search": solve_s},
        "blocks": [dict(r, predicted_s=None) for r in block_rows],
    }
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    _plots(out, sol, sols, times, problem, overhead_s)


def _plots(out, sol, sols, times, problem, overhead_s: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from passes.search import predicted_seconds
    fig, ax = plt.subplots(figsize=(max(6, len(sol.strategies) * 0.15), 3))
    ax.bar(range(len(sol.strategies)), sol.strategies)
    ax.set_xlabel("ParallelBlock")
    ax.set_ylabel("strategy index")
    ax.set_title("chosen strategy per block")
    fig.tight_layout()
    fig.savefig(out / "strategy.png", dpi=100)
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(4, 4))
    pred = [predicted_seconds(problem, s.choices, overhead_s) for s in sols]
    meas = [sorted(t)[len(t) // 2] for t in times]
    ax.scatter(pred, meas)
    for i, (p, m) in enumerate(zip(pred, meas)):
        ax.annotate(str(i), (p, m))
    lim = [0, max(pred + meas) * 1.1]
    ax.plot(lim, lim, "k--", lw=0.5)
    ax.set_xlabel("predicted step s")
    ax.set_ylabel("measured step s")
    ax.set_title("validated candidates")
    fig.tight_layout()
    fig.savefig(out / "predicted_vs_measured.png", dpi=100)
    plt.close(fig)
