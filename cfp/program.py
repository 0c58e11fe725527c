"""Trace a training step into a flat program of equations.

``trace_program`` runs ``jax.make_jaxpr`` on the step, inlines nested calls (``jit``,
``custom_jvp_call``, ``custom_vjp_call``, ``closed_call``), drops dead code, and returns a
``Program``: a flat list of equations over integer value ids that can be re-evaluated
(``evaluate``) with hooks around each equation. ``Program.graph()`` is its plain-data view
(``cfp.graph``).

Example:
    >>> import jax, jax.numpy as jnp
    >>> prog = trace_program(lambda x, w: jnp.sum(x @ w), jnp.ones((4, 8)), jnp.ones((8, 2)))
    >>> prog.graph().ops[0].hlo
    '%dot.2 = f32[4,2] dot(f32[4,8] %Arg_0.0, f32[8,2] %Arg_1.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}'
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any, Callable, Sequence

import jax
from jax.extend import core as jcore

from cfp.errors import CfpError
from cfp.graph import CONTRACTIONS, Graph, build_graph
from cfp.jax_compat import bind_equation, dtype_name


# Calls whose body is inlined: they change nothing about the math.
_INLINED = {"jit", "pjit", "closed_call", "core_call", "custom_jvp_call", "custom_vjp_call",
            "custom_vjp_call_jaxpr", "custom_lin"}


# Remat: the body is inlined behind an optimization barrier, as JAX lowers it.
_REMAT = {"checkpoint", "remat", "remat2"}


# Control flow whose body cfp cannot unroll; refused when a contraction is inside.
_REFUSED = {
    "while": ("lax.while_loop / fori_loop", "use lax.scan (or fori_loop with static bounds, "
              "which is a scan) over the layers"),
    "cond": ("lax.cond / switch", "compute both branches and select with jnp.where, or move "
             "the condition out of the step"),
}


@dataclasses.dataclass
class _Eqn:
    primitive: Any  # a jax Primitive
    params: dict
    inputs: list[int]
    outputs: list[int]
    stacks_layers: bool = False
    origin: int = -1  # the traced equation this is a copy of (one per scan iteration)
    in_scan: bool = False
    effects: bool = False  # the equation has effects (a print, a callback): always kept
    # the position whose ``evaluate`` hooks it takes (``cfp.recompute``: a recomputed copy,
    # its original's; -1, none); None: its own
    op: int | None = None


@dataclasses.dataclass
class Program:
    """A flat, re-evaluable step: equations over integer value ids.

    ``consts`` maps the ids of literals and captured constants to their values.
    """

    eqns: list[_Eqn]
    avals: dict[int, tuple[tuple[int, ...], str]]
    consts: dict[int, Any]
    inputs: list[int]
    outputs: list[int]
    in_tree: Any  # the pytree structure of the step's arguments
    out_tree: Any
    dead_ops: int = 0
    jaxpr: Any = None  # the traced step, with its scans (``evaluate_rolled``)
    origins: dict = dataclasses.field(default_factory=dict)  # place in the trace -> origin
    split_conds: bool = False  # a cond was split (``evaluate_rolled`` would run it whole)
    _graph: Graph | None = None

    def graph(self) -> Graph:
        if self._graph is None:
            self._graph = build_graph(self)
        return self._graph

    @property
    def rewritten(self) -> bool:
        """Whether equations were inserted (``cfp.recompute``): it evaluates flat only."""
        return any(e.op is not None for e in self.eqns)

    @property
    def scans(self) -> bool:
        """Whether the step has a scan (unrolled here, one copy of its body per iteration)."""
        return any(e.in_scan for e in self.eqns)

    def restricted(self, outputs: list[int]) -> tuple["Program", list[int]]:
        """The program computing ``outputs`` alone (the equations they need, in order), and
        per equation of it its index here."""
        live, kept = set(outputs), []
        for i in reversed(range(len(self.eqns))):
            eqn = self.eqns[i]
            if eqn.effects or any(o in live for o in eqn.outputs):
                kept.append(i)
                live.update(eqn.inputs)
        kept.reverse()
        out = dataclasses.replace(self, eqns=[self.eqns[i] for i in kept],
                                  outputs=list(outputs), _graph=None)
        return out, kept

    def copies(self) -> dict[int, list[int]]:
        """Origin -> the equations that are its copies (one per iteration of its scans)."""
        out: dict[int, list[int]] = {}
        for i, e in enumerate(self.eqns):
            out.setdefault(e.origin, []).append(i)
        return out

    def rolled_constraints(self, constraints: dict[int, Any]) -> dict[int, Any] | None:
        """The constraints of a rolled step, keyed by each equation's first copy (what
        ``evaluate_rolled`` reads), or None where the step cannot roll: a contraction whose
        copies (one per iteration) are constrained differently (a plan that differs per
        layer), or a split ``cond``. Any other operator whose copies differ gets no constraint:
        a scan's first iteration reads the stack's input where the others read the previous
        layer, so a layer's leading operators can belong to another block there, and in the
        loop's one body XLA places them by the contractions around them."""
        if self.split_conds:
            return None
        out = {}
        for idx in self.copies().values():
            entries = {repr(constraints.get(i)): constraints.get(i) for i in idx}
            if len(entries) == 1:
                if constraints.get(idx[0]) is not None:
                    out[idx[0]] = constraints[idx[0]]
            elif self.eqns[idx[0]].primitive.name in CONTRACTIONS:
                return None
        return out

    def evaluate_rolled(self, flat_inputs: Sequence[Any], *,
                        before: Callable[[int, list], list] | None = None,
                        after: Callable[[int, list], list] | None = None) -> list[Any]:
        """The step's outputs, evaluated as traced: each scan as a ``lax.scan`` over its body
        and remat's recomputation behind an optimization barrier. The hooks are those of
        ``evaluate``, called with the index of each equation's first copy (see
        ``rolled_constraints``)."""
        first = {o: idx[0] for o, idx in self.copies().items()}

        def run(jaxpr, consts, args, path):
            env = dict(zip(jaxpr.constvars, consts))
            env.update(zip(jaxpr.invars, args))

            def read(x):
                return x.val if isinstance(x, jcore.Literal) else env[x]

            for eqn in jaxpr.eqns:
                ins, name = [read(x) for x in eqn.invars], eqn.primitive.name
                sub = _inlinable_body(eqn)
                if sub is not None:
                    outs = run(sub.jaxpr, sub.consts, ins, path + (id(eqn),))
                elif name == "scan":
                    outs = scan(eqn.params, ins, path + (("scan", id(eqn)),))
                elif name in _REMAT:
                    body, consts, barrier = _remat_parts(eqn)
                    if barrier:
                        ins = [v if isinstance(x, jcore.Literal)
                               else jax.lax.optimization_barrier(v)
                               for x, v in zip(eqn.invars, ins)]
                    outs = run(body, consts, ins, path + (id(eqn),))
                else:
                    i = first.get(self.origins.get(path + (id(eqn),)))
                    if i is not None and before is not None:
                        ins = before(i, ins)
                    outs = eqn.primitive.bind(*ins, **eqn.params)
                    outs = list(outs) if eqn.primitive.multiple_results else [outs]
                    if i is not None and after is not None:
                        outs = after(i, outs)
                env.update(zip(eqn.outvars, outs))
            return [read(v) for v in jaxpr.outvars]

        def scan(params, ins, path):
            body, n_consts, n_carry = params["jaxpr"], params["num_consts"], params["num_carry"]
            consts = ins[:n_consts]

            def step(carry, xs):
                outs = run(body.jaxpr, body.consts, consts + list(carry) + list(xs), path)
                return outs[:n_carry], outs[n_carry:]

            carry, ys = jax.lax.scan(step, ins[n_consts:n_consts + n_carry],
                                     ins[n_consts + n_carry:], length=params["length"],
                                     reverse=params["reverse"], unroll=params["unroll"])
            return list(carry) + list(ys)

        return run(self.jaxpr.jaxpr, self.jaxpr.consts, list(flat_inputs), ())

    def evaluate(self, flat_inputs: Sequence[Any], *,
                 before: Callable[[int, list], list] | None = None,
                 after: Callable[[int, list], list] | None = None,
                 ops: Sequence[int] | None = None, env: dict[int, Any] | None = None,
                 scopes: dict[int, str] | None = None) -> dict[int, Any]:
        """Evaluate the equations (all, or the indices in ``ops``) and return the environment.

        ``before(i, operands)`` may replace an equation's operands and ``after(i, results)``
        its results (e.g. to apply sharding constraints). ``env`` supplies live-in values.
        ``scopes`` names equations: each is evaluated, with its ``before`` and ``after``,
        inside ``jax.named_scope`` of its name, which the compiled program's metadata then
        carries (so a collective that reshards an equation's operands carries it too).
        """
        env = dict(env or {})
        env.update(zip(self.inputs, flat_inputs))
        for i in (range(len(self.eqns)) if ops is None else ops):
            eqn = self.eqns[i]
            args = [env[j] if j in env else self.consts[j] for j in eqn.inputs]
            hooked = i if eqn.op is None else eqn.op
            with (jax.named_scope(scopes[i]) if scopes and i in scopes
                  else contextlib.nullcontext()):
                if before is not None and hooked >= 0:
                    args = before(hooked, args)
                out = eqn.primitive.bind(*args, **eqn.params)
                out = list(out) if eqn.primitive.multiple_results else [out]
                if after is not None and hooked >= 0:
                    out = after(hooked, out)
            env.update(zip(eqn.outputs, out))
        return env

    def output_values(self, env: dict[int, Any]) -> list[Any]:
        return [env[j] if j in env else self.consts[j] for j in self.outputs]


def trace_program(step: Callable, *args: Any) -> Program:
    """Trace ``step(*args)`` (arrays or ``jax.ShapeDtypeStruct``s) into a flat ``Program``."""
    flat_args, in_tree = jax.tree_util.tree_flatten(args)
    closed, out_shape = jax.make_jaxpr(step, return_shape=True)(*args)
    out_tree = jax.tree_util.tree_structure(out_shape)
    b = _Builder()
    in_ids = [b.new_value(v.aval) for v in closed.jaxpr.invars]
    out_ids = b.inline(closed.jaxpr, closed.consts, in_ids)
    prog = Program(b.eqns, b.avals, b.consts, in_ids, out_ids, in_tree, out_tree,
                   jaxpr=closed, origins=b.origins, split_conds=b.split_conds)
    return _dead_code_eliminated(prog)


class _Builder:
    def __init__(self):
        self.eqns: list[_Eqn] = []
        self.avals: dict[int, tuple[tuple[int, ...], str]] = {}
        self.consts: dict[int, Any] = {}
        self.dtypes: dict[int, Any] = {}  # the jax dtype of each value (keys included)
        self.pieces: dict[int, list[int]] = {}  # a stack this trace made -> its pieces
        self.slices: dict[tuple[int, int], int] = {}  # (stacked value, i) -> its slice i
        self.stacking = False  # set while the ops that stack a scan's results are traced
        self.origins: dict[tuple, int] = {}  # where an equation sits in the trace -> its id
        self.helpers: list = []
        self.split_conds = False

    def new_value(self, aval) -> int:
        vid = len(self.avals)
        self.avals[vid] = (tuple(int(d) for d in aval.shape), dtype_name(aval.dtype))
        self.dtypes[vid] = aval.dtype
        return vid

    def const(self, val, aval) -> int:
        vid = self.new_value(aval)
        self.consts[vid] = val
        return vid

    def inline(self, jaxpr, consts, in_ids: list[int], path: tuple = ()) -> list[int]:
        """Append ``jaxpr``'s equations applied to ``in_ids``; its results' ids. ``path``
        names where the jaxpr sits in the traced step (the calls, scans and remats around it),
        so every copy of one traced equation gets the same ``origin``."""
        env: dict[Any, int] = {}
        for var, c in zip(jaxpr.constvars, consts):
            env[var] = self.const(c, var.aval)
        env.update(zip(jaxpr.invars, in_ids))

        def read(x) -> int:
            if isinstance(x, jcore.Literal):
                return self.const(x.val, x.aval)
            return env[x]

        for eqn in jaxpr.eqns:
            ins = [read(x) for x in eqn.invars]
            name = eqn.primitive.name
            sub = _inlinable_body(eqn)
            if sub is not None:
                outs = self.inline(sub.jaxpr, sub.consts, ins, path + (id(eqn),))
                env.update(zip(eqn.outvars, outs))
                continue
            if name == "scan":
                outs = self.unrolled_scan(eqn.params, ins, path + (("scan", id(eqn)),))
                env.update(zip(eqn.outvars, outs))
                continue
            if name in _REMAT:
                body, consts, barrier = _remat_parts(eqn)
                if barrier:
                    ins = [j if j in self.consts else self.traced(jax.lax.optimization_barrier, j)
                           for j in ins]
                outs = self.inline(body, consts, ins, path + (id(eqn),))
                env.update(zip(eqn.outvars, outs))
                continue
            if name == "cond" and not _contains_contraction(eqn):
                parts = _independent_parts(eqn)
                if len(parts) > 1:  # one cond per part, each reading only its own operands
                    self.split_conds = True
                    outs = [None] * len(eqn.outvars)
                    for part_outs, part_ins in parts:
                        for k, o in zip(part_outs, self.traced_many(
                                _cond_part(eqn, part_outs, part_ins),
                                ins[0], *[ins[1 + i] for i in part_ins])):
                            outs[k] = o
                    env.update(zip(eqn.outvars, outs))
                    continue
            if name in _REFUSED and _contains_contraction(eqn):
                what, change = _REFUSED[name]
                raise CfpError(f"the step puts contractions inside {what}, which cfp cannot "
                               f"split into layers: {change}")
            outs = [self.new_value(v.aval) for v in eqn.outvars]
            self.eqns.append(_Eqn(eqn.primitive, dict(eqn.params), ins, outs, self.stacking,
                                  self.origin(path + (id(eqn),)),
                                  any(isinstance(p, tuple) for p in path), bool(eqn.effects)))
            env.update(zip(eqn.outvars, outs))
        return [read(v) for v in jaxpr.outvars]

    def traced(self, fn: Callable, *in_ids: int) -> int:
        """Inline ``fn`` applied to the values ``in_ids``; its one result's id."""
        return self.traced_many(fn, *in_ids)[0]

    def traced_many(self, fn: Callable, *in_ids: int) -> list[int]:
        """Inline ``fn`` applied to the values ``in_ids``; its results' ids."""
        structs = [jax.ShapeDtypeStruct(self.avals[j][0], self.dtypes[j]) for j in in_ids]
        closed = jax.make_jaxpr(fn)(*structs)
        self.helpers.append(closed)  # alive, so no later equation reuses its eqns' ids
        return self.inline(closed.jaxpr, closed.consts, list(in_ids))

    def origin(self, key: tuple) -> int:
        return self.origins.setdefault(key, len(self.origins))

    def unrolled_scan(self, params: dict, ins: list[int], path: tuple) -> list[int]:
        """A ``scan`` as ``length`` copies of its body: iteration ``i`` reads slice ``i`` of
        the stacked inputs and its per-iteration results are stacked again; each layer of a
        scanned stack is then a repeated segment, as if the loop were unrolled."""
        body, n_consts, n_carry = params["jaxpr"], params["num_consts"], params["num_carry"]
        length = params["length"]
        consts, carry, xs = ins[:n_consts], ins[n_consts:n_consts + n_carry], ins[n_consts + n_carry:]
        ys: list[list[int]] = [[] for _ in range(length)]
        for i in (reversed(range(length)) if params["reverse"] else range(length)):
            x_i = [self.layer_slice(x, i) for x in xs]
            outs = self.inline(body.jaxpr, body.consts, consts + carry + x_i, path)
            carry, ys[i] = outs[:n_carry], outs[n_carry:]
        stacked = []
        for k in range(len(ys[0]) if length else 0):
            pieces = [ys[i][k] for i in range(length)]
            self.stacking = True
            stacked.append(self.traced(_stack, *pieces))
            self.stacking = False
            self.pieces[stacked[-1]] = pieces
        return carry + stacked

    def layer_slice(self, stacked: int, i: int) -> int:
        """Slice ``i`` of a stacked value: the piece itself when this trace stacked it (a
        forward scan's residuals read by the reverse scan), else one slice per (value, i)."""
        if stacked in self.pieces:
            return self.pieces[stacked][i]
        key = (stacked, i)
        if key not in self.slices:
            self.slices[key] = self.traced(
                lambda a: jax.lax.index_in_dim(a, i, 0, keepdims=False), stacked)
        return self.slices[key]


def _remat_parts(eqn) -> tuple[Any, tuple, bool]:
    """(body jaxpr, its consts, whether its inputs go behind an optimization barrier) of a
    remat equation: the barrier is what JAX lowers a differentiated ``prevent_cse`` remat to."""
    body = eqn.params["jaxpr"]
    barrier = bool(eqn.params.get("prevent_cse") and eqn.params.get("differentiated"))
    return getattr(body, "jaxpr", body), tuple(getattr(body, "consts", ())), barrier


def _stack(*pieces):
    """Pieces stacked on a new leading axis, by reshape and concatenate (primitives that every
    JAX version has and the analysis has rules for)."""
    return jax.lax.concatenate([jax.lax.reshape(p, (1,) + p.shape) for p in pieces], 0)


def _inlinable_body(eqn):
    if eqn.primitive.name not in _INLINED:
        return None
    for key in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
        body = eqn.params.get(key)
        if body is None:
            continue
        if hasattr(body, "consts"):  # a ClosedJaxpr
            return body
        return jcore.ClosedJaxpr(body, ())
    return None


def _independent_parts(eqn) -> list[tuple[list[int], list[int]]]:
    """The parts of a ``cond`` that share no work: (its results, its operands, by position
    after the branch index) per part, in the order of their first result. Two results are in
    one part when, in some branch, they are computed from a common operand or intermediate
    value of more than one element; scalars (a step count, a predicate) are recomputed in
    each part that needs them. A cond whose branches act leaf by leaf (``optax.MultiSteps``:
    accumulate, or apply the inner optimizer) so splits into one cond per leaf, which follows
    its leaf's block."""
    n_out = len(eqn.outvars)
    parent = list(range(n_out))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    reads: list[set[int]] = [set() for _ in range(n_out)]  # operand positions per result
    claims: dict = {}  # (branch, variable) -> the first result computed from it
    for b, branch in enumerate(eqn.params["branches"]):
        jaxpr = branch.jaxpr
        position = {v: i for i, v in enumerate(jaxpr.invars)}
        for k, out in enumerate(jaxpr.outvars):
            cone_vars, cone_ins = _cone(jaxpr, out)
            reads[k] |= {position[v] for v in cone_ins}
            for v in cone_vars:
                if math.prod(v.aval.shape) > 1:
                    parent[find(k)] = find(claims.setdefault((b, v), k))
    groups: dict[int, list[int]] = {}
    for k in range(n_out):
        groups.setdefault(find(k), []).append(k)
    return [(outs, sorted(set().union(*(reads[k] for k in outs))))
            for outs in groups.values()]


def _cone(jaxpr, out) -> tuple[list, set]:
    """(the variables ``out`` is computed from, inputs and intermediates; the inputs among
    them) in ``jaxpr``."""
    inputs = set(jaxpr.invars)
    producer = {v: e for e in jaxpr.eqns for v in e.outvars}
    seen, stack = set(), [out]
    while stack:
        v = stack.pop()
        if isinstance(v, jcore.Literal) or v in seen:
            continue
        seen.add(v)
        if v in producer:
            stack += list(producer[v].invars)
    return list(seen), seen & inputs


def _cond_part(eqn, outs: list[int], operands: list[int]) -> Callable:
    """``f(index, *operands) -> results``: the ``cond`` ``eqn`` restricted to the results
    ``outs``, each branch evaluating only the equations they need."""
    def branch_fn(branch):
        jaxpr, consts = branch.jaxpr, branch.consts
        wanted = [jaxpr.outvars[k] for k in outs]
        needed = set().union(*(_cone(jaxpr, v)[0] for v in wanted))

        def run(*xs):
            env = dict(zip(jaxpr.constvars, consts))
            env.update((jaxpr.invars[i], x) for i, x in zip(operands, xs))
            read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]  # noqa: E731
            for e in jaxpr.eqns:
                if any(v in needed for v in e.outvars):
                    env.update(zip(e.outvars, bind_equation(e, map(read, e.invars))))
            return [read(v) for v in wanted]
        return run

    branches = [branch_fn(b) for b in eqn.params["branches"]]
    return lambda index, *xs: jax.lax.switch(index, branches, *xs)


def _contains_contraction(eqn) -> bool:
    for sub in jcore.jaxprs_in_params(eqn.params):
        for inner in sub.eqns:
            if inner.primitive.name in CONTRACTIONS or _contains_contraction(inner):
                return True
    return False


def _dead_code_eliminated(prog: Program) -> Program:
    kept = prog.restricted(prog.outputs)[0]
    kept.dead_ops = len(prog.eqns) - len(kept.eqns)
    return kept
