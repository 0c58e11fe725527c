"""Trace a training step into a flat operator graph.

``trace_program`` runs ``jax.make_jaxpr`` on the step, inlines nested calls (``jit``,
``custom_jvp_call``, ``custom_vjp_call``, ``closed_call``), drops dead code, and returns a
``Program``: a flat list of equations over integer value ids that can be re-evaluated
(``evaluate``) with hooks around each equation. ``Program.graph()`` is the plain-data view
(shapes, dtypes, operands, users, contraction dimension numbers) that the analysis records;
every operator prints in HLO notation.

Example:
    >>> import jax, jax.numpy as jnp
    >>> prog = trace_program(lambda x, w: jnp.sum(x @ w), jnp.ones((4, 8)), jnp.ones((8, 2)))
    >>> prog.graph().ops[0].hlo
    '%dot.2 = f32[4,2] dot(f32[4,8] %Arg_0.0, f32[8,2] %Arg_1.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}'
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import weakref
from typing import Any, Callable, Sequence

import jax
import numpy as np
from jax.extend import core as jcore

from cfp.errors import CfpError
from cfp.jax_compat import bind_equation, dtype_name, itemsize

CONTRACTIONS = ("dot_general", "conv_general_dilated")

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

_DTYPE_SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16", "float64": "f64",
                "int32": "s32", "int64": "s64", "int8": "s8", "int16": "s16", "uint8": "u8",
                "uint32": "u32", "uint64": "u64", "bool": "pred"}

_HLO_NAME = {
    "dot_general": "dot", "conv_general_dilated": "convolution", "add_any": "add",
    "sub": "subtract", "mul": "multiply", "div": "divide", "neg": "negate", "max": "maximum",
    "min": "minimum", "exp": "exponential", "integer_pow": "power", "pow": "power",
    "select_n": "select", "eq": "compare", "ne": "compare", "lt": "compare", "gt": "compare",
    "le": "compare", "ge": "compare", "convert_element_type": "convert",
    "broadcast_in_dim": "broadcast", "reduce_sum": "reduce", "reduce_max": "reduce",
    "reduce_min": "reduce", "reduce_prod": "reduce", "squeeze": "reshape",
    "dynamic_slice": "dynamic-slice", "dynamic_update_slice": "dynamic-update-slice",
    "scatter-add": "scatter", "scatter_add": "scatter", "logistic": "logistic",
    "argmax": "reduce", "argmin": "reduce", "stop_gradient": "copy", "copy_p": "copy",
}


def dtype_short(dtype: str) -> str:
    """HLO's short name of a numpy dtype name (``float32`` -> ``f32``)."""
    return _DTYPE_SHORT.get(dtype, dtype)


@dataclasses.dataclass(frozen=True)
class Value:
    """A tensor of the step: a step input, a constant, or an operator's result."""

    id: int
    shape: tuple[int, ...]
    dtype: str
    name: str  # HLO-style, without the '%'
    producer: int | None  # index of the producing op; None for inputs and constants
    input_index: int | None = None  # position among the step's flat inputs
    literal: str | None = None  # a scalar constant's value, as text

    @property
    def type_str(self) -> str:
        return f"{dtype_short(self.dtype)}[{','.join(map(str, self.shape))}]"

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * itemsize(self.dtype)


@dataclasses.dataclass(frozen=True)
class Op:
    """One operator of the flat graph: plain data only (picklable, no JAX objects)."""

    index: int
    primitive: str
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    attrs: tuple[tuple[str, Any], ...]  # the simple parameters (ints, tuples, strings)
    hlo: str  # the operator in HLO notation
    flops: float
    stacks_layers: bool = False  # part of stacking a scan's per-layer results
    scan_origin: int | None = None  # inside a scan: the equation every iteration copies

    def attr(self, key: str, default: Any = None) -> Any:
        return dict(self.attrs).get(key, default)

    @property
    def is_contraction(self) -> bool:
        return self.primitive in CONTRACTIONS


_MEMO: dict[int, dict] = {}


def memo(owner, key, make: Callable):
    """``make()``, computed once per ``key`` for as long as ``owner`` (a graph or a record,
    which are immutable) lives: the walks over the state and the windows run for every
    combination priced."""
    table = _MEMO.get(id(owner))
    if table is None:
        table = _MEMO[id(owner)] = {}
        weakref.finalize(owner, _MEMO.pop, id(owner), None)
    if key not in table:
        table[key] = make()
    return table[key]


@dataclasses.dataclass(frozen=True)
class Graph:
    """The operator graph of a step: values, ops in program order, step inputs and outputs."""

    values: dict[int, Value]
    ops: tuple[Op, ...]
    inputs: tuple[int, ...]
    outputs: tuple[int, ...]
    users: dict[int, tuple[int, ...]]  # value id -> indices of ops that read it
    dead_ops: int  # equations of the jaxpr dropped because nothing used them

    def producer_op(self, value_id: int) -> Op | None:
        p = self.values[value_id].producer
        return None if p is None else self.ops[p]

    def state_pairs(self) -> tuple[tuple[int, int], ...]:
        """(input, output) value pairs of the training state: a step ``(params, opt_state,
        batch) -> (params, opt_state, loss)`` returns its new state first, leaf for leaf in
        its inputs' order, and the loss last. The state is what lives between steps: a plan
        returns it in the layout it came in, and a loop donates it. A forward step returns
        the loss alone: it has no pairs, and nothing is donated."""
        def make():
            pairs = tuple(zip(self.inputs, self.outputs[:-1]))
            for a, b in pairs:
                va, vb = self.values[a], self.values[b]
                if (va.shape, va.dtype) != (vb.shape, vb.dtype):
                    raise CfpError(f"the step returns {vb.type_str} where its state input is "
                                   f"{va.type_str}: a step returns (params, opt_state, loss), "
                                   f"its new state in the order and types its inputs came in")
            return pairs
        return memo(self, "state_pairs", make)

    def fingerprint(self) -> str:
        """A hash of the graph's structure: it changes when the traced step changes."""
        h = hashlib.sha256()
        for op in self.ops:
            h.update(op.hlo.encode())
        for v in self.outputs:
            h.update(str(v).encode())
        return h.hexdigest()[:16]


@dataclasses.dataclass
class _Eqn:
    primitive: Any  # a jax Primitive
    params: dict
    inputs: list[int]
    outputs: list[int]
    stacks_layers: bool = False
    origin: int = -1  # the traced equation this is a copy of (one per scan iteration)
    in_scan: bool = False


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
            self._graph = _build_graph(self)
        return self._graph

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
            if getattr(eqn, "effects", None) or any(o in live for o in eqn.outputs):
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

    def rolls(self, hooks: dict[int, Any]) -> bool:
        """Whether every copy of each equation has the same entry in ``hooks`` (or none):
        then ``evaluate_rolled`` with hooks from the first copy is the same computation."""
        return not self.split_conds and all(
            len({repr(hooks.get(i)) for i in idx}) == 1 for idx in self.copies().values())

    def evaluate_rolled(self, flat_inputs: Sequence[Any], *,
                        before: Callable[[int, list], list] | None = None,
                        after: Callable[[int, list], list] | None = None) -> list[Any]:
        """The step's outputs, evaluated as traced: each scan as a ``lax.scan`` over its body
        and remat's recomputation behind an optimization barrier. The hooks are those of
        ``evaluate``, called with the index of each equation's first copy (see ``rolls``)."""
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
            with (jax.named_scope(scopes[i]) if scopes and i in scopes
                  else contextlib.nullcontext()):
                if before is not None:
                    args = before(i, args)
                out = eqn.primitive.bind(*args, **eqn.params)
                out = list(out) if eqn.primitive.multiple_results else [out]
                if after is not None:
                    out = after(i, out)
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
                                  any(isinstance(p, tuple) for p in path)))
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


# ----------------------------------------------------------------------------------------------
# The plain-data graph


def _build_graph(prog: Program) -> Graph:
    values: dict[int, Value] = {}
    for k, vid in enumerate(prog.inputs):
        shape, dtype = prog.avals[vid]
        values[vid] = Value(vid, shape, dtype, f"Arg_{k}.{vid}", None, k)
    for vid in prog.consts:
        shape, dtype = prog.avals[vid]
        c = prog.consts[vid]
        literal = repr(np.asarray(c).item()) if np.ndim(c) == 0 else None
        values[vid] = Value(vid, shape, dtype, f"constant.{vid}", None, literal=literal)
    ops = []
    users: dict[int, list[int]] = {}
    for i, eqn in enumerate(prog.eqns):
        hname = _HLO_NAME.get(eqn.primitive.name, eqn.primitive.name.replace("_", "-"))
        for o in eqn.outputs:
            shape, dtype = prog.avals[o]
            values[o] = Value(o, shape, dtype, f"{hname}.{o}", i)
        for j in eqn.inputs:
            users.setdefault(j, []).append(i)
        attrs = _simple_attrs(eqn)
        ins = [values[j] for j in eqn.inputs]
        outs = [values[o] for o in eqn.outputs]
        ops.append(Op(i, eqn.primitive.name, tuple(eqn.inputs), tuple(eqn.outputs), attrs,
                      _hlo_line(hname, ins, outs, attrs, eqn.primitive.name),
                      _flops(eqn.primitive.name, ins, outs, dict(attrs)), eqn.stacks_layers,
                      eqn.origin if eqn.in_scan else None))
    return Graph(values, tuple(ops), tuple(prog.inputs), tuple(prog.outputs),
                 {k: tuple(v) for k, v in users.items()}, prog.dead_ops)


def _plain(x: Any) -> Any:
    """A parameter as plain data, or None when it is not simple."""
    if isinstance(x, (bool, int, float, str)) or x is None:
        return x
    if isinstance(x, (np.integer, np.floating)):
        return x.item()
    if isinstance(x, np.dtype) or type(x).__name__ in ("DType",):
        return str(x)
    if isinstance(x, (tuple, list)):
        items = [_plain(e) for e in x]
        return None if any(e is _UNSIMPLE for e in items) else tuple(items)
    if hasattr(x, "_asdict"):  # NamedTuples such as ConvDimensionNumbers
        return _plain(tuple(x))
    if hasattr(x, "name") and type(x).__module__.startswith("jax") and isinstance(
            getattr(x, "name"), str) and not hasattr(x, "spec"):
        return x.name  # enums such as GatherScatterMode, Precision
    return _UNSIMPLE


_UNSIMPLE = object()


def _simple_attrs(eqn) -> tuple[tuple[str, Any], ...]:
    out = []
    for key, val in sorted(eqn.params.items()):
        if key == "dimension_numbers" and eqn.primitive.name == "dot_general":
            (lc, rc), (lb, rb) = val
            out += [("lhs_batch_dims", tuple(lb)), ("rhs_batch_dims", tuple(rb)),
                    ("lhs_contracting_dims", tuple(lc)), ("rhs_contracting_dims", tuple(rc))]
            continue
        if key == "dimension_numbers" and hasattr(val, "lhs_spec"):
            out += [("lhs_spec", tuple(val.lhs_spec)), ("rhs_spec", tuple(val.rhs_spec)),
                    ("out_spec", tuple(val.out_spec))]
            continue
        if key == "dimension_numbers" and (hasattr(val, "offset_dims")  # gather
                                           or hasattr(val, "update_window_dims")):  # scatter
            for f in val._fields if hasattr(val, "_fields") else ():
                p = _plain(getattr(val, f))
                if p is not _UNSIMPLE:
                    out.append((f, p))
            continue
        p = _plain(val)
        if p is not _UNSIMPLE and p is not None:
            out.append((key, p))
    return tuple(out)


_SHOWN_ATTRS = ("lhs_batch_dims", "rhs_batch_dims", "lhs_contracting_dims",
                "rhs_contracting_dims", "permutation", "broadcast_dimensions", "axes",
                "dimensions", "new_sizes", "y", "window_strides", "padding", "lhs_spec",
                "rhs_spec", "out_spec", "start_indices", "limit_indices", "dimension", "axis",
                "feature_group_count")


def _hlo_line(hname: str, ins: list[Value], outs: list[Value], attrs, prim: str) -> str:
    if len(outs) == 1:
        lhs, ty = f"%{outs[0].name}", outs[0].type_str
    else:
        lhs = f"%{outs[0].name}" if outs else "%none"
        ty = "(" + ", ".join(o.type_str for o in outs) + ")"
    operands = ", ".join(f"{v.type_str} %{v.name}" for v in ins)
    shown = []
    d = dict(attrs)
    for key in _SHOWN_ATTRS:
        if key in d:
            if key.endswith("_batch_dims") and not d[key]:
                continue
            val = d[key]
            text = "{" + ",".join(map(str, val)) + "}" if isinstance(val, tuple) else str(val)
            shown.append(f"{key}={text}")
    if hname == "compare":
        shown.append(f"direction={prim.upper()}")
    tail = (", " + ", ".join(shown)) if shown else ""
    return f"{lhs} = {ty} {hname}({operands}){tail}"


def _flops(prim: str, ins: list[Value], outs: list[Value], attrs: dict) -> float:
    if not outs:
        return 0.0
    out_n = math.prod(outs[0].shape)
    if prim == "dot_general":
        contract = math.prod(ins[0].shape[d] for d in attrs["lhs_contracting_dims"])
        return 2.0 * out_n * contract
    if prim == "conv_general_dilated":
        rhs = ins[1].shape
        spec = attrs["rhs_spec"]
        per_out = math.prod(rhs[d] for d in spec[1:])  # input features x kernel window
        return 2.0 * out_n * per_out
    if prim.startswith("reduce_") or prim in ("argmax", "argmin", "cumsum", "cumprod",
                                               "cummax", "cumlogsumexp"):
        return float(math.prod(ins[0].shape))
    return float(out_n)
