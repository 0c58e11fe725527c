"""Turning block strategies into shardings, sub-programs and state layouts.

- ``sub_program``: the operators of a set (a block, a segment), with their live-ins and live-outs,
  as a function that re-evaluates exactly those equations of the traced step.
- ``block_constraints``: a strategy's sharding constraints on a block's contractions (operands
  and results) and on every other member's labelled results, applied with
  ``jax.lax.with_sharding_constraint`` while re-evaluating.
- ``state_specs``: where a plan keeps each state leaf (``STATE_LAYOUTS``).
- ``unexpected_collectives``: compile a block alone under a strategy and list every collective
  the strategy does not name (read by ``cfp.collectives``).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Sequence

from cfp import dims as dimrules
from cfp.blocks import Block
from cfp.collectives import Collective, unnamed_collectives
from cfp.graph import Graph, memo
from cfp.jax_compat import to_dtype
from cfp.program import Program


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
                  mesh, recompute=None) -> tuple[Callable, bool]:
    """``(f(*step_inputs) -> step_outputs, rolled)``: the whole step under ``constraints``,
    with ``recompute`` (``cfp.recompute.Recompute``) where given. Its scans stay
    ``lax.scan``s (``rolled``) when the constraints are the same in every iteration, as the
    search makes them (``Program.rolled_constraints``), and nothing is recomputed; otherwise
    the scans run unrolled, as analysed."""
    rolled = (program.rolled_constraints(constraints)
              if program.scans and not recompute and not program.rewritten else None)
    if rolled is not None:
        return sub_function(program, None, constraints=rolled, mesh=mesh), True
    if recompute:
        from cfp.recompute import recomputed
        program = recomputed(program, recompute)
    sub = SubProgram(tuple(range(len(program.eqns))), tuple(program.inputs),
                     tuple(program.outputs))
    return sub_function(program, sub, constraints=constraints, mesh=mesh), False


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


