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
2. **Common values.** A value that copies of one block in successive layers read, but that
   no layer makes (a position bias, rotary tables, an encoder's output that every decoder
   layer attends to), is a common input of the layers (``common_values``): it crosses the
   cut after the block that made it, not every cut up to its last reader, and the terms and
   partial sums of its gradient, which the layers add up, cross none. Otherwise such a value
   would widen every cut it spans, and the layers that read it would merge into one piece.
3. **Fingerprints.** A piece's fingerprint is, per block, its contractions (kinds, shapes,
   dimension numbers, dtypes) and how its seed's operands connect: to which blocks of the same
   piece (by offset) or to something outside it. Constants (computed from no step input, such
   as rotary cosines made in the first layer that reads them) connect to nothing.
4. **Segments.** The pieces split into *runs* (``_runs``): each the longest repetition of a
   unit of pieces (an encoder's layers, then a decoder's), or a stretch that repeats nothing.
   In each run the most frequent piece type (the earliest on ties) opens a segment at each of
   its occurrences; pieces before its first occurrence form a leading segment. So layers
   become segments, a model whose MoE and dense layers alternate gets one segment type for
   each, an encoder-decoder gets one for each stack, and the number of unique segments does
   not grow with depth.

Example: ``find_segments(graph, blocks)`` on a 4-layer GPT gives instances
``(0, 8), (8, 16), (16, 24), (24, 32), (32, 33)`` of two types.
"""
from __future__ import annotations

import collections
import dataclasses
import re

from cfp.blocks import BlockAnalysis, LAYOUT_OPS
from cfp.graph import Graph, computed_from_inputs


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
    interned: dict[tuple, int] = {}
    varying = computed_from_inputs(graph)
    piece_fp = [interned.setdefault(_range_fingerprint(graph, ba, s, e, varying),
                                    len(interned))
                for s, e in pieces]
    groups: list[list[int]] = []
    for lo, hi in _runs(piece_fp):
        groups += _split_tail(_open_at_most_frequent(piece_fp, lo, hi), piece_fp, groups)
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


def _runs(piece_fp: list[int]) -> list[tuple[int, int]]:
    """Split the pieces into runs ``[lo, hi)``: each the longest repetition of a unit of
    pieces that starts where the last run ended (an encoder's layers, then a decoder's, whose
    units differ), or a stretch of pieces that repeat nothing consecutively."""
    n, runs, loose, i = len(piece_fp), [], None, 0
    while i < n:
        best = 0, 0  # (pieces covered, period)
        for period in range(1, (n - i) // 2 + 1):
            k = 1
            while piece_fp[i + k * period:i + (k + 1) * period] == piece_fp[i:i + period]:
                k += 1
            if k > 1 and k * period > best[0]:
                best = k * period, period
        if not best[0]:
            loose = i if loose is None else loose
            i += 1
            continue
        if loose is not None:
            runs.append((loose, i))
            loose = None
        runs.append((i, i + best[0]))
        i += best[0]
    return runs + ([(loose, n)] if loose is not None else [])


def _open_at_most_frequent(piece_fp: list[int], lo: int, hi: int) -> list[list[int]]:
    """Group the pieces ``[lo, hi)``: the most frequent piece type among them (the earliest on
    ties) opens a group at each occurrence; the pieces before its first form a group."""
    fps = piece_fp[lo:hi]
    counts = collections.Counter(fps)
    opener = max(counts, key=lambda fp: (counts[fp], -fps.index(fp)))
    opens = [lo + k for k, fp in enumerate(fps) if fp == opener]
    return ([list(range(lo, opens[0]))] if opens[0] > lo else []) + [
        list(range(a, b)) for a, b in zip(opens, opens[1:] + [hi])]


def _split_tail(groups: list[list[int]], piece_fp: list[int],
                before: list[list[int]] = ()) -> list[list[int]]:
    """The last group keeps the longest run of pieces that repeats an earlier group (of
    ``groups`` or ``before``); the pieces after it (a model's head) form a group of their
    own."""
    last = groups[-1]
    best = 0
    for grp in list(before) + groups[:-1]:
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
    diff = [0] * (n + 1)
    for intervals in _spans(graph, ba).values():
        intervals = sorted((lo, hi) for lo, hi, _ in intervals)
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


def _spans(graph: Graph, ba: BlockAnalysis) -> dict[int, list[tuple[int, int, int]]]:
    """Per set of nearest contraction sources (interned), the (earlier block, later block,
    value) of each tensor of that set crossing between blocks, shortened where it is common
    (``common_values``)."""
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
        if op.index in ba.owner and op.is_contraction:  # one of constants alone has no block
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
    common, summing = common_values(graph, ba)
    crossings = []  # (source, earlier block, later block, value)
    for op in graph.ops:
        j = ba.owner.get(op.index)
        if j is None or op.stacks_layers or op.index in summing:
            continue  # a scan's stack reads every layer by design; see common_values
        for v in op.inputs:
            p = graph.values[v].producer
            i = ba.owner.get(p) if p is not None else None
            if i is None or i == j or not source.get(v, 0) or not graph.values[v].shape:
                continue
            crossings.append((source[v], min(i, j), max(i, j), v))
    # What passes from a common value's maker, or a block before it, to a block that reads
    # the value (the value itself, the saved statistics of a norm whose backward runs where
    # the value's gradient is summed) or back (that sum, the gradients it feeds) enters the
    # readers as a common input: it crosses the cuts up to the one after the maker.
    makers: dict[int, list[int]] = {}  # reader block -> blocks that made common values it reads
    for _, lo, hi, v in crossings:
        if v in common:
            makers.setdefault(hi, []).append(lo)
    spans: dict[int, list[tuple[int, int, int]]] = {}
    for sid, lo, hi, v in crossings:
        maker = min((m for m in makers.get(hi, ()) if m >= lo), default=None)
        spans.setdefault(sid, []).append((lo, hi if maker is None else maker + 1, v))
    return spans


def common_values(graph: Graph, ba: BlockAnalysis) -> tuple[frozenset[int], frozenset[int]]:
    """(values that repeated layers read but that belong to none of them, the operators that
    sum their gradients): the common inputs of the layers' instances, such as a position bias
    or a mask computed once, rotary tables, or an encoder's output that every decoder layer
    attends to.

    A value is read in common when two of its readers are copies of one block in two copies
    of a run of blocks: blocks ``j < k`` at the same offset of two equal, consecutive runs of
    ``k - j`` block fingerprints (a layer and the next), with a block between them that does
    not read it (the query, key and value projections of one layer's input sit side by side:
    they are one layer's readers). The backward pass sums a value's gradient over its
    readers, as a tree of ``add_any`` whose partial sums nothing else reads; when the terms
    come from such copies of a block, the tree's operators are the second set and its full
    sum, which goes back to where the value was made, is a common value too."""
    interned: dict[tuple, int] = {}
    fp = [interned.setdefault(block_fingerprint(graph, ba, b), len(interned))
          for b in range(len(ba.blocks))]

    def copies(j: int, k: int) -> bool:  # fp[x:x + d] == fp[x + d:x + 2d], x <= j < x + d
        d, run = k - j, 0
        if fp[j] != fp[k]:
            return False
        for y in range(max(0, j - d + 1), min(j + d, len(fp) - d)):
            run = run + 1 if fp[y] == fp[y + d] else 0
            if run >= d:
                return True
        return False

    def repeated(readers: set[int]) -> bool:
        ordered = sorted(readers)
        return any(copies(j, k) and not set(range(j, k + 1)) <= readers
                   for a, j in enumerate(ordered) for k in ordered[a + 1:])

    common: set[int] = set()
    for v, users in graph.users.items():
        producer = graph.values[v].producer
        made_in = ba.owner.get(producer) if producer is not None else None
        readers = {ba.owner[u] for u in users if u in ba.owner} - {made_in}
        if made_in is not None and graph.values[v].shape and len(readers) > 1 and repeated(
                readers):
            common.add(v)
    partial = {v for v, users in graph.users.items()
               if users and all(graph.ops[u].primitive == "add_any" for u in users)}
    parent: dict[int, int] = {}  # add_any op -> an add_any op of the same tree, nearer its root

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for op in graph.ops:
        if op.primitive == "add_any":
            parent[op.index] = op.index
            for v in op.inputs:
                p = graph.values[v].producer
                if v in partial and p is not None and graph.ops[p].primitive == "add_any":
                    parent[root(p)] = op.index
    trees: dict[int, list[int]] = {}
    for i in parent:
        trees.setdefault(root(i), []).append(i)
    summing: set[int] = set()
    for top, members in trees.items():
        inputs = {v for i in members for v in graph.ops[i].inputs}
        sources = {ba.owner[p] for v in inputs  # the terms, not sums made elsewhere
                   if (p := _made_by(graph, v)) is not None and p in ba.owner
                   and graph.ops[p].primitive != "add_any"}
        if len(sources) > 1 and repeated(sources):
            summing.update(members)
            common.update(graph.ops[top].outputs)
    return frozenset(common), frozenset(summing)


def _made_by(graph: Graph, value: int) -> int | None:
    """The operator that computed ``value``, looking through layout operators and remat's
    barrier (which pass a value on unchanged)."""
    while (p := graph.values[value].producer) is not None:
        op = graph.ops[p]
        if op.primitive == "optimization_barrier":
            value = op.inputs[op.outputs.index(value)]
        elif op.primitive in LAYOUT_OPS:
            value = op.inputs[0]
        else:
            return p
    return None


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


def _range_fingerprint(graph: Graph, ba: BlockAnalysis, start: int, end: int,
                       varying: set[int]) -> tuple:
    fp = []
    for b in range(start, end):
        seed = graph.ops[ba.blocks[b].seed]
        links = tuple(_sources_in_range(graph, ba, v, start, end, varying)
                      for v in seed.inputs[:2])
        fp.append((block_fingerprint(graph, ba, b), links))
    return tuple(fp)


def _sources_in_range(graph: Graph, ba: BlockAnalysis, value: int, start: int, end: int,
                      varying: set[int]):
    """Nearest contractions feeding ``value``: as offsets of blocks inside the range, or
    'out' for anything outside it. Constants (values computed from no step input, such as
    a rotary table's cosines, made in whichever layer reads them first) link to nothing."""
    found: set = set()
    stack, seen = [value], set()
    while stack:
        v = stack.pop()
        if v in seen or v not in varying:
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
