"""What a window holds in memory under a combination (``option_memory``), composed from its compiled
program's figures and the analysis: the weights gathered and held, the state, what the forward
pass keeps for the backward (``held_for_backward``: per platform, which elementwise results its
fusion recomputes), and the gradients that wait for their combined reduction."""
from __future__ import annotations

import dataclasses

from cfp import dims as dimrules
from cfp.graph import loss_op, memo
from cfp.sharding import sub_program
from cfp.windows import Window, held_state, shard_bytes, state_layout, window_ops


# XLA's default threshold for combining all-reduces and reduce-scatters
# (xla/service/collective_utils.h): gradients left waiting for a combined reduction are at
# most this many bytes at once.
COMBINED_REDUCTION_BYTES = 30 * 2**20


def option_memory(analysis, window: Window, combo, measured, axis_names,
                  read_earlier: frozenset[int] = frozenset(),
                  held: frozenset[int] | None = None,
                  terms: "MemoryTerms | None" = None) -> tuple[int, int, int, int, int]:
    """(bytes that add up over windows, transient bytes, held bytes, waiting bytes, remade
    bytes) of a window under ``combo``, per device.

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
    at once. Where the window's layer is recomputed (``MemoryTerms.remade``), what its
    forward pass would hold, and its weights gathered, are remade instead: its backward pass
    makes them again, for the whole layer at once (``cfp.solver.Problem.layer_starts``).
    ``held`` and ``terms`` (``memory_terms``) are what the caller computed already, for many
    combinations."""
    terms = terms or memory_terms(analysis, window, read_earlier, held)
    size, held_size, gathered_size = term_sizers(analysis, window, combo, axis_names)
    gathered = gathered_params(analysis, window, combo)
    # A held weight copy (a bfloat16 cast of a weight the backward pass reads) is among the
    # compiled window's weight copies, unless its weight is gathered first; an analytic
    # measurement has no copies, so there it counts held.
    copied = ({v for v, weight in terms.weight_copies if weight not in gathered}
              if measured.note != "analytic" else set())
    held_bytes = {t[0]: held_size(t) for t in terms.held if t[0] not in copied}
    held_bytes.update((t[0], n) for t in terms.gathered if (n := gathered_size(t)))
    adding = sum(size(*t) for t in terms.adding) + sum(held_bytes.values())
    gathered_extra = sum(size(*t, stored=False) - size(*t) for t in terms.adding
                         if t[0] in gathered)
    # A recomputed window's backward pass reads its weights as its barrier passes them, split,
    # and gathers them again: none is held gathered from the forward pass.
    regathered = 0
    if not terms.remade:
        adding += gathered_extra
    elif measured.note == "analytic":  # a compiled window's temporaries hold them already
        regathered = gathered_extra
    # A compiled window's temporaries include the activations it holds; an analytic one's
    # leave them out (``cfp.analytic``).
    held_internal = 0 if measured.note == "analytic" else sum(
        held_bytes.get(v, 0) for v in terms.internal)
    # Recomputed in the backward pass, what the forward pass would hold is made again there,
    # but for what the compiled window's temporaries count already (those it makes and reads
    # itself, and the weights it gathers).
    remade = sum(held_size(t) for t in terms.remade
                 if measured.note == "analytic" or t[0] not in terms.internal)
    # A table's gradient is held from the step's start (``MemoryTerms``), as its blocks
    # compute with it, whatever its state layout; it does not wait besides.
    adding += sum(size(*t, stored=False) for t in terms.adding if t[0] in terms.tables)
    whole = held_params(analysis, window) - gathered - terms.tables
    waiting = sum(size(*t, stored=False) for t in terms.adding if t[0] in whole)
    # The weight copies among the temporaries are held from the step's start
    # (``cfp.measure.weight_copy_bytes``).
    copies = measured.weight_copy_bytes
    return (adding + copies,
            max(0, measured.temp_bytes - held_internal - copies),
            sum(held_bytes.values()), waiting, remade + regathered)


def terms_key(analysis, window: Window, terms: MemoryTerms) -> tuple:
    """What ``option_memory`` reads of a window instance, with its values named by their
    order of appearance and their shapes: the window type, its blocks' strategies, the terms
    and the state it holds. Two instances with one key (the same block of repeated layers,
    reading and holding alike) have the same memory under every combination, so a deep
    model's layers are composed once (``cfp.problem.build_problem``)."""
    g = analysis.graph
    index: dict[int, int] = {}

    def name(v):
        return index.setdefault(v, len(index))

    def names(rows):
        return tuple(tuple(name(x) if i == 0 else x for i, x in enumerate(row)) for row in rows)

    from cfp.sharding import state_kinds
    kinds, pairs = state_kinds(g), g.state_pairs()
    key = (window.type,
           tuple(tuple(st.axes for st in analysis.blocks.blocks[b].strategies)
                 for b in range(window.start, window.end)),
           names(terms.adding), names(terms.held), names(terms.gathered),
           names(terms.remade),
           tuple(sorted(name(v) for v in terms.internal)),
           tuple(sorted((name(v), name(w)) for v, w in terms.weight_copies)),
           tuple((name(pairs[k][0]), kinds[k]) for k in held_state(analysis, window)))
    tables = tuple(sorted(index[v] for v in terms.tables if v in index))
    shapes = tuple(g.values[v].shape + (g.values[v].dtype,) for v in index)
    return key + (tables, shapes)


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
    weight_copies: frozenset = frozenset()  # (held value, the one weight it is made from)
    remade: tuple = ()  # held but for recompute: made again in the backward pass, as held


def memory_terms(analysis, window: Window, read_earlier: frozenset[int] = frozenset(),
                 held: frozenset[int] | None = None,
                 remade: frozenset[int] = frozenset()) -> MemoryTerms:
    """The window's ``MemoryTerms``, with ``held`` the activations the forward pass holds
    (``held_for_backward`` where None) and ``remade`` those it would hold that recompute
    makes again in the backward pass instead (``held_values``)."""
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
    held_terms, gathered, internal, again = [], [], set(), []
    for i in sub.ops:
        for v in g.ops[i].outputs:
            forward, backward = readers.get(v, ((), ()))
            if v in kept:
                held_terms.append((v, made[v], tuple(forward), tuple(backward)))
            elif v in remade and v in made:
                again.append((v, made[v], tuple(forward), tuple(backward)))
            elif i < backward_from and backward and v in made:
                gathered.append((v, made[v], tuple(backward)))
            else:
                continue
            if v not in leaving:
                internal.add(v)
    copies = weight_made(g)
    return MemoryTerms(tuple(adding), tuple(held_terms), frozenset(internal),
                       tuple(gathered), gather_tables(g, backward_from),
                       frozenset((t[0], copies[t[0]]) for t in held_terms if t[0] in copies),
                       tuple(again))


def weight_made(g) -> dict[int, int]:
    """value -> the parameter an op makes it from alone (with constants): a weight cast to
    bfloat16 or transposed. The compiled program holds these as weight copies
    (``cfp.measure.weight_copy_bytes``). Found once per graph."""
    def make():
        params = param_values(g)
        source = {v: v for v in params}
        for op in g.ops:
            found = {source.get(v, -1) for v in op.inputs  # constants aside
                     if g.values[v].producer is not None or g.values[v].input_index is not None}
            if len(found) == 1 and -1 not in found:
                source.update((v, next(iter(found))) for v in op.outputs)
        return {v: w for v, w in source.items() if v not in params}
    return memo(g, "weight_made", make)


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


def held_values(analysis, recompute, platform: str) -> frozenset[int]:
    """The activations the forward pass holds for the backward pass
    (``held_for_backward``) where ``recompute`` is applied: those of the
    step with the recompute inserted that the analysed step has. A recomputed layer holds
    its inputs (its barrier reads them) and what its policy saves; its other results are
    made again in the backward pass and held by none."""
    from cfp.recompute import traced_step
    if not recompute:
        return held_for_backward(analysis.graph, platform=platform)
    g = analysis.graph
    return frozenset(v for v in held_for_backward(traced_step(analysis, recompute).graph(),
                                                  platform=platform)
                     if v in g.values and g.values[v].producer is not None)


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
