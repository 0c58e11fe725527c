"""Find repeated sequences of blocks (segments), so that each is profiled once.

1. **Cuts.** Between consecutive blocks ``c-1 | c`` of the global sequence, the *cut width* is
   the number of independent tensors that cross it: results of one block read by a block on the
   other side (forward activations and backward cotangents alike), counted once per set of
   nearest contraction sources (``_cut_widths``). Tensors that depend on no contraction (masks,
   step counters) are computed once, and scalars (loss terms) have no layout: neither counts.
   Nor does the stacking of a scan's per-layer results (the stacked gradient of stacked
   weights), which reads every layer by construction. The narrowest cuts split the sequence
   into *pieces*: in a transformer, the residual stream and its gradient are all that cross
   between attention and MLP and between layers.
2. **Fingerprints.** A piece's fingerprint is, per block, its contractions (kinds, shapes,
   dimension numbers, dtypes) and how its seed's operands connect: to which blocks of the same
   piece (by offset) or to something outside it.
3. **Segments.** The most frequent piece type (the earliest on ties) opens a segment at each of
   its occurrences; pieces before its first occurrence form a leading segment. So layers become
   segments, a model whose MoE and dense layers alternate gets one segment type for each, and
   the number of unique segments does not grow with depth.

Example: ``find_segments(graph, blocks)`` on a 4-layer GPT gives instances
``(0, 8), (8, 16), (16, 24), (24, 32), (32, 33)`` of two types.
"""
from __future__ import annotations

import collections
import dataclasses
import re

from cfp.blocks import BlockAnalysis
from cfp.graph import Graph


@dataclasses.dataclass(frozen=True)
class Segment:
    """A range ``[start, end)`` of the global block sequence and its segment type."""

    start: int
    end: int
    type: int


@dataclasses.dataclass(frozen=True)
class SegmentAnalysis:
    instances: tuple[Segment, ...]
    representatives: tuple[int, ...]  # per type: index into instances of the one to profile
    cut_widths: tuple[int, ...]  # width of cut c (between blocks c-1 and c), c = 1..n-1
    piece_starts: tuple[int, ...]

    @property
    def num_types(self) -> int:
        return len(self.representatives)


def find_segments(graph: Graph, ba: BlockAnalysis) -> SegmentAnalysis:
    """Split the block sequence into segments and find the repeated ones."""
    n = len(ba.blocks)
    widths = _cut_widths(graph, ba)
    if n <= 1:
        starts = [0]
    else:
        narrow = min(widths)
        starts = [0] + [c for c in range(1, n) if widths[c - 1] == narrow]
    pieces = list(zip(starts, starts[1:] + [n]))
    piece_fp = [_range_fingerprint(graph, ba, s, e) for s, e in pieces]
    counts = collections.Counter(piece_fp)
    opener = max(counts, key=lambda fp: (counts[fp], -piece_fp.index(fp)))
    opens = [k for k, fp in enumerate(piece_fp) if fp == opener]
    groups = ([list(range(opens[0]))] if opens[0] else []) + [
        list(range(a, b)) for a, b in zip(opens, opens[1:] + [len(pieces)])]
    groups = _split_tail(groups, piece_fp)
    types: dict[tuple, int] = {}
    instances = []
    for grp in groups:
        fp = tuple(piece_fp[k] for k in grp)
        s, e = pieces[grp[0]][0], pieces[grp[-1]][1]
        instances.append(Segment(s, e, types.setdefault(fp, len(types))))
    reps = []
    for t in range(len(types)):
        idx = [i for i, seg in enumerate(instances) if seg.type == t]
        reps.append(idx[len(idx) // 2])
    return SegmentAnalysis(tuple(instances), tuple(reps), tuple(widths), tuple(starts))


def _split_tail(groups: list[list[int]], piece_fp: list) -> list[list[int]]:
    """The last segment keeps the longest run of pieces that repeats an earlier segment; the
    pieces after it (a model's head) form a trailing segment of their own."""
    last = groups[-1]
    best = 0
    for grp in groups[:-1]:
        if len(grp) < len(last) and [piece_fp[k] for k in grp] == [
                piece_fp[k] for k in last[:len(grp)]]:
            best = max(best, len(grp))
    if best:
        return groups[:-1] + [last[:best], last[best:]]
    return groups


def _cut_widths(graph: Graph, ba: BlockAnalysis) -> list[int]:
    """Width of each cut: how many *independent* tensors cross it.

    Tensors are told apart by their nearest contraction sources (the blocks whose contractions
    they are computed from, through any non-contraction ops): a LayerNorm's output and its saved
    statistics carry the same information as the residual stream they come from, so together
    they count once. Tensors that depend on no contraction, and scalars, do not count."""
    n = len(ba.blocks)
    interned: dict[frozenset, int] = {frozenset(): 0}
    union_cache: dict[tuple[int, int], int] = {}
    members: list[frozenset] = [frozenset()]

    def union(a: int, b: int) -> int:
        if a == b or b == 0:
            return a
        if a == 0:
            return b
        key = (min(a, b), max(a, b))
        if key not in union_cache:
            fs = members[a] | members[b]
            if fs not in interned:
                interned[fs] = len(members)
                members.append(fs)
            union_cache[key] = interned[fs]
        return union_cache[key]

    source: dict[int, int] = {}
    for op in graph.ops:
        if op.is_contraction:
            fs = frozenset({ba.owner[op.index]})
            sid = interned.setdefault(fs, len(members))
            if sid == len(members):
                members.append(fs)
        else:
            sid = 0
            for v in op.inputs:
                sid = union(sid, source.get(v, 0))
        for v in op.outputs:
            source[v] = sid
    spans: dict[int, list[tuple[int, int]]] = {}
    for op in graph.ops:
        j = ba.owner.get(op.index)
        if j is None or op.stacks_layers:  # a scan's stack reads every layer by design
            continue
        for v in op.inputs:
            p = graph.values[v].producer
            i = ba.owner.get(p) if p is not None else None
            if i is None or i == j or not source.get(v, 0) or not graph.values[v].shape:
                continue
            spans.setdefault(source[v], []).append((min(i, j), max(i, j)))
    diff = [0] * (n + 1)
    for intervals in spans.values():
        intervals.sort()
        lo, hi = intervals[0]
        for a, b in intervals[1:] + [(n + 1, n + 1)]:
            if a > hi:
                diff[lo + 1] += 1
                diff[hi + 1] -= 1
                lo, hi = a, b
            else:
                hi = max(hi, b)
    widths, run = [], 0
    for c in range(1, n):
        run += diff[c]
        widths.append(run)
    return widths


_NAME = re.compile(r"%[\w.\-]+")


def contraction_signature(graph: Graph, op_index: int) -> str:
    """An operator's HLO line without value names: what it computes, not where."""
    return _NAME.sub("%", graph.ops[op_index].hlo)


def block_fingerprint(graph: Graph, ba: BlockAnalysis, b: int) -> tuple:
    block = ba.blocks[b]
    return (contraction_signature(graph, block.seed),
            tuple(sorted(contraction_signature(graph, m.op) for m in block.contractions
                         if m.role != "seed")),
            len(block.strategies))


def _range_fingerprint(graph: Graph, ba: BlockAnalysis, start: int, end: int) -> tuple:
    fp = []
    for b in range(start, end):
        seed = graph.ops[ba.blocks[b].seed]
        links = tuple(_sources_in_range(graph, ba, v, start, end) for v in seed.inputs[:2])
        fp.append((block_fingerprint(graph, ba, b), links))
    return tuple(fp)


def _sources_in_range(graph: Graph, ba: BlockAnalysis, value: int, start: int, end: int):
    """Nearest contractions feeding ``value``: as offsets of blocks inside the range, or
    'out' for anything outside it."""
    found: set = set()
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        op = graph.producer_op(v)
        if op is None:
            found.add("out")
            continue
        owner = ba.owner.get(op.index)
        if owner is not None and not start <= owner < end:
            found.add("out")
        elif op.is_contraction:
            found.add(owner)
        else:
            stack.extend(op.inputs)
    ints = sorted(x - start for x in found if isinstance(x, int))
    return tuple(ints) + (("out",) if "out" in found else ())
