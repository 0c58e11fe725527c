"""Profiling windows and the boundaries between them (derived from the analysis alone).

A unique segment whose strategy space exceeds ``max_combinations`` is split into consecutive
*windows* whose spaces fit; every instance of the segment is split at the same offsets. Each
window type is profiled once, for every combination of its blocks' strategies.

**Boundaries.** A window is measured with its live-ins already in the layout its first reader
wants and its live-outs in the layout their producer makes, so a measured window time holds no
resharding at its edges. What crosses between window instances is priced separately: for each
tensor that a block of one window produces (or the step feeds) and a block of another window
reads, the layout it leaves in under the producer's strategy and the layout the reader wants
under its strategy; search adds the measured resharding time of every such pair
(``Boundary``). Step inputs read by several blocks (tied weights) enter in the layout their first
reader wants; other readers pay a resharding from it.
"""
from __future__ import annotations

import dataclasses
import math

from cfp import dims as dimrules


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


def split_windows(analysis, max_combinations: int) -> tuple[list[Window], list[int]]:
    """Window instances over the whole block sequence, and per window type the index of its
    representative instance (inside the segment's representative)."""
    sa = analysis.segments
    offsets = {t: _cuts(analysis, sa.instances[r], max_combinations)
               for t, r in enumerate(sa.representatives)}
    window_type: dict[tuple[int, int], int] = {}
    windows = []
    for seg in sa.instances:
        for lo, hi in offsets[seg.type]:
            wt = window_type.setdefault((seg.type, lo), len(window_type))
            windows.append(Window(seg.start + lo, seg.start + hi, wt))
    reps = [0] * len(window_type)
    for (seg_type, lo), wt in window_type.items():
        rep = sa.instances[sa.representatives[seg_type]]
        reps[wt] = next(i for i, w in enumerate(windows) if w.start == rep.start + lo)
    return windows, reps


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
    return [len(analysis.blocks.blocks[b].strategies) for b in range(window.start, window.end)]


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
    return _dedupe(out)


def _dedupe(items: list[Boundary]) -> list[Boundary]:
    seen, out = set(), []
    for b in items:
        key = (b.value, b.src, b.dst, b.src_labels, b.dst_labels)
        if key not in seen:
            seen.add(key)
            out.append(b)
    return out


def boundary_specs(boundary: Boundary, src_strategy, dst_strategy, axis_names):
    """(layout it leaves in, layout it is wanted in) as PartitionSpec entries."""
    return (dimrules.spec_axes(boundary.src_labels, src_strategy.axes, axis_names),
            dimrules.spec_axes(boundary.dst_labels, dst_strategy.axes, axis_names))


def shard_bytes(shape, dtype_size: int, spec, mesh_shape, axis_names) -> int:
    """Bytes of one device's shard of a tensor laid out as ``spec``."""
    n = math.prod(shape) * dtype_size
    for entry in spec:
        for name in (entry if isinstance(entry, tuple) else (entry,) if entry else ()):
            n //= mesh_shape[axis_names.index(name)]
    return n
