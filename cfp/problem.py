"""The CP-SAT problem a profile poses (``build_problem``: per window its options' time and memory,
per boundary the reshardings' prices, the memory budget), its solutions (the top plans, the plan
without reshardings, the hand plans' choices), the composition calibrated to what XLA holds,
and the composed step time (``predicted_seconds``)."""
from __future__ import annotations

import dataclasses
import logging
import math
import time

import numpy as np

from cfp.errors import CfpError
from cfp.execute import Storage
from cfp.jax_compat import itemsize
from cfp.mesh import AXIS_NAMES
from cfp.recompute import layer_starts
from cfp.sharding import STATE_LAYOUTS
from cfp.solver import (LP_MAX_VARIABLES, Group, Option, Problem, Solution, evaluate,
                        least_memory, model_booleans, penalizing_reshardings, solve,
                        solve_alike)
from cfp.window_memory import (COMBINED_REDUCTION_BYTES, held_values, memory_terms,
                               option_memory, read_back_across, terms_key)
from cfp.windows import (held_state, inputs_read_earlier, layouts, priced_alike, shard_bytes,
                         state_layout)

log = logging.getLogger(__name__)


UNRESHARDED = "predicted without reshardings"  # the source of ``predicted_plans``' extra plan
SCALE = 1e7  # integer cost units per second: 0.1 microsecond, finer than any timing here
FAILED_RESHARD_S = 1e6  # a resharding XLA could not compile or run: never worth choosing


def calibrated(analysis, problem: Problem, windows, over, *, first: bool,
               budget_bytes: int) -> Problem:
    """``problem`` calibrated on the predictions ``over`` the budget ``budget_bytes`` once
    compiled ((solution, compiled peak) each, the solution's memory as ``problem`` composes
    it):

    - The ``first`` time, where every one of them keeps parameters whole, what their steps
      hold beyond the composition is attributed to those parameters (state layouts ``plan``
      and ``zero1``: the composition counts their gradients waiting and the weight copies
      their windows make, and XLA may hold more of either, longer;
      ``scripts/composed_memory.py --peak-top`` lists them). Every option then counts its
      whole-kept parameters' bytes (its ``Option.waiting``, their gradients' size; a
      gathered table's is not among them) times the smallest such excess per byte among
      them.
    - Otherwise the solver composes against ``budget_bytes`` scaled by the composed /
      compiled ratio of the one closest to fitting (the budget, not the one ``problem`` was
      solved under: a second scaling would count the first one's shortfall twice)."""
    peaks = [p for _, p in over]
    if first:
        kept_whole = [sum(g.options[c].waiting for g, c in zip(problem.groups, s.choices))
                      for s, _ in over]
        if all(kept_whole):
            per_byte = min((p - s.memory) / k for (s, p), k in zip(over, kept_whole))
            log.info("%d predictions over the budget once compiled (peaks %s); parameters "
                     "kept whole count %.2f times their bytes more", len(over), peaks,
                     per_byte)
            return dataclasses.replace(problem, groups=[
                dataclasses.replace(grp, options=[
                    dataclasses.replace(o, memory=o.memory + math.ceil(per_byte * o.waiting))
                    for o in grp.options])
                for grp in problem.groups])
    budget = int(budget_bytes * max(s.memory / p for s, p in over))
    log.info("%d predictions over the budget once compiled (peaks %s); solving against %d "
             "bytes", len(over), peaks, budget)
    return dataclasses.replace(problem, memory_budget=budget)


def plan_storage(analysis, problem: Problem, windows, choices) -> Storage:
    """Where the plan of ``choices`` (one option per window instance) keeps each state leaf:
    the state layout each window's combination names for the state it holds."""
    leaves = []
    for w, grp, c in zip(windows, problem.groups, choices):
        layout = state_layout(analysis, w, grp.options[c].strategies)
        leaves += [(k, layout) for k in held_state(analysis, w)]
    return Storage(leaves=tuple(sorted(leaves)))


# Of the budget, the share a step compiled for GPUs may peak at and count as fitting: its peak
# is the program's own (XLA's rematerialization off: ``cfp.jax_compat.compiler_options``), and
# the device needs room beside it (XLA's own limits leave 5%: ``xla_gpu_memory_limit_slop_factor``).
COMPILED_FIT_SHARE = 0.95


def compiled_fits(peak_bytes: int, budget_bytes: int | None, platform: str) -> bool:
    """Whether a compiled peak fits the budget: on GPUs, within ``COMPILED_FIT_SHARE`` of it."""
    if budget_bytes is None:
        return True
    return peak_bytes <= budget_bytes * (COMPILED_FIT_SHARE if platform != "cpu" else 1.0)


def fastest_within_budget(candidates, memory_budget_bytes: int | None) -> int:
    """Index of the measured fastest candidate whose compiled peak fits the budget (the
    composed memory that chose them can be off either way)."""
    fits = [i for i, c in enumerate(candidates)
            if memory_budget_bytes is None or c.compiled_peak_bytes <= memory_budget_bytes]
    if not fits:
        peaks = sorted(c.compiled_peak_bytes / 2**30 for c in candidates)
        raise CfpError(f"no candidate plan fits {memory_budget_bytes / 2**30:.3f} GiB per device "
                       f"once compiled (compiled peaks {peaks[0]:.3f} to {peaks[-1]:.3f} GiB, "
                       f"though their composed memory fit): raise --memory-budget")
    return min(fits, key=lambda i: candidates[i].median_s)


def build_problem(analysis, profile, memory_budget_bytes: int | None, recompute=None
                  ) -> tuple[Problem, dict]:
    """The CP-SAT problem and, per group, the option -> combination table; its memory that
    of the step with ``recompute`` (``cfp.recompute.Recompute``) applied, where given."""
    names = AXIS_NAMES[:len(analysis.mesh_shape)]
    blocks = analysis.blocks.blocks
    groups, combos = [], {}
    read_earlier = inputs_read_earlier(analysis, profile.windows)
    held = held_values(analysis, recompute, profile.platform)
    remade = held_values(analysis, None, profile.platform) - held if recompute else frozenset()
    read_back = read_back_across(analysis)  # boundaries a backward pass reads
    composed: dict[tuple, list[Option]] = {}  # terms_key -> the window's options
    for gi, w in enumerate(profile.windows):
        seg = profile.window_profiles[w.type]
        terms = memory_terms(analysis, w, read_earlier[gi], held, remade)
        key = terms_key(analysis, w, terms)
        if key not in composed:
            composed[key] = [Option(combo, int(round(m.time_s * SCALE)),
                                    *option_memory(analysis, w, combo, m, names, terms=terms))
                             for combo, m in sorted(seg.results.items()) if m.status == "ok"]
        opts = composed[key]
        table = [o.strategies for o in opts]
        if not opts:
            statuses = {m.status for m in seg.results.values()}
            fix = ("profile again to measure the combinations the budget did not reach"
                   if "not_measured" in statuses else "raise --memory-budget and profile again"
                   if "oom" in statuses else "see profile.csv for why")
            raise CfpError(f"window type {w.type} has no measured combination that runs "
                           f"({', '.join(sorted(statuses))}): {fix}")
        groups.append(Group(tuple(range(w.start, w.end)), opts))
        combos[gi] = table
    edges: dict = {}
    reshards: dict = {}
    edge_memory: dict = {}
    priced: dict[tuple, tuple] = {}  # the same tensor between alike blocks: priced once
    for b, alike in zip(profile.boundaries, priced_alike(profile.boundaries, blocks)):
        if alike not in priced:
            priced[alike] = _boundary_tables(b, blocks, profile.reshard_s, analysis.mesh_shape,
                                             names)
        small, moved, extra = priced[alike]
        key = (b.src, b.dst)
        edges[key] = edges.get(key, 0) + small
        reshards[key] = reshards.get(key, False) | moved
        if extra is not None and (b.value in held or (b.value, b.dst, b.dst_labels) in read_back):
            # held for the backward pass, or read by the reader's: a larger copy is held
            edge_memory[key] = edge_memory.get(key, 0) + extra
    copies: dict[int, list[int]] = {}  # a scan body's block -> its copy in every iteration
    for b in blocks:
        origin = analysis.graph.ops[b.seed].scan_origin
        if origin is not None:
            copies.setdefault(origin, []).append(b.index)
    ties = [(c[k], c[k + 1]) for c in copies.values() for k in range(len(c) - 1)]
    problem = Problem(groups, [len(b.strategies) for b in blocks], edges, memory_budget_bytes,
                      ties, alike_blocks(analysis), reshards=reshards,
                      edge_memory=edge_memory, waiting_cap=COMBINED_REDUCTION_BYTES,
                      layer_starts=layer_starts(analysis, profile.windows, recompute))
    return problem, combos


def _boundary_tables(b, blocks, reshard_s: dict, mesh_shape, names) -> tuple:
    """Per (source strategy, destination strategy) of boundary ``b``: the resharding's cost,
    whether it moves the tensor, and the bytes of the larger copy held where the value is held
    across (None where no pair holds more)."""
    src, src_of = layouts(b.src_labels, blocks[b.src].strategies, names)
    dst, dst_of = layouts(b.dst_labels, blocks[b.dst].strategies, names)
    small = np.zeros((len(src), len(dst)), dtype=np.int64)  # per distinct layout pair
    moved = np.zeros((len(src), len(dst)), dtype=bool)
    for i, s in enumerate(src):
        for j, d in enumerate(dst):
            if s != d:
                moved[i, j] = True
                key = (b.shape, b.dtype, s, d)
                if key not in reshard_s:
                    raise CfpError("the profile has reshardings it did not time (its budget "
                                   "ran out): profile again to time them")
                seconds = reshard_s[key]
                small[i, j] = int(round((FAILED_RESHARD_S if seconds is None else seconds)
                                        * SCALE))
    size = [shard_bytes(b.shape, itemsize(b.dtype), s, mesh_shape, names) for s in src + dst]
    src_b, dst_b = size[:len(src)], size[len(src):]
    extra = np.array([[d if d > s else 0 for d in dst_b] for s in src_b], np.int64)
    every = np.ix_(src_of, dst_of)
    return small[every], moved[every], extra[every] if extra.any() else None


def alike_blocks(analysis) -> list[tuple[int, int]]:
    """Pairs of blocks at the same offset of consecutive instances of one segment type (the
    same block of repeated layers) that have the same strategies."""
    blocks = analysis.blocks.blocks
    last: dict[int, object] = {}
    out = []
    for seg in analysis.segments.instances:
        prev = last.get(seg.type)
        last[seg.type] = seg
        if prev is None or prev.end - prev.start != seg.end - seg.start:
            continue
        for a, b in zip(range(prev.start, prev.end), range(seg.start, seg.end)):
            if [t.axes for t in blocks[a].strategies] == [t.axes for t in blocks[b].strategies]:
                out.append((a, b))
    return out


ALIKE_FROM_OPTIONS = 2000  # options over all groups above which a solve starts alike
# The whole problem's solve from the alike plan gets this many times the alike solve's
# seconds, at least WHOLE_MIN_S, within the time limit. A whole problem too large for the LP
# relaxation is not solved: on LLaMA-2-13B's 361 blocks (2x25x4) that solve ran its 60 s
# limit without beating the alike plan.
WHOLE_PER_ALIKE = 3
WHOLE_MIN_S = 10.0


def _options(problem: Problem) -> int:
    return sum(len(g.options) for g in problem.groups)


ALIKE = " among plans whose repeated layers are alike"  # the status of an alike-only plan


def top_plans(problem: Problem, k: int, time_limit_s: float, *, alike_only: bool = False,
              exclude=(), relative_gap: float = 0.0, alike: Solution | None = None):
    """The ``k`` cheapest plans, cheapest first. A large problem (deep, or on a large mesh)
    starts each from the cheapest plan whose repeated layers are alike (``solve_alike``:
    quick at any depth); unless ``alike_only``, the whole problem then runs from it within
    ``time_limit_s``, free to give layers different strategies, which pays under a tight
    memory budget. A small one is solved whole at once: there the alike problem is hardly
    smaller, and proving it optimal can take as long as the whole. The whole solve from an
    alike start gets ``WHOLE_PER_ALIKE`` times the alike solve's seconds (at least
    ``WHOLE_MIN_S``, within ``time_limit_s``); one over ``LP_MAX_VARIABLES`` booleans, whose
    search would run without the LP relaxation, is not solved. ``relative_gap``: each
    solve stops once proved within that share of the cheapest (``cfp.solver.solve``).
    ``alike``: the first plan's alike start, solved already (for another purpose: ranking
    meshes), so not solved again."""
    sols = []
    k = max(1, k)
    # Without its LP relaxation the whole search finds nothing better than the alike start
    # in its time (LLaMA-2-13B on 2x25x4: 440,000 booleans, 60 s and more). Counted only
    # where a plan can start alike.
    whole_too_large = (not alike_only and (bool(problem.alike) or alike is not None)
                       and model_booleans(problem) > LP_MAX_VARIABLES)
    if problem.memory_budget is not None and least_memory(problem) > problem.memory_budget:
        k = 0  # a lower bound already over the budget: no solve can succeed
    for _ in range(k):
        t0 = time.perf_counter()
        excluded = list(exclude) + [s.choices for s in sols]
        from_alike = bool(problem.alike) and (alike_only or _options(problem) > ALIKE_FROM_OPTIONS)
        if alike is not None and not sols:
            start = dataclasses.replace(alike, status=alike.status.removesuffix(ALIKE))
        else:
            start = solve_alike(problem, time_limit_s=time_limit_s, exclude=excluded,
                                relative_gap=relative_gap) if from_alike else None
        if alike_only and from_alike and start is None:
            break  # no (further) plan whose repeated layers are alike
        if alike_only and start is not None:
            sol = dataclasses.replace(start, status=start.status + ALIKE)
        elif start is not None and whole_too_large:
            sol = dataclasses.replace(start, status=f"{start.status}{ALIKE} (the whole "
                                                    f"problem, too large for the LP, not solved)")
        else:
            try:
                limit_s = time_limit_s if start is None else min(
                    time_limit_s, max(WHOLE_MIN_S, WHOLE_PER_ALIKE * start.solve_s))
                sol = solve(problem, time_limit_s=limit_s, exclude=excluded,
                            hint=start.choices if start else None, relative_gap=relative_gap)
            except CfpError:  # out of time: the plans found so far are the candidates
                if start is None and sols:
                    break
                if start is None:
                    raise
                sol = None
            if start is not None and (sol is None or sol.objective >= start.objective):
                sol = dataclasses.replace(
                    start, status=sol.status if sol is not None and sol.status.startswith(
                        "OPTIMAL") else f"FEASIBLE (the best plan whose repeated layers are alike: "
                         f"{start.status} among those)")
        if sol is None:
            break
        sols.append(dataclasses.replace(sol, solve_s=time.perf_counter() - t0))
    if not sols:
        need = least_memory(problem)
        which = " whose repeated layers are alike" if alike_only and problem.alike else ""
        raise CfpError(f"no plan{which} fits the memory budget of "
                       f"{problem.memory_budget / 2**30:.3f} GiB per device; the smallest any "
                       f"plan reaches is about {need / 2**30:.3f} GiB")
    return sols


def predicted_plans(problem: Problem, k: int, time_limit_s: float, exclude=()
                    ) -> list[Solution]:
    """The ``k`` cheapest plans (``top_plans``) but those in ``exclude`` and, when every one
    of them reshards between blocks, the cheapest plan that reshards nothing
    (``unresharded_plan``). The composition prices a boundary resharding alone, after a
    producer op; inside a whole step the same resharding can cost more (README, *Why the
    composition's picks lose*). Validating the best plan that needs none keeps a plan
    predicted faster by a few percent, but with reshardings, from winning unmeasured against
    it."""
    sols = top_plans(problem, k, time_limit_s, exclude=exclude)
    if not problem.reshards or not all(resharded(problem, s.strategies) for s in sols):
        return sols
    return sols + unresharded_plan(problem, time_limit_s, exclude)


def unresharded_plan(problem: Problem, time_limit_s: float, exclude=()) -> list[Solution]:
    """The cheapest plan but those in ``exclude`` that reshards nothing between blocks (status
    ``UNRESHARDED``), if one fits the budget: a list of it, or an empty one."""
    try:
        sol = top_plans(penalizing_reshardings(problem, int(FAILED_RESHARD_S * SCALE)), 1,
                        time_limit_s, exclude=exclude)[0]
    except CfpError:  # out of time, or none fits
        return []
    if resharded(problem, sol.strategies):
        return []
    return [dataclasses.replace(sol, objective=evaluate(problem, sol.choices)[0],
                                status=UNRESHARDED)]


def resharded(problem: Problem, strategies) -> bool:
    """Whether the plan changes the layout of some tensor between two blocks."""
    return any(bool(moved[strategies[i], strategies[j]])
               for (i, j), moved in problem.reshards.items())


def baseline_candidates(analysis, problem: Problem, known, *, within_budget: bool = True
                        ) -> list[tuple[str, Solution]]:
    """The rule-file baselines (``cfp.baselines``) that are plans of this problem: every block
    on a profiled strategy, every window on a feasible measured combination, parameters kept as
    the plan keeps them, one strategy per scan body, and within the memory budget. Search
    validates them next to its own predictions, so a plan people already use is measured too,
    not only predicted."""
    from cfp.baselines import baseline_strategy_indices
    out, seen = [], set(known)
    for name, (idx, layout) in baseline_strategy_indices(analysis, storage=True).items():
        if None in idx:
            continue
        choices = []
        for g in problem.groups:
            want = tuple(idx[b] for b in g.blocks)
            choices.append(next((i for i, o in enumerate(g.options)
                                 if o.strategies[:len(want)] == want
                                 and (len(o.strategies) == len(want)
                                      or STATE_LAYOUTS[o.strategies[-1]] == layout)), None))
        if None in choices or tuple(choices) in seen:
            continue
        cost, mem, strategies = evaluate(problem, choices)
        if within_budget and problem.memory_budget is not None and mem > problem.memory_budget:
            continue
        if any(strategies[i] != strategies[j] for i, j in problem.ties):
            continue  # layers of one scan on different strategies: not a plan of a scan
        seen.add(tuple(choices))
        out.append((name, Solution(tuple(choices), strategies, cost, mem, f"baseline {name}",
                                   0.0)))
    return out


def predicted_seconds(problem: Problem, choices, launch_overhead_s: float) -> float:
    """Composed step time: windows, boundary reshardings, and one program launch."""
    return evaluate(problem, choices)[0] / SCALE + launch_overhead_s


def plan_flops(analysis) -> float:
    return float(sum(op.flops for op in analysis.graph.ops))
