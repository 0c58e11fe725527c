"""How a partition flows through an operator without communication.

A block labels tensor dims with the loop dim of its seed contraction that they follow
(``Labels``: one ``int`` or ``None`` per dim). For an operator, ``forward`` derives its result
labels from its operands' labels, ``backward`` derives its operands' labels from the labels its
result is wanted in. Both also return *requirements* ``(label, divisor)``: the operator is
communication-free under a strategy only when the label's shard count divides ``divisor``
(``divisor == 0``: the label must not be split at all). A reduction over a split label, a merge
whose minor dim is split, or a slice of a split dim are such cases: under those strategies the
operator needs a collective, so it is not a block member there.

Operators without a rule here are *opaque*: their result is unlabelled and they are
communication-free only when no operand label is split.

Example:
    >>> reshape_groups((8, 4, 16), (32, 16))
    [((0, 1), (0,)), ((2,), (1,))]
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Sequence

Labels = tuple  # tuple[int | None, ...]
Req = tuple  # (label, divisor)

ELEMENTWISE = frozenset("""
add add_any sub mul div rem pow max min neg exp exp2 log log1p expm1 tanh logistic sin cos tan
sqrt rsqrt cbrt abs sign floor ceil round erf erfc erf_inv integer_pow select_n eq ne lt le gt ge
and or not xor convert_element_type copy copy_p is_finite nextafter atan2 square clamp
reduce_precision real imag shift_left shift_right_logical shift_right_arithmetic stop_gradient
acos asin atan sinh cosh asinh acosh atanh lgamma digamma population_count bitcast_convert_type
""".split())
REDUCTIONS = frozenset("reduce_sum reduce_max reduce_min reduce_prod reduce_and reduce_or "
                       "reduce_xor argmax argmin".split())
SCATTERS = frozenset("scatter-add scatter_add scatter".split())
CUMULATIVE = frozenset("cumsum cumprod cummax cummin cumlogsumexp".split())


@dataclasses.dataclass(frozen=True)
class Flow:
    """Labels of an op's results (``outs``), of the layout it wants its operands in (``ins``),
    and the requirements under which it needs no collective."""

    outs: tuple[Labels, ...]
    ins: tuple[Labels, ...]
    reqs: tuple[Req, ...]


def _none(shape) -> Labels:
    return (None,) * len(shape)


def reshape_groups(a: Sequence[int], b: Sequence[int]) -> list[tuple[tuple, tuple]]:
    """Pair the dims of shape ``a`` and shape ``b`` into groups of equal element count."""
    i = j = 0
    groups = []
    while i < len(a) or j < len(b):
        if i < len(a) and a[i] == 1 and not (j < len(b) and b[j] == 1):
            groups.append(((i,), ()))
            i += 1
            continue
        if j < len(b) and b[j] == 1 and not (i < len(a) and a[i] == 1):
            groups.append(((), (j,)))
            j += 1
            continue
        gi, gj, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                gi.append(i)
                pa *= a[i]
                i += 1
            else:
                gj.append(j)
                pb *= b[j]
                j += 1
        groups.append((tuple(gi), tuple(gj)))
    return groups


def _map_reshape(src_shape, dst_shape, src_labels: Labels) -> tuple[Labels, list[Req]]:
    """Carry labels across a reshape: a group's major dim keeps its label, minor ones must not
    be split."""
    dst = [None] * len(dst_shape)
    reqs: list[Req] = []
    for gi, gj in reshape_groups(src_shape, dst_shape):
        big_i = [d for d in gi if src_shape[d] > 1]
        big_j = [d for d in gj if dst_shape[d] > 1]
        if not big_i:
            continue
        major = src_labels[big_i[0]]
        for d in big_i[1:]:
            if src_labels[d] is not None:
                reqs.append((src_labels[d], 0))
        if major is None:
            continue
        if not big_j:
            reqs.append((major, 0))
            continue
        dst[big_j[0]] = major
        if len(big_i) > 1 or len(big_j) > 1:
            reqs.append((major, dst_shape[big_j[0]]))
    return tuple(dst), reqs


def merge_labels(labels: list, reqs: list) -> int | None:
    """The label of a dim several tensors share; a disagreeing label must not be split."""
    found = [l for l in labels if l is not None]
    if not found:
        return None
    for other in found[1:]:
        if other != found[0]:
            reqs.append((other, 0))
    return found[0]


def forward(prim: str, attrs: dict, in_shapes, out_shapes, in_labels: list) -> Flow:
    """Result labels of an op from its operands' labels (``None`` for an unlabelled operand)."""
    in_labels = [l if l is not None else _none(s) for l, s in zip(in_labels, in_shapes)]
    reqs: list[Req] = []
    if prim in ELEMENTWISE and len(out_shapes) == 1:
        out = out_shapes[0]
        res = []
        for d in range(len(out)):
            res.append(merge_labels([l[d] for l, s in zip(in_labels, in_shapes)
                               if len(s) == len(out) and s[d] == out[d]], reqs))
        outs = (tuple(res),)
        ins = tuple(_expected_elementwise(s, outs[0], out) for s in in_shapes)
        return Flow(outs, ins, tuple(reqs))
    if prim == "optimization_barrier":
        return Flow(tuple(in_labels), tuple(in_labels), ())
    if prim == "broadcast_in_dim":
        out = [None] * len(out_shapes[0])
        for i, d in enumerate(attrs["broadcast_dimensions"]):
            if in_shapes[0][i] == out_shapes[0][d]:
                out[d] = in_labels[0][i]
        return Flow((tuple(out),), (in_labels[0],) + tuple(_none(s) for s in in_shapes[1:]), ())
    if prim in ("reshape", "squeeze"):
        out, reqs = _map_reshape(in_shapes[0], out_shapes[0], in_labels[0])
        return Flow((out,), (in_labels[0],) + tuple(_none(s) for s in in_shapes[1:]),
                    tuple(reqs))
    if prim == "transpose":
        perm = attrs["permutation"]
        return Flow((tuple(in_labels[0][p] for p in perm),), (in_labels[0],), ())
    if prim in REDUCTIONS:
        axes = set(attrs.get("axes", ()))
        reqs = [(in_labels[0][a], 0) for a in axes if in_labels[0][a] is not None]
        out = tuple(l for d, l in enumerate(in_labels[0]) if d not in axes)
        return Flow((out,) * len(out_shapes), (in_labels[0],), tuple(reqs))
    if prim in CUMULATIVE or prim in ("sort", "rev", "top_k", "argsort"):
        axes = _cumulative_axes(prim, attrs, in_shapes[0])
        reqs = [(in_labels[0][a], 0) for a in axes if in_labels[0][a] is not None]
        outs = tuple(tuple(None if d in axes else l for d, l in enumerate(in_labels[0]))
                     if len(s) == len(in_shapes[0]) else _none(s) for s in out_shapes)
        return Flow(outs, tuple(in_labels), tuple(reqs))
    if prim in ("slice", "pad", "dynamic_slice", "dynamic_update_slice", "concatenate", "split"):
        return _window_like(in_shapes, out_shapes, in_labels)
    if prim == "gather" and not attrs.get("operand_batching_dims"):
        return _gather_forward(attrs, in_shapes, out_shapes, in_labels)
    if prim in SCATTERS and not attrs.get("operand_batching_dims"):
        return _scatter_forward(attrs, in_shapes, in_labels)
    # Opaque: no collective only when nothing it reads is split.
    reqs = [(l, 0) for lab in in_labels for l in lab if l is not None]
    return Flow(tuple(_none(s) for s in out_shapes), tuple(_none(s) for s in in_shapes),
                tuple(reqs))


def _gather_pairs(attrs, in_shapes, out_shapes):
    """(output dim, 'indices' or 'operand', dim there) for the dims a gather carries over:
    batch dims of the result come from the indices (last indices dim is the index vector),
    offset dims from whole-extent operand dims."""
    out_rank = len(out_shapes[0])
    offset = list(attrs["offset_dims"])
    batch = [d for d in range(out_rank) if d not in offset]
    pairs = [(o, "indices", i) for o, i in zip(batch, range(len(in_shapes[1]) - 1))]
    window = [d for d in range(len(in_shapes[0])) if d not in attrs["collapsed_slice_dims"]]
    for o, d in zip(offset, window):
        if attrs["slice_sizes"][d] == in_shapes[0][d]:
            pairs.append((o, "operand", d))
    return pairs


def _gather_forward(attrs, in_shapes, out_shapes, in_labels) -> Flow:
    out = [None] * len(out_shapes[0])
    carried = set()
    for o, src, d in _gather_pairs(attrs, in_shapes, out_shapes):
        out[o] = in_labels[0 if src == "operand" else 1][d]
        if src == "operand":
            carried.add(d)
    reqs = [(l, 0) for d, l in enumerate(in_labels[0]) if l is not None and d not in carried]
    return Flow((tuple(out),), tuple(in_labels), tuple(reqs))


def _scatter_pairs(attrs, in_shapes):
    """(operand dim, updates dim) for the operand dims a scatter writes whole: its window dims
    (those not scattered into) in order, paired with the updates' window dims, where the
    update spans the operand dim's full extent."""
    operand, updates = in_shapes[0], in_shapes[2]
    window = [d for d in range(len(operand)) if d not in attrs["inserted_window_dims"]]
    return [(d, u) for d, u in zip(window, attrs["update_window_dims"])
            if updates[u] == operand[d]]


def _scatter_forward(attrs, in_shapes, in_labels) -> Flow:
    """A scatter into a table, as an embedding's gradient is: a dim written whole keeps the
    label of the updates' dim it comes from (split, each device writes its own columns); a
    split updates dim that is scattered (rows summed or overwritten by index) or a split
    operand dim scattered into needs a collective."""
    reqs: list[Req] = []
    operand, indices, updates = in_labels[0], in_labels[1], in_labels[2]
    pairs = dict(_scatter_pairs(attrs, in_shapes))
    out = tuple(merge_labels([operand[d], updates[pairs[d]]], reqs) if d in pairs else None
                for d in range(len(operand)))
    reqs += [(l, 0) for d, l in enumerate(operand) if l is not None and d not in pairs]
    carried = set(pairs.values())
    reqs += [(l, 0) for d, l in enumerate(updates) if l is not None and d not in carried]
    reqs += [(l, 0) for l in indices if l is not None]
    want = list(updates)
    for d, u in pairs.items():
        want[u] = out[d]
    ins = (out, tuple(indices), tuple(want)) + tuple(_none(s) for s in in_shapes[3:])
    return Flow((out,), ins, tuple(reqs))


def _expected_elementwise(shape, out_labels: Labels, out_shape) -> Labels:
    if len(shape) != len(out_shape):
        return _none(shape)
    return tuple(l if shape[d] == out_shape[d] else None for d, l in enumerate(out_labels))


def _cumulative_axes(prim, attrs, shape) -> set[int]:
    if prim in CUMULATIVE:
        return {attrs["axis"]}
    if prim == "rev":
        return set(attrs["dimensions"])
    if prim == "sort":
        return {attrs.get("dimension", len(shape) - 1)}
    return {len(shape) - 1}  # top_k and friends work on the last dim


def _window_like(in_shapes, out_shapes, in_labels) -> Flow:
    """Slices, pads, concatenations: a dim that keeps its full extent keeps its label; one
    that changes extent must not be split."""
    reqs: list[Req] = []
    outs = []
    data = [(s, l) for s, l in zip(in_shapes, in_labels) if len(s) > 0]
    for out in out_shapes:
        res = []
        for d, size in enumerate(out):
            cands = [l[d] for s, l in data if len(s) == len(out) and s[d] == size]
            changed = [l[d] for s, l in data if len(s) == len(out) and s[d] != size]
            for c in changed:
                if c is not None:
                    reqs.append((c, 0))
            res.append(None if changed else merge_labels(cands, reqs))
        outs.append(tuple(res))
    ins = tuple(tuple(l if (len(s) == len(out_shapes[0]) and s[d] == out_shapes[0][d])
                      else None for d, l in enumerate(lab))
                for s, lab in zip(in_shapes, in_labels))
    return Flow(tuple(outs), ins, tuple(reqs))


def backward(prim: str, attrs: dict, in_shapes, out_shapes, out_labels: list) -> Flow:
    """Operand labels of an op from the labels its results are wanted in."""
    out_labels = [l if l is not None else _none(s) for l, s in zip(out_labels, out_shapes)]
    want = out_labels[0]
    out_shape = out_shapes[0]
    if prim in ELEMENTWISE and len(out_shapes) == 1:
        ins = tuple(_expected_elementwise(s, want, out_shape) for s in in_shapes)
    elif prim == "broadcast_in_dim":
        first = tuple(want[d] if in_shapes[0][i] == out_shape[d] else None
                      for i, d in enumerate(attrs["broadcast_dimensions"]))
        ins = (first,) + tuple(_none(s) for s in in_shapes[1:])
    elif prim in ("reshape", "squeeze"):
        first, extra = _map_reshape(out_shape, in_shapes[0], want)
        ins = (first,) + tuple(_none(s) for s in in_shapes[1:])
    elif prim == "transpose":
        perm = attrs["permutation"]
        inv = [0] * len(perm)
        for i, p in enumerate(perm):
            inv[p] = i
        ins = (tuple(want[inv[d]] for d in range(len(perm))),)
    elif prim in REDUCTIONS:
        axes = set(attrs.get("axes", ()))
        it = iter(want)
        ins = (tuple(None if d in axes else next(it) for d in range(len(in_shapes[0]))),)
    elif prim == "optimization_barrier":
        ins = tuple(out_labels)
    elif prim in ("slice", "pad", "concatenate"):  # a dim kept whole keeps its label
        ins = tuple(tuple(want[d] if len(s) == len(out_shape) and s[d] == out_shape[d]
                          else None for d in range(len(s))) for s in in_shapes)
    elif prim in SCATTERS and not attrs.get("operand_batching_dims"):
        pairs = _scatter_pairs(attrs, in_shapes)
        ins = [list(_none(s)) for s in in_shapes]
        for d, u in pairs:
            ins[0][d] = ins[2][u] = want[d]
        ins = tuple(tuple(x) for x in ins)
    elif prim == "gather" and not attrs.get("operand_batching_dims"):
        ins = [list(_none(s)) for s in in_shapes]
        for o, src, d in _gather_pairs(attrs, in_shapes, out_shapes):
            ins[0 if src == "operand" else 1][d] = want[o]
        ins = tuple(tuple(x) for x in ins)
    else:
        ins = tuple(_none(s) for s in in_shapes)
    if prim not in ("reshape", "squeeze"):
        extra = []
    # Check the inferred operands against the op's own forward rule.
    fwd = forward(prim, attrs, in_shapes, out_shapes, list(ins))
    reqs = list(fwd.reqs) + list(extra)
    for got, wanted in zip(fwd.outs, out_labels):
        for g, w in zip(got, wanted):
            if w is not None and g is not None and g != w:  # None: replicated, free to slice
                reqs.append((w, 0))
    return Flow(tuple(out_labels), ins, tuple(reqs))


def spec_axes(labels: Labels, strategy_axes: tuple, axis_names: Sequence[str]) -> tuple:
    """PartitionSpec entries of a tensor with ``labels`` under a strategy."""
    return _spec_axes(tuple(labels), tuple(strategy_axes), tuple(axis_names))


@functools.lru_cache(maxsize=2**16)
def _spec_axes(labels: Labels, strategy_axes: tuple, axis_names: tuple) -> tuple:
    spec = []
    for l in labels:
        used = tuple(axis_names[a] for a, d in enumerate(strategy_axes) if l is not None and d == l)
        spec.append(None if not used else used[0] if len(used) == 1 else used)
    return tuple(spec)


def satisfied(reqs, strategy_axes: tuple, mesh_shape: tuple) -> bool:
    """Whether a strategy meets every requirement (see the module docstring)."""
    for label, divisor in reqs:
        n = math.prod(mesh_shape[a] for a, d in enumerate(strategy_axes) if d == label)
        if n > 1 and (divisor == 0 or divisor % n):
            return False
    return True
