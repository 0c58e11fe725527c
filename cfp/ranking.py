"""Which combinations of a window too large to measure whole are measured.

A window whose space exceeds ``max_combinations`` (a whole layer on a 2-D mesh: 24 strategies
per block) is not split into smaller windows: its joint combinations are ranked by an additive
price and the cheapest ``max_combinations`` are measured, together with every combination a
plan people write uses (``cfp.baselines``). The price of a combination is the analytic price
of each block on its strategy alone (``cfp.analytic``) plus the analytic price of every
resharding between two blocks of the window (``windows.boundaries``); nothing is compiled.
``k_cheapest`` enumerates the cheapest combinations exactly.
"""
from __future__ import annotations

import heapq
import math

import numpy as np

from cfp.windows import Window, boundaries, layouts


def k_cheapest(prices: list, edges: dict, k: int) -> list[tuple[float, tuple[int, ...]]]:
    """The ``k`` cheapest assignments of one strategy per block, cheapest first, as (price,
    strategies). ``prices[i][s]``: block i on strategy s; ``edges[(i, j)]`` (i < j): a matrix
    added for the pair's strategies. Exact for non-negative prices: a best-first search whose
    bound adds each unassigned block's cheapest price."""
    n = len(prices)
    rest = [0.0] * (n + 1)
    for i in range(n - 1, -1, -1):
        rest[i] = rest[i + 1] + min(prices[i])
    incoming: dict[int, list] = {j: [] for j in range(n)}
    for (i, j), table in edges.items():
        incoming[j].append((i, np.asarray(table, float)))
    heap = [(rest[0], 0.0, ())]
    out = []
    while heap and len(out) < k:
        _, cost, partial = heapq.heappop(heap)
        j = len(partial)
        if j == n:
            out.append((cost, partial))
            continue
        for s, price in enumerate(prices[j]):
            c = cost + price + sum(table[partial[i], s] for i, table in incoming[j])
            heapq.heappush(heap, (c + rest[j + 1], c, partial + (s,)))
    return out


def window_prices(analysis, window: Window, cost, axis_names) -> tuple[list, dict]:
    """(per block of ``window``, the analytic seconds of each strategy alone; per pair of its
    blocks a tensor crosses between, the analytic resharding seconds per strategy pair)."""
    from cfp import analytic
    blocks = analysis.blocks.blocks
    prices = [[analytic.window_measurement(analysis, Window(b, b + 1, 0), (s,), cost,
                                           axis_names).time_s
               for s in range(len(blocks[b].strategies))]
              for b in range(window.start, window.end)]
    singles = [Window(b, b + 1, 0) for b in range(len(blocks))]
    edges: dict = {}
    for bd in boundaries(analysis, singles):
        if not (window.start <= bd.src < window.end and window.start <= bd.dst < window.end):
            continue
        src, src_of = layouts(bd.src_labels, blocks[bd.src].strategies, axis_names)
        dst, dst_of = layouts(bd.dst_labels, blocks[bd.dst].strategies, axis_names)
        small = np.array([[analytic.reshard_s(bd.shape, bd.dtype, s, d, analysis.mesh_shape,
                                              axis_names, cost) for d in dst] for s in src])
        i, j = sorted((bd.src - window.start, bd.dst - window.start))
        table = small[np.ix_(src_of, dst_of)]
        table = table if bd.src - window.start == i else table.T
        if i == j:  # a block's new state back to its own input's layout: on the diagonal
            prices[i] = [p + table[s, s] for s, p in enumerate(prices[i])]
            continue
        edges[(i, j)] = edges.get((i, j), 0) + table
    return prices, edges


def ranked_combinations(analysis, window: Window, k: int, cost, axis_names,
                        also=()) -> list[tuple[int, ...]]:
    """The ``k`` combinations of ``window`` cheapest by the additive analytic price, then
    those of ``also`` (combinations plans people write use) not among them."""
    prices, edges = window_prices(analysis, window, cost, axis_names)
    ranked = [c for _, c in k_cheapest(prices, edges, k)]
    return ranked + [c for c in dict.fromkeys(also) if c not in set(ranked)]


def baseline_combinations(analysis, window: Window, windows, *, storage: bool = False
                          ) -> list[tuple]:
    """The combinations of window type ``window.type`` that the rule-file baselines
    (``cfp.baselines``) put any of its instances on; with ``storage``, each as
    (combination, the baseline's state layout)."""
    from cfp.baselines import baseline_strategy_indices
    out = []
    for found in baseline_strategy_indices(analysis, storage=storage).values():
        idx, layout = found if storage else (found, None)
        for w in windows:
            if w.type == window.type:
                combo = tuple(idx[b] for b in range(w.start, w.end))
                if None not in combo:
                    out.append((combo, layout) if storage else combo)
    return list(dict.fromkeys(out))


def space_size(analysis, window: Window) -> int:
    return math.prod(len(analysis.blocks.blocks[b].strategies)
                     for b in range(window.start, window.end))
