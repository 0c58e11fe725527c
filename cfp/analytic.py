"""Pricing without compiling: a window combination and a resharding from the analysis alone.

For a cluster too large to compile for here, each block's strategy is priced from what it
implies (Alpa's cost model, ``../shared/REFERENCE.md``):

- **compute**: per contraction, a roofline of its per-device FLOPs (the FLOPs over the devices
  its strategy splits it across) against its per-device operand and result bytes; per other
  operator, the bytes of its per-device results over memory bandwidth (elementwise chains fuse,
  so their reads are not counted again);
- **collectives**: the all-reduce of every contraction whose contracting dim is split (its
  per-device result, over the axes that split it), and, for a member the strategy leaves out of
  the block (it needs a collective under it), an all-reduce of its result if it is a reduction
  (over a split dim), else an all-gather of each split operand;
- **reshardings**: per mesh axis, an all-gather where the source splits a dim on it and the
  destination does not, an all-to-all where they split different dims, nothing where only the
  destination splits (a local slice);
- **memory**: arguments and results from the window's layouts; temporaries as the largest
  contraction's per-device operands and result (XLA reuses the rest), less those the window's
  own program would not hold as temporaries: its arguments and results, and the activations
  held for the backward pass (``cfp.window_memory.held_for_backward`` on the cost model's platform),
  which the composition counts as held.

All collectives use ``CostModel.collective_s`` with the alpha and beta of the slowest network
level the mesh axes span (``cfp.cluster``).
"""
from __future__ import annotations

import math

from cfp import dims as dimrules
from cfp.cost_model import CostModel
from cfp.jax_compat import itemsize
from cfp.measure import Measurement
from cfp.sharding import sub_program
from cfp.window_memory import held_for_backward
from cfp.windows import Window, apply_state, shard_bytes, window_layouts, window_ops


def _axes_of(spec, axis_names) -> list[tuple[int, ...]]:
    """Per dim, the mesh axes that split it."""
    out = []
    for entry in spec:
        names = entry if isinstance(entry, tuple) else (entry,) if entry else ()
        out.append(tuple(axis_names.index(n) for n in names))
    return out


def window_measurement(analysis, window: Window, combo, cost: CostModel, axis_names,
                       known: dict | None = None) -> Measurement:
    """The priced ``Measurement`` of one combination of a window (no compile, no run).
    ``known``: a dict kept across the combinations of one window, holding what its block
    strategies give, which its state layouts share."""
    g, mesh_shape = analysis.graph, analysis.mesh_shape
    n = window.end - window.start
    key = (window.start, window.end, tuple(combo[:n]))
    known = {} if known is None else known
    if key not in known:
        known[key] = _strategies_part(analysis, window, combo, cost, axis_names)
    seconds, temp, colls, sub, ins, outs, constraints = known[key]
    ins, outs, colls = list(ins), list(outs), list(colls)
    nbytes = lambda v, spec: shard_bytes(g.values[v].shape, itemsize(g.values[v].dtype),  # noqa
                                         spec, mesh_shape, axis_names)
    plain = dict(zip(sub.live_ins, ins))
    apply_state(analysis, window, combo, sub, ins, outs, dict(constraints), axis_names)
    # Split state: the gradient's all-reduce becomes a reduce-scatter and the gather of the
    # updated parameters (the same bytes); a parameter stored split (fsdp) is gathered once
    # more, as the forward and the backward pass each gather it.
    for v, spec in zip(sub.live_ins, ins):
        axes = tuple(sorted({a for d in _axes_of(spec, axis_names) for a in d}
                            - {a for d in _axes_of(plain[v], axis_names) for a in d}))
        if axes and any(g.ops[u].primitive not in dimrules.ELEMENTWISE
                        for u in g.users.get(v, ())):
            colls.append(("all-gather", axes, nbytes(v, plain[v])))
    seconds += sum(cost.collective_s(kind, axes, b, mesh_shape) for kind, axes, b in colls)
    arg_b = sum(nbytes(v, s) for v, s in zip(sub.live_ins, ins))
    out_b = sum(nbytes(v, s) for v, s in zip(sub.live_outs, outs))
    return Measurement("ok", seconds, seconds, seconds, 0, 0.0, arg_b + out_b + temp, arg_b,
                       out_b, temp, collectives=tuple(colls), note="analytic")


def _strategies_part(analysis, window: Window, combo, cost: CostModel, axis_names) -> tuple:
    """Of ``window_measurement``, what the block strategies of ``combo`` give: (compute
    seconds, temporary bytes, collectives, the window's program, its live-in and live-out
    specs and constraints before its state layout)."""
    g, mesh_shape = analysis.graph, analysis.mesh_shape
    blocks = [analysis.blocks.blocks[b] for b in range(window.start, window.end)]
    strategies = [b.strategies[k] for b, k in zip(blocks, combo)]
    nbytes = lambda v, spec: shard_bytes(g.values[v].shape, itemsize(g.values[v].dtype),  # noqa
                                         spec, mesh_shape, axis_names)
    sub = sub_program(g, window_ops(analysis, window))
    # What the window's own program would hold as temporaries: not its arguments and
    # results, nor the activations held for the backward pass (counted as held).
    counted = (held_for_backward(g, platform=cost.platform) | set(sub.live_ins)
               | set(sub.live_outs))
    seconds, temp, colls = 0.0, 0, []
    for block, st in zip(blocks, strategies):
        under = {m.op for m in block.members_under(st, mesh_shape)}
        split = math.prod(mesh_shape[a] for a, d in enumerate(st.axes) if d is not None)
        for m in block.members:
            op = g.ops[m.op]
            ins = [dimrules.spec_axes(lab, st.axes, axis_names) for lab in m.ins]
            outs = [dimrules.spec_axes(lab, st.axes, axis_names) for lab in m.outs]
            out_b = sum(nbytes(v, s) for v, s in zip(op.outputs, outs))
            if op.is_contraction:
                in_b = sum(nbytes(v, s) for v, s in zip(op.inputs, ins))
                seconds += max(op.flops / split / cost.device_flops,
                               (in_b + out_b) / cost.device_bandwidth)
                temp = max(temp, sum(nbytes(v, s) for v, s in zip(op.inputs + op.outputs,
                                                                    ins + outs)
                                     if v not in counted))
                axes = tuple(sorted({a for l in m.reduces for a in st.loop_axes(l)}))
                if axes:
                    colls.append(("all-reduce", axes, out_b))
            else:
                seconds += out_b / cost.device_bandwidth
            if m.op not in under and op.primitive in dimrules.REDUCTIONS:
                axes = tuple(sorted({a for spec in ins for d in _axes_of(spec, axis_names)
                                     for a in d}))  # partial results summed across them
                colls.append(("all-reduce", axes, out_b))
            elif m.op not in under:  # needs its operands whole along the axes that split them
                for v, spec in zip(op.inputs, ins):
                    axes = tuple(sorted({a for d in _axes_of(spec, axis_names) for a in d}))
                    if axes:
                        whole = tuple(None for _ in spec)
                        colls.append(("all-gather", axes, nbytes(v, whole)))
    colls += _resharded_inside(analysis, window, strategies, axis_names)
    ins, outs, constraints = window_layouts(g, blocks, strategies, sub, axis_names)
    return seconds, temp, tuple(colls), sub, tuple(ins), tuple(outs), constraints


def _resharded_inside(analysis, window: Window, strategies, axis_names) -> list[tuple]:
    """The collectives that move tensors between the window's own blocks: a value one block
    makes, or the window reads, in another layout than a later block wants it."""
    g, mesh_shape = analysis.graph, analysis.mesh_shape
    member = {m.op: (i, m) for i, b in enumerate(range(window.start, window.end))
              for m in analysis.blocks.blocks[b].members}
    spec = lambda labels, i: dimrules.spec_axes(labels, strategies[i].axes, axis_names)  # noqa
    first: dict[int, tuple] = {}  # a value the window reads -> (block, layout) of its first reader
    out = []
    for op in sorted(member):
        j, m = member[op]
        for pos, v in enumerate(g.ops[op].inputs):
            val = g.values[v]
            if not val.shape:
                continue
            want = spec(m.ins[pos], j)
            if val.producer in member:
                i, made_by = member[val.producer]
                made = spec(made_by.outs[g.ops[val.producer].outputs.index(v)], i)
            else:
                i, made = first.setdefault(v, (j, want))
            if i != j:
                out += reshard_collectives(val.shape, val.dtype, made, want, mesh_shape,
                                           axis_names)
    return out


def reshard_s(shape, dtype: str, src, dst, mesh_shape, axis_names, cost: CostModel) -> float:
    """Seconds to move a tensor from layout ``src`` to ``dst`` (PartitionSpec entries)."""
    return sum(cost.collective_s(kind, axes, nbytes, mesh_shape)
               for kind, axes, nbytes in reshard_collectives(shape, dtype, src, dst, mesh_shape,
                                                             axis_names))


def reshard_collectives(shape, dtype: str, src, dst, mesh_shape, axis_names) -> list[tuple]:
    """The collectives, (kind, mesh axes, bytes), that move a tensor from layout ``src`` to
    ``dst``: an all-gather over the axes only ``src`` splits, an all-to-all over those the
    two split along different dims."""
    if tuple(src) == tuple(dst):
        return []
    src_axes, dst_axes = _axes_of(src, axis_names), _axes_of(dst, axis_names)
    where_src = {a: d for d, axes in enumerate(src_axes) for a in axes}
    where_dst = {a: d for d, axes in enumerate(dst_axes) for a in axes}
    gather = tuple(sorted(a for a in where_src if a not in where_dst))
    swap = tuple(sorted(a for a in where_src if a in where_dst and where_src[a] != where_dst[a]))
    nbytes = lambda spec: shard_bytes(shape, itemsize(dtype), spec, mesh_shape, axis_names)  # noqa
    out = [("all-gather", gather, nbytes(dst))] if gather else []
    return out + ([("all-to-all", swap, nbytes(src))] if swap else [])
