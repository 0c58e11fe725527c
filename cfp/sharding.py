"""Turning block strategies into shardings, sub-programs and compiled collectives.

- ``sub_program``: the operators of a set (a block, a segment), with their live-ins and live-outs,
  as a function that re-evaluates exactly those equations of the traced step.
- ``block_constraints``: a strategy's sharding constraints on a block's contractions (operands
  and results) and on every other member's labelled results, applied with
  ``jax.lax.with_sharding_constraint`` while re-evaluating.
- ``collectives``: the collectives of a compiled program (kind, bytes, mesh axes), read from
  ``Compiled.as_text()``.
- ``check_communication_free``: compile a block alone under a strategy and list every collective
  the strategy does not name.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from typing import Callable, Sequence

import numpy as np

from cfp import dims as dimrules
from cfp.blocks import Block
from cfp.jax_compat import to_dtype
from cfp.graph import Graph, memo
from cfp.program import Program

COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute")


@dataclasses.dataclass(frozen=True)
class SubProgram:
    ops: tuple[int, ...]  # program order
    live_ins: tuple[int, ...]
    live_outs: tuple[int, ...]


def sub_program(graph: Graph, ops: Sequence[int]) -> SubProgram:
    """The operators ``ops`` as a program: what they read from outside and what escapes."""
    ops = tuple(sorted(ops))
    opset = set(ops)
    produced = {v for i in ops for v in graph.ops[i].outputs}
    live_ins: dict[int, None] = {}
    for i in ops:
        for v in graph.ops[i].inputs:
            if v not in produced and not _is_const(graph, v):
                live_ins.setdefault(v)
    outputs = set(graph.outputs)
    live_outs = [v for i in ops for v in graph.ops[i].outputs
                 if v in outputs or any(u not in opset for u in graph.users.get(v, ()))]
    return SubProgram(ops, tuple(live_ins), tuple(live_outs))


def _is_const(graph: Graph, v: int) -> bool:
    val = graph.values[v]
    return val.producer is None and val.input_index is None


def step_function(program: Program, *, constraints: dict[int, tuple[list, list]],
                  mesh) -> tuple[Callable, bool]:
    """``(f(*step_inputs) -> step_outputs, rolled)``: the whole step under ``constraints``.
    Its scans stay ``lax.scan``s (``rolled``) when the constraints are the same in every
    iteration, as the search makes them; otherwise the scans run unrolled, as analysed."""
    rolled = program.scans and program.rolls(constraints)
    g = program.graph()
    sub = None if rolled else SubProgram(tuple(range(len(g.ops))), tuple(g.inputs),
                                         tuple(g.outputs))
    return sub_function(program, sub, constraints=constraints, mesh=mesh), rolled


def sub_function(program: Program, sub: SubProgram | None, *,
                 constraints: dict[int, tuple[list, list]] | None = None,
                 mesh=None, tagged: bool = False) -> Callable:
    """``f(*live_ins) -> live_outs`` re-evaluating ``sub``'s equations, with sharding
    constraints ``{op: (operand specs, result specs)}`` (``None`` entries: unconstrained).
    ``tagged``: every equation runs in a named scope of its position in ``sub`` (``op_tag``),
    so its compiled counterparts can be found by their metadata (``tagged_op``). ``sub=None``:
    the whole step, as traced (``Program.evaluate_rolled``)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    constraints = constraints or {}

    def constrain(values, specs):
        return [v if s is None else jax.lax.with_sharding_constraint(
            v, NamedSharding(mesh, PartitionSpec(*s))) for v, s in zip(values, specs)]

    def before(i, args):
        return constrain(args, constraints[i][0]) if i in constraints else args

    def after(i, outs):
        return constrain(outs, constraints[i][1]) if i in constraints else outs

    if sub is None:  # the whole step, its scans rolled
        return lambda *inputs: program.evaluate_rolled(
            inputs, before=before if constraints else None,
            after=after if constraints else None)

    def fn(*live_ins):
        env = program.evaluate([], ops=sub.ops, env=dict(zip(sub.live_ins, live_ins)),
                               before=before if constraints else None,
                               after=after if constraints else None,
                               scopes={i: op_tag(k) for k, i in enumerate(sub.ops)}
                               if tagged else None)
        return [env[v] for v in sub.live_outs]

    return fn


def op_tag(position: int) -> str:
    """The named scope of the equation at ``position`` in a sub-program
    (``sub_function(tagged=True)``). Positions, not the step's operator indices: two
    sub-programs that differ only in where they sit in the step (two layers' blocks) compile
    to the same program, which JAX's persistent compilation cache then serves for both, with
    the metadata of whichever compiled first; by position, its tags read right for both."""
    return f"cfp_op{position}"


def block_constraints(block: Block, strategy, axis_names) -> dict[int, tuple[list, list]]:
    """Sharding constraints a strategy puts on a block: every contraction's operands and
    result, and every other member's labelled results, each in the layout the strategy gives
    it. Left free, XLA splits values the plan keeps whole (and the other way round) wherever
    that looks cheaper to it, adding collectives no strategy names."""
    out = {}
    spec = lambda l: dimrules.spec_axes(l, strategy.axes, axis_names)  # noqa: E731
    contractions = {m.op for m in block.contractions}
    for m in block.members:
        if m.op in contractions:
            out[m.op] = ([spec(l) for l in m.ins], [spec(l) for l in m.outs])
        elif any(l is not None for lab in m.outs for l in lab):
            out[m.op] = ([None] * len(m.ins), [spec(l) for l in m.outs])
    return out


def state_updates(graph: Graph) -> dict[int, int]:
    """The values of the optimizer update, each with the index of the state pair
    (``Graph.state_pairs``) whose new value it computes: walking back from each new state
    leaf through the elementwise operators of its shape, down to and including the values
    they start from (a gradient: a contraction's, a reduction's or a scatter's result).
    Under a plan that splits the state, these are computed in the state's split layout:
    the gradient reduced into it, the update on shards. No model is named: the walk stops
    at the first operator that is not elementwise, so the backward pass stays the block's.
    With them, the update's statistics of their shape (``_statistics``: a global norm's
    squares), computed in the same layout."""
    return _updates(graph)[0]


def _updates(graph: Graph) -> tuple[dict[int, int], dict[int, int]]:
    """(``state_updates``, ``update_statistics``), found once per graph."""
    def make():
        walked = _state_updates(graph)
        values, ops = _statistics(graph, walked)
        return {**walked, **values}, ops
    return memo(graph, "updates", make)


def _state_updates(graph: Graph) -> dict[int, int]:
    out: dict[int, int] = {}
    for k, (_, new) in enumerate(graph.state_pairs()):
        shape = graph.values[new].shape
        stack = [new] if shape else []
        while stack:
            v = stack.pop()
            op = graph.producer_op(v)
            if v in out or op is None:
                continue
            out[v] = k
            if op.primitive in dimrules.ELEMENTWISE:
                stack += [u for u in op.inputs if graph.values[u].shape == shape]
    return out


def update_statistics(graph: Graph) -> dict[int, int]:
    """The operators of the optimizer update's statistics, each with its state pair's index
    (``_statistics``): a global norm's squares and their sum, Adafactor's row and column
    statistics and what carries them into their parameter's update. Under a layout that
    splits the dims they reduce or broadcast, each may need a collective: the update implies
    it, so the strategy check names it, under any state layout."""
    return _updates(graph)[1]


_CARRIERS = frozenset(("broadcast_in_dim", "reshape", "transpose", "squeeze",
                       "expand_dims")) | dimrules.ELEMENTWISE


def _statistics(graph: Graph, updates: dict[int, int]) -> tuple[dict[int, int], dict[int, int]]:
    """(values, operators) computed from the update values ``updates`` or the state leaves
    outside the walk back from the new state: from each, its readers that lead only to
    reductions or into an update value (the square of a gradient whose sum a global norm takes;
    Adafactor's statistics, raised to a power and broadcast into its parameter's update, and
    its parameter scale, the mean square of the parameter), through elementwise and layout
    operators. Their elementwise results of the update
    value's shape are computed in its layout (``values``), so a split layout sums shards
    rather than gathering the gradient whole; ``operators`` are all of them, reductions
    included."""
    values: dict[int, int] = {}
    ops: dict[int, int] = {}
    starts = list(updates.items()) + [(v, k) for k, (v, _) in enumerate(graph.state_pairs())]
    for v, k in starts:
        shape = graph.values[v].shape
        if not shape:
            continue  # a step count: scalars have no layout
        for first in graph.users.get(v, ()):
            if any(o in updates for o in graph.ops[first].outputs):
                continue  # the update itself
            found_values, found_ops, stack, ok = set(), set(), [first], True
            while stack and ok:
                r = stack.pop()
                op = graph.ops[r]
                if r in found_ops or any(o in updates for o in op.outputs):
                    continue  # seen, or it joins an update
                found_ops.add(r)
                if op.primitive in dimrules.REDUCTIONS:
                    continue
                if op.primitive not in _CARRIERS:
                    ok = False  # other work reads it (the forward or backward pass)
                    break
                found_values |= {o for o in op.outputs if graph.values[o].shape == shape
                                 and op.primitive in dimrules.ELEMENTWISE}
                stack += [u for o in op.outputs for u in graph.users.get(o, ())]
            if ok:
                for x in found_values:
                    values.setdefault(x, k)
                for r in found_ops:
                    ops.setdefault(r, k)
    return values, ops


STATE_LAYOUTS = ("plan", "zero1", "fsdp")  # where a plan keeps a state leaf between steps

def state_kinds(graph: Graph) -> list[str]:
    """Per state pair (``Graph.state_pairs``), ``param`` when an operator outside the
    optimizer update (``state_updates``) reads the leaf, as the forward pass reads a
    parameter, else ``opt`` (optimizer state, which only the update reads)."""
    def make():
        update_ops = {graph.values[u].producer for u in state_updates(graph)}
        return ["param" if any(r not in update_ops for r in graph.users.get(v, ())) else "opt"
                for v, _ in graph.state_pairs()]
    return memo(graph, "state_kinds", make)


def _axes(entry) -> tuple:
    """The mesh axes of one PartitionSpec entry (None, a name, or a tuple of names)."""
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def split_rest(spec, shape, mesh_shape, axis_names) -> tuple:
    """``spec`` split further over the mesh axes it leaves replicated: each such axis (of
    size > 1), in mesh order, on the first dim it leaves whole that the axis divides, else on
    the first split dim it divides further; an axis that divides no dim leaves it whole."""
    return _split_rest(tuple(spec), tuple(shape), tuple(mesh_shape), tuple(axis_names))


@functools.lru_cache(maxsize=2**16)
def _split_rest(spec, shape, mesh_shape, axis_names) -> tuple:
    entries = [_axes(e) for e in spec]
    size = dict(zip(axis_names, mesh_shape))
    used = {a for e in entries for a in e}
    for a in axis_names:
        if size[a] == 1 or a in used:
            continue
        fits = [d for d in range(len(shape))
                if (shape[d] // math.prod(size[b] for b in entries[d])) % size[a] == 0]
        for d in sorted(fits, key=lambda d: bool(entries[d]))[:1]:
            entries[d] = entries[d] + (a,)
    return tuple(None if not e else e[0] if len(e) == 1 else e for e in entries)


def refines(spec, coarse) -> bool:
    """Whether ``spec`` splits each dim over the axes ``coarse`` splits it over, and maybe
    more after them: a layout reached from ``coarse`` by splitting further, no data moved.

    >>> refines(("m0", ("m1", "m2")), ("m0", "m1")), refines((None, "m0"), ("m0", None))
    (True, False)
    """
    return len(spec) == len(coarse) and all(
        _axes(f)[:len(_axes(c))] == _axes(c) for f, c in zip(spec, coarse))


def state_specs(graph: Graph, pairs, layouts, ins: dict, constraints: dict, mesh_shape,
                axis_names, ops=None) -> dict:
    """Apply state layouts in place: ``layouts[k]`` (one of ``STATE_LAYOUTS``) for each state
    pair index ``k`` in ``pairs``; ``ins`` maps a step input to the spec its first reader
    wants, ``constraints`` an operator to its (operand, result) specs. ``zero1`` splits the
    optimizer state over the mesh axes that spec leaves replicated (``split_rest``), ``fsdp``
    the parameters too; under either the optimizer update (``state_updates``) is constrained
    to the split layout, so the gradient is reduced into it and the update runs on shards
    (the operators in ``ops``, all when None). A gradient that its block makes split in a
    layout the split one does not refine (a tied embedding's, computed split by vocabulary
    in the head and stored split by hidden) keeps its block's layout: constrained, XLA
    would gather the contraction's other operand whole to make it so. Returns the stored
    spec of every pair in ``pairs``: the new state leaves in it."""
    state, kinds = graph.state_pairs(), state_kinds(graph)
    stored, split = {}, {}
    for k in pairs:
        v = state[k][0]
        split[k] = split_rest(ins[v], graph.values[v].shape, mesh_shape, axis_names)
        if layouts[k] == "fsdp" or (layouts[k] == "zero1" and kinds[k] == "opt"):
            ins[v] = split[k]
        stored[k] = ins[v]
    updates = memo(graph, "updates_by_pair", lambda: _updates_by_pair(graph))
    for k in stored:  # the update on shards
        if layouts[k] == "plan":
            continue
        for u in updates.get(k, ()):
            op = graph.producer_op(u)
            if ops is not None and op.index not in ops:
                continue
            operands, results = constraints.get(op.index, ([None] * len(op.inputs),
                                                           [None] * len(op.outputs)))
            results = list(results)
            made = results[op.outputs.index(u)]
            if (op.primitive not in dimrules.ELEMENTWISE and made is not None
                    and not refines(split[k], made)):
                continue  # its block splits it otherwise: resharded where the update reads it
            results[op.outputs.index(u)] = split[k]
            constraints[op.index] = (list(operands), results)
    return stored


def _updates_by_pair(graph: Graph) -> dict[int, list[int]]:
    """``state_updates`` per state pair: the values of its update, in program order."""
    out: dict[int, list[int]] = {}
    for u, k in state_updates(graph).items():
        out.setdefault(k, []).append(u)
    return out


def member_layouts(members, graph: Graph, sub: SubProgram, strategy, axis_names
                   ) -> tuple[list, list]:
    """PartitionSpec entries for a sub-program's live-ins (as their readers want them; a dim
    readers disagree on is replicated) and live-outs (as their producer makes them);
    unlabelled tensors are replicated."""
    wanted: dict[int, tuple] = {}
    made: dict[int, tuple] = {}
    for m in members:
        op = graph.ops[m.op]
        for v, lab in zip(op.inputs, m.ins):
            old = wanted.setdefault(v, lab)  # readers that disagree get it replicated there
            wanted[v] = tuple(a if a == b else None for a, b in zip(old, lab))
        for v, lab in zip(op.outputs, m.outs):
            made[v] = lab

    def spec(v, table):
        lab = table.get(v) or (None,) * len(graph.values[v].shape)
        return dimrules.spec_axes(lab, strategy.axes, axis_names)

    return [spec(v, wanted) for v in sub.live_ins], [spec(v, made) for v in sub.live_outs]


# ---------------------------------------------------------------------------------------------
# Reading collectives from compiled HLO


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of COLLECTIVE_KINDS
    bytes: int  # bytes of the result on one device
    axes: tuple[int, ...] | None  # mesh axes its groups run along; None if they match none
    line: str
    op: int | None = None  # the operator it serves, where a check attributed it


_COLL_RE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+(" +
                      "|".join(COLLECTIVE_KINDS) + r")(-start)?\(")
_TYPE_RE = re.compile(r"(pred|[a-z]+\d+)\[([\d,]*)\]")
HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
             "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def collectives(hlo_text: str, mesh_shape: tuple[int, ...]) -> list[Collective]:
    """Every collective of a compiled HLO module (``-done`` halves of async pairs skipped)."""
    found = []
    for line in hlo_text.splitlines():
        m = _COLL_RE.match(line)
        if not m:
            continue
        types, kind, start = m.group(1), m.group(2), m.group(3)
        shapes = [(t, [int(d) for d in dims.split(",") if d]) for t, dims in _TYPE_RE.findall(types)]
        if start and len(shapes) > 1:  # async start: (operands..., results...)
            shapes = shapes[len(shapes) // 2:]
        nbytes = sum(HLO_BYTES.get(t, 4) * math.prod(d) for t, d in shapes)
        found.append(Collective(kind, nbytes, _axes_of(line, kind, mesh_shape), line.strip()))
    return found


def _parse_groups(line: str, n: int) -> list[list[int]] | None:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:<=\[([\d,]+)\](?:T\(([\d,]+)\))?|"
                  r", device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}", line)
    if m:  # Shardy's form: mesh['a'=4,'b'=2] {'a'}: groups run along the named axes
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        sizes = [int(x) for _, x in axes]
        ids = np.arange(math.prod(sizes))
        shape, perm = (m.group(2), m.group(3)) if m.group(2) else (m.group(4), m.group(5))
        if shape:
            ids = ids.reshape([int(x) for x in shape.split(",")])
            if perm:
                ids = ids.transpose([int(x) for x in perm.split(",")])
        ids = ids.reshape(sizes)
        chosen = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in m.group(6)]
        others = [i for i in range(len(sizes)) if i not in chosen]
        moved = np.transpose(ids, others + chosen)
        return moved.reshape(-1, math.prod(sizes[i] for i in chosen) if chosen else 1).tolist()
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        base = np.arange(math.prod(int(x) for x in m.group(2).split(","))).reshape(
            [int(x) for x in m.group(2).split(",")])
        if m.group(3):
            base = base.transpose([int(x) for x in m.group(3).split(",")])
        return base.reshape(shape).reshape(shape[0], -1).tolist()
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if m:
        groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}",
                                                                            m.group(1))]
        return groups if groups and groups[0] else [list(range(n))]
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
    if m:
        pairs = [tuple(int(x) for x in p.split(",")) for p in re.findall(r"\{(\d+,\d+)\}",
                                                                         m.group(1))]
        return [list(p) for p in pairs]
    return None


def _axes_of(line: str, kind: str, mesh_shape) -> tuple[int, ...] | None:
    n = math.prod(mesh_shape)
    groups = _parse_groups(line, n)
    if groups is None:
        return None
    coords = np.array(np.unravel_index(np.arange(n), mesh_shape)).T  # device -> mesh coords
    if kind == "collective-permute":
        axes = set()
        for a, b in groups:
            axes |= {i for i in range(len(mesh_shape)) if coords[a][i] != coords[b][i]}
        return tuple(sorted(axes))
    wanted = {frozenset(g) for g in groups}
    for r in range(1, len(mesh_shape) + 1):
        for axes in _subsets(len(mesh_shape), r):
            others = [i for i in range(len(mesh_shape)) if i not in axes]
            part: dict[tuple, set] = {}
            for d in range(n):
                part.setdefault(tuple(coords[d][others]), set()).add(d)
            if {frozenset(s) for s in part.values()} == wanted:
                return axes
    return None


def _subsets(n: int, r: int):
    import itertools
    return [tuple(c) for c in itertools.combinations(range(n), r)]


# ---------------------------------------------------------------------------------------------
# The communication-free check


def compile_block(program: Program, graph: Graph, block: Block, strategy, mesh, *,
                  members=None):
    """Compile a block's members (those that need no collective under ``strategy``) alone,
    constrained as in the profile and the step (``block_constraints``); returns the compiled
    program and the operators it holds, in the order of their tags."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    mesh_shape = tuple(mesh.devices.shape)
    members = members if members is not None else block.members_under(strategy, mesh_shape)
    sub = sub_program(graph, [m.op for m in members])
    names = mesh.axis_names
    in_specs, out_specs = member_layouts(members, graph, sub, strategy, names)
    constraints = block_constraints(dataclasses.replace(block, members=tuple(members)),
                                    strategy, names)
    fn = sub_function(program, sub, constraints=constraints, mesh=mesh, tagged=True)
    shard = lambda s: NamedSharding(mesh, PartitionSpec(*s))  # noqa: E731
    args = [jax.ShapeDtypeStruct(graph.values[v].shape, to_dtype(graph.values[v].dtype),
                                  sharding=shard(s))
            for v, s in zip(sub.live_ins, in_specs)]
    jitted = jax.jit(fn, in_shardings=[shard(s) for s in in_specs],
                     out_shardings=[shard(s) for s in out_specs])
    return jitted.lower(*args).compile(), sub.ops


def unexpected_collectives(program: Program, graph: Graph, block: Block, strategy, mesh, *,
                           members=None) -> list[Collective]:
    """Collectives in the compiled block that the strategy does not name; empty when the
    block is communication-free (``unnamed_collectives``)."""
    compiled, ops = compile_block(program, graph, block, strategy, mesh, members=members)
    return unnamed_collectives(compiled.as_text(), tuple(mesh.devices.shape), ops,
                               dict(block.named_allreduces(strategy)))


_TAG_RE = re.compile(r'op_name="[^"]*?\b(cfp_op\d+)/')


def tagged_op(line: str, ops: Sequence[int]) -> int | None:
    """The operator (a step operator index) a compiled instruction of the tagged sub-program
    of operators ``ops`` serves, by its ``op_tag`` (None: no tag)."""
    m = _TAG_RE.search(line)
    k = None if m is None else int(m.group(1)[len("cfp_op"):])
    return ops[k] if k is not None and k < len(ops) else None


def unnamed_collectives(hlo_text: str, mesh_shape, ops: Sequence[int],
                        allreduce_axes: dict[int, tuple],
                        excused: frozenset[int] = frozenset(),
                        untagged: frozenset[str] = frozenset()) -> list[Collective]:
    """The collectives of a compiled sub-program of operators ``ops``, traced with every
    operator in its own named scope (``sub_function(tagged=True)``), that are not named: an
    all-reduce (or a reduce-scatter: for GPUs, XLA's all-reduce whose result is then split)
    tagged with operator ``i`` over a subset of ``allreduce_axes[i]``, and any
    collective tagged with an operator in ``excused``, are named; one without a tag is named
    only when its kind is in ``untagged`` (XLA's gather of split state into the layout the
    program returns it in carries none).
    XLA combines several collectives into one over a tuple, carrying the first one's tag:
    each of its operands is then checked by the operator it serves (``served_ops``)."""
    out = []
    defs = _definitions(hlo_text)
    for c in collectives(hlo_text, mesh_shape):
        for i in served_ops(c, defs, ops):
            named = c.kind in untagged if i is None else i in excused or (
                c.kind in ("all-reduce", "reduce-scatter") and c.axes is not None
                and set(c.axes) <= set(allreduce_axes.get(i, ())))
            if not named:
                out.append(dataclasses.replace(c, op=i))
                break
    return out


_DEF_RE = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=")
_OPERANDS_RE = re.compile(r"\b(?:" + "|".join(COLLECTIVE_KINDS) + r")(?:-start)?\(([^)]*)\)")
_COMPUTATION_RE = re.compile(r"^(?:ENTRY\s+)?(%[\w.\-]+)\s.*\{\s*$")
_REDUCING = (" reduce(", " dot(", " convolution(", " scatter(", " reduce-window(")


def _definitions(hlo_text: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """(instruction name -> its line, computation name -> its instructions' lines), over every
    computation of a compiled module."""
    lines: dict[str, str] = {}
    bodies: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        m = _COMPUTATION_RE.match(line)
        if m:
            current = bodies.setdefault(m.group(1), [])
            continue
        d = _DEF_RE.match(line)
        if d:
            lines[d.group(1)] = line
            if current is not None:
                current.append(line)
    return lines, bodies


def _called(line: str, bodies: dict, depth: int = 0) -> list[str]:
    """The lines of the computations an instruction calls (a fusion's body), nested."""
    out = []
    for name in re.findall(r"(?:calls|to_apply)=(%[\w.\-]+)", line) if depth < 4 else ():
        for inner in bodies.get(name, ()):
            out += [inner] + _called(inner, bodies, depth + 1)
    return out


def served_ops(c: Collective, defs: tuple, ops: Sequence[int]) -> list[int | None]:
    """The operators a collective serves: its own tag's, or for one XLA combined over a
    tuple of operands, each operand's. Where the combined collective's metadata names one
    operator per operand (``op_name="(a:b:...)"``), those; else for a reduction's collective
    (all-reduce, reduce-scatter) the tag of the reduction (reduce, dot, convolution, scatter)
    whose partial sums it adds, found inside the fusion computing the operand or up through
    the elementwise instructions after it; otherwise the tag of the instruction computing the
    operand; else the collective's own. A reduction's collective that XLA made without a
    tag (for GPUs, a reduce-scatter from an all-reduce and its slice) serves the reduction
    whose partial sums it adds."""
    own = tagged_op(c.line, ops)
    m = _OPERANDS_RE.search(c.line)
    names = re.findall(r"%[\w.\-]+", m.group(1)) if m else []
    reduces = c.kind in ("all-reduce", "reduce-scatter")
    if own is None and reduces and len(names) == 1:
        return [_nearest_tag(n, defs, ops) for n in _concatenated(names[0], defs) or names]
    if len(names) < 2 or c.kind == "all-to-all":  # an all-to-all's operands are its pieces
        return [own]
    listed = listed_ops(c.line, ops)
    if len(listed) == len(names):
        return listed
    found = []
    for n in names:
        i = (_reduction_of(n, defs, ops) if reduces else tagged_op(defs[0].get(n, ""), ops))
        found.append(own if i is None else i)
    return found


def listed_ops(line: str, ops: Sequence[int]) -> list[int]:
    """The operators a combined collective's metadata names, in its operands' order: XLA's
    combiner joins the combined instructions' names, ``op_name="(cfp_op3/dot:cfp_op9/...)"``."""
    listed = [int(k) for k in re.findall(r"\bcfp_op(\d+)/", op_name(line))]
    return [ops[k] for k in listed] if all(k < len(ops) for k in listed) else []


def op_name(line: str) -> str:
    """A compiled instruction's ``op_name`` metadata ("" where it has none)."""
    m = re.search(r'op_name="([^"]*)"', line)
    return m.group(1) if m else ""


def _fusion_output(line: str, defs: tuple, index: int) -> str | None:
    """The instruction inside a multi-output fusion ``line`` that computes its output
    ``index`` (the operand ``index`` of its computation's root tuple); None if not one."""
    m = re.search(r" fusion\(.*calls=(%[\w.\-]+)", line)
    root = next((x for x in defs[1].get(m.group(1), ()) if x.lstrip().startswith("ROOT ")
                 and " tuple(" in x), None) if m else None
    if root is None:
        return None
    parts = re.findall(r"%[\w.\-]+", root.split(" tuple(", 1)[1])
    return parts[index] if index < len(parts) else None


_MOVES = (" bitcast(", " copy(", " reshape(", " transpose(")


def _nearest_tag(name: str, defs: tuple, ops: Sequence[int], depth: int = 0) -> int | None:
    """The tag of the instruction computing ``name``: up through instructions that only move
    its elements, and for an output of a multi-output fusion, the tag of what computes that
    output inside it (the fusion itself carries its root's)."""
    line = defs[0].get(name, "")
    k = re.search(r" get-tuple-element\((%[\w.\-]+)\), index=(\d+)", line)
    inner = k and _fusion_output(defs[0].get(k.group(1), ""), defs, int(k.group(2)))
    if inner and depth < 6:
        return _nearest_tag(inner, defs, ops, depth + 1)
    i = tagged_op(line, ops)
    if i is not None or depth >= 6 or not any(m in line for m in _MOVES):
        return i
    m = re.search(r"\w\((%[\w.\-]+)", line.split("=", 1)[-1])
    return _nearest_tag(m.group(1), defs, ops, depth + 1) if m else None


def _concatenated(name: str, defs: tuple) -> list[str]:
    """The operands of ``name`` where it is an untagged fusion that concatenates them (for
    GPUs, XLA reduces several values as one flat buffer); else none."""
    line = defs[0].get(name, "")
    if " fusion(" not in line or op_name(line) or not any(
            " concatenate(" in x for x in _called(line, defs[1])):
        return []
    m = re.search(r" fusion\(([^)]*)\)", line)
    return re.findall(r"%[\w.\-]+", m.group(1))


def _reduction_of(name: str, defs: tuple, ops: Sequence[int], depth: int = 0) -> int | None:
    """The operator whose reduction computes the value ``name`` (up through elementwise
    instructions XLA put after it, such as a negation), else ``name``'s own tag."""
    line = defs[0].get(name, "")
    reducing = [i for x in [line] + _called(line, defs[1]) if any(k in x for k in _REDUCING)
                if (i := tagged_op(x, ops)) is not None]
    if reducing:
        return reducing[-1]
    m = re.search(r"\w\((%[^)]*)\)", line.split("=", 1)[-1])
    if depth < 3 and m:
        names = re.findall(r"%[\w.\-]+", m.group(1))
        k = re.search(r" get-tuple-element\(%[\w.\-]+\), index=(\d+)", line)
        if k:  # an element of a tuple another collective returns: that element's operand
            tm = _OPERANDS_RE.search(defs[0].get(names[0], ""))
            parts = re.findall(r"%[\w.\-]+", tm.group(1)) if tm else []
            names = parts[int(k.group(1)):int(k.group(1)) + 1] or names
        for n in names:
            i = _reduction_of(n, defs, ops, depth + 1)
            if i is not None:
                return i
    return tagged_op(line, ops)
