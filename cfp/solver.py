"""The plan search as a CP-SAT model (OR-Tools), on integers.

A ``Problem`` has *groups* (window instances), each choosing one of its measured *options* (a
combination of strategies for its blocks, with a cost and memory terms), and *edges* between
blocks of different groups, each with a cost table over the two blocks' strategies (the
resharding of the tensors that cross). Edges follow the program's real boundaries, so they need
not form a chain (tied embeddings, skip connections).

Model: one-hot booleans per group option; per block, booleans ``x[b][s]`` tied to the options
that give it strategy ``s`` (and equal for *tied* blocks: the copies of one block in the
iterations of a scan, which runs one body). Per edge, the strategies of each side fall into
groups that give the crossing tensors one layout (equal rows, equal columns of its table), and
"transport" booleans ``e[r,c]`` between groups satisfy ``sum_c e[r,c] = sum of x_i[s] over s
in r`` and ``sum_r e[r,c] = sum of x_j[t] over t in c`` (exactly one is true, and it prices
the pair): they grow with the distinct layouts, not with the strategies. Memory: the step's
peak is the largest, over groups ``k`` in program order, of every group's memory (persistent
plus held-for-backward bytes), less the held bytes of the groups after ``k`` (the backward
pass reaches ``k`` after it has freed them), plus ``k``'s transient bytes and the bytes ``k``
and the groups after it leave waiting (gradients awaiting a combined reduction, at most
``Problem.waiting_cap`` of them); each of these is at most the budget; an edge may add bytes
too (``edge_memory``: a resharded copy the backward pass reads, held until then), priced on
the same transport booleans. Costs are integers (the caller scales seconds to its profiles'
resolution), so the optimum is exact.

``solve_alike`` solves the quotient in which *alike* blocks (the same block of repeated layers)
take one strategy: one group per window of one layer, whatever the depth. Its plan starts the
whole problem (a hint), which may then give layers different strategies.

Example:
    >>> p = Problem(groups=[Group((0,), [Option((0,), 5), Option((1,), 3)])], num_strategies=[2])
    >>> solve(p).choices
    (1,)
"""
from __future__ import annotations

import dataclasses
import threading
import time

import numpy as np

from cfp.errors import CfpError


LP_MAX_VARIABLES = 200_000  # above this the search runs without its LP relaxation
EAGER_LP_MAX_VARIABLES = 50_000  # up to this the LP holds all its constraints from the start


@dataclasses.dataclass(frozen=True)
class Option:
    strategies: tuple[int, ...]  # one per block of the group (then its state layout, if any)
    cost: int
    memory: int = 0  # persistent + held-for-backward bytes: these add up over groups
    transient: int = 0  # bytes alive only while the group runs
    held: int = 0  # of ``memory``, the activations held for the backward pass
    # made by the group's backward pass and held from then until their combined reduction
    # (gradients; at most ``Problem.waiting_cap`` of all groups' wait at once)
    waiting: int = 0
    # what a recomputed layer's backward pass makes again for the group (its activations
    # and the weights it gathers): live from the start of the layer's backward pass
    # (``Problem.layer_starts``)
    remade: int = 0


@dataclasses.dataclass(frozen=True)
class Group:
    blocks: tuple[int, ...]
    options: list[Option]


@dataclasses.dataclass
class Problem:
    groups: list[Group]
    num_strategies: list[int]  # per block
    edges: dict = dataclasses.field(default_factory=dict)  # (i, j) -> int array [S_i, S_j]
    memory_budget: int | None = None
    ties: list = dataclasses.field(default_factory=list)  # (i, j): same strategy (one scan)
    alike: list = dataclasses.field(default_factory=list)  # (i, j): same block, repeated layer
    # Per window in program order: (its group, held, transient and waiting bytes per option).
    # None: one window per group, in the groups' order (a quotient's group stands for
    # several windows, ``solve_alike``).
    sequence: list | None = None
    # The most gradient bytes that wait at once: XLA combines reductions into groups of at
    # most this many bytes (``windows.COMBINED_REDUCTION_BYTES``). None: no bound.
    waiting_cap: int | None = None
    # (i, j) -> bool array [S_i, S_j]: some tensor between the two blocks changes layout (a
    # resharding priced 0 is still one). Empty: not known.
    reshards: dict = dataclasses.field(default_factory=dict)
    # (i, j) -> int array [S_i, S_j]: bytes per device the plan holds for a tensor crossing
    # between the two blocks, beyond what the groups count (a resharded copy the backward
    # pass reads). They add up over the step, like ``Option.memory``.
    edge_memory: dict = dataclasses.field(default_factory=dict)
    # group -> the first group of its recomputed layer: the layer's backward pass makes what
    # its groups remade (``Option.remade``) at once, each live until its group's backward is
    # done (a group not here: its own alone). Composed by ``evaluate`` only: no solve takes
    # a recompute.
    layer_starts: dict = dataclasses.field(default_factory=dict)


def _sequence(problem: Problem) -> list:
    if problem.sequence is not None:
        return problem.sequence
    return [(g, tuple(o.held for o in grp.options), tuple(o.transient for o in grp.options),
             tuple(o.waiting for o in grp.options)) for g, grp in enumerate(problem.groups)]


@dataclasses.dataclass(frozen=True)
class Solution:
    choices: tuple[int, ...]  # option index per group
    strategies: tuple[int, ...]  # strategy per block
    objective: int
    memory: int
    status: str  # OPTIMAL | FEASIBLE
    solve_s: float
    edge_booleans: int = 0  # transport booleans the model needed for its edges


def evaluate(problem: Problem, choices) -> tuple[int, int, tuple[int, ...]]:
    """(cost, memory, block strategies) of a choice of one option per group."""
    strat = [0] * len(problem.num_strategies)
    cost = mem = 0
    for g, c in zip(problem.groups, choices):
        opt = g.options[c]
        cost += opt.cost
        mem += opt.memory
        for b, s in zip(g.blocks, opt.strategies):
            strat[b] = s
    for (i, j), table in problem.edges.items():
        cost += int(table[strat[i], strat[j]])
    for (i, j), table in problem.edge_memory.items():
        mem += int(table[strat[i], strat[j]])
    held, transient, waiting = ([row[k][choices[g]] for g, *row in _sequence(problem)]
                                for k in range(3))
    remade = [grp.options[c].remade for grp, c in zip(problem.groups, choices)]
    for g in range(len(remade) if any(remade) else 0):  # one window per group (no quotient)
        transient[g] += sum(remade[problem.layer_starts.get(g, g):g + 1])
    return (cost, mem + transient_peak(held, transient, waiting, problem.waiting_cap),
            tuple(strat))


def transient_peak(held, transient, waiting=None, cap: int | None = None) -> int:
    """Over windows in program order, the largest transient less the held bytes of the
    windows after it (the backward pass has freed them by then), plus the bytes it and the
    windows after it leave waiting, at most ``cap``; at least 0."""
    above, freed, waited = 0, 0, 0
    for h, t, w in zip(reversed(held), reversed(transient),
                       reversed([0] * len(held) if waiting is None else waiting)):
        waited += w
        above = max(above, t - freed + _capped(waited, cap))
        freed += h
    return above


def _capped(waiting: int, cap: int | None) -> int:
    """The waiting bytes held at once (``Problem.waiting_cap``)."""
    return waiting if cap is None else min(waiting, cap)


def least_memory(problem: Problem) -> int:
    """A lower bound on the memory of every plan (for the error when none fits): at each
    window, every group at its least memory less what the later windows free, plus the
    window's least transient and the least the windows from it on leave waiting."""
    seq = _sequence(problem)
    freed = {g: [0] * len(grp.options) for g, grp in enumerate(problem.groups)}
    least = {g: min(o.memory for o in grp.options) for g, grp in enumerate(problem.groups)}
    total, bound, waited = sum(least.values()), 0, 0
    cap = problem.waiting_cap
    for g, held, transient, waiting in reversed(seq):
        waited += min(waiting)
        bound = max(bound, total + min(transient) + _capped(waited, cap))
        freed[g] = [f + h for f, h in zip(freed[g], held)]
        new = min(o.memory - f for o, f in zip(problem.groups[g].options, freed[g]))
        total += new - least[g]
        least[g] = new
    return bound if seq else total


def penalizing_reshardings(problem: Problem, never: int | None = None) -> Problem:
    """``problem`` with every boundary resharding costing more than any whole plan: its
    cheapest plan reshards at as few block pairs as it can, and is the cheapest of those that
    reshard nowhere when there are any. Edge costs of ``never`` or more (reshardings that
    failed, never chosen) are left out of the penalty, which would otherwise multiply them
    past CP-SAT's 64-bit objective."""
    def most(table) -> int:
        kept = table if never is None else table[table < never]
        return int(kept.max()) if kept.size else 0
    penalty = 1 + sum(max(o.cost for o in g.options) for g in problem.groups) \
        + sum(most(t) for t in problem.edges.values())
    edges = {k: problem.edges.get(k, 0) + penalty * moved.astype(np.int64)
             for k, moved in problem.reshards.items()}
    edges.update({k: t for k, t in problem.edges.items() if k not in edges})
    return dataclasses.replace(problem, edges=edges)


def solve(problem: Problem, *, time_limit_s: float = 60.0, exclude=(), workers: int = 1,
          hint=None, relative_gap: float = 0.0) -> Solution | None:
    """The cheapest plan (None when no plan meets the memory budget or all are excluded; a
    ``CfpError`` when the time limit ends the search before it found a plan or proved none).
    ``hint``: option index per group of a plan to start from. ``relative_gap``: the search
    stops once its plan is proved within this share of the cheapest (its status then says
    how close it was proved)."""
    from ortools.sat.python import cp_model
    if any(o.remade for grp in problem.groups for o in grp.options):
        raise ValueError("a problem with recompute is composed (evaluate), never solved")
    t0 = time.perf_counter()
    stats: dict[str, int] = {}
    m = cp_model.CpModel()
    y = [[m.NewBoolVar(f"y{g}_{o}") for o in range(len(grp.options))]
         for g, grp in enumerate(problem.groups)]
    for g, vs in enumerate(y):
        m.AddExactlyOne(vs)
    x = {}
    for g, grp in enumerate(problem.groups):
        for k, b in enumerate(grp.blocks):
            for s in range(problem.num_strategies[b]):
                ys = [y[g][o] for o, opt in enumerate(grp.options) if opt.strategies[k] == s]
                x[b, s] = m.NewBoolVar(f"x{b}_{s}")
                m.Add(x[b, s] == sum(ys)) if ys else m.Add(x[b, s] == 0)
    objective = [opt.cost * y[g][o] for g, grp in enumerate(problem.groups)
                 for o, opt in enumerate(grp.options)]
    held_across = []  # edge memory: (bytes, transport boolean)
    for i, j, table, held, rows, cols in _edge_layouts(problem):
        e = {(r, c): m.NewBoolVar(f"e{i}_{j}_{r}_{c}") for r in range(len(rows))
             for c in range(len(cols))}
        for r, members in enumerate(rows):
            m.Add(sum(e[r, c] for c in range(len(cols))) == sum(x[i, s] for s in members))
        for c, members in enumerate(cols):
            m.Add(sum(e[r, c] for r in range(len(rows))) == sum(x[j, t] for t in members))
        objective += [int(table[rows[r][0], cols[c][0]]) * v for (r, c), v in e.items()
                      if table[rows[r][0], cols[c][0]]]
        held_across += [(int(held[rows[r][0], cols[c][0]]), v) for (r, c), v in e.items()
                        if held[rows[r][0], cols[c][0]]]
        stats["edge_booleans"] = stats.get("edge_booleans", 0) + len(e)
    if problem.memory_budget is not None:
        seq = _sequence(problem)
        total = m.NewIntVar(0, sum(max(o.memory for o in grp.options)
                                   for grp in problem.groups)
                            + sum(int(np.max(t)) for t in problem.edge_memory.values()),
                            "memory")
        m.Add(total == sum(opt.memory * y[g][o] for g, grp in enumerate(problem.groups)
                           for o, opt in enumerate(grp.options))
              + sum(n * v for n, v in held_across))
        # Held bytes of the windows after this one, and waiting bytes of this one and those
        # after it: chains of variables, one per window whose constraint counts. A window
        # whose group has a later window with transients at least as large, option by
        # option, needs none where nothing waits: less is freed after that one (the quotient
        # of alike layers repeats its groups in every layer). Where anything waits, more waits
        # at the earlier window, so every window's constraint counts.
        cap, waits = problem.waiting_cap, any(any(w) for *_, w in seq)
        bound = sum(max(held) for _, held, _, _ in seq)
        most = sum(max(w) for *_, w in seq)
        freed, pending, waited, pending_wait = 0, {}, 0, {}
        wait, capped_of = 0, None
        later_max: dict[int, tuple] = {}
        for k in reversed(range(len(seq))):
            g, held, transient, waiting = seq[k]
            for o, w in enumerate(waiting):
                if w:
                    pending_wait[g, o] = pending_wait.get((g, o), 0) + w
            top = None if waits else later_max.get(g)
            if top is None or any(t > u for t, u in zip(transient, top)):
                if pending:
                    var = m.NewIntVar(0, bound, f"freed{k}")
                    m.Add(var == freed + sum(c * y[q][o] for (q, o), c in pending.items()))
                    freed, pending = var, {}
                if pending_wait:
                    var = m.NewIntVar(0, most, f"waited{k}")
                    m.Add(var == waited + sum(c * y[q][o]
                                              for (q, o), c in pending_wait.items()))
                    waited, pending_wait = var, {}
                if cap is None or most <= cap:
                    wait = waited
                elif waited is not capped_of:  # a new sum: its own bound
                    wait, capped_of = m.NewIntVar(0, cap, f"waiting{k}"), waited
                    m.AddMinEquality(wait, [waited, cap])
                m.Add(total - freed + sum(t * y[g][o] for o, t in enumerate(transient) if t)
                      + wait <= problem.memory_budget)
                later_max[g] = transient if top is None else tuple(map(max, transient, top))
            for o, h in enumerate(held):
                if h:
                    pending[g, o] = pending.get((g, o), 0) + h
    for i, j in problem.ties:
        for s in range(problem.num_strategies[i]):
            m.Add(x[i, s] == x[j, s])
    for prev in exclude:  # no-good cuts: not this exact plan again
        m.AddBoolOr([y[g][c].Not() for g, c in enumerate(prev)])
    if hint is not None:
        for g, c in enumerate(hint):
            for o, v in enumerate(y[g]):
                m.AddHint(v, o == c)
    m.Minimize(sum(objective))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = workers
    solver.parameters.relative_gap_limit = relative_gap
    # No probing in presolve: on LLaMA-2-13B's 2x4x25 quotient (13,429 booleans) it took 15 s
    # of a 24 s solve and 8.6 s without, to the same optimum; the default job's top 3 plans
    # are the same, in 0.65 s against 0.83.
    solver.parameters.cp_model_probing_level = 0
    # The LP relaxation guides the search well but its memory grows with the model: a 4-axis
    # GPT-39B plan on 64 devices (500 000 booleans) needs 4 GB with it and 1.4 GB without.
    variables = len(m.Proto().variables)
    solver.parameters.linearization_level = 2 if variables <= LP_MAX_VARIABLES else 0
    # CP-SAT adds the LP's constraints lazily, as they are violated, by default. On
    # LLaMA-2-13B's quotient on a 2x4x25 mesh (13,429 variables) its first plan then came
    # after 13.4 s, and with every constraint from the start the search ended OPTIMAL in
    # 2.6 s (a 4-layer GPT on 2x4, whole: 14.6 s to 4.9 s, the same plan). A proof that no
    # plan fits can take longer so (up to 2x on those), and the memory grows with the model.
    solver.parameters.add_lp_constraints_lazily = variables > EAGER_LP_MAX_VARIABLES
    status = _solve_interruptibly(solver, m)
    if status == cp_model.UNKNOWN:
        raise CfpError(f"the solver found no plan within its time limit ({time_limit_s:g} s) "
                       f"and could not prove there is none: raise --time-limit")
    if status == cp_model.MODEL_INVALID:  # cfp built a model CP-SAT refuses: cfp's bug
        raise RuntimeError(f"CP-SAT refused the plan model: {m.Validate().splitlines()[0]}")
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    choices = tuple(next(o for o, v in enumerate(vs) if solver.Value(v)) for vs in y)
    cost, mem, strat = evaluate(problem, choices)
    gap = (solver.ObjectiveValue() - solver.BestObjectiveBound()) / max(
        abs(solver.ObjectiveValue()), 1e-9)
    label = ("FEASIBLE" if status != cp_model.OPTIMAL
             else "OPTIMAL" if gap <= 0 else f"OPTIMAL to within {gap:.2%}")
    return Solution(choices, strat, cost, mem, label, time.perf_counter() - t0,
                    stats.get("edge_booleans", 0))


def _edge_layouts(problem: Problem):
    """Per edge that costs time or holds memory: ``(i, j, time table, held bytes table,
    rows, cols)``, where strategies whose rows (columns) are equal are grouped: they give
    the crossing tensor one layout, and transport runs between those groups, so ``solve``'s
    booleans grow with the distinct layouts, not with the strategies."""
    for i, j in set(problem.edges) | set(problem.edge_memory):
        table = np.asarray(problem.edges.get((i, j), 0)) + np.zeros(
            (problem.num_strategies[i], problem.num_strategies[j]), dtype=np.int64)
        held = np.asarray(problem.edge_memory.get((i, j), 0)) + np.zeros_like(table)
        if table.any() or held.any():
            yield (i, j, table, held, _groups(np.concatenate([table, held], axis=1)),
                   _groups(np.concatenate([table.T, held.T], axis=1)))


def model_booleans(problem: Problem) -> int:
    """The booleans ``solve`` makes for ``problem``'s choices and edges (its memory chain adds
    a few integers per window): whether its search can run with the LP relaxation
    (``LP_MAX_VARIABLES``), known without building the model."""
    return (sum(len(g.options) + sum(problem.num_strategies[b] for b in g.blocks)
                for g in problem.groups)
            + sum(len(rows) * len(cols) for *_, rows, cols in _edge_layouts(problem)))


def _solve_interruptibly(solver, model) -> int:
    """``solver.Solve(model)`` under cfp's interrupt policy. CP-SAT's own SIGINT catching is
    off: it would end the search as if its time were up, so that a Ctrl-C is lost, and leave
    SIGINT at its default (the next Ctrl-C kills the run with no word). The search runs in a
    thread, so that Ctrl-C is raised here at once; it stops the search first."""
    solver.parameters.catch_sigint_signal = False
    if threading.current_thread() is not threading.main_thread():
        return solver.Solve(model)  # only the main thread takes signals
    done, outcome = threading.Event(), {}

    def search():
        try:
            outcome["status"] = solver.Solve(model)
        except BaseException as e:  # raised again below, in the caller's thread
            outcome["error"] = e
        finally:
            done.set()

    threading.Thread(target=search, name="cp-sat", daemon=True).start()
    try:
        while not done.wait(0.1):  # Event.wait, unlike Thread.join, survives an interrupt
            pass
    except KeyboardInterrupt:
        solver.StopSearch()
        done.wait()
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["status"]


def solve_alike(problem: Problem, *, time_limit_s: float = 60.0, exclude=(),
                relative_gap: float = 0.0) -> Solution | None:
    """The cheapest plan in which the blocks of ``problem.alike`` (the same block in repeated
    layers) take the same strategy, solved on the quotient problem: groups whose blocks are
    alike merge into one, whose options add up the members' costs and memory (so the budget
    still holds for the whole model), and edges add up likewise. It has one group per window
    of one layer, whatever the depth, so it solves in a fraction of the whole problem's time
    and starts that one."""
    t0 = time.perf_counter()
    parent = list(range(len(problem.num_strategies)))

    def find(b):
        while parent[b] != b:
            parent[b] = parent[parent[b]]
            b = parent[b]
        return b

    for i, j in list(problem.ties) + list(problem.alike):
        parent[find(i)] = find(j)
    members: dict[tuple, list[int]] = {}  # class of each block, in order -> groups
    for g, grp in enumerate(problem.groups):
        members.setdefault(tuple(find(b) for b in grp.blocks), []).append(g)
    rep_of = {}  # block -> the block of its merged group's first member at its position
    groups, origin = [], []
    for gs in members.values():
        first = problem.groups[gs[0]]
        for g in gs:
            rep_of.update(zip(problem.groups[g].blocks, first.blocks))
        common = set.intersection(*[{o.strategies for o in problem.groups[g].options}
                                    for g in gs])
        opts = []
        for st in sorted(common):
            picked = [next(o for o in problem.groups[g].options if o.strategies == st)
                      for g in gs]
            opts.append(Option(st, sum(o.cost for o in picked), sum(o.memory for o in picked),
                               max(o.transient for o in picked), sum(o.held for o in picked),
                               sum(o.waiting for o in picked)))
        groups.append(Group(first.blocks, opts))
        origin.append(gs)
    position = {b: (q, k) for q, grp in enumerate(groups) for k, b in enumerate(grp.blocks)}
    def quotient_edges(tables: dict, field: str) -> dict:
        """Edge tables between classes; one inside a class is on its diagonal, folded into
        the options' ``field`` (cost or memory)."""
        out: dict = {}
        for (i, j), table in tables.items():
            ri, rj = rep_of[i], rep_of[j]
            if ri == rj:
                q, k = position[ri]
                diag = np.diagonal(np.asarray(table))
                groups[q] = Group(groups[q].blocks, [dataclasses.replace(
                    o, **{field: getattr(o, field) + int(diag[o.strategies[k]])})
                    for o in groups[q].options])
                continue
            out[ri, rj] = out.get((ri, rj), 0) + np.asarray(table)
        return out

    edges = quotient_edges(problem.edges, "cost")
    edge_memory = quotient_edges(problem.edge_memory, "memory")
    ties = sorted({(rep_of[i], rep_of[j]) for i, j in list(problem.ties) + list(problem.alike)
                   if rep_of[i] != rep_of[j]})
    quotient_of = {g: q for q, gs in enumerate(origin) for g in gs}
    sequence = []  # the whole step's windows, each priced by its quotient group's choice
    for g, *row in _sequence(problem):
        q = quotient_of[g]
        index = [next(o for o, opt in enumerate(problem.groups[g].options)
                      if opt.strategies == qo.strategies) for qo in groups[q].options]
        sequence.append((q, *(tuple(x[o] for o in index) for x in row)))
    quotient = Problem(groups, problem.num_strategies, edges, problem.memory_budget, ties,
                       sequence=sequence, edge_memory=edge_memory,
                       waiting_cap=problem.waiting_cap)

    def lift(choices_q):
        out = [0] * len(problem.groups)
        for q, c in enumerate(choices_q):
            st = groups[q].options[c].strategies
            for g in origin[q]:
                out[g] = next(o for o, opt in enumerate(problem.groups[g].options)
                              if opt.strategies == st)
        return tuple(out)

    excluded_q = []
    for prev in exclude:  # a plan whose layers are alike excludes its quotient choice
        picked = [problem.groups[gs[0]].options[prev[gs[0]]].strategies for gs in origin]
        excluded_q.append(tuple(next((o for o, opt in enumerate(grp.options)
                                      if opt.strategies == st), -1)
                                for grp, st in zip(groups, picked)))
    sol = solve(quotient, time_limit_s=time_limit_s,
                exclude=[c for c in excluded_q if -1 not in c and lift(c) in set(exclude)],
                relative_gap=relative_gap)
    if sol is None:
        return None
    choices = lift(sol.choices)
    cost, mem, strat = evaluate(problem, choices)
    return Solution(choices, strat, cost, mem, sol.status, time.perf_counter() - t0,
                    sol.edge_booleans)


def _groups(table) -> list[list[int]]:
    """Row indices grouped by equal rows."""
    seen: dict[bytes, list[int]] = {}
    for r in range(table.shape[0]):
        seen.setdefault(np.ascontiguousarray(table[r]).tobytes(), []).append(r)
    return list(seen.values())
