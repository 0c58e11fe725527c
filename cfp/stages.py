"""Pipeline stages by Alpa's dynamic program: slice a chain of layers into contiguous stages,
each on a submesh of the cluster, for the least 1F1B iteration latency.

With ``B`` micro-batches, stages of times ``t_1..t_S`` take ``sum(t_i) + (B - 1) * max(t_i)``.
For a bound ``t_max`` on the slowest stage, ``F(s, k, d)`` is the least sum of stage times that
slices layers ``k..L-1`` into ``s`` stages on exactly ``d`` devices, each stage at most
``t_max`` and fitting memory with the ``min(s, B)`` micro-batches 1F1B keeps in flight on the
first of them:

    F(s, k, d) = min over i >= k, submesh m of  price(k, i, m).time_s + F(s - 1, i + 1, d - |m|)

with ``F(0, L, 0) = 0``. The latency is the least ``F(S, 0, N) + (B - 1) * t_max`` over ``S``
and over ``t_max`` among the distinct stage times, ascending (one memo per ``t_max``).

Pruning, exact: the DP without a bound gives a first plan and the floor ``F_inf`` of every sum.
A plan that ``t_max`` adds to those of smaller bounds has a stage of time exactly ``t_max``; a
cheap relaxation (covering the layers before and after that stage on the devices left, free of
the bound and of the micro-batches in flight) bounds its sum from below, so ``t_max`` is skipped
when that bound, or ``F_inf``, plus ``(B - 1) * t_max`` reaches the best latency so far. Of the
bounds left, those below the least one any plan meets are skipped by bisection (feasibility
grows with ``t_max``).

Example: two layers on one node of two devices, where data parallelism gains only 1.25x:

    >>> cost = lambda i, j, m: StageCost((j - i + 1) * (1.0 if m.num_devices == 1 else 0.8), 0)
    >>> plan = plan_stages(2, 1, 2, cost, micro_batches=4)
    >>> [(s.first_layer, s.last_layer, s.submesh.shape) for s in plan.stages], plan.latency_s
    ([(0, 0, (1, 1)), (1, 1, (1, 1))], 5.0)
"""
from __future__ import annotations

import bisect
import dataclasses
import functools
import itertools
import math
from typing import Callable

import numpy as np


@dataclasses.dataclass(frozen=True)
class Submesh:
    nodes: int
    devices_per_node: int

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def shape(self) -> tuple[int, int]:
        return (self.nodes, self.devices_per_node)


@dataclasses.dataclass(frozen=True)
class StageCost:
    time_s: float  # forward + backward of one micro-batch, sending its output included
    memory_bytes: int  # per device, whatever the micro-batches in flight (weights, optimizer)
    activation_bytes: int = 0  # per device and micro-batch in flight


@dataclasses.dataclass(frozen=True)
class Stage:
    first_layer: int
    last_layer: int  # inclusive
    submesh: Submesh
    cost: StageCost


@dataclasses.dataclass(frozen=True)
class StagePlan:
    stages: tuple[Stage, ...]
    micro_batches: int
    dp_states: int = 0  # (s, k, d) states evaluated, over every t_max tried
    t_max_tried: int = 0  # bounds the DP ran for (the unbounded one included)
    t_max_candidates: int = 0  # distinct stage times

    @property
    def slowest_s(self) -> float:
        return max(s.cost.time_s for s in self.stages)

    @property
    def latency_s(self) -> float:
        return sum(s.cost.time_s for s in self.stages) + (self.micro_batches - 1) * self.slowest_s


Price = Callable[[int, int, Submesh], "StageCost | None"]


def submeshes(num_nodes: int, devices_per_node: int) -> list[Submesh]:
    """Alpa's shapes: (1, 2^k) within a node, (1, devices_per_node), and whole nodes."""
    widths = [2 ** k for k in range(devices_per_node.bit_length())]
    if widths[-1] != devices_per_node:
        widths.append(devices_per_node)
    return ([Submesh(1, w) for w in widths]
            + [Submesh(n, devices_per_node) for n in range(2, num_nodes + 1)])


def _room(cost: StageCost, budget: int | None) -> float:
    """The most micro-batches in flight with which the stage fits (< 1: it never fits)."""
    if budget is None:
        return math.inf
    if cost.memory_bytes > budget:
        return -1
    return math.inf if cost.activation_bytes <= 0 else \
        (budget - cost.memory_bytes) // cost.activation_bytes


def plan_stages(num_layers: int, num_nodes: int, devices_per_node: int, price: Price, *,
                micro_batches: int, memory_budget_bytes: int | None = None
                ) -> StagePlan | None:
    """The 1F1B-fastest split of the layers into stages on submeshes using every device; None
    when no split fits."""
    L, N, B = num_layers, num_nodes * devices_per_node, micro_batches
    price = functools.cache(price)
    options: list[list[tuple[int, Submesh, StageCost, float]]] = [[] for _ in range(L)]
    for k, i in itertools.combinations_with_replacement(range(L), 2):
        for m in submeshes(num_nodes, devices_per_node):
            cost = price(k, i, m)
            if cost is not None and (room := _room(cost, memory_budget_bytes)) >= 1:
                options[k].append((i, m, cost, room))
    times = sorted({c.time_s for opts in options for _, _, c, _ in opts})
    top = min(L, N, B)  # stage counts 1..top - 1, and top or more
    states = 0
    solved: dict[float, tuple[float, StagePlan | None]] = {}  # t_max -> (least sum, best plan)

    # Per first layer k, its options as arrays: last layer, devices, time, room.
    arrays = [(np.array([i for i, _, _, _ in o], dtype=np.int64).reshape(-1),
               np.array([m.num_devices for _, m, _, _ in o], dtype=np.int64).reshape(-1),
               np.array([c.time_s for _, _, c, _ in o], dtype=float).reshape(-1),
               np.array([r for _, _, _, r in o], dtype=float).reshape(-1)) for o in options]
    devices = np.arange(N + 1)

    def solve(t_max: float) -> tuple[float, StagePlan | None]:
        """F(s, k, d) for every s, k, d at once per (s, k), as arrays over d. A stage with
        ``B`` or more stages from it on keeps ``B`` micro-batches in flight whatever their
        number, so those counts share one row, ``top``: F(top, k, d) is the least sum over
        every count from ``top`` on, its stage followed by ``top - 1`` stages or by ``top``
        or more (``via_top``)."""
        nonlocal states
        if t_max in solved:
            return solved[t_max]
        F = np.full((top + 1, L + 1, N + 1), math.inf)
        F[0, L, 0] = 0.0
        choice = np.full((top + 1, L, N + 1), -1, dtype=np.int64)
        via_top = np.zeros((L, N + 1), dtype=bool)
        for s in range(1, top + 1):
            shared = s == top and top == B
            for k in range(L - 1, -1, -1) if shared else range(L):
                last, size, t, room = arrays[k]
                keep = np.flatnonzero((t <= t_max) & (room >= min(s, B)))
                if not len(keep):
                    continue
                rest = devices[None, :] - size[keep, None]  # devices left for later stages
                left = np.maximum(rest, 0)
                after_it = F[s - 1, last[keep, None] + 1, left]
                if shared:
                    more = F[s, last[keep, None] + 1, left]
                    longer = more < after_it
                    after_it = np.minimum(after_it, more)
                total = np.where(rest >= 0, t[keep, None] + after_it, math.inf)
                best = total.argmin(axis=0)  # the first of equal sums, as options are listed
                F[s, k] = total[best, devices]
                choice[s, k] = np.where(np.isfinite(F[s, k]), keep[best], -1)
                if shared:
                    via_top[k] = longer[best, devices]
                states += N + 1
        least, plan, slowest = math.inf, None, 0.0
        for S in range(1, top + 1):
            if not np.isfinite(F[S, 0, N]):
                continue
            least = min(least, float(F[S, 0, N]))
            stages, k, d, s = [], 0, N, S
            while s > 0:
                i, m, c, _ = options[k][choice[s, k, d]]
                stages.append(Stage(k, i, m, c))
                if not (s == top == B and via_top[k, d]):
                    s -= 1
                k, d = i + 1, d - m.num_devices
            candidate = StagePlan(tuple(stages), B)
            slowest = max(slowest, candidate.slowest_s)
            if plan is None or candidate.latency_s < plan.latency_s:
                plan = candidate
        solved[t_max] = (least, plan, slowest)
        return solved[t_max]

    floor, best, _ = solve(math.inf)
    if best is None:
        return None
    # Least sums covering layers k..L-1 (``after``) or 0..k-1 (``before``) on exactly d devices,
    # free of t_max and of the micro-batches in flight: a plan that uses stage (k, i, m) sums to
    # at least before[k][d1] + its time + after[i + 1][N - |m| - d1] for some d1.
    after = np.full((L + 1, N + 1), math.inf)
    before = np.full((L + 1, N + 1), math.inf)
    after[L, 0] = before[0, 0] = 0.0
    shifted = []  # per k: devices left once each option's submesh is taken, and where valid
    for k in range(L):
        rest = devices[None, :] - arrays[k][1][:, None]
        shifted.append((np.maximum(rest, 0), rest >= 0))
    for k in range(L - 1, -1, -1):
        last, _, t, _ = arrays[k]
        if len(t):
            rest, valid = shifted[k]
            cand = np.where(valid, t[:, None] + after[last[:, None] + 1, rest], math.inf)
            after[k] = np.minimum(after[k], cand.min(axis=0))
    for k in range(L):
        last, _, t, _ = arrays[k]
        if len(t):
            rest, valid = shifted[k]
            np.minimum.at(before, last + 1, np.where(valid, before[k][rest] + t[:, None],
                                                     math.inf))
    least_with: dict[float, float] = {}  # t_max -> least sum of a plan with a stage that long
    for k in range(L):
        last, size, t, _ = arrays[k]
        if not len(t):
            continue
        split = (N - size)[:, None] - devices[None, :]  # devices after it, given d1 before
        around = np.where(split >= 0, before[k][None, :]
                          + after[last[:, None] + 1, np.maximum(split, 0)], math.inf)
        for time_s, total in zip(t, t + around.min(axis=1)):
            least_with[time_s] = min(least_with.get(time_s, math.inf), float(total))

    def hopeless(t: float) -> bool:  # a plan new at t has a stage of time t
        return max(least_with[t], floor) + (B - 1) * t >= best.latency_s

    # Bisect for the least bound any plan meets (feasibility grows with the bound). Then walk
    # the bounds down: the plans found under a bound stay optimal under every bound down to
    # their slowest stage, so the next bound tried is the first below that; and once the
    # least sum plus (B - 1) times the least bound cannot beat the best, no lower bound can.
    open_ = [t for t in times if not hopeless(t)]
    lo, hi = 0, len(open_)
    while lo < hi:
        mid = (lo + hi) // 2
        if solve(open_[mid])[1] is None:
            lo = mid + 1
        else:
            hi = mid
    k = len(open_) - 1
    while k >= lo:
        least, plan, slowest = solve(open_[k])
        if plan is None:
            break
        if plan.latency_s < best.latency_s:
            best = plan
        if least + (B - 1) * open_[lo] >= best.latency_s:
            break
        k = min(k, bisect.bisect_left(open_, slowest)) - 1
    return dataclasses.replace(best, dp_states=states, t_max_tried=len(solved),
                               t_max_candidates=len(times))


def brute_force_stages(num_layers: int, num_nodes: int, devices_per_node: int, price: Price, *,
                       micro_batches: int, memory_budget_bytes: int | None = None
                       ) -> StagePlan | None:
    """Exhaustive over every split into contiguous stages and every assignment of submeshes
    whose device counts add up to the cluster; for tests."""
    L, N = num_layers, num_nodes * devices_per_node
    price = functools.cache(price)
    meshes = submeshes(num_nodes, devices_per_node)
    best = None
    for cuts in itertools.product((False, True), repeat=L - 1):  # cut after layer j or not
        ends = [j for j, cut in enumerate(cuts) if cut] + [L - 1]
        ranges = list(zip([0] + [e + 1 for e in ends[:-1]], ends))
        S = len(ranges)
        for ms in itertools.product(meshes, repeat=S):
            if sum(m.num_devices for m in ms) != N:
                continue
            costs = [price(a, b, m) for (a, b), m in zip(ranges, ms)]
            if any(c is None or _room(c, memory_budget_bytes) < min(S - p, micro_batches)
                   for p, c in enumerate(costs)):
                continue
            plan = StagePlan(tuple(Stage(a, b, m, c) for (a, b), m, c in zip(ranges, ms, costs)),
                             micro_batches)
            if best is None or plan.latency_s < best.latency_s:
                best = plan
    return best
