"""The stages pass: pipeline stages over the layers, each run with an intra-op plan.

Alpa's stage DP (``cfp.stages``) slices the layers into stages on submeshes of a described
cluster (``cfp.cluster``); each (stage, submesh) is priced by cfp's own intra-op search:

1. The step is traced at the micro-batch size (the batch over ``micro_batches``) and grouped
   into blocks once. Per submesh shape it is analysed and priced analytically for that
   submesh (its nodes' and devices' alphas and betas, as ``--cost analytic`` does).
2. The *units* are the instances of the most frequent segment type (the layers); segments of
   other types belong to the unit before them, or to the first. Per submesh, a few plans of
   the whole step with its repeated layers alike (``solve_alike``) are the candidates: the
   best within no limit, and within the memory budget scaled to stages of 1, 2, 4, ...
   layers. A stage of units ``k..i`` costs what the cheapest candidate that fits there (one
   micro-batch in flight) costs on its blocks and the edges among them, plus sending what
   crosses to later stages (forward and backward, whole tensors, at the slowest level
   between submeshes; step inputs are placed, not sent). Its memory splits into what it
   holds anyway and the activations of each micro-batch in flight (``Option.held``), which
   the DP multiplies by the micro-batches 1F1B keeps in flight there. Stages with the same
   segment types, the same ends and the same submesh are priced once.
3. The DP picks the split and submeshes for the least ``sum + (B - 1) x slowest``.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import math
import time

import numpy as np

from cfp.errors import CfpError
from cfp.solver import transient_peak
from cfp.stages import StageCost, StagePlan, Submesh, plan_stages

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StageOptions:
    micro_batches: int
    memory_budget_bytes: int | None
    max_combinations: int = 32
    time_limit_s: float = 60.0


@dataclasses.dataclass(frozen=True)
class StageLayout:
    """A stage of the plan with its intra-op plan on its submesh."""

    first_layer: int
    last_layer: int
    blocks: tuple[int, int]  # [start, end) of the global block sequence
    submesh: tuple[int, int]  # (nodes, devices per node)
    mesh_shape: tuple[int, ...]  # the logical mesh its intra-op plan runs on
    strategies: tuple[int, ...]  # per block of the stage, on that mesh
    time_s: float  # one micro-batch, forward and backward, sending included
    memory_bytes: int  # per device, with the micro-batches 1F1B keeps in flight there
    in_flight: int
    plan: dict  # its blocks' strategies and contractions' constraints, as in plan.json


@dataclasses.dataclass(frozen=True)
class StagesRecord:
    spec: object  # the WorkloadSpec at the global batch
    cluster: str
    micro_batches: int
    num_layers: int
    plan: StagePlan
    stages: tuple[StageLayout, ...]
    priced: int  # (stage, submesh) pairs priced
    submeshes_analysed: int
    pricing_s: float  # analysing, pricing and solving for every submesh
    dp_s: float  # the stage DP alone
    time_s: float
    tracing_s: float = 0.0  # tracing the step and grouping its blocks, once


def micro_batch_spec(spec, micro_batches: int):
    """``spec`` at the micro-batch size; a ``CfpError`` when the batch does not divide."""
    if spec.batch_size % micro_batches:
        raise CfpError(f"--micro-batches {micro_batches} does not divide the batch size "
                       f"{spec.batch_size}")
    return dataclasses.replace(spec, batch_size=spec.batch_size // micro_batches)


def run_stages(spec, cluster, options: StageOptions) -> StagesRecord:
    """Plan pipeline stages for ``spec`` (resolved, global batch) on ``cluster``."""
    from cfp.grouping import group_blocks
    from cfp.pool import map_meshes
    from cfp.stages import submeshes
    from cfp.tracing import trace_step
    start = time.perf_counter()
    mb_spec = micro_batch_spec(spec, options.micro_batches)
    graph = trace_step(mb_spec.build()).graph()
    grouping = group_blocks(graph)
    traced_s = time.perf_counter() - start
    meshes = submeshes(*cluster.nodes)
    pricings: dict[Submesh, _SubmeshPricing] = dict(zip(meshes, map_meshes(
        _SubmeshPricing, (mb_spec, cluster, graph, grouping, options), meshes)))
    analysing_s = time.perf_counter() - start - traced_s
    first = pricings[Submesh(1, 1)]  # the units are the same on every mesh
    units = first.units
    solved: dict[tuple, tuple | None] = {}
    pricing_s = 0.0

    def price(k: int, i: int, m: Submesh) -> StageCost | None:
        nonlocal pricing_s
        t0 = time.perf_counter()
        key = (first.unit_types(k, i), k == 0, i == len(units) - 1, m)
        if key not in solved:
            solved[key] = pricings[m].price(k, i)
        found = solved[key]
        pricing_s += time.perf_counter() - t0
        return None if found is None else found[0]

    nodes, per_node = cluster.nodes
    t0 = time.perf_counter()
    plan = plan_stages(len(units), nodes, per_node, price, micro_batches=options.micro_batches,
                       memory_budget_bytes=options.memory_budget_bytes)
    dp_s = time.perf_counter() - t0 - pricing_s
    if plan is None:
        budget = options.memory_budget_bytes
        raise CfpError(f"no split of the {len(units)} layers into stages on {cluster.name} "
                       + (f"fits {budget / 2**30:.3f} GiB per device" if budget is not None
                          else "has a plan on every stage"))
    from cfp.passes.analysis import run_analysis
    layouts = []
    for p, st in enumerate(plan.stages):
        pr = pricings[st.submesh]
        strategies = pr.price(st.first_layer, st.last_layer)[1]
        lo, hi = pr.block_range(st.first_layer, st.last_layer)
        in_flight = min(len(plan.stages) - p, options.micro_batches)
        analysis = run_analysis(mb_spec, pr.mesh_shape, graph, grouping)
        layouts.append(StageLayout(
            st.first_layer, st.last_layer, (lo, hi), st.submesh.shape,
            pr.mesh_shape, strategies, st.cost.time_s,
            st.cost.memory_bytes + in_flight * st.cost.activation_bytes, in_flight,
            _stage_plan(analysis, (lo, hi), strategies)))
    rec = StagesRecord(spec, cluster.name, options.micro_batches, len(units), plan,
                       tuple(layouts), len(solved), len(pricings), analysing_s + pricing_s,
                       dp_s, time.perf_counter() - start, traced_s)
    log.info("stages pass: %.1f s, %d stages priced on %d submeshes", rec.time_s, rec.priced,
             rec.submeshes_analysed)
    return rec


def run_staged(spec, stages, micro_batches: int, *, iters: int = 0):
    """Loss and gradients of ``spec``'s step (real data, seed 0) run as pipeline stages on
    this machine's devices: each stage's operators as separately compiled programs on its own
    submesh under its intra-op plan, micro-batches in GPipe order (every micro-batch through a
    program before the next program), and what crosses between stages moved with
    ``jax.device_put``. ``stages``: ``StageLayout``s, on consecutive
    devices. Losses and gradients are averaged over micro-batches, which is the step's when
    its loss is a mean over the batch. With ``iters``, also the median seconds of that many
    staged runs (one program at a time: stages do not overlap here). Returns ((loss,
    gradients), seconds or None, the number of programs).

    The stages were planned on the step's graph; the gradient program holds the same
    contractions in the same order, so each of its operators goes to the stage of the block
    whose contraction seeds the block it belongs to in its own grouping."""
    import statistics

    import jax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from cfp import sharding
    from cfp.grouping import group_blocks
    from cfp.execute import example_inputs, plan_specs
    from cfp.program import trace_program
    from cfp.passes.analysis import run_analysis
    from cfp.mesh import AXIS_NAMES
    from cfp.tracing import trace_step
    mb_spec = micro_batch_spec(spec, micro_batches)
    mb_workload = mb_spec.build()
    params = example_inputs(mb_workload)[0]  # the same values as the step's, its own types
    batch = example_inputs(spec.build())[1]
    size = spec.batch_size // micro_batches
    pieces = [jax.tree_util.tree_map(
        lambda x, m=m: x[m * size:(m + 1) * size]
        if getattr(x, "ndim", 0) and x.shape[0] == spec.batch_size else x, batch)
        for m in range(micro_batches)]
    prog = trace_program(mb_workload.grad_fn(), params, pieces[0])
    g = prog.graph()
    step_graph = trace_step(mb_workload).graph()
    grouping = group_blocks(step_graph)
    step_contractions = [op.index for op in step_graph.ops if op.is_contraction]
    grad_contractions = [op.index for op in g.ops if op.is_contraction]
    to_step = dict(zip(grad_contractions, step_contractions))
    stage_of_block = {b: p for p, st in enumerate(stages) for b in range(*st.blocks)}
    grad_blocks = group_blocks(g)
    stage_of = {}
    for b in grad_blocks.blocks:
        step_block = grouping.owner[to_step[b.seed]]
        for m in b.members:
            stage_of[m.op] = stage_of_block[step_block]
    for op in reversed(g.ops):  # an operator of no block runs with its first reader
        if op.index not in stage_of:
            readers = [stage_of[u] for v in op.outputs for u in g.users.get(v, ())
                       if u in stage_of]
            stage_of[op.index] = min(readers, default=len(stages) - 1)
    meshes, constraints, first = [], [], 0
    devices = jax.devices()
    for st in stages:
        n = math.prod(st.mesh_shape)
        names = AXIS_NAMES[:len(st.mesh_shape)]
        mesh = Mesh(np.array(devices[first:first + n]).reshape(st.mesh_shape), names)
        first += n
        analysis = run_analysis(mb_spec, st.mesh_shape, step_graph, grouping)
        strategies = [0] * len(analysis.blocks.blocks)
        strategies[st.blocks[0]:st.blocks[1]] = st.strategies
        cons = plan_specs(analysis, strategies, names)[2]
        meshes.append(mesh)
        constraints.append({gi: cons[si] for gi, si in to_step.items() if si in cons})
    runs = []  # (stage, ops): consecutive operators of one stage
    for op in g.ops:
        if runs and runs[-1][0] == stage_of[op.index]:
            runs[-1][1].append(op.index)
        else:
            runs.append((stage_of[op.index], [op.index]))
    programs = []
    for p, ops in runs:
        sub, mine = sharding.sub_program(g, ops), set(ops)
        fn = jax.jit(sharding.sub_function(prog, sub, constraints={
            i: c for i, c in constraints[p].items() if i in mine}, mesh=meshes[p]))
        programs.append((meshes[p], sub, fn))
    flat = [jax.tree_util.tree_leaves((params, piece)) for piece in pieces]

    def run_once():
        envs = [dict(zip(g.inputs, leaves)) for leaves in flat]
        for mesh, sub, fn in programs:  # GPipe: each program over every micro-batch
            here = NamedSharding(mesh, PartitionSpec())
            for env in envs:
                outs = fn(*[jax.device_put(env[v], here) for v in sub.live_ins])
                env.update(zip(sub.live_outs, outs))
        results = [[np.asarray(env[v], np.float64) for v in g.outputs] for env in envs]
        return [sum(r[k] for r in results) / micro_batches for k in range(len(g.outputs))]

    out = run_once()
    seconds = None
    if iters:
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            run_once()
            times.append(time.perf_counter() - t0)
        seconds = statistics.median(times)
    return (out[0], out[1:]), seconds, len(programs)


def _stage_plan(analysis, blocks: tuple[int, int], strategies) -> dict:
    """The stage's part of ``plan.json``: its mesh, blocks and constraints."""
    from cfp.plan import make_plan
    full = [0] * len(analysis.blocks.blocks)
    full[blocks[0]:blocks[1]] = strategies
    plan = make_plan(analysis, full)
    ops = {str(m.op) for b in analysis.blocks.blocks[blocks[0]:blocks[1]] for m in b.members}
    return {"mesh": plan["mesh"],
            "blocks": [b for b in plan["blocks"] if blocks[0] <= b["block"] < blocks[1]],
            "constraints": {op: c for op, c in plan["constraints"].items() if op in ops}}


class _SubmeshPricing:
    """The micro-batch step analysed and priced for one submesh, and its stages' prices.

    Candidate plans come from the whole step with its repeated layers alike, solved under
    memory limits for stages of 1, 2, 4, ... layers (the budget times the layers over the
    stage's; a solve is skipped when the previous plan meets it already). A stage's price is
    the cheapest candidate that fits one micro-batch in flight, evaluated on the stage's own
    blocks and edges: a few solves per submesh rather than one per stage."""

    def __init__(self, spec, cluster, graph, grouping, options: StageOptions, m: Submesh):
        from cfp.passes.analysis import run_analysis
        from cfp.passes.profile import ProfileOptions, run_profile
        from cfp.problem import build_problem
        self.cluster = cluster.submesh(*m.shape)
        self.options = options
        shape = self.cluster.mesh_shape
        self.analysis = a = run_analysis(spec, shape, graph, grouping)
        self.profile = run_profile(a, ProfileOptions(
            cost="analytic", max_combinations=options.max_combinations,
            cost_model=self.cluster.cost_model(shape)))
        problem, _ = build_problem(a, self.profile, None)
        # A stage keeps its state as its blocks compute: the options of that state layout.
        self.problem = dataclasses.replace(problem, groups=[dataclasses.replace(grp, options=[
            o for o in grp.options if len(o.strategies) == len(grp.blocks)
            or o.strategies[-1] == 0]) for grp in problem.groups])
        counts = collections.Counter(seg.type for seg in a.segments.instances)
        unit_type = max(counts, key=lambda t: (counts[t], -t))
        self.segments = a.segments.instances
        self.units = [s for s in self.segments if s.type == unit_type]
        self.group_start = np.array([grp.blocks[0] for grp in self.problem.groups])
        # Between submeshes, the slowest level any two stages may sit across.
        level = cluster.levels[0] if cluster.nodes[0] > 1 else cluster.levels[-1]
        self.link = (level.alpha_s, level.beta_s_per_byte)
        g, owner = a.graph, a.blocks.owner
        crossing = {(owner[op.index], owner[u], v, g.values[v].nbytes)
                    for op in g.ops if op.index in owner for v in op.outputs
                    if g.values[v].input_index is None for u in g.users.get(v, ())
                    if u in owner and owner[u] != owner[op.index]}
        self.crossing = np.array(sorted(crossing), dtype=np.int64).reshape(-1, 4)
        self.candidates = [self._tables(c) for c in self._candidate_plans()]
        self.mesh_shape, self.num_blocks = a.mesh_shape, len(a.blocks.blocks)
        self.waiting_cap = self.problem.waiting_cap

    def __getstate__(self) -> dict:
        """What crosses back from a pool's process: all but the analysis, profile and
        problem, which pricing a stage no longer reads."""
        return {k: v for k, v in self.__dict__.items()
                if k not in ("analysis", "profile", "problem")}

    def _candidate_plans(self) -> list[tuple[int, ...]]:
        from cfp.solver import solve_alike
        budget, layers = self.options.memory_budget_bytes, len(self.units)
        limits = [None] + ([] if budget is None else sorted(
            {budget * layers // n for n in _powers_of_two(layers)} | {budget}, reverse=True))
        plans, last = [], None
        for limit in limits:
            if last is not None and limit is not None and last.memory <= limit:
                continue  # the plan found for a looser limit is the best here too
            try:
                sol = solve_alike(dataclasses.replace(self.problem, memory_budget=limit),
                                  time_limit_s=self.options.time_limit_s)
            except CfpError:  # out of time: tighter limits fare no better
                break
            if sol is None:
                break
            plans.append(sol.strategies)
            last = sol
        return plans

    def _tables(self, strategies):
        """Per group of a candidate plan: its option, cost, memory, transient, held and waiting
        bytes; per edge its cost."""
        choices, cost, memory, transient, held, waiting = [], [], [], [], [], []
        for g, grp in enumerate(self.problem.groups):
            want = tuple(strategies[b] for b in grp.blocks)
            c = next(o for o, opt in enumerate(grp.options)
                     if opt.strategies[:len(want)] == want)
            opt = grp.options[c]
            choices.append(c)
            cost.append(opt.cost), memory.append(opt.memory), transient.append(opt.transient)
            held.append(opt.held), waiting.append(opt.waiting)
        edges = np.array([(i, j, int(t[strategies[i], strategies[j]]))
                          for (i, j), t in self.problem.edges.items()],
                         dtype=np.int64).reshape(-1, 3)
        return (tuple(strategies), np.array(cost), np.array(memory), np.array(transient),
                np.array(held), np.array(waiting), edges)

    def block_range(self, k: int, i: int) -> tuple[int, int]:
        n = self.num_blocks
        lo = 0 if k == 0 else self.units[k].start
        hi = n if i == len(self.units) - 1 else self.units[i + 1].start
        return lo, hi

    def unit_types(self, k: int, i: int) -> tuple[int, ...]:
        lo, hi = self.block_range(k, i)
        return tuple(s.type for s in self.segments if lo <= s.start < hi)

    def price(self, k: int, i: int):
        """(StageCost, strategies of the stage's blocks) of units ``k..i`` here, or None."""
        from cfp.problem import SCALE
        lo, hi = self.block_range(k, i)
        inside = (self.group_start >= lo) & (self.group_start < hi)
        best = None
        for strategies, cost, memory, transient, held, waiting, edges in self.candidates:
            within = (edges[:, 0] >= lo) & (edges[:, 0] < hi) & (edges[:, 1] >= lo) & \
                (edges[:, 1] < hi)
            total = int(cost[inside].sum() + edges[within, 2].sum())
            mem = int(memory[inside].sum() + transient_peak(
                held[inside], transient[inside], waiting[inside], self.waiting_cap))
            budget = self.options.memory_budget_bytes
            if (budget is None or mem <= budget) and (best is None or total < best[0]):
                best = (total, mem, int(held[inside].sum()), strategies[lo:hi])
        if best is None:
            return None
        b = self.crossing  # (producer block, reader block, value, bytes)
        one_side = ((b[:, 0] >= lo) & (b[:, 0] < hi)) != ((b[:, 1] >= lo) & (b[:, 1] < hi))
        crossing = b[one_side & (np.maximum(b[:, 0], b[:, 1]) >= hi)]  # to a later stage
        nbytes = np.unique(crossing[:, 2:4], axis=0)[:, 1] if len(crossing) else []  # once
        sent = sum(self.link[0] + int(n) * self.link[1] for n in nbytes)
        total, mem, activation, strategies = best
        return StageCost(total / SCALE + sent, mem - activation, activation), strategies


def _powers_of_two(n: int) -> list[int]:
    return [2 ** k for k in range(n.bit_length()) if 2 ** k <= n]

