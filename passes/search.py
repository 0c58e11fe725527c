"""The search pass: one plan for the whole model, run across the mesh and laid open.

``build_problem`` turns the profiles into a CP-SAT problem (``cfp.solver``): one group per
window instance, whose options are its measured combinations (time, memory), and one edge per
pair of blocks that a boundary tensor joins, priced from the resharding table. The search pass
solves it, asks for the next-best plans too (``validate_top``), adds the baseline plans that
are plans of the problem (``baseline_candidates``), runs each end to end on the mesh,
interleaved, keeps the measured fastest, and reports.
"""
from __future__ import annotations

import dataclasses
import time

import numpy as np

from cfp.errors import CfpError
from cfp.solver import Group, Option, Problem, Solution, evaluate, solve
from cfp.windows import boundary_specs, option_memory

SCALE = 1e7  # integer cost units per second: 0.1 microsecond, finer than any timing here


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    memory_budget_bytes: int | None
    time_limit_s: float = 60.0
    validate_top: int = 3
    validate_baselines: bool = True  # also run the rule-file baselines that are plans here
    iters: int | None = None  # steps per measurement; None: at least 5 steps and 0.3 s
    rounds: int = 5  # measurements per plan, interleaved across plans
    check_numerics: bool = True


def build_problem(analysis, profile, segs, memory_budget_bytes: int | None
                  ) -> tuple[Problem, dict]:
    """The CP-SAT problem and, per group, the option -> combination table."""
    names = ("m0", "m1", "m2")[:len(analysis.mesh_shape)]
    blocks = analysis.blocks.blocks
    groups, combos = [], {}
    mem_cache: dict = {}
    for gi, w in enumerate(profile.windows):
        seg = segs[w.type]
        rep = profile.windows[profile.representatives[w.type]]
        opts, table = [], []
        for combo, m in sorted(seg.results.items()):
            if m.status != "ok":
                continue
            key = (w.type, combo)
            if key not in mem_cache:
                mem_cache[key] = option_memory(analysis, rep, combo, m, names)
            mem, transient = mem_cache[key]
            opts.append(Option(combo, int(round(m.time_s * SCALE)), mem, transient))
            table.append(combo)
        if not opts:
            raise CfpError(f"window type {w.type} has no feasible combination: raise "
                           f"--memory-budget or --profile-budget and profile again")
        groups.append(Group(tuple(range(w.start, w.end)), opts))
        combos[gi] = table
    edges: dict = {}
    for b in profile.boundaries:
        src_s, dst_s = blocks[b.src].strategies, blocks[b.dst].strategies
        t = np.zeros((len(src_s), len(dst_s)), dtype=np.int64)
        for i, s in enumerate(src_s):
            for j, d in enumerate(dst_s):
                src, dst = boundary_specs(b, s, d, names)
                if src != dst:
                    t[i, j] = int(round(profile.reshard_s.get((b.shape, b.dtype, src, dst), 0.0)
                                        * SCALE))
        key = (b.src, b.dst)
        edges[key] = edges.get(key, 0) + t
    problem = Problem(groups, [len(b.strategies) for b in blocks], edges, memory_budget_bytes)
    return problem, combos


def smallest_memory(problem: Problem) -> int:
    """The least memory any plan reaches (for the error when none fits)."""
    return sum(min(o.memory for o in g.options) for g in problem.groups) + min(
        (max(min(o.transient for o in g.options) for g in problem.groups),), default=0)


def top_plans(problem: Problem, k: int, time_limit_s: float):
    sols = []
    for _ in range(max(1, k)):
        sol = solve(problem, time_limit_s=time_limit_s, exclude=[s.choices for s in sols])
        if sol is None:
            break
        sols.append(sol)
    if not sols:
        need = smallest_memory(problem)
        raise CfpError(f"no plan fits the memory budget of "
                       f"{problem.memory_budget / 2**30:.3f} GB per device; the smallest any "
                       f"plan reaches is about {need / 2**30:.3f} GB")
    return sols


def baseline_candidates(analysis, problem: Problem, known) -> list[tuple[str, Solution]]:
    """The rule-file baselines (``cfp.baselines``) that are plans of this problem: every block
    on a profiled strategy, every window on a feasible measured combination, parameters kept as
    the plan keeps them, and within the memory budget. Search validates them next to its own
    predictions, so a plan people already use is measured too, not only predicted."""
    from cfp.baselines import applies, baseline_plan, load_rules
    out, seen = [], set(known)
    for name, rule in load_rules().items():
        if rule.axes is None or rule.storage != "plan" or not applies(rule, analysis):
            continue
        bp = baseline_plan(rule, analysis)
        idx = []
        for b, st in zip(analysis.blocks.blocks, bp.strategies):
            idx.append(next((i for i, t in enumerate(b.strategies) if t.axes == st.axes), None))
        if None in idx or tuple(idx) in seen:
            continue
        choices = []
        for g in problem.groups:
            want = tuple(idx[b] for b in g.blocks)
            choices.append(next((i for i, o in enumerate(g.options) if o.strategies == want),
                                None))
        if None in choices:
            continue
        cost, mem, strategies = evaluate(problem, choices)
        if problem.memory_budget is not None and mem > problem.memory_budget:
            continue
        seen.add(strategies)
        out.append((name, Solution(tuple(choices), strategies, cost, mem, f"baseline {name}",
                                   0.0)))
    return out


def predicted_seconds(problem: Problem, choices, launch_overhead_s: float) -> float:
    """Composed step time: windows, boundary reshardings, and one program launch."""
    return evaluate(problem, choices)[0] / SCALE + launch_overhead_s


def measure_plans(program, analysis, plans, mesh, args_host, options: SearchOptions):
    """Compile every plan, then time them in interleaved rounds; per plan the list of
    measured seconds per step and the compiled executable."""
    from cfp.execute import PlannedStep, time_steps
    steps = []
    for strategies in plans:
        ps = PlannedStep(program, analysis, strategies, mesh)
        t0 = time.perf_counter()
        ps.compile()
        ps.compile_s = time.perf_counter() - t0
        ps.args = ps.place(args_host)
        time_steps(ps.compiled, ps.args, iters=1)  # warm-up
        steps.append(ps)
    times = [[] for _ in steps]
    for r in range(options.rounds):  # the order rotates, so drift hits every plan alike
        for i in [(r + k) % len(steps) for k in range(len(steps))]:
            ps = steps[i]
            times[i].append(time_steps(ps.compiled, ps.args, iters=options.iters))
    return steps, times


def plan_flops(analysis) -> float:
    return float(sum(op.flops for op in analysis.graph.ops))
