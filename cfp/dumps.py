"""The files a run writes beside its records, for people and tools to read: the analysis's
block and segment dumps, the strategy maps (``strategy_map.txt`` and its JSON twin), the
plan's figure, the stages' JSON, and the memory figures of a predicted plan.json."""
from __future__ import annotations

from pathlib import Path

from cfp.report import gb_text, ms_text, segment_op_count


def write_analysis_dumps(rec, directory: Path) -> None:
    """``parallel_blocks.txt``, ``strategy_map.txt`` and ``segments.txt``."""
    directory.mkdir(parents=True, exist_ok=True)
    g, ba = rec.graph, rec.blocks
    paths = input_paths(rec.spec)
    lines = []
    for b in ba.blocks:
        lines.append(f"Parallel Block {b.index}:")
        for m in b.members:
            op = g.ops[m.op]
            lines.append(f"    {m.op} {_with_paths(op.hlo, paths)}")
            lines.append(f"    role: {m.role}; plan: {_plan_text(m.outs)}"
                         + (f"; collective-free unless split: {_reqs_text(m.reqs)}"
                            if m.reqs else ""))
    lines.append("")
    lines.append(f"Unclaimed operators ({len(ba.unclaimed)}):")
    lines += [f"    {i} {g.ops[i].hlo}" for i in ba.unclaimed]
    (directory / "parallel_blocks.txt").write_text("\n".join(lines) + "\n")

    lines = []
    for b in ba.blocks:
        lines.append(f"Instruction {b.seed}: {_with_paths(g.ops[b.seed].hlo, paths)}")
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


def input_paths(spec) -> list[str]:
    """The pytree path of every step input, ``Arg_<k>`` in the dumps' HLO lines
    (``Workload.input_paths``)."""
    return spec.build().input_paths()


def _with_paths(hlo: str, paths: list[str]) -> str:
    """``hlo`` followed by the path of every step input it reads."""
    import re
    args = sorted({int(k) for k in re.findall(r"%Arg_(\d+)\.", hlo)})
    return hlo + ("  # " + ", ".join(f"Arg_{k} = {paths[k]}" for k in args if k < len(paths))
                  if args else "")


def plan_of(analysis, rec) -> dict:
    """``plan.json``'s content for the search record ``rec``, with the plan in words."""
    from cfp.describe import plan_words
    from cfp.plan import make_plan
    plan = rec.plan
    plan_json = make_plan(analysis, plan.strategies, in_specs=rec.in_specs,
                          out_specs=rec.out_specs, source=plan.source, storage=plan.storage,
                          recompute=rec.recompute)
    plan_json["description"] = plan_words(analysis, plan.strategies, plan.storage,
                                          rec.recompute)
    return plan_json


def write_search_dumps(workdir, analysis, profile, rec) -> None:
    """debug_search/: after_ir.txt, input/output_placement_specs.txt, mem_usage.txt,
    report.json, plan.png, predicted_vs_measured.png; and plan.json (with the plan in words)
    in the work dir."""
    import json
    import math
    import jax
    from cfp.dims import spec_axes
    from cfp.plan import write_plan
    from cfp.collectives import collectives
    out = Path(workdir) / "debug_search"
    out.mkdir(parents=True, exist_ok=True)
    axis_names = analysis.mesh_axes
    g, blocks = analysis.graph, analysis.blocks.blocks
    plan = rec.plan
    paths = input_paths(analysis.spec)
    rows = []
    member = {m.op: (b, m) for b in blocks for m in b.members}
    for op in g.ops:
        if op.index in member:
            b, m = member[op.index]
            st = b.strategies[plan.strategies[b.index]]
            specs = [spec_axes(l, st.axes, axis_names) for l in m.outs]
            where = f"block {b.index} ({m.role})"
        else:
            specs, where = ["(XLA decides)"], "unclaimed"
        rows.append(f"{op.index:6d} {where:28s} {specs}  {_with_paths(op.hlo, paths)}")
    (out / "after_ir.txt").write_text(
        "# Per operator: block, sharding of its result(s) under the plan, HLO line\n"
        + "\n".join(rows) + "\n\n# Compiled HLO after partitioning\n" + rec.compiled_text)
    workload = analysis.spec.build()
    params_abs = workload.abstract_params()
    leaves = jax.tree_util.tree_flatten_with_path(
        (params_abs, workload.abstract_opt_state(), workload.abstract_batch()))[0]
    in_lines = [f"{jax.tree_util.keystr(p)}: {s}" for (p, _), s in zip(leaves, rec.in_specs)]
    (out / "input_placement_specs.txt").write_text("\n".join(in_lines) + "\n")
    (out / "output_placement_specs.txt").write_text(
        "\n".join(f"output {i}: {s}" for i, s in enumerate(rec.out_specs)) + "\n")
    mem = rec.memory
    (out / "mem_usage.txt").write_text("\n".join(
        [f"{k}: {v} B ({v / 2**30:.4f} GiB)" for k, v in mem.items()]
        + [f"composed from the profiles: {plan.composed_memory_bytes} B "
           f"({plan.composed_memory_bytes / 2**30:.4f} GiB)"]) + "\n")
    write_plan(Path(workdir) / "plan.json", plan_of(analysis, rec))
    by_kind: dict = {}
    for c in collectives(rec.compiled_text, analysis.mesh_shape):
        k = by_kind.setdefault(c.kind, {"count": 0, "bytes": 0})
        k["count"] += 1
        k["bytes"] += c.bytes
    devices = math.prod(analysis.mesh_shape)
    report = {
        "backend": jax.devices()[0].platform, "devices": devices,
        "mesh": list(analysis.mesh_shape),
        "solution": list(plan.strategies), "source": plan.source,
        "solver_status": rec.solver_status, "solve_s": rec.solve_s,
        "predicted_step_s": plan.predicted_s, "measured_step_s": list(plan.measured_s),
        "measured_median_s": plan.median_s, "memory_gb": mem["peak_bytes"] / 2**30,
        "composed_memory_gb": plan.composed_memory_bytes / 2**30,
        "tflop_count": rec.step_flops / 1e12,
        "tflops_per_device": [rec.step_flops / t / devices / 1e12 for t in plan.measured_s],
        "collectives": by_kind, "numerics": rec.numerics,
        "candidates": [{"source": c.source, "solution": list(c.strategies),
                        "predicted_s": c.predicted_s, "measured_s": c.median_s,
                        "composed_memory_gb": c.composed_memory_bytes / 2**30,
                        "compiled_memory_gb": c.compiled_peak_bytes / 2**30}
                       for c in rec.candidates],
        "pass_times_s": {"analysis": analysis.stats.time_s, "profile": profile.time_s,
                         "search": rec.time_s},
        "phase_times_s": {"profile": profile.phase_s, "search": rec.phase_s},
    }
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    fig = plan_figure(*plan_figure_data(analysis, rec), title=(
        f"{analysis.spec.label} on mesh {'x'.join(map(str, analysis.mesh_shape))}: "
        f"{plan.source}"))
    fig.savefig(out / "plan.png", dpi=110)
    _plots(out, rec)


def plan_figure_data(analysis, rec):
    """What ``plan_figure`` draws: per segment instance its label (with where the kept plan
    keeps the state its blocks update) and, per block, what each mesh axis splits under it; per candidate its label, measured median seconds,
    compiled peak bytes, whether it is a hand plan and whether it was kept."""
    from cfp.describe import block_splits, same_programs, state_of_blocks
    splits = block_splits(analysis, rec.plan.strategies)
    rows = []
    for seg in analysis.segments.instances:
        cells = ["; ".join(f"{axis}: {', '.join(roles)}" for axis, roles in splits[b].items())
                 or "replicated" for b in range(seg.start, seg.end)]
        where = (f"block {seg.start}" if seg.end == seg.start + 1
                 else f"blocks {seg.start}-{seg.end - 1}")
        state = state_of_blocks(analysis, rec.plan.storage, seg.start, seg.end)
        rows.append((f"{where} (type {seg.type}" + (f"; state {state})" if state else ")"),
                     cells))
    candidates = []
    for i, c in enumerate(rec.candidates):
        if c.source.startswith("baseline "):
            label, hand = c.source.removeprefix("baseline "), True
        else:
            same = same_programs(analysis, c.strategies, c.storage)
            label = f"cfp {i}" + (f" (= {', '.join(same)})" if same else "")
            hand = bool(same)
        candidates.append((label, c.median_s, c.compiled_peak_bytes, hand, i == rec.kept))
    return rows, candidates


def plan_figure(rows, candidates, *, title: str = ""):
    """Left: a grid of segment instances (rows) by their blocks (columns), each cell coloured
    by which mesh axis splits which role there. Right: every candidate's measured step time
    and compiled memory, the hand plans beside cfp's own, the kept one marked."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    kinds = list(dict.fromkeys(c for _, cells in rows for c in cells))
    colour = {k: ("#dddddd" if k == "replicated" else plt.cm.tab10(i % 10))
              for i, k in enumerate(kinds)}
    width = max(len(cells) for _, cells in rows)
    fig, (grid, bars) = plt.subplots(
        1, 2, figsize=(6 + 0.35 * width, 1.8 + max(0.45 * len(rows), 0.3 * len(candidates))
                       + 0.22 * len(kinds)),
        gridspec_kw={"width_ratios": [max(width, 4), 5]}, layout="constrained")
    for r, (_, cells) in enumerate(rows):
        for b, cell in enumerate(cells):
            grid.add_patch(plt.Rectangle((b, r), 0.95, 0.9, color=colour[cell]))
    grid.set_xlim(0, width)
    grid.set_ylim(len(rows), 0)
    grid.set_yticks([r + 0.45 for r in range(len(rows))], [label for label, _ in rows],
                    fontsize=8)
    grid.set_xticks([b + 0.475 for b in range(width)], [str(b) for b in range(width)],
                    fontsize=7)
    grid.set_xlabel("block within the segment instance", fontsize=8)
    grid.tick_params(length=0)
    for side in grid.spines.values():
        side.set_visible(False)
    fig.legend(handles=[Patch(color=colour[k], label=k) for k in kinds],
               loc="outside lower left", fontsize=7, frameon=False,
               title="what each mesh axis splits", title_fontsize=8, alignment="left")
    grid.set_title("kept plan, block by block", fontsize=9)
    y = range(len(candidates))
    bars.barh(y, [c[1] * 1e3 for c in candidates],
              color=["#999999" if c[3] else "#1f77b4" for c in candidates],
              edgecolor=["black" if c[4] else "none" for c in candidates], linewidth=1.5)
    bars.set_yticks(list(y), [c[0] + ("  (kept)" if c[4] else "") for c in candidates],
                    fontsize=8)
    bars.set_ylim(len(candidates) - 0.5, -0.5)
    top = max(c[1] for c in candidates) * 1e3
    for i, c in enumerate(candidates):
        bars.text(c[1] * 1e3 + top * 0.02, i, f"{ms_text(c[1])}, {gb_text(c[2])}",
                  va="center", fontsize=7)
    bars.set_xlim(0, top * 1.6)
    bars.set_xlabel("measured step time, ms (grey: a hand plan)", fontsize=8)
    bars.set_title("candidates run end to end", fontsize=9)
    bars.tick_params(labelsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


def _plots(out, rec) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(4, 4))
    pred = [c.predicted_s for c in rec.candidates]
    meas = [c.median_s for c in rec.candidates]
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


def prediction_memory(rec) -> dict:
    """A predicted plan's memory per device as ``plan.json`` records it: the whole step
    compiled for the GPUs, where it was (and the ``XLA_FLAGS`` that run it as compiled), and
    the composition, each saying where it comes from."""
    from cfp.gpu_compile import label
    from cfp.jax_compat import DESCRIBED_GPU_OPTIONS, xla_flags
    out = {"composed_bytes": int(rec.memory_bytes), "composed_from": rec.memory_source}
    if rec.compiled_peak_bytes is not None:
        out.update(compiled_bytes=int(rec.compiled_peak_bytes),
                   compiled_for=label(rec.compiled_for),
                   xla_flags=xla_flags(DESCRIBED_GPU_OPTIONS))
    return out


def stages_json(rec) -> dict:
    """``stages/plan.json``: per stage its layers, submesh and shardings."""
    return {"format": "cfp-stage-plan", "version": 1, "cluster": rec.cluster,
            "micro_batches": rec.micro_batches, "predicted_latency_s": rec.plan.latency_s,
            "stages": [{"layers": [st.first_layer, st.last_layer], "blocks": list(st.blocks),
                        "submesh": list(st.submesh), "predicted_s": st.time_s,
                        "memory_bytes": st.memory_bytes, "in_flight": st.in_flight, **st.plan}
                       for st in rec.stages]}
