"""Recompute: a layer's forward pass computed again in the backward pass, as ``jax.checkpoint``
does, applied to the traced step as written.

A policy, named as JAX names it in ``jax.checkpoint_policies``, says which of a layer's forward
results are saved for the backward pass: ``dots_saveable`` the contractions' results,
``dots_with_no_batch_dims_saveable`` those of contractions with no batch dimension,
``nothing_saveable`` none (only the layer's inputs), ``none`` every result (no recompute). The
results the backward pass reads and the policy does not save are computed again from the
layer's inputs and its saved results, where the backward pass first reads them, behind
``optimization_barrier`` as JAX lowers a differentiated ``jax.checkpoint``: XLA cannot merge the
recomputation back into the forward pass, and holds the layer's inputs instead of its
activations from the forward pass to the backward (where its scheduler runs the recomputation
late, as XLA's GPU scheduler does; XLA's CPU scheduler runs it early and saves nothing).

A layer is a segment instance (``cfp.segments``): the forward operators of its blocks and those
no block claims between them. A layer whose inputs the backward pass already reads through a
barrier (a step under ``nn.remat`` or ``jax.checkpoint``) is not recomputed twice.

Example:
    >>> import jax, jax.numpy as jnp
    >>> from cfp.program import trace_program
    >>> from cfp.graph import loss_op
    >>> def step(w, x):
    ...     loss, grad = jax.value_and_grad(lambda w: jnp.sum(jnp.tanh(x @ w) @ w))(w)
    ...     return w - grad, loss
    >>> prog = trace_program(step, jnp.ones((4, 4)), jnp.ones((2, 4)))
    >>> back = loss_op(prog.graph())  # the operators before it are the forward pass
    >>> again = recomputed(prog, Recompute(((0, tuple(range(back)), "nothing_saveable"),), back))
    >>> dots = lambda p: [e.primitive.name for e in p.eqns].count("dot_general")
    >>> dots(prog), dots(again)
    (5, 6)
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Sequence

from cfp.errors import CfpError

# The suffix of a hand plan's line recomputing every layer (``Prediction.hand_plans``)
RECOMPUTING_EVERY_LAYER = " recomputing every layer"
POLICIES = ("none", "dots_saveable", "dots_with_no_batch_dims_saveable", "nothing_saveable")


@dataclasses.dataclass(frozen=True)
class Recompute:
    """Per layer, its segment instance, its forward operators (indices in the analysed step)
    and its policy; the backward pass is every operator after ``backward_from`` (the
    loss's)."""

    layers: tuple[tuple[int, tuple[int, ...], str], ...]
    backward_from: int

    def __bool__(self) -> bool:
        return any(policy != "none" for _, _, policy in self.layers)

    def to_json(self) -> dict:
        return {"backward_from": self.backward_from,
                "layers": [{"segment": k, "policy": policy, "ops": _runs(ops)}
                           for k, ops, policy in self.layers if policy != "none"]}

    @classmethod
    def from_json(cls, data: dict, index: Sequence[int] | None = None) -> "Recompute":
        """From ``plan.json``'s ``recompute``; ``index`` maps each analysed operator to its
        position in the step as the user traced it."""
        at = (lambda i: i) if index is None else (lambda i: index[i])  # noqa: E731
        return cls(tuple((layer.get("segment", -1),
                          tuple(at(i) for a, b in layer["ops"] for i in range(a, b)),
                          layer["policy"]) for layer in data["layers"]),
                   at(data["backward_from"]))


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise CfpError(f"recompute {policy!r} is not a policy: one of {', '.join(POLICIES)}")
    return policy


def layer_ops(analysis, loss: int) -> tuple[tuple[int, ...], ...]:
    """Per segment instance, its forward operators: those of its blocks before the loss (the
    operator ``loss``), and those no block claims between them."""
    owner, out = analysis.blocks.owner, []
    for seg in analysis.segments.instances:
        mine = [op for op, b in owner.items() if seg.start <= b < seg.end and op < loss]
        if not mine:
            out.append(())
            continue
        out.append(tuple(i for i in range(min(mine), max(mine) + 1)
                         if owner.get(i) is None or seg.start <= owner[i] < seg.end))
    return tuple(out)


def forced(analysis, policy: str) -> Recompute | None:
    """``policy`` on every layer of every segment type that repeats (the model's layers);
    None for ``none`` or a step without a backward pass."""
    from cfp.graph import loss_op
    loss = loss_op(analysis.graph)
    if check_policy(policy) == "none" or loss is None:
        return None
    seg = analysis.segments
    counts = [0] * seg.num_types
    for inst in seg.instances:
        counts[inst.type] += 1
    layers = tuple((k, ops, policy) for k, (ops, inst)
                   in enumerate(zip(layer_ops(analysis, loss), seg.instances))
                   if ops and counts[inst.type] > 1)
    return Recompute(layers, loss) if layers else None


def layer_starts(analysis, windows, recompute: Recompute | None) -> dict[int, int]:
    """Per window of a recomputed layer (its index in ``windows``), the index of the layer's
    first window: the backward pass makes the layer's forward again at once, before the
    backward of its last window, so what each of its windows makes again is live from
    there until that window's backward is done."""
    if not recompute:
        return {}
    instances = analysis.segments.instances
    firsts = {}
    for k, _, policy in recompute.layers:
        if policy == "none":
            continue
        inst = instances[k]
        mine = [i for i, w in enumerate(windows) if inst.start <= w.start < inst.end]
        firsts.update((i, mine[0]) for i in mine)
    return firsts


def recomputed(program, recompute: Recompute):
    """``program`` with each layer's recompute inserted before the backward pass first reads
    what it recomputes: an ``optimization_barrier`` over the layer's inputs, the saved results
    the recomputation reads and the backward values at hand there, then a copy of every
    forward operator the unsaved results the backward pass reads are computed from; the
    backward pass from there reads the copies, and the inputs and backward values as they
    left the barrier. Each
    equation's ``op`` is the position in ``program`` whose hooks it takes (a copy its
    original's, so it gets its sharding constraints; the barrier -1, none). A layer's
    results that later layers read are their inputs, held for them: not recomputed. A layer
    whose values or inputs the backward pass reads through a barrier is rematerialized
    already (the user's ``jax.checkpoint``): left as it is."""
    from cfp.program import _Eqn
    eqns, back = program.eqns, recompute.backward_from
    users: dict[int, list[int]] = {}
    for pos, e in enumerate(eqns):
        for v in e.inputs:
            users.setdefault(v, []).append(pos)
    avals, next_id = dict(program.avals), max(program.avals, default=-1) + 1
    # a value -> (from where, its copy) per barrier it passes: a backward reader reads the
    # copy of the last barrier before it, as the backward pass of a checkpointed layer reads
    # what passed its barrier (so XLA gathers a split weight again, not holding the forward's)
    renamed: dict[int, list[tuple[int, int]]] = {}
    inserted: dict[int, list] = {}  # position -> equations inserted before it
    barrier = _barrier_primitive()
    for _, ops, policy in recompute.layers:
        if policy == "none":
            continue
        made = {v: i for i in ops for v in eqns[i].outputs}
        touched = set(made) | {v for i in ops for v in eqns[i].inputs}
        if any(eqns[u].primitive.name == "optimization_barrier"
               for v in touched for u in users.get(v, ()) if u > back):
            continue  # the step rematerializes it already
        mine = set(ops)
        saved = {v for i in ops if _saves(policy, eqns[i], program)
                 for v in eqns[i].outputs}
        saved |= {v for v in made if any(u < back and u not in mine  # what later layers read
                                         for u in users.get(v, ()))}
        late = [v for v in made if v not in saved and any(u > back for u in users.get(v, ()))]
        cone, stack = set(), list(late)
        while stack:
            v = stack.pop()
            i = made.get(v)
            if i is None or i in cone or v in saved:
                continue
            cone.add(i)
            stack += eqns[i].inputs
        if not cone:
            continue
        order = sorted(cone)
        copied = {v for i in order for v in eqns[i].outputs}
        first = min(u for v in late for u in users[v] if u > back)
        again = {v for i in order for v in eqns[i].inputs} - copied  # saved, or inputs
        inputs = [v for i in ops for v in eqns[i].inputs
                  if v not in program.consts and (v not in made or v in again)]
        arrived = _arrived(eqns, first, back, program.consts)
        reads = list(dict.fromkeys(inputs + arrived))
        fresh = {}
        for v in reads + [v for i in order for v in eqns[i].outputs]:
            fresh[v], avals[next_id] = next_id, avals[v]
            next_id += 1
        chunk = [_Eqn(barrier, {}, reads, [fresh[v] for v in reads], op=-1)] if reads else []
        for i in order:
            e = eqns[i]
            chunk.append(dataclasses.replace(
                e, inputs=[fresh.get(v, v) for v in e.inputs],
                outputs=[fresh[v] for v in e.outputs], op=i))
        inserted.setdefault(first, []).extend(chunk)
        for v in late + reads:
            renamed.setdefault(v, []).append((first, fresh[v]))
    if not inserted:
        return program
    out = []
    for pos, e in enumerate(eqns):
        out += inserted.get(pos, [])
        if pos > back:
            e = dataclasses.replace(e, inputs=[_latest(renamed.get(v, ()), pos, v)
                                               for v in e.inputs])
        out.append(dataclasses.replace(e, op=pos))
    return dataclasses.replace(program, eqns=out, avals=avals, _graph=None)


def traced_step(analysis, recompute: Recompute | None = None):
    """The analysed step traced, with ``recompute`` inserted where given: each once per
    analysis (a cluster plan compiles and prices several whole steps of it)."""
    from cfp.graph import memo
    from cfp.tracing import trace_step
    program = memo(analysis, "traced step", lambda: trace_step(analysis.spec.build()))
    if not recompute:
        return program
    return memo(analysis, ("traced step", recompute), lambda: recomputed(program, recompute))


def _latest(copies, pos: int, v: int) -> int:
    """The copy of ``v`` a reader at ``pos`` reads: that of the last barrier before it."""
    return max(((at, copy) for at, copy in copies if at <= pos), default=(0, v))[1]


def _arrived(eqns, first: int, back: int, consts) -> list[int]:
    """Backward values at hand where the backward pass first reads a layer's recomputed
    results (position ``first``): what that reader takes from the backward pass (the
    cotangent), else what the equation before it made. Behind the barrier too, as JAX's
    transposed remat puts its cotangents there, and read from there on as they leave it (XLA
    drops a barrier's result nothing reads, and with it the wait), they keep XLA from
    recomputing before the backward pass reaches the layer."""
    made = {v for e in eqns[back + 1:first] for v in e.outputs}
    taken = [v for v in eqns[first].inputs if v in made and v not in consts]
    if not taken and first - 1 > back:
        taken = list(eqns[first - 1].outputs)
    return list(dict.fromkeys(taken))


def _saves(policy: str, eqn, program) -> bool:
    """Whether JAX's ``jax.checkpoint_policies.<policy>`` saves ``eqn``'s results."""
    import jax
    if policy == "nothing_saveable":
        return False
    from cfp.jax_compat import to_dtype
    avals = [jax.ShapeDtypeStruct(program.avals[v][0], to_dtype(program.avals[v][1]))
             for v in eqn.inputs]
    return bool(getattr(jax.checkpoint_policies, policy)(eqn.primitive, *avals, **eqn.params))


def _barrier_primitive():
    import jax
    import jax.numpy as jnp
    return jax.make_jaxpr(jax.lax.optimization_barrier)(jnp.zeros(())).eqns[0].primitive


def _runs(ops: Sequence[int]) -> list[list[int]]:
    """Sorted indices as ``[start, end)`` runs."""
    out: list[list[int]] = []
    for i in sorted(ops):
        if out and out[-1][1] == i:
            out[-1][1] += 1
        else:
            out.append([i, i + 1])
    return out


def recomputed_work(graph, program) -> tuple[float, int]:
    """Of the equations ``program`` (``recomputed`` from the step of ``graph``) computes
    twice, the contractions' FLOPs and the bytes the others write (what bounds an
    elementwise op's time: a softmax made again is memory's work, not FLOPs)."""
    seen = Counter(e.op for e in program.eqns if e.op is not None and e.op >= 0)
    again = [(graph.ops[op], n - 1) for op, n in seen.items() if n > 1]
    flops = sum(n * op.flops for op, n in again if op.is_contraction)
    written = sum(n * graph.values[v].nbytes
                  for op, n in again if not op.is_contraction for v in op.outputs)
    return flops, written


def mixed(full: Recompute, nothing: int, lighter: int, policy: str) -> Recompute | None:
    """``full``'s layers, the first ``nothing`` under ``nothing_saveable``, the next
    ``lighter`` under ``policy``, the rest not recomputed (the last layers' activations
    are held the shortest); None for none."""
    policies = ["nothing_saveable"] * nothing + [policy] * lighter
    layers = tuple((k, ops, p) for (k, ops, _), p in zip(full.layers, policies))
    return Recompute(layers, full.backward_from) if layers else None
