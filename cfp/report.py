"""What people read: console lines and the text dumps of each pass.

Library code logs; the lines users read come from here.
"""
from __future__ import annotations

import collections
from pathlib import Path

from cfp.blocks import Block
from cfp.graph import Graph


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


def block_summary(graph: Graph, block: Block) -> str:
    return f"block {block.index}: {_short(graph.ops[block.seed].hlo, 80)}"


# ---------------------------------------------------------------------------------------------
# profile


def profile_console(rec, segs, window_space_log10: float, model_space_log10: float) -> None:
    counts = collections.Counter(m.status for seg in segs.values() for m in seg.results.values())
    say(f"combinations: {sum(counts.values())} ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}); "
        f"compiled in this run: {rec.compiled}")
    say(f"launch overhead subtracted: {rec.launch_overhead_s * 1e3:.3f} ms per program")
    say(f"whole-model plan space: 10^{model_space_log10:.1f} plans, covered by "
        f"{len(rec.windows)} window instances of {len(segs)} types")
