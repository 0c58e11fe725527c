"""Intra-operator strategies of a tensor contraction on a device mesh.

A contraction (``dot_general`` or a convolution) has *loop dims*: batch dims (in both operands and
the result), lhs-free and rhs-free dims (in one operand and the result) and contracting dims (in
both operands, summed away). A strategy maps each mesh axis to at most one loop dim, or to none
(replicated along that axis); on a 2-D mesh one loop dim may take both axes, major first (Alpa's
``S01``). A split contracting dim leaves partial sums: the strategy names an all-reduce over
that axis. Convolutions expose batch, output-feature and input-feature dims; spatial dims are
never split (that needs halo exchange).

Names follow Alpa: ``<out> = <lhs> x <rhs> @ {axes}``, one ``S`` (split) or ``R`` per tensor
dim; ``@ {...}`` lists the mesh axes of each split loop dim in the order the splits first appear
reading the line left to right (``01`` for a dim split over both axes), then
``(allreduce @ a)`` for each split contracting dim.

Example:
    >>> dims = dot_loop_dims((8, 4), (4, 8), ((1,), (0,)), ((), ()))
    >>> [s.name for s in enumerate_strategies(dims, (4,))[0]]
    ['SR = SR x RR @ {0}', 'RS = RR x RS @ {0}', 'RR = RS x SR @ {0} (allreduce @ 0)']
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from typing import Literal

LoopKind = Literal["batch", "lhs", "rhs", "contract"]


@dataclasses.dataclass(frozen=True)
class LoopDim:
    """One loop dim of a contraction and where it sits in each tensor (None: absent)."""

    kind: LoopKind
    size: int
    lhs: int | None
    rhs: int | None
    out: int | None


@dataclasses.dataclass(frozen=True)
class Strategy:
    """A strategy: for each mesh axis, the loop dim it splits (None: replicated)."""

    axes: tuple[int | None, ...]
    name: str

    def loop_axes(self, loop: int) -> tuple[int, ...]:
        """The mesh axes (major first) that split loop dim ``loop``."""
        return tuple(a for a, d in enumerate(self.axes) if d == loop)


def dot_loop_dims(lhs_shape, rhs_shape, contracting, batch) -> tuple[LoopDim, ...]:
    """Loop dims of ``dot_general`` from its operand shapes and dimension numbers."""
    (lc, rc), (lb, rb) = contracting, batch
    dims = []
    out = 0
    for l, r in zip(lb, rb):
        dims.append(LoopDim("batch", lhs_shape[l], l, r, out))
        out += 1
    for l in range(len(lhs_shape)):
        if l not in lc and l not in lb:
            dims.append(LoopDim("lhs", lhs_shape[l], l, None, out))
            out += 1
    for r in range(len(rhs_shape)):
        if r not in rc and r not in rb:
            dims.append(LoopDim("rhs", rhs_shape[r], None, r, out))
            out += 1
    for l, r in zip(lc, rc):
        dims.append(LoopDim("contract", lhs_shape[l], l, r, None))
    return tuple(dims)


def conv_loop_dims(lhs_shape, rhs_shape, lhs_spec, rhs_spec, out_spec, *,
                   feature_group_count: int = 1, batch_group_count: int = 1
                   ) -> tuple[LoopDim, ...]:
    """Loop dims of ``conv_general_dilated``: the images (free in lhs), output features (free
    in rhs), input features (contracted)."""
    dims = []
    if batch_group_count == 1:
        dims.append(LoopDim("lhs", lhs_shape[lhs_spec[0]], lhs_spec[0], None, out_spec[0]))
    if feature_group_count == 1 and batch_group_count == 1:
        dims.append(LoopDim("rhs", rhs_shape[rhs_spec[0]], None, rhs_spec[0], out_spec[1]))
        dims.append(LoopDim("contract", lhs_shape[lhs_spec[1]], lhs_spec[1], rhs_spec[1], None))
    return tuple(dims)


def op_loop_dims(op, values) -> tuple[LoopDim, ...]:
    """Loop dims of a graph ``Op`` that is a contraction."""
    lhs, rhs = (values[i].shape for i in op.inputs[:2])
    if op.primitive == "dot_general":
        return dot_loop_dims(lhs, rhs, (op.attr("lhs_contracting_dims"),
                                        op.attr("rhs_contracting_dims")),
                             (op.attr("lhs_batch_dims"), op.attr("rhs_batch_dims")))
    return conv_loop_dims(lhs, rhs, op.attr("lhs_spec"), op.attr("rhs_spec"),
                          op.attr("out_spec"),
                          feature_group_count=op.attr("feature_group_count", 1),
                          batch_group_count=op.attr("batch_group_count", 1))


def _valid(axes: tuple[int | None, ...], dims, mesh_shape) -> bool:
    for loop in set(a for a in axes if a is not None):
        used = [i for i, d in enumerate(axes) if d == loop]
        if used != list(range(used[0], used[0] + len(used))):
            return False  # a dim over several axes takes them major first, consecutively
        if dims[loop].size % math.prod(mesh_shape[i] for i in used):
            return False
    return True


def strategy_name(axes: tuple[int | None, ...], dims: tuple[LoopDim, ...], ndims) -> str:
    """Alpa-style name of a strategy, e.g. ``SS = SR x RS @ {0,1}``."""
    out_rank, lhs_rank, rhs_rank = ndims
    split = {d: "".join(str(a) for a, x in enumerate(axes) if x == d)
             for d in set(axes) if d is not None}
    order: list[int] = []

    def tensor(rank, where) -> str:
        letters = []
        for pos in range(rank):
            loop = next((i for i, d in enumerate(dims) if getattr(d, where) == pos), None)
            if loop is not None and loop in split:
                letters.append("S")
                if loop not in order:
                    order.append(loop)
            else:
                letters.append("R")
        return "".join(letters)

    text = f"{tensor(out_rank, 'out')} = {tensor(lhs_rank, 'lhs')} x {tensor(rhs_rank, 'rhs')}"
    text += " @ {" + ",".join(split[d] for d in order) + "}"
    for d in sorted(split, key=order.index):
        if dims[d].kind == "contract":
            text += f" (allreduce @ {split[d]})"
    return text


def enumerate_strategies(dims: tuple[LoopDim, ...], mesh_shape: tuple[int, ...], *,
                         ndims: tuple[int, int, int] | None = None
                         ) -> tuple[list[Strategy], int]:
    """All non-dominated strategies of a contraction, and the count before pruning.

    A strategy is kept when every split divides its dim. It is *dominated* when some mesh axis
    is left unused although another valid strategy agrees with it on every used axis and puts
    that axis on a non-contracting dim: the same communication, less work per device.
    """
    if ndims is None:
        ndims = (sum(d.out is not None for d in dims), sum(d.lhs is not None for d in dims),
                 sum(d.rhs is not None for d in dims))
    strategies, before = _enumerate(tuple(dims), tuple(mesh_shape), tuple(ndims))
    return list(strategies), before


@functools.lru_cache(maxsize=4096)  # the contractions of repeated layers have the same dims
def _enumerate(dims: tuple[LoopDim, ...], mesh_shape: tuple[int, ...],
               ndims: tuple[int, int, int]) -> tuple[tuple[Strategy, ...], int]:
    choices = [[None] + (list(range(len(dims))) if n > 1 else []) for n in mesh_shape]
    valid = [a for a in itertools.product(*choices) if _valid(a, dims, mesh_shape)]
    valid_set = set(valid)

    def dominated(axes) -> bool:
        for i, d in enumerate(axes):
            if d is not None or mesh_shape[i] == 1:
                continue
            for loop, ld in enumerate(dims):
                if ld.kind == "contract":
                    continue
                better = axes[:i] + (loop,) + axes[i + 1:]
                if better in valid_set:
                    return True
        return False

    kept = [a for a in valid if not dominated(a)]
    kept.sort(key=lambda a: tuple(99 if d is None else d for d in a))
    return tuple(Strategy(a, strategy_name(a, dims, ndims)) for a in kept), len(valid)
