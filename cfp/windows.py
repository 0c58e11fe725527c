"""Profiling windows and the boundaries between them (derived from the analysis alone).

A unique segment whose strategy space exceeds ``max_combinations`` is split into consecutive
*windows* whose spaces fit; every instance of the segment is split at the same offsets. Each
window type is profiled once, for the combinations of its blocks' strategies search asks
for. Segments repeat by their contractions, so two instances of one window can still differ in
other operators (the first layer also gathers the embedding and updates its table): a window instance whose
operators (kinds and shapes) differ from those of the instance in its segment's representative
is a window type of its own, profiled on itself, so that no window is priced by another
program. What the step computes once for every layer, from constants or on scalars, does not
count (``_operators``).

**Boundaries.** A window is measured with its live-ins already in the layout its first reader
wants and its live-outs in the layout their producer makes, so a measured window time holds no
resharding at its edges. What crosses between window instances is priced separately: for each
tensor that a block of one window produces (or the step feeds) and a block of another window
reads, the layout it leaves in under the producer's strategy and the layout the reader wants
under its strategy; search adds the measured resharding time of every such pair
(``Boundary``). Step inputs read by several blocks (tied weights) enter in the layout their first
reader wants; other readers pay a resharding from it. The new training state leaves the step
in the layout its input came in (the plan is a fixed point, so a loop can feed it back). A
window that reads a state leaf first and computes its new value returns it so itself, and its
measured time holds that resharding (``held_state``); where the two are in different windows,
the resharding from the layout its producer makes to that one is a boundary.

**State layouts.** A window that holds state is measured under each of ``STATE_LAYOUTS`` for it
(the last entry of its combinations): as its blocks compute (``plan``), the optimizer state
split over the mesh axes the blocks leave replicated (``zero1``), or the parameters split too
(``fsdp``). Its program then holds the gathers and the reduce-scatter into the split layout
where XLA puts them, both passes, and its memory the split state and the gathered weights.
"""
from __future__ import annotations

import dataclasses
import functools
import math

from cfp import dims as dimrules
from cfp.graph import computed_from_inputs, memo
from cfp.sharding import STATE_LAYOUTS, block_constraints, state_specs, sub_program


@dataclasses.dataclass(frozen=True)
class Window:
    """An instance ``[start, end)`` of window type ``type`` in the global block sequence."""

    start: int
    end: int
    type: int


@dataclasses.dataclass(frozen=True)
class Boundary:
    """A tensor crossing from block ``src`` (its layout there) to block ``dst`` (the layout it
    wants there): ``value`` with ``shape``/``dtype``; labels per block."""

    value: int
    shape: tuple[int, ...]
    dtype: str
    src: int
    src_labels: tuple
    dst: int
    dst_labels: tuple


def split_windows(analysis, max_combinations: int, whole_segments: bool = False
                  ) -> tuple[list[Window], list[int]]:
    """Window instances over the whole block sequence, and per window type the index of its
    representative instance (inside the segment's representative). With ``whole_segments``
    every segment is one window, however large its space (``cfp.ranking`` chooses which of
    its combinations are measured)."""
    sa = analysis.segments
    offsets = {t: ([(0, sa.instances[r].end - sa.instances[r].start)] if whole_segments
                   else _cuts(analysis, sa.instances[r], max_combinations))
               for t, r in enumerate(sa.representatives)}
    # the representative segments first, so that their windows' operators name each type
    order = sorted(range(len(sa.instances)), key=lambda i: i not in sa.representatives)
    window_type: dict[tuple, int] = {}
    placed = []
    first: dict[int, Window] = {}  # type -> its first placed instance: the representative's
    for i in order:
        seg = sa.instances[i]
        for lo, hi in offsets[seg.type]:
            key = (seg.type, lo, _operators(analysis, seg.start + lo, seg.start + hi),
                   _strategies(analysis, seg.start + lo, seg.start + hi))
            wt = window_type.setdefault(key, len(window_type))
            w = Window(seg.start + lo, seg.start + hi, wt)
            first.setdefault(w.type, w)
            placed.append(w)
    windows = sorted(placed, key=lambda w: w.start)
    return windows, [windows.index(first[t]) for t in range(len(first))]


def _operators(analysis, start: int, end: int) -> tuple:
    """What the blocks ``[start, end)`` compute, independent of where: each member's kind and
    operand and result shapes and dtypes, as a sorted multiset (a scan's per-layer slices,
    which differ only in their offsets, compare equal; the iteration whose windows hold the
    update of the scan's stacked weights does not). Left out: what a step computes once for
    every layer and costs nothing beside it, members computed from constants alone (a causal
    mask from ``iota``) and members whose operands and results are all scalars (an optimizer's
    step count and its bias corrections). The first layer's window holds those, the others
    read them, and they would make it a window type of its own."""
    g = analysis.graph
    varying = memo(g, "computed_from_inputs", lambda: computed_from_inputs(g))

    def shapes(values):
        return tuple((g.values[v].shape, g.values[v].dtype) for v in values)

    def counts(op) -> bool:
        if not any(v in varying for v in op.outputs):
            return False
        return any(g.values[v].shape for v in (*op.inputs, *op.outputs))

    ops = [g.ops[m.op] for b in range(start, end) for m in analysis.blocks.blocks[b].members]
    return tuple(sorted(repr((op.primitive, shapes(op.inputs), shapes(op.outputs)))
                        for op in ops if counts(op)))


def _strategies(analysis, start: int, end: int) -> tuple:
    """The strategies of the blocks ``[start, end)`` (their mesh axes' loop dims, in order):
    a combination names strategies by index, so instances of one type must list the same
    ones (a member ``_operators`` leaves out still prunes its block's strategies)."""
    return tuple(tuple(st.axes for st in analysis.blocks.blocks[b].strategies)
                 for b in range(start, end))


def _cuts(analysis, seg, max_combinations: int) -> list[tuple[int, int]]:
    """Offsets of consecutive windows of ``seg`` whose spaces fit ``max_combinations`` (a
    single block larger than that stands alone)."""
    cuts, space = [0], 1
    for k, b in enumerate(range(seg.start, seg.end)):
        n = max(1, len(analysis.blocks.blocks[b].strategies))
        if k > cuts[-1] and space * n > max_combinations:
            cuts.append(k)
            space = 1
        space *= n
    return list(zip(cuts, cuts[1:] + [seg.end - seg.start]))


def window_space(analysis, window: Window) -> list[int]:
    """Strategies per block of ``window`` and, when it holds training state
    (``held_state``), the state layouts last: a combination is a strategy per block and,
    then, one of ``STATE_LAYOUTS`` for the state the window holds."""
    blocks = [len(analysis.blocks.blocks[b].strategies) for b in range(window.start, window.end)]
    return blocks + ([len(STATE_LAYOUTS)] if held_state(analysis, window) else [])


def first_readers(analysis) -> dict[int, int]:
    """Step input -> the block of its first reader in program order (the block whose strategy
    sets the layout it enters in)."""
    def make():
        out: dict[int, int] = {}
        for op in analysis.graph.ops:
            b = analysis.blocks.owner.get(op.index)
            if b is not None:
                for v in op.inputs:
                    if analysis.graph.values[v].producer is None:
                        out.setdefault(v, b)
        return out
    return memo(analysis.blocks, "first_readers", make)


def held_state(analysis, window: Window) -> tuple[int, ...]:
    """Indices of the state pairs (``Graph.state_pairs``) the window holds whole: its blocks
    read the leaf first and compute its new value. Its program takes them in the layout the
    plan stores them in and returns them so (the step's fixed point, inside the window), under
    the state layout its combination names; a pair split across windows stays as its first
    reader computes, its return priced as a boundary."""
    g, owner = analysis.graph, analysis.blocks.owner
    first = first_readers(analysis)
    inside = range(window.start, window.end)
    return memo(analysis.blocks, ("held_state", window.start, window.end), lambda: tuple(
        k for k, (v, new) in enumerate(g.state_pairs())
        if g.values[v].shape and first.get(v) in inside
        and owner.get(g.values[new].producer) in inside))


def state_layout(analysis, window: Window, combo) -> str:
    """The state layout a combination of ``window`` names (``plan`` when it holds none)."""
    n = window.end - window.start
    return STATE_LAYOUTS[combo[n]] if len(combo) > n else "plan"


def apply_state(analysis, window: Window, combo, sub, ins: list, outs: list,
                constraints: dict, axis_names) -> None:
    """The window's live-in and live-out specs and constraints (``window_layouts``), changed
    in place for the state it holds under ``combo``'s state layout (``held_state``,
    ``cfp.sharding.state_specs``)."""
    held = held_state(analysis, window)
    if not held:
        return
    g = analysis.graph
    pairs = g.state_pairs()
    at_in = {v: i for i, v in enumerate(sub.live_ins)}
    want = {pairs[k][0]: ins[at_in[pairs[k][0]]] for k in held}
    layout = state_layout(analysis, window, combo)
    stored = state_specs(g, held, {k: layout for k in held}, want, constraints,
                         analysis.mesh_shape, axis_names, ops=set(sub.ops))
    at_out = {v: i for i, v in enumerate(sub.live_outs)}
    for k in held:
        v, new = pairs[k]
        ins[at_in[v]] = want[v]
        if new in at_out:
            outs[at_out[new]] = stored[k]


def window_ops(analysis, window: Window) -> list[int]:
    return sorted(m.op for b in range(window.start, window.end)
                  for m in analysis.blocks.blocks[b].members)


def boundaries(analysis, windows: list[Window]) -> list[Boundary]:
    """Every tensor crossing between blocks of different window instances (see module doc)."""
    g, ba = analysis.graph, analysis.blocks
    window_of = {b: i for i, w in enumerate(windows) for b in range(w.start, w.end)}
    member = {m.op: m for b in ba.blocks for m in b.members}
    first_reader: dict[int, tuple[int, tuple]] = {}  # value -> (block, labels) of first reader
    out = []
    for op in g.ops:
        j = ba.owner.get(op.index)
        if j is None:
            continue
        for pos, v in enumerate(op.inputs):
            val = g.values[v]
            if not val.shape or (val.producer is None and val.input_index is None):
                continue  # scalars have no layout; constants are not boundaries
            want = member[op.index].ins[pos]
            if val.producer is not None and val.producer in member:
                i = ba.owner[val.producer]
                made = member[val.producer].outs[g.ops[val.producer].outputs.index(v)]
            elif val.producer is None:  # a step input: its first reader sets its layout
                i, made = first_reader.setdefault(v, (j, want))
            else:
                continue  # produced by an unclaimed operator: XLA decides
            if window_of[i] != window_of[j] or (val.producer is None and i != j):
                out.append(Boundary(v, val.shape, val.dtype, i, made, j, want))
    held = {k for w in windows for k in held_state(analysis, w)}
    for k, (v, new) in enumerate(g.state_pairs()):  # new state: back to the layout it came in
        val, producer = g.values[new], g.values[new].producer
        if k in held or not val.shape or producer not in member:
            continue  # scalars have no layout; an unclaimed producer's layout is XLA's
        i = ba.owner[producer]
        made = member[producer].outs[g.ops[producer].outputs.index(new)]
        j, want = first_reader.get(v, (i, (None,) * len(val.shape)))  # unread: replicated
        out.append(Boundary(new, val.shape, val.dtype, i, made, j, want))
    return _dedupe(out)


def _dedupe(items: list[Boundary]) -> list[Boundary]:
    seen, out = set(), []
    for b in items:
        key = (b.value, b.src, b.dst, b.src_labels, b.dst_labels)
        if key not in seen:
            seen.add(key)
            out.append(b)
    return out


def priced_alike(bounds, blocks) -> list[tuple]:
    """Per boundary, what prices it: its tensor, its labels and its two blocks' strategies.
    Boundaries with one key (the same tensor between the alike blocks of repeated layers)
    need the same reshardings at the same prices."""
    axes = [tuple(st.axes for st in b.strategies) for b in blocks]
    return [(b.shape, b.dtype, b.src_labels, b.dst_labels, axes[b.src], axes[b.dst])
            for b in bounds]


def layouts(labels, strategies, axis_names) -> tuple[list[tuple], list[int]]:
    """(the distinct layouts a tensor with ``labels`` takes under ``strategies``, and per
    strategy the index of its layout): boundaries are priced per distinct layout pair, which
    on large meshes are far fewer than the strategy pairs."""
    distinct: dict[tuple, int] = {}
    index = [distinct.setdefault(dimrules.spec_axes(labels, s.axes, axis_names), len(distinct))
             for s in strategies]
    return list(distinct), index


def shard_bytes(shape, dtype_size: int, spec, mesh_shape, axis_names) -> int:
    """Bytes of one device's shard of a tensor laid out as ``spec``."""
    return _shard_bytes(tuple(shape), dtype_size, tuple(spec), tuple(mesh_shape),
                        tuple(axis_names))


@functools.lru_cache(maxsize=2**16)
def _shard_bytes(shape, dtype_size: int, spec, mesh_shape, axis_names) -> int:
    n = math.prod(shape) * dtype_size
    for entry in spec:
        for name in (entry if isinstance(entry, tuple) else (entry,) if entry else ()):
            n //= mesh_shape[axis_names.index(name)]
    return n


def window_layouts(graph, blocks, strategies, sub, axis_names) -> tuple[list, list, dict]:
    """For a window under one strategy per block: live-in specs (as the first reader in program
    order wants them), live-out specs (as their producer makes them), and the constraints of
    its blocks' strategies (``block_constraints``)."""
    want, made, constraints = {}, {}, {}
    for block, strat in zip(blocks, strategies):
        for m in block.members:
            op = graph.ops[m.op]
            for v, lab in zip(op.inputs, m.ins):
                if v not in want or m.op < want[v][0]:
                    want[v] = (m.op, dimrules.spec_axes(lab, strat.axes, axis_names))
            for v, lab in zip(op.outputs, m.outs):
                made[v] = dimrules.spec_axes(lab, strat.axes, axis_names)
        constraints.update(block_constraints(block, strat, axis_names))
    none = lambda v: (None,) * len(graph.values[v].shape)  # noqa: E731
    ins = [want[v][1] if v in want else none(v) for v in sub.live_ins]
    outs = [made.get(v, none(v)) for v in sub.live_outs]
    return ins, outs, constraints


def inputs_read_earlier(analysis, windows: list[Window]) -> list[frozenset[int]]:
    """Per window, the step inputs it reads that an earlier window reads too (a step input
    is held once, so its bytes count in the first window that reads it)."""
    g, first, out = analysis.graph, {}, []
    for k, w in enumerate(windows):
        reads = [v for v in sub_program(g, window_ops(analysis, w)).live_ins
                 if g.values[v].input_index is not None]
        out.append(frozenset(v for v in reads if first.setdefault(v, k) != k))
    return out


