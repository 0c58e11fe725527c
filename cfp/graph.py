"""The plain-data view of a traced step (``cfp.program``): its values (shapes, dtypes) and
operators (operands, users, contraction dimension numbers, FLOPs), each printed in HLO notation;
what the analysis records and every later pass reads.

Example:
    >>> import jax.numpy as jnp
    >>> from cfp.program import trace_program
    >>> g = trace_program(lambda x, w: jnp.sum(x @ w), jnp.ones((4, 8)), jnp.ones((8, 2))).graph()
    >>> g.ops[0].hlo
    '%dot.2 = f32[4,2] dot(f32[4,8] %Arg_0.0, f32[8,2] %Arg_1.1), lhs_contracting_dims={1}, rhs_contracting_dims={0}'
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
import weakref
from typing import Any, Callable

import numpy as np

from cfp.errors import CfpError
from cfp.jax_compat import itemsize

CONTRACTIONS = ("dot_general", "conv_general_dilated")


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


# ----------------------------------------------------------------------------------------------
# The plain-data graph


def build_graph(prog) -> Graph:
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


def computed_from_inputs(graph: Graph) -> set[int]:
    """The values computed from a step input (the others are constants: the same every
    step)."""
    out = {v for v, val in graph.values.items() if val.input_index is not None}
    for op in graph.ops:
        if any(v in out for v in op.inputs):
            out.update(op.outputs)
    return out


def repeats(graph: Graph) -> dict[int, int]:
    """Value -> the value it recomputes, for the values remat recomputes behind an
    optimization barrier: a barrier's result repeats its operand, and an operator applied to
    repeated operands (and same attributes) repeats the earlier operator it matches."""
    repeats: dict[int, int] = {}
    seen: dict[tuple, tuple[int, ...]] = {}
    constant = {v for v, val in graph.values.items()  # computed from constants only
                if val.producer is None and val.input_index is None}

    def same(v):  # scalar literals are equal by value
        lit = graph.values[v].literal
        return (lit, graph.values[v].dtype) if lit is not None else repeats.get(v, v)

    for op in graph.ops:
        if op.primitive == "optimization_barrier":
            for i, o in zip(op.inputs, op.outputs):
                repeats[o] = repeats.get(i, i)
            continue
        if all(v in constant for v in op.inputs):
            constant.update(op.outputs)
        key = (op.primitive, op.attrs, tuple(same(v) for v in op.inputs))
        if key in seen and any(v in repeats or v in constant for v in op.inputs):
            repeats.update(zip(op.outputs, seen[key]))
        else:
            seen.setdefault(key, op.outputs)
    return repeats


def loss_op(g) -> int | None:
    """Index of the op computing the step's loss, its last output when that is a scalar an
    op computes: the backward pass comes after it. None where there is none (a forward
    step, a loss passed through)."""
    loss = g.values[g.outputs[-1]] if g.outputs else None
    return None if loss is None or loss.shape else loss.producer
