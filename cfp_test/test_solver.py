import dataclasses
import itertools
import random

import numpy as np
import pytest

from cfp.solver import Group, Option, Problem, evaluate, solve, solve_alike


def brute_force(problem: Problem) -> tuple[int, tuple] | None:
    """Exhaustive optimum (cost, choices); None when nothing fits the budget."""
    best = None
    for choices in itertools.product(*[range(len(g.options)) for g in problem.groups]):
        cost, mem, strat = evaluate(problem, choices)
        if problem.memory_budget is not None and mem > problem.memory_budget:
            continue
        if any(strat[i] != strat[j] for i, j in problem.ties):
            continue
        if best is None or cost < best[0]:
            best = (cost, choices)
    return best


def chain_dp(problem: Problem) -> int:
    """Exact optimum of a chain (edges only between consecutive groups), no memory budget."""
    groups = problem.groups
    owner = {b: g for g, grp in enumerate(groups) for b in grp.blocks}

    def edge_cost(g, o_prev, o_next):
        total = 0
        for (i, j), table in problem.edges.items():
            gi, gj = owner[i], owner[j]
            if {gi, gj} == {g, g + 1}:
                si = groups[gi].options[o_prev if gi == g else o_next]
                sj = groups[gj].options[o_prev if gj == g else o_next]
                total += int(table[si.strategies[groups[gi].blocks.index(i)],
                                   sj.strategies[groups[gj].blocks.index(j)]])
        return total

    best = [o.cost for o in groups[0].options]
    for g in range(len(groups) - 1):
        best = [groups[g + 1].options[n].cost + min(best[p] + edge_cost(g, p, n)
                                                   for p in range(len(best)))
                for n in range(len(groups[g + 1].options))]
    return min(best)


def _random_chain(rng, groups=4, blocks_per=2, strategies=3, budget=None, held=False,
                  waiting=False):
    gs, nb = [], []
    for g in range(groups):
        blocks = tuple(range(len(nb), len(nb) + blocks_per))
        nb += [strategies] * blocks_per
        opts = []
        for c in np.ndindex(*(strategies,) * blocks_per):
            memory = rng.randint(1, 20)
            opts.append(Option(c, rng.randint(10, 100), memory, rng.randint(0, 10),
                               rng.randint(0, memory) if held else 0,
                               rng.randint(0, 12) if waiting else 0))
        gs.append(Group(blocks, opts))
    edges = {}
    for g in range(groups - 1):
        i, j = gs[g].blocks[-1], gs[g + 1].blocks[0]
        edges[i, j] = np.array([[0 if s == t else rng.randint(1, 40) for t in range(strategies)]
                                for s in range(strategies)])
    return Problem(gs, nb, edges, budget)


@pytest.mark.parametrize("seed", range(6))
def test_solver_matches_brute_force_and_dp(seed):
    rng = random.Random(seed)
    p = _random_chain(rng, groups=3)
    sol = solve(p)
    assert sol.status == "OPTIMAL"
    assert sol.objective == brute_force(p)[0] == chain_dp(p)
    assert evaluate(p, sol.choices)[0] == sol.objective


@pytest.mark.parametrize("seed", range(6))
def test_solver_respects_a_binding_memory_budget(seed):
    rng = random.Random(100 + seed)
    free = _random_chain(rng, groups=3, held=seed % 2 == 1)
    unconstrained = brute_force(free)
    mem_of_best = evaluate(free, unconstrained[1])[1]
    tight = Problem(free.groups, free.num_strategies, free.edges, mem_of_best - 1)
    want = brute_force(tight)
    sol = solve(tight)
    if want is None:
        assert sol is None
    else:
        assert sol.objective == want[0] and sol.memory <= tight.memory_budget
        assert sol.objective >= unconstrained[0]


@pytest.mark.parametrize("seed", range(4))
def test_memory_held_across_edges_counts_in_the_budget(seed):
    """A resharded copy held for the backward pass (``Problem.edge_memory``) adds to every
    plan's memory; under a budget it binds, the solver matches brute force. Control: without
    it the unconstrained optimum fits; with it, one that reshards does not (seeds 2 and 3)."""
    rng = random.Random(200 + seed)
    free = _random_chain(rng, groups=3, held=True)
    best = brute_force(free)
    held = {k: np.where(t > 0, 50, 0) for k, t in free.edges.items()}
    budget = evaluate(free, best[1])[1]  # the free optimum just fits without edge memory
    tight = Problem(free.groups, free.num_strategies, free.edges, budget, edge_memory=held)
    plain = Problem(free.groups, free.num_strategies, free.edges, budget)
    assert evaluate(plain, best[1])[1] <= budget  # control
    strategies = evaluate(free, best[1])[2]
    reshards = any(t[strategies[i], strategies[j]] for (i, j), t in free.edges.items())
    assert (evaluate(tight, best[1])[1] > budget) == reshards
    want = brute_force(tight)
    sol = solve(tight)
    assert (sol is None) == (want is None)
    if sol is not None:
        assert sol.objective == want[0] and evaluate(tight, sol.choices)[1] <= budget
        assert sol.memory == evaluate(tight, sol.choices)[1]


def test_incompatible_neighbours_pay_or_avoid_the_resharding():
    """Two segments each best alone (strategy 0 and 1) but incompatible at their boundary."""
    def problem(reshard):
        g0 = Group((0,), [Option((0,), 10), Option((1,), 14)])
        g1 = Group((1,), [Option((0,), 14), Option((1,), 10)])
        return Problem([g0, g1], [2, 2], {(0, 1): np.array([[0, reshard], [reshard, 0]])})
    cheap = solve(problem(reshard=1))  # paying 1 beats giving up 4
    assert cheap.strategies == (0, 1) and cheap.objective == 21
    dear = solve(problem(reshard=9))  # paying 9 is worse than one side's 4
    assert dear.strategies[0] == dear.strategies[1] and dear.objective == 24


def test_non_chain_edges_and_exclusion():
    rng = random.Random(7)
    p = _random_chain(rng, groups=3, blocks_per=1)
    p.edges[(0, 2)] = np.array([[0, 50, 50], [50, 0, 50], [50, 50, 0]])  # a skip connection
    first = solve(p)
    assert first.objective == brute_force(p)[0]
    second = solve(p, exclude=[first.choices])
    assert second.choices != first.choices and second.objective >= first.objective


@pytest.mark.parametrize("seed", range(4))
def test_tied_blocks_take_one_strategy(seed):
    """The copies of a scan body's block in its iterations (here the first block of every
    group) take the same strategy, at the brute-force optimum over the plans that do."""
    rng = random.Random(200 + seed)
    free = _random_chain(rng, groups=3)
    ties = [(0, 2), (2, 4)]
    tied = Problem(free.groups, free.num_strategies, free.edges, None, ties)
    sol = solve(tied)
    assert len({sol.strategies[b] for b in (0, 2, 4)}) == 1
    assert sol.objective == brute_force(tied)[0] >= brute_force(free)[0]


def test_ties_bind_where_the_free_optimum_differs():
    """Negative control: on some instance the untied optimum gives the copies different
    strategies, so the ties above are not satisfied by chance."""
    for seed in range(200, 220):
        free = _random_chain(random.Random(seed), groups=3)
        strategies = evaluate(free, brute_force(free)[1])[2]
        if len({strategies[b] for b in (0, 2, 4)}) > 1:
            return
    raise AssertionError("the free optimum tied the copies on every instance")


@pytest.mark.parametrize("seed", [0, 1, 14, 16])
def test_alike_layers_solve_on_the_quotient(seed):
    """Three layers of two blocks, each block alike across layers: the quotient's optimum is
    the brute-force optimum over the plans whose layers are alike, also with a skip edge
    between two copies of one block (a cost on the diagonal) and a memory budget. With held
    activations (seeds 14 and 16), the budget binds where the quotient must price each layer's
    window in the step's order (pricing a quotient group as one window misses both)."""
    rng = random.Random(300 + seed)
    free = _random_chain(rng, groups=3, held=seed > 1)
    free.edges[(0, 4)] = np.array([[rng.randint(0, 9) for _ in range(3)] for _ in range(3)])
    alike = [(0, 2), (2, 4), (1, 3), (3, 5)]
    budget = sorted(evaluate(free, c)[1] for c in [(o,) * 3 for o in range(9)])[4]
    p = Problem(free.groups, free.num_strategies, free.edges, budget, [], alike)
    want = brute_force(Problem(free.groups, free.num_strategies, free.edges, budget, alike))
    sol = solve_alike(p)
    assert sol.objective == want[0] == evaluate(p, sol.choices)[0]
    assert sol.memory <= budget
    assert len({sol.strategies[b] for b in (0, 2, 4)}) == 1


def test_whole_problem_mixes_layers_under_a_tight_budget():
    """Fast layers need 10 bytes, lean ones 5: within 25 bytes, plans with alike layers must
    all be lean (cost 60); the whole problem runs two fast and one lean (cost 40)."""
    from cfp.problem import top_plans
    layer = [Option((0,), 10, 10), Option((1,), 20, 5)]
    p = Problem([Group((b,), layer) for b in range(3)], [2, 2, 2], {}, 25, [], [(0, 1), (1, 2)])
    assert solve_alike(p).objective == 60
    assert top_plans(p, 1, 10.0)[0].objective == 40
    assert top_plans(p, 1, 10.0, alike_only=True)[0].objective == 60


def test_a_whole_problem_too_large_for_the_lp_keeps_its_alike_start(monkeypatch):
    """Within 25 bytes the whole problem mixes layers (cost 40), its alike start is all lean
    (60). Started alike, a whole problem over the LP's size limit is not solved: its plan is
    the alike one, and its status says why. Control: within the limit it is solved (40).
    The booleans ``solve`` makes are counted without building its model."""
    import cfp.problem
    from cfp.problem import top_plans
    from cfp.solver import model_booleans
    layer = [Option((0,), 10, 10), Option((1,), 20, 5)]
    p = Problem([Group((b,), layer) for b in range(3)], [2, 2, 2], {}, 25, [], [(0, 1), (1, 2)])
    monkeypatch.setattr(cfp.problem, "ALIKE_FROM_OPTIONS", 0)  # every solve starts alike
    assert top_plans(p, 1, 10.0)[0].objective == 40  # control
    monkeypatch.setattr(cfp.problem, "LP_MAX_VARIABLES", model_booleans(p) - 1)
    sol = top_plans(p, 1, 10.0)[0]
    assert sol.objective == 60 and "too large for the LP, not solved" in sol.status
    chain = _random_chain(random.Random(5))
    made = solve(chain).edge_booleans
    assert made > 0 and model_booleans(chain) == made + sum(
        len(g.options) + sum(chain.num_strategies[b] for b in g.blocks) for g in chain.groups)


def test_plans_with_alike_layers_only_stop_where_none_fits():
    """Bytes held between two layers that take one strategy (20 per pair) put every plan
    whose layers are alike over 25 bytes (15 + 40); layers that alternate fit (15). Asked
    for alike plans only (as meshes are ranked), top_plans says none fits, and solves
    nothing more. Control: the whole problem has a plan, with layers not alike."""
    from cfp.errors import CfpError
    from cfp.problem import top_plans
    layer = [Option((0,), 10, 5), Option((1,), 10, 5)]
    held = np.array([[20, 0], [0, 20]])
    p = Problem([Group((b,), layer) for b in range(3)], [2, 2, 2], {}, 25, [], [(0, 1), (1, 2)],
                edge_memory={(0, 1): held, (1, 2): held})
    assert solve_alike(p) is None
    whole = top_plans(p, 1, 10.0)[0]
    assert whole.memory == 15 and whole.strategies in ((0, 1, 0), (1, 0, 1))
    with pytest.raises(CfpError, match="no plan whose repeated layers are alike fits"):
        top_plans(p, 1, 10.0, alike_only=True)


def test_the_peak_holds_a_windows_transient_beside_the_held_activations_up_to_it():
    """Window 0's transient (8) runs in the backward pass after window 1's held activations
    (6) are freed: the peak is 20 + max(8 - 6, 1) = 22, not 20 + 8. Within 23 bytes the plan
    fits; counted with every window's held activations (the control: held 0) it does not."""
    from cfp.solver import least_memory

    def problem(held, budget=None):
        return Problem([Group((0,), [Option((0,), 10, 10, 8)]),
                        Group((1,), [Option((0,), 10, 10, 1, held)])], [1, 1], {}, budget)
    assert evaluate(problem(6), (0, 0))[1] == 22
    assert evaluate(problem(0), (0, 0))[1] == 28
    assert solve(problem(6, 23)) is not None and solve(problem(0, 23)) is None
    assert least_memory(problem(6)) == 22 and least_memory(problem(0)) == 28


def test_a_recomputed_layer_makes_its_windows_again_at_once():
    """A layer of two windows (groups 1 and 2) recomputed: its backward pass makes both
    windows' activations again (5 and 7) when it starts, at window 2, so there the peak
    holds both beside window 2's transient (1): 20 + 5 + 7 + 1 = 33; at window 1 it holds
    window 1's (5) beside its transient (2). Control: with each window's made again alone
    (no layer), the peak is 20 + 7 + 1 = 28. Such a problem is composed, never solved."""
    def problem(layer_starts):
        return Problem([Group((0,), [Option((0,), 10, 10, 0)]),
                        Group((1,), [Option((0,), 10, 5, 2, remade=5)]),
                        Group((2,), [Option((0,), 10, 5, 1, remade=7)])], [1, 1, 1], {},
                       layer_starts=layer_starts)
    assert evaluate(problem({1: 1, 2: 1}), (0, 0, 0))[1] == 33
    assert evaluate(problem({}), (0, 0, 0))[1] == 20 + 7 + 1
    with pytest.raises(ValueError):
        solve(problem({1: 1, 2: 1}))


@pytest.mark.parametrize("seed", range(4))
def test_least_memory_bounds_every_plan_from_below(seed):
    import itertools
    from cfp.solver import least_memory
    p = _random_chain(random.Random(500 + seed), groups=3, blocks_per=1, held=True,
                      waiting=seed >= 2)
    p.waiting_cap = 10 if seed == 3 else None
    plans = list(itertools.product(*[range(len(g.options)) for g in p.groups]))
    peaks = [evaluate(p, c)[1] for c in plans]
    assert least_memory(p) <= min(peaks)
    for c, peak in zip(plans, peaks):  # with no choice left, the bound is the plan's peak
        only = dataclasses.replace(p, groups=[dataclasses.replace(g, options=[g.options[i]])
                                              for g, i in zip(p.groups, c)])
        only.waiting_cap = p.waiting_cap
        assert least_memory(only) == peak


def test_alike_layers_keep_each_windows_memory_where_their_transients_differ():
    """Two alike layers, the first's fast option with the larger transient (10 against 1):
    its peak is 20 + max(10 - 5, 1) = 25, over a budget of 24, so the quotient must run the
    lean option (cost 40). Checking the quotient group at its last window alone (its
    transient 1) would admit the fast plan."""
    def layer(transient_fast):
        return Group((0,), [Option((0,), 10, 10, transient_fast, 5), Option((1,), 20, 10, 0, 5)])
    first, last = layer(10), layer(1)
    p = Problem([first, Group((1,), last.options)], [2, 2], {}, 24, [], [(0, 1)])
    assert evaluate(p, (0, 0))[1] == 25
    sol = solve_alike(p)
    assert sol.objective == 40 and sol.memory <= 24


def test_gradients_left_waiting_count_from_their_window_to_the_steps_end():
    """Window 1 leaves 5 bytes waiting (gradients awaiting a combined reduction): they count
    at its own transient (20 + 1 + 5 = 26) and at window 0's, which runs after it in the
    backward pass (20 - (6 - 5) + 8 = 27), not 22. Within 26 bytes the plan does not fit;
    the control, nothing waiting, fits."""
    from cfp.solver import least_memory

    def problem(waiting, budget=None):
        return Problem([Group((0,), [Option((0,), 10, 10, 8)]),
                        Group((1,), [Option((0,), 10, 10, 1, 6, waiting)])], [1, 1], {}, budget)
    assert evaluate(problem(5), (0, 0))[1] == 27 and evaluate(problem(0), (0, 0))[1] == 22
    assert solve(problem(5, 26)) is None and solve(problem(0, 26)) is not None
    assert least_memory(problem(5)) == 27


@pytest.mark.parametrize("seed", range(6))
def test_solver_matches_brute_force_with_gradients_left_waiting(seed):
    """Waiting bytes can exceed what a window frees, and a bound on them is not linear; under
    a budget that binds, the solver still finds brute force's plan, within the budget."""
    rng = random.Random(700 + seed)
    free = _random_chain(rng, groups=3, held=True, waiting=True)
    free.waiting_cap = 10 if seed % 2 else None  # groups of at most 10 bytes, or none
    best = brute_force(free)
    tight = Problem(free.groups, free.num_strategies, free.edges,
                    evaluate(free, best[1])[1] - 1, waiting_cap=free.waiting_cap)
    want, sol = brute_force(tight), solve(tight)
    assert (sol is None) == (want is None)
    if sol is not None:
        assert sol.objective == want[0] and evaluate(tight, sol.choices)[1] <= tight.memory_budget


def test_alike_layers_check_every_window_where_gradients_wait():
    """Two alike layers; their fast option leaves 5 bytes waiting and frees none. Both fast:
    the last layer's window peaks at 20 + 2 + 5 = 27, the first's at 20 + 2 + 10 = 32, over a
    budget of 30; so the quotient runs both lean (cost 40). Checking the quotient group at
    its last window alone (its transients are no smaller) would admit the fast plan (cost
    20); the control, nothing waiting, is fast within the budget."""
    def problem(waiting):
        layer = [Option((0,), 10, 10, 2, 0, waiting), Option((1,), 20, 10, 2)]
        return Problem([Group((0,), layer), Group((1,), layer)], [2, 2], {}, 30, [], [(0, 1)])
    assert evaluate(problem(5), (0, 0))[1] == 32
    assert solve_alike(problem(5)).objective == 40
    assert solve_alike(problem(0)).objective == 20


def test_gradients_waiting_at_once_are_at_most_the_combined_reductions_size():
    """Three windows each leave 5 bytes waiting; XLA combines reductions into groups of at
    most ``waiting_cap`` bytes, so no more than 8 wait at once: the first window's peak is
    20 + 4 + 8 (32), not 20 + 4 + 15. Within 32 bytes it fits; the control, no bound,
    does not."""
    from cfp.solver import least_memory

    def problem(cap, budget=None):
        return Problem([Group((b,), [Option((0,), 10, 20 if b == 0 else 0,
                                            4 if b == 0 else 0, 0, 5)]) for b in range(3)],
                       [1, 1, 1], {}, budget, waiting_cap=cap)
    assert evaluate(problem(8), (0, 0, 0))[1] == 32
    assert evaluate(problem(None), (0, 0, 0))[1] == 39
    assert solve(problem(8, 32)) is not None and solve(problem(None, 32)) is None
    assert least_memory(problem(8)) == 32
    assert solve_alike(problem(8, 31)) is None and solve_alike(problem(8, 32)) is not None


def test_failed_reshardings_leave_the_unresharded_plan_solvable():
    """600 blocks in a chain, each boundary with a resharding XLA could not run (priced
    ``FAILED_RESHARD_S``): the best plan without reshardings is found (every block on the
    cheaper strategy). Control: a penalty that counts the failed prices multiplies them past
    CP-SAT's 64-bit objective, and the model CP-SAT refuses is raised as cfp's bug, not
    taken for "no plan fits"."""
    from cfp.problem import FAILED_RESHARD_S, SCALE, unresharded_plan
    from cfp.solver import penalizing_reshardings
    failed, n = int(FAILED_RESHARD_S * SCALE), 600
    problem = Problem([Group((b,), [Option((0,), 20), Option((1,), 10)]) for b in range(n)],
                      [2] * n,
                      {(b, b + 1): np.array([[0, failed], [5, 0]]) for b in range(n - 1)},
                      reshards={(b, b + 1): np.array([[False, True], [True, False]])
                                for b in range(n - 1)})
    (sol,) = unresharded_plan(problem, 10)
    assert set(sol.strategies) == {1}
    with pytest.raises(RuntimeError, match="CP-SAT refused the plan model"):
        solve(penalizing_reshardings(problem), time_limit_s=10)
