"""Profiling windows and the boundaries between them (derived from the analysis alone).

A unique segment whose strategy space exceeds ``max_combinations`` is split into consecutive
*windows* whose spaces fit; every instance of the segment is split at the same offsets. Each
window type is profiled once, for every combination of its blocks' strategies. Segments repeat
by their contractions, so two instances of one window can still differ in other operators (the
first layer also gathers the embedding and updates its table): a window instance whose
operators (kinds and shapes) differ from those of the instance in its segment's representative
is a window type of its own, profiled on itself, so that no window is priced by another
program.

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
from cfp.graph import memo
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
            key = (seg.type, lo, _operators(analysis, seg.start + lo, seg.start + hi))
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
    update of the scan's stacked weights does not)."""
    g = analysis.graph

    def shapes(values):
        return tuple((g.values[v].shape, g.values[v].dtype) for v in values)

    ops = [g.ops[m.op] for b in range(start, end) for m in analysis.blocks.blocks[b].members]
    return tuple(sorted(repr((op.primitive, shapes(op.inputs), shapes(op.outputs)))
                        for op in ops))


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


# XLA's default threshold for combining all-reduces and reduce-scatters
# (xla/service/collective_utils.h): gradients left waiting for a combined reduction are at
# most this many bytes at once.
COMBINED_REDUCTION_BYTES = 30 * 2**20


def option_memory(analysis, window: Window, combo, measured, axis_names,
                  read_earlier: frozenset[int] = frozenset(),
                  held: frozenset[int] | None = None,
                  terms: "MemoryTerms | None" = None) -> tuple[int, int, int, int]:
    """(bytes that add up over windows, transient bytes, held bytes, waiting bytes) of a
    window under ``combo``, per device.

    Adding up: the window's parameters, optimizer state and batch coming in (those not in
    ``read_earlier``, held for an earlier window already; their updates take their place,
    donated), the step outputs it makes that are not state, the gradients of its tables
    (``MemoryTerms``), plus the activations it produces in the forward pass and holds for the
    backward pass (``held_for_backward``, each in the layout ``MemoryTerms`` says XLA keeps)
    or holds gathered (``MemoryTerms.gathered``). Transient: the compiled temporaries less
    the held activations inside them (an analytic measurement's hold none); one window's
    transient counts in the step's peak at a time, beside the held activations of the
    windows up to it (those of later windows the backward pass has freed: ``solver``). Held:
    the activations among the adding-up bytes. The weight copies of a compiled window
    (``cfp.measure.weight_copy_bytes``: a weight in another layout or type, made from nothing
    the step computes) add up, taken out of its transient: the whole step makes them at its
    start. Waiting: the gradients of the parameters the
    window holds and its state layout keeps whole (``plan``, ``zero1``), at the layout its
    blocks compute with. XLA combines their reductions into groups of up to
    ``COMBINED_REDUCTION_BYTES``, so each waits from the window's backward pass until its
    group is complete, on a small model to near the step's end (``scripts/composed_memory.py
    --peak-top`` lists them live at the compiled peak); a split layout (``fsdp``) reduces each
    at once. ``held`` and ``terms`` (``memory_terms``) are what the caller computed already,
    for many combinations."""
    terms = terms or memory_terms(analysis, window, read_earlier, held)
    size, held_size, gathered_size = term_sizers(analysis, window, combo, axis_names)
    held_bytes = {t[0]: held_size(t) for t in terms.held}
    held_bytes.update((t[0], n) for t in terms.gathered if (n := gathered_size(t)))
    adding = sum(size(*t) for t in terms.adding) + sum(held_bytes.values())
    gathered = gathered_params(analysis, window, combo)
    adding += sum(size(*t, stored=False) - size(*t) for t in terms.adding if t[0] in gathered)
    # A compiled window's temporaries include the activations it holds; an analytic one's
    # leave them out (``cfp.analytic``).
    held_internal = 0 if measured.note == "analytic" else sum(
        held_bytes.get(v, 0) for v in terms.internal)
    # A table's gradient is held from the step's start (``MemoryTerms``), as its blocks
    # compute with it, whatever its state layout; it does not wait besides.
    adding += sum(size(*t, stored=False) for t in terms.adding if t[0] in terms.tables)
    whole = held_params(analysis, window) - gathered - terms.tables
    waiting = sum(size(*t, stored=False) for t in terms.adding if t[0] in whole)
    # The weight copies among the temporaries are held from the step's start
    # (``cfp.measure.weight_copy_bytes``).
    copies = measured.weight_copy_bytes
    return (adding + copies, max(0, measured.temp_bytes - held_internal - copies),
            sum(held_bytes.values()), waiting)


def gathered_params(analysis, window: Window, combo) -> frozenset[int]:
    """The parameters ``combo`` stores split (``fsdp``) that the window gathers to compute
    with. XLA gathers them early and holds them gathered until the backward pass is done with
    them, across the windows between (the compiled peaks of whole steps say so:
    ``scripts/composed_memory.py``), so each counts whole, as its blocks compute with it, in
    the memory that adds up over windows."""
    if state_layout(analysis, window, combo) != "fsdp":
        return frozenset()
    return held_params(analysis, window)


def held_params(analysis, window: Window) -> frozenset[int]:
    """The step inputs that are parameters among the state the window holds
    (``held_state``)."""
    from cfp.sharding import state_kinds
    kinds, pairs = state_kinds(analysis.graph), analysis.graph.state_pairs()
    return frozenset(pairs[k][0] for k in held_state(analysis, window) if kinds[k] == "param")


def term_sizers(analysis, window: Window, combo, axis_names):
    """Bytes per device of a step input or output term (value, block position or None,
    labels), of a held activation term (``MemoryTerms.held``), and of a gathered residual
    term (``MemoryTerms.gathered``: 0 where no backward reader wants a larger layout)."""
    from cfp.sharding import split_rest, state_kinds
    blocks = [analysis.blocks.blocks[b] for b in range(window.start, window.end)]
    axes = [b.strategies[k].axes for b, k in zip(blocks, combo)]
    g, mesh_shape = analysis.graph, analysis.mesh_shape
    layout, split = state_layout(analysis, window, combo), set()
    if layout != "plan":  # the state inputs stored split (``apply_state``)
        kinds, pairs = state_kinds(g), g.state_pairs()
        split = {pairs[k][0] for k in held_state(analysis, window)
                 if layout == "fsdp" or kinds[k] == "opt"}

    def spec(v, k, labels, stored=True):
        s = ((None,) * len(g.values[v].shape) if k is None
             else dimrules.spec_axes(labels, axes[k], axis_names))
        return (split_rest(s, g.values[v].shape, mesh_shape, axis_names)
                if stored and v in split else s)

    def nbytes(v, s):
        return shard_bytes(g.values[v].shape, _itemsize(g.values[v].dtype), s, mesh_shape,
                           axis_names)

    def size(v, k, labels, stored=True):
        return nbytes(v, spec(v, k, labels, stored))

    def held_size(term):
        v, made, forward, backward = term
        early = {spec(v, *r) for r in forward}
        kept = [spec(v, *made)] + [s for s in (spec(v, *r) for r in backward) if s in early]
        return max(nbytes(v, s) for s in kept)

    def gathered_size(term):
        v, made, backward = term
        largest = max(nbytes(v, spec(v, *r)) for r in backward)
        return largest if largest > size(v, *made) else 0

    return size, held_size, gathered_size


@dataclasses.dataclass(frozen=True)
class MemoryTerms:
    """The tensors of a window instance whose bytes ``option_memory`` counts.

    A step input or output is (value, position of the block whose strategy lays it out or None
    when replicated, its labels). A held activation is (value, its producer's (position,
    labels), its forward readers' in the window, its backward readers' in the window). It is
    held in the producer's layout, unless a backward reader wants a layout that a forward
    reader wanted too: XLA then keeps the forward pass's copy (an all-gather's result, say)
    instead of gathering again, and the larger layout counts.

    A gathered residual is (value, its producer's (position, labels), its backward readers'
    in the window): a forward result the held set leaves to recomputation (a cheap
    elementwise op's) that the backward pass reads. Where a backward reader wants it in a
    larger layout than its producer makes, it is held in the largest such layout: a backward
    fusion cannot recompute past the all-gather, and XLA keeps the gathered copy from the
    forward pass to the backward.
    Otherwise it is recomputed and counts nothing.

    A table is a parameter that a gather reads in the forward pass (an embedding). Its
    gradient is a scatter-add into a zeroed buffer of its size, which XLA allocates at the
    step's start and holds to the gradient's reduction (``scripts/composed_memory.py
    --peak-top`` lists it live at the compiled peak)."""

    adding: tuple  # step inputs not read earlier, step outputs
    held: tuple = ()  # activations the window holds for its backward pass
    internal: frozenset = frozenset()  # the held and gathered ones that do not leave the window
    gathered: tuple = ()  # residuals held where a backward reader gathers them
    tables: frozenset = frozenset()  # the step's parameters a forward gather reads


def memory_terms(analysis, window: Window, read_earlier: frozenset[int] = frozenset(),
                 held: frozenset[int] | None = None) -> MemoryTerms:
    g = analysis.graph
    blocks = [analysis.blocks.blocks[b] for b in range(window.start, window.end)]
    sub = sub_program(g, window_ops(analysis, window))
    kept = held_for_backward(g) if held is None else held
    loss = loss_op(g)
    backward_from = len(g.ops) if loss is None else loss  # no backward pass: none
    want, made = {}, {}  # live-ins as their first reader wants them; results as made
    readers = {}  # value -> ([forward readers], [backward readers]) in the window
    for k, block in enumerate(blocks):
        for m in block.members:
            op = g.ops[m.op]
            for v, lab in zip(op.inputs, m.ins):
                if v not in want or m.op < want[v][0]:
                    want[v] = (m.op, k, lab)
                readers.setdefault(v, ([], []))[m.op > backward_from].append((k, lab))
            for v, lab in zip(op.outputs, m.outs):
                made[v] = (k, lab)
    adding = [(v,) + (want[v][1:] if v in want else (None, None)) for v in sub.live_ins
              if g.values[v].input_index is not None and v not in read_earlier]
    # The new state is donated: it takes its input's place, counted with the input.
    outputs = set(g.outputs) - {new for _, new in g.state_pairs()}
    leaving = set(sub.live_outs)
    adding += [(v,) + made.get(v, (None, None)) for v in sub.live_outs if v in outputs]
    held_terms, gathered, internal = [], [], set()
    for i in sub.ops:
        for v in g.ops[i].outputs:
            forward, backward = readers.get(v, ((), ()))
            if v in kept:
                held_terms.append((v, made[v], tuple(forward), tuple(backward)))
            elif i < backward_from and backward and v in made:
                gathered.append((v, made[v], tuple(backward)))
            else:
                continue
            if v not in leaving:
                internal.add(v)
    return MemoryTerms(tuple(adding), tuple(held_terms), frozenset(internal),
                       tuple(gathered), gather_tables(g, backward_from))


def gather_tables(g, backward_from: int) -> frozenset[int]:
    """The step's parameters that a gather before ``backward_from`` reads as its table
    (``MemoryTerms``), found once per graph."""
    def make():
        params = param_values(g)
        return frozenset(op.inputs[0] for op in g.ops[:backward_from]
                         if op.primitive == "gather" and op.inputs[0] in params)
    return memo(g, "gather_tables", make)


def param_values(g) -> frozenset[int]:
    """The step inputs that are parameters (``cfp.sharding.state_kinds``)."""
    def make():
        from cfp.sharding import state_kinds
        pairs = g.state_pairs()
        return frozenset(pairs[k][0] for k, kind in enumerate(state_kinds(g)) if kind == "param")
    return memo(g, "param_values", make)


# Elementwise ops XLA does not duplicate into another fusion (``IsExpensive``): a backward op
# that reads their result reads it from memory, so the forward pass holds it.
EXPENSIVE = frozenset("""div rem pow exp exp2 log log1p expm1 tanh logistic sin cos tan sqrt rsqrt
cbrt erf erfc erf_inv atan2 acos asin atan sinh cosh asinh acosh atanh lgamma digamma""".split())
GPU_CHEAP = frozenset({"div", "sqrt", "rsqrt", "exp"})


def loss_op(g) -> int | None:
    """Index of the op computing the step's loss, its last output when that is a scalar an
    op computes: the backward pass comes after it. None where there is none (a forward
    step, a loss passed through)."""
    loss = g.values[g.outputs[-1]] if g.outputs else None
    return None if loss is None or loss.shape else loss.producer


def read_back_across(analysis) -> frozenset[tuple[int, int, tuple]]:
    """(value, block, labels) where a block's backward pass reads, under those labels, a
    forward result another block makes. Where the reader wants it in a larger layout than
    its maker makes, the resharded copy (an all-gather's result) is held from the reader's
    forward pass to its backward, whether or not the forward pass holds the value itself: a
    fusion that would recompute an elementwise result cannot recompute it past the
    all-gather (the compiled peak of a step whose vocabulary projection gathers the batch
    holds the final layer norm's values gathered: ``cfp_test/test_state_layouts.py``)."""
    def make():
        g, owner, loss = analysis.graph, analysis.blocks.owner, loss_op(analysis.graph)
        if loss is None:
            return frozenset()
        return frozenset((v, b.index, labels) for b in analysis.blocks.blocks
                         for m in b.members if m.op > loss
                         for v, labels in zip(g.ops[m.op].inputs, m.ins)
                         if (made := g.values[v].producer) is not None and made < loss
                         and owner.get(made, b.index) != b.index)
    return memo(analysis.blocks, "read_back_across", make)


def held_for_backward(g, elementwise_residuals: bool = True,
                      platform: str = "cpu") -> frozenset[int]:
    """The activations the forward pass holds for the backward pass: produced before the
    loss, read after it, and materialized. Held as they are: a contraction's or a reduction's
    result, and an operand that a backward contraction (or remat's recomputation) reads. A
    value only elementwise ops read after the loss is held where its op is expensive to
    recompute on ``platform`` (``expensive``: a gelu's tanh; a softmax's exp on CPU); the
    result of a cheap elementwise or layout op (a bias add, a scale) is recomputed inside the
    backward fusion that reads it, so what that op reads is held instead, down to a
    materialized value. Without ``elementwise_residuals`` (the rule before these counted)
    such values are not held."""
    return memo(g, ("held_for_backward", elementwise_residuals, platform),
                lambda: _held_for_backward(g, elementwise_residuals, platform))


def expensive(primitive: str, dtype: str, platform: str) -> bool:
    """Whether XLA on ``platform`` keeps an elementwise op's result rather than duplicate the
    op into each fusion that reads it, by XLA's ``IsExpensive``: ``EXPENSIVE``, less on GPU
    a divide, square root, reciprocal square root or exp in float32 or float16, which XLA's
    GPU fusion names as cheap (single hardware instructions). A rule, not the fusion itself:
    XLA's GPU priority fusion weighs a cost model too and can recompute more (a bfloat16 exp,
    a tanh, in a deviceless A100 compile), which the composition then counts high."""
    if platform == "gpu" and dtype in ("float32", "float16") and primitive in GPU_CHEAP:
        return False
    return primitive in EXPENSIVE


def _held_for_backward(g, elementwise_residuals: bool, platform: str) -> frozenset[int]:
    from cfp.blocks import LAYOUT_OPS
    loss = loss_op(g)
    if loss is None:
        return frozenset()
    recomputed = set(dimrules.ELEMENTWISE) | set(LAYOUT_OPS) | {"broadcast_in_dim", "iota"}
    out, seen = set(), set()

    def read_late(v):  # by a backward fusion, which recomputes a cheap op's result
        producer = g.values[v].producer
        if producer is None or producer > loss or v in seen:
            return
        seen.add(v)
        op = g.ops[producer]
        if op.primitive in recomputed and not expensive(op.primitive, g.values[v].dtype,
                                                        platform):
            for x in op.inputs:
                read_late(x)
        else:
            out.add(v)

    for op in g.ops[:loss]:
        stored = op.is_contraction or op.primitive in dimrules.REDUCTIONS
        for v in op.outputs:
            late = [u for u in g.users.get(v, ()) if u > loss]
            if late and (stored or any(_feeds_contraction(g, u) for u in late)):
                out.add(v)
            elif late and elementwise_residuals:
                read_late(v)
    return frozenset(out)


def _feeds_contraction(g, op_index: int, depth: int = 3) -> bool:
    """Whether an op is a contraction, or a layout op (reshape, transpose, convert) on the way
    to one, or remat's barrier (its operands are what remat saves for the backward pass)."""
    from cfp.blocks import LAYOUT_OPS
    op = g.ops[op_index]
    if op.is_contraction or op.primitive == "optimization_barrier":
        return True
    if op.primitive not in LAYOUT_OPS or depth == 0:
        return False
    return any(_feeds_contraction(g, u, depth - 1) for v in op.outputs
               for u in g.users.get(v, ()))


def _itemsize(dtype: str) -> int:
    from cfp.jax_compat import itemsize
    return itemsize(dtype)
