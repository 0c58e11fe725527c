"""The search pass: one plan for the whole model, run across the mesh and laid open.

``run_search(analysis, profile, options)`` turns the profiles into a CP-SAT problem
(``build_problem``, ``cfp.solver``): one group per window instance, whose options are its
measured combinations (time, memory), and one edge per pair of blocks that a boundary tensor
joins, priced from the resharding table. It solves it, asks for the next-best plans too
(``validate_top``) and, when all of those reshard, for the best plan that does not
(``predicted_plans``), compiles them and solves again for those over the memory budget once
compiled (``fitting_predictions``), adds the baseline plans that are plans of the problem
(``baseline_candidates``), runs each end to end on the mesh in interleaved rounds, keeps the
measured fastest, checks it against the single-device step, and returns a ``SearchRecord``.
Across processes (``SearchOptions.runtime``) it runs in a worker that joins their runtime
(``cfp.worker``), on process 0's plans, timed by the slowest process.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time

from cfp.baselines import load_rules
from cfp.errors import CfpError
from cfp.execute import Storage
from cfp.mesh import AXIS_NAMES
from cfp.phases import Phases
from cfp.problem import (COMPILED_FIT_SHARE, UNRESHARDED, baseline_candidates, build_problem,
                         calibrated, compiled_fits, fastest_within_budget, plan_flops,
                         plan_storage, predicted_plans, predicted_seconds, top_plans,
                         unresharded_plan)
from cfp.solver import Problem, Solution, evaluate, least_memory
from cfp.timing import RACE_LEVEL, slower

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class SearchOptions:
    memory_budget_bytes: int | None
    time_limit_s: float = 60.0
    validate_top: int = 3
    validate_baselines: bool = True  # also run the rule-file baselines that are plans here
    iters: int | None = None  # steps per measurement; None: at least 5 steps and 0.1 s
    rounds: int = 7  # most measurements per plan, interleaved across plans
    min_rounds: int = 5  # fewest; more only while the fastest is not ``slower`` than the rest
    # most rounds of the race between the fastest plan and its rival (``measure_plans``)
    race_rounds: int = 15
    check_numerics: bool = True  # on configurations small enough for one device
    runtime: object = None  # cfp.multihost.Runtime: run across these processes' devices
    compilation_cache: str | None = None  # for the worker that runs it across processes
    recompute: str = "none"  # a policy forced on every layer (``cfp.recompute.forced``)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """A plan search ran end to end."""

    source: str  # "predicted", UNRESHARDED or "baseline <name>"
    strategies: tuple[int, ...]  # per block
    choices: tuple[int, ...]  # combination index per window instance
    predicted_s: float  # composed from the profiles
    composed_memory_bytes: int
    measured_s: tuple[float, ...]  # seconds per step, one per round
    compile_s: float
    compiled_peak_bytes: int  # per device, from the compiled step's memory analysis
    storage: Storage = Storage()  # where the plan keeps the training state

    @property
    def median_s(self) -> float:
        return statistics.median(self.measured_s)


@dataclasses.dataclass(frozen=True)
class SearchRecord:
    """What the search pass found, as plain data: every candidate with its predicted and
    measured times, the kept one's compiled program and layouts, the numerical check."""

    candidates: tuple[Candidate, ...]
    kept: int
    solver_status: str
    solve_s: float
    step_flops: float
    numerics: dict | None  # loss_rel_err, grad_excess_over_tol; None when not checked
    compiled_text: str  # the kept plan's compiled HLO
    memory: dict  # the kept plan's compiled memory (cfp.measure.memory_of)
    in_specs: tuple  # per step input, its PartitionSpec entries
    out_specs: tuple
    time_s: float
    phase_s: dict
    scans: str = ""  # "rolled" or "unrolled" when the step has scans: how the kept plan ran
    # the ids of the devices the kept plan ran on, in its mesh's order
    device_ids: tuple[int, ...] = ()
    # what it was searched from (``cfp.workdir.search_inputs``): a step handed to
    # cfp.autoshard again finds the plan without running it again
    inputs: str = ""
    recompute: dict | None = None  # what every plan ran recomputing (``Recompute.to_json``)

    @property
    def plan(self) -> Candidate:
        return self.candidates[self.kept]


def run_search(analysis, profile, options: SearchOptions) -> SearchRecord:
    """Search, validate and check a plan for ``analysis`` from ``profile``; see the module
    docstring."""
    if options.runtime is not None:  # in a worker that joins the processes' runtime
        from cfp.worker import Worker, WorkerOptions
        worker = Worker(analysis, WorkerOptions(
            "measure", options.memory_budget_bytes, 1,
            compilation_cache=options.compilation_cache, runtime=options.runtime))
        try:
            return worker.call(run_search, analysis, profile,
                               dataclasses.replace(options, runtime=None))
        finally:
            worker.close()
    from cfp.execute import checkable, compare_numerics, real_inputs, reference_run
    from cfp.measure import memory_of
    from cfp.multihost import share
    from cfp.recompute import forced, recomputed
    from cfp.tracing import trace_step
    start = time.perf_counter()
    phases = Phases()
    with phases("tracing"):
        workload = analysis.spec.build()
        mesh = analysis.mesh()
        program = trace_step(workload)
        recompute = forced(analysis, options.recompute)
        if recompute:
            program = recomputed(program, recompute)
        checked = options.check_numerics and checkable(analysis)
        args_host = (reference_run(workload, analysis, program)[0] if checked
                     else real_inputs(workload))
    with phases("solving"):
        problem, _ = build_problem(analysis, profile, options.memory_budget_bytes)
    sols, compiled, status = fitting_predictions(analysis, problem, profile, options, program,
                                                 mesh, phases)
    solve_s = phases.seconds["solving"]  # the compiles that check its predictions aside
    with phases("solving"):
        # Each hand plan runs as a hand plan, though a prediction is the same plan, and as its
        # rule writes it: every state leaf in the rule's layout, not the per-window layouts
        # its choices translate to (those keep the leaves no window holds as computed).
        hand = {}  # its candidate's status -> its storage
        if options.validate_baselines:
            rules = load_rules()
            for name, sol in baseline_candidates(analysis, problem, ()):
                sols.append(sol)
                hand[sol.status] = Storage(rules[name].storage)
        sols = share(sols)  # the solver's time limit makes its answer one process's to give
    storages = [hand.get(s.status) or plan_storage(analysis, problem, profile.windows, s.choices)
                for s in sols]
    plans = [(None if s.status in hand else compiled.get(s.choices)) or (s.strategies, st)
             for s, st in zip(sols, storages)]
    steps, times = measure_plans(program, analysis, plans, mesh, args_host, options, phases,
                                 rivals=[i for i, s in enumerate(sols) if s.status in hand])
    candidates = tuple(Candidate(
        s.status if s.status.startswith(("baseline", "predicted")) else "predicted",
        tuple(s.strategies),
        tuple(s.choices), predicted_seconds(problem, s.choices, profile.launch_overhead_s),
        s.memory, tuple(t), ps.compile_s, memory_of(ps.compiled)["peak_bytes"], st)
        for s, t, ps, st in zip(sols, times, steps, storages))
    kept = share(fastest_within_budget(candidates, options.memory_budget_bytes))  # process 0's
    numerics = None
    if checked:
        with phases("numerical check"):
            check = compare_numerics(workload, analysis, candidates[kept].strategies, mesh,
                                     candidates[kept].storage, program=program)
        numerics = {"loss_rel_err": check.loss_rel_err,
                    "grad_excess_over_tol": check.grad_excess}
        if not check.ok:
            raise RuntimeError(f"the sharded step does not match the single-device step "
                               f"({check.describe()}) under the plan "
                               f"{list(candidates[kept].strategies)}")
    step = steps[kept]
    rec = SearchRecord(candidates, kept, status, solve_s, plan_flops(analysis), numerics,
                       step.compiled.as_text(), memory_of(step.compiled),
                       tuple(map(tuple, step.in_specs)), tuple(map(tuple, step.out_specs)),
                       time.perf_counter() - start, dict(phases.seconds),
                       ("rolled" if step.rolled else "unrolled") if program.scans else "",
                       tuple(int(d.id) for d in mesh.devices.flat),
                       recompute=recompute.to_json() if recompute else None)
    log.info("search pass: %.1f s, phases %s", rec.time_s, rec.phase_s)
    return rec


CALIBRATIONS = 4  # most solves against a composition calibrated to what XLA holds


def fitting_predictions(analysis, problem: Problem, profile, options: SearchOptions, program,
                        mesh, phases: Phases | None = None
                        ) -> tuple[list[Solution], dict, str]:
    """``predicted_plans`` that fit the budget once compiled, the compiled steps (choices ->
    ``PlannedStep``, compiled, not run, for validation to run) and the first solve's status.
    The composition can count less than XLA holds. Under a budget every prediction is
    compiled; where some are over it, the composition is calibrated on those (``calibrated``)
    and they are solved again (the top plans again when a top plan was over, else the best
    plan without reshardings alone), never to a plan compiled already, up to
    ``CALIBRATIONS`` solves in all. The predictions that fit are returned, or where none
    does, the last ones. The solutions' memory is the uncalibrated composition. ``phases``
    takes the seconds of solving and of compiling apart."""
    from cfp.execute import PlannedStep, compile_steps
    from cfp.measure import memory_of
    phases = phases or Phases()
    budget, composed = problem.memory_budget, problem
    with phases("solving"):
        sols = predicted_plans(problem, options.validate_top, options.time_limit_s)
    compiled = {}
    status = sols[0].status
    if budget is None:
        return sols, compiled, status

    def peaks(sols) -> list[int]:
        steps = [PlannedStep(program, analysis, sol.strategies, mesh,
                             plan_storage(analysis, problem, profile.windows, sol.choices))
                 for sol in sols]
        with phases("compiling"):
            compile_steps(steps)
        compiled.update((sol.choices, ps) for sol, ps in zip(sols, steps))
        return [memory_of(ps.compiled)["peak_bytes"] for ps in steps]

    fitting: list[Solution] = []
    platform = "cpu" if mesh is None else mesh.devices.flat[0].platform
    for n in range(CALIBRATIONS):
        peaks_bytes = peaks(sols)
        fitting += [s for s, p in zip(sols, peaks_bytes) if compiled_fits(p, budget, platform)]
        over = [(s, p) for s, p in zip(sols, peaks_bytes)
                if not compiled_fits(p, budget, platform)]
        if not over or n == CALIBRATIONS - 1:
            break
        with phases("solving"):
            problem = calibrated(analysis, problem, profile.windows, over, first=n == 0,
                                 budget_bytes=budget)
        seen = list(compiled)
        try:
            with phases("solving"):
                sols = (predicted_plans(problem, options.validate_top, options.time_limit_s,
                                        seen) if any(s.status != UNRESHARDED for s, _ in over)
                        else unresharded_plan(problem, options.time_limit_s, seen))
        except CfpError:  # nothing composes within the calibrated budget
            break
        if not sols:
            break
    kept = fitting or [s for s, _ in over]
    return [dataclasses.replace(s, memory=evaluate(composed, s.choices)[1])
            for s in kept], compiled, status


def measure_plans(program, analysis, plans, mesh, args_host, options: SearchOptions,
                  phases: Phases | None = None, rivals=()):
    """Compile every plan ((block strategies, ``Storage``); a compiled ``PlannedStep`` is
    taken as it is), then time them in interleaved rounds; per plan the compiled step and the
    measured seconds per step of each round. Plans compiled to one program are run once
    (``_twins``). The rounds are ``race``'s, ``rivals`` (the hand plans) those of them that
    fit the budget once compiled. Where every plan's state and the largest plan's temporaries
    fit the memory budget together (``_fit_together``), each plan's state is placed once and a step run
    untimed; otherwise each measurement places its plan's state from the host, runs a step
    untimed, times its steps, and frees the state before the next plan's is placed: the
    candidates of a memory-bound search each fit the devices, and together would not."""
    from cfp.execute import PlannedStep, compile_steps, steps_for, time_steps
    from cfp.measure import memory_of
    from cfp.multihost import processes, share
    phases = phases or Phases()
    steps = [plan if isinstance(plan, PlannedStep)
             else PlannedStep(program, analysis, plan[0], mesh, plan[1]) for plan in plans]
    with phases("compiling"):
        compile_steps(steps)
    twin = _twins(steps)
    runs = [i for i, j in enumerate(twin) if i == j]
    held, warm_s = {}, {}
    if _fit_together([steps[i] for i in runs], options.memory_budget_bytes):
        with phases("placing state"):
            held = {i: steps[i].loop(args_host) for i in runs}
    fitting_rivals = list(dict.fromkeys(
        twin[i] for i in rivals if options.memory_budget_bytes is None
        or memory_of(steps[i].compiled)["peak_bytes"] <= options.memory_budget_bytes))

    def measure(i: int) -> float:  # unless held, the state placed is freed on return
        run = held.get(i)
        if run is None:
            with phases("placing state"):
                run = steps[i].loop(args_host)
        with phases("running"):
            if i not in held or i not in warm_s:  # the first step on the state placed
                warm_s[i] = time_steps(run, iters=1)
            iters = options.iters
            if iters is None and processes() > 1:  # every process runs as many steps
                iters = share(steps_for(warm_s[i]))
            # process 0's time, so that every process stops and keeps alike
            return share(time_steps(run, iters=iters))

    times = race(measure, runs, fitting_rivals, options)
    return steps, [list(times[j]) for j in twin]


RACE_LOOK = 4  # rounds of the race between looks at whether it is decided



def race(measure, runs: list[int], rivals: list[int], options: SearchOptions
         ) -> dict[int, list[float]]:
    """Seconds per round of each of ``runs`` (``measure(i)``: one round's seconds of plan
    ``i``), the plans taking turns in each round, the order rotating so that drift hits every
    plan alike. Rounds stop after ``min_rounds`` once every other plan is ``slower`` than the
    fastest, and after ``rounds`` at most. Then, where the fastest of the plans that are no
    ``rivals`` (cfp's own) and the fastest rival are not told apart, the two race on alone
    until one is ``slower`` than the other or ``race_rounds`` have run: a tie is then a tie."""
    times: dict[int, list[float]] = {i: [] for i in runs}
    racing = runs
    for r in range(max(options.rounds, options.race_rounds)):
        # the race: cfp's fastest against the fastest rival alone, looked at every
        # RACE_LOOK rounds (each look at a 95% interval may tell apart two alike by chance)
        if r >= options.rounds and (r - options.rounds) % RACE_LOOK == 0:
            racing = _racing(times, rivals)
            if not racing:
                break
        for i in [racing[(r + k) % len(racing)] for k in range(len(racing))]:
            times[i].append(measure(i))
        if (options.min_rounds <= r + 1 < options.rounds
                and _separated([times[i] for i in runs])):
            break
    return times


def _racing(times: dict, rivals: list[int]) -> list[int]:
    """The fastest of the plans that are no rivals (cfp's own) and the fastest of ``rivals``,
    by median, where neither is ``slower`` than the other; else none."""
    own = [i for i in times if i not in rivals]
    if not own or not rivals:
        return []
    best, rival = (min(plans, key=lambda i: statistics.median(times[i]))
                   for plans in (own, rivals))
    if (slower(times[rival], times[best], RACE_LEVEL)
            or slower(times[best], times[rival], RACE_LEVEL)):
        return []
    return [best, rival]


def _fit_together(steps, budget_bytes: int | None) -> bool:
    """Whether the compiled ``steps``' arguments (their state and batch), all placed at once,
    leave room within ``budget_bytes`` per device (None: no bound) for the largest of their
    temporaries and outputs. Process 0's answer."""
    from cfp.measure import memory_of
    from cfp.multihost import share
    if budget_bytes is None:
        return True
    memory = [memory_of(ps.compiled) for ps in steps]
    return share(sum(m["argument_bytes"] for m in memory)
                 + max(m["peak_bytes"] - m["argument_bytes"] for m in memory) <= budget_bytes)


def _twins(steps) -> list[int]:
    """Per compiled plan, the first plan compiled to the same program (itself when none):
    a hand plan that is another candidate's program is run once, and both get its times.
    Process 0's answer, so that every process runs the same programs."""
    from cfp.measure import normalized_hlo
    from cfp.multihost import share
    first: dict[tuple, int] = {}
    return share([first.setdefault((normalized_hlo(ps.compiled), repr(ps.in_specs),
                                    repr(ps.out_specs)), i) for i, ps in enumerate(steps)])


def _separated(times) -> bool:
    best = min(range(len(times)), key=lambda i: statistics.median(times[i]))
    return all(slower(t, times[best], RACE_LEVEL) for i, t in enumerate(times) if i != best)


# ---------------------------------------------------------------------------------------------
# Planning for a cluster that is not here: solve the priced profile, run nothing


@dataclasses.dataclass(frozen=True)
class Prediction:
    """A plan for a described cluster (``cfp.cluster``): solved from a priced profile (compile
    only, or analytic), not run."""

    mesh_shape: tuple[int, ...]
    strategies: tuple[int, ...]  # per block
    predicted_s: float
    memory_bytes: int  # per device, composed
    solver_status: str
    solve_s: float
    step_flops: float
    pricing: str  # the profile's cost: "model" (compile-only) or "analytic"
    memory_budget_bytes: int | None = None
    storage: Storage = Storage()  # where the plan keeps the training state
    # the rule-file hand plans priced from the same profile: (name, seconds, composed bytes per
    # device, the peak of its whole step compiled for ``compiled_for``, None: not compiled)
    hand_plans: tuple = ()
    choices: tuple = ()  # option per window instance (``build_problem``'s)
    memory_source: str = ""  # where the composed memory comes from (``ProfileRecord``)
    # the plan's whole step compiled for the GPUs the profile was compiled for: its peak per
    # device (None: not compiled), and those GPUs
    compiled_peak_bytes: int | None = None
    compiled_for: str | None = None
    # of ``predicted_s``, the seconds priced, not measured: under mocked GPUs the windows'
    # collectives and the reshardings (``priced_seconds``); the rest was timed on the GPU here
    priced_s: float = 0.0
    # what the plan recomputes (``Recompute.to_json``; None: nothing) and, of
    # ``predicted_s``, the seconds that costs (``recompute_seconds``)
    recompute: dict | None = None
    recompute_s: float = 0.0


# A plan for a cluster is a prediction, priced from a model: its solve stops once its plan is
# proved within 1% of the cheapest composition (the solver's status says how close).
PREDICTION_GAP = 0.01


def predict_plan(analysis, profile, memory_budget_bytes: int | None,
                 time_limit_s: float, *, alike_only: bool = False,
                 hand_plans: bool = True, ranked: Prediction | None = None,
                 compile_for: str | None = None) -> Prediction:
    """The best plan of the priced profile, with its predicted step time and memory, and
    unless not ``hand_plans``, the hand plans priced beside it. ``ranked``: the plan whose
    repeated layers are alike that ranked this mesh (``rank_meshes``), from the same
    analysis priced the same way (analytic): the whole problem starts from it, not solving it
    again. Where the profile's programs were compiled for GPUs, or ``compile_for`` names
    GPUs to compile for, the plan's whole step (and each hand plan's) is compiled for them,
    and what fits the budget is what fits once compiled (``_fitting_once_compiled``)."""
    gpus = profile.compiled_for or compile_for
    problem, _ = build_problem(analysis, profile, memory_budget_bytes)
    alike = None
    if (ranked is not None and profile.cost == ranked.pricing
            and len(ranked.choices) == len(problem.groups)
            and all(c < len(g.options) for c, g in zip(ranked.choices, problem.groups))):
        cost, memory, strategies = evaluate(problem, ranked.choices)
        # the ranked plan where this problem is the one it was solved in; else solved again
        fits = problem.memory_budget is None or memory <= problem.memory_budget
        if tuple(strategies) == ranked.strategies and fits:
            alike = Solution(ranked.choices, strategies, cost, memory, ranked.solver_status,
                             ranked.solve_s)
    hand_sols = (baseline_candidates(analysis, problem, [], within_budget=False)
                 if hand_plans else [])
    hand = tuple((name, predicted_seconds(problem, sol.choices, profile.launch_overhead_s),
                  sol.memory, None) for name, sol in hand_sols)
    try:
        sol = top_plans(problem, 1, time_limit_s, alike_only=alike_only,
                        relative_gap=PREDICTION_GAP, alike=alike)[0]
    except CfpError as e:  # no plan composes within the budget
        if gpus is None or problem.memory_budget is None:  # neither does any hand plan
            if not hand:
                raise
            raise CfpError(f"{e}; the hand plans need " + ", ".join(
                f"{name} {mem / 2**30:.1f} GiB" for name, _, mem, _ in hand)) from None
        sol = None  # XLA may hold less than the composition: compiled, it decides
    peak = None
    if gpus is not None:  # the whole step compiled for the GPUs too
        budget = problem.memory_budget
        compiled = {}  # choices -> (solution, peak) of cfp's plans compiled
        if budget is not None and (sol is None or max(
                [sol.memory] + [mem for _, _, mem, _ in hand]) > budget * COMPILED_FIT_SHARE):
            # memory binds: the hand plans' whole steps compiled too, so what fits is XLA's
            # say, beside the fastest plan (with no budget where the composition fits none)
            sol = sol or top_plans(dataclasses.replace(problem, memory_budget=None), 1,
                                   time_limit_s, relative_gap=PREDICTION_GAP)[0]
            rules = load_rules()
            peaks = plan_peaks(analysis, problem, profile, [s for _, s in hand_sols] + [sol],
                               gpus, [Storage(rules[name].storage) for name, _ in hand_sols])
            hand = tuple(h[:3] + (p,) for h, p in zip(hand, peaks))
            compiled[sol.choices] = (sol, peaks[-1])
        sol, peak, recompute, recomputing = _fitting_once_compiled(
            analysis, problem, profile, sol, time_limit_s, gpus,
            [(name, s, h[3]) for (name, s), h in zip(hand_sols, hand)], compiled)
        hand += recomputing
    else:
        recompute = None
    storage = plan_storage(analysis, problem, profile.windows, sol.choices)
    seconds = predicted_seconds(problem, sol.choices, profile.launch_overhead_s)
    extra_s = recompute_seconds(analysis, recompute, seconds, gpus)
    return Prediction(tuple(analysis.mesh_shape), tuple(sol.strategies), seconds + extra_s,
                      composed_bytes(analysis, profile, sol, recompute), sol.status,
                      sol.solve_s, plan_flops(analysis), profile.cost,
                      memory_budget_bytes, storage, hand, tuple(sol.choices),
                      profile.memory_source(), peak, gpus,
                      priced_seconds(analysis, profile, sol.choices)
                      if profile.cost == "mock" else 0.0,
                      recompute.to_json() if recompute else None, extra_s)


def composed_bytes(analysis, profile, sol: Solution, recompute) -> int:
    """The memory per device ``sol`` composes to with ``recompute`` applied (its own where
    there is none)."""
    if not recompute:
        return sol.memory
    return evaluate(build_problem(analysis, profile, None, recompute)[0], sol.choices)[1]


def recompute_seconds(analysis, recompute, seconds: float, gpu: str) -> float:
    """What recomputing costs a plan of ``seconds`` per step on ``gpu``s: its seconds per
    FLOP times the contractions' FLOPs computed again (the step's time is its contractions'
    where memory binds), and the bytes the other operators write again, split over the
    mesh, at the GPU's memory bandwidth."""
    if not recompute:
        return 0.0
    from cfp.gpu_compile import memory_bandwidth
    from cfp.recompute import recomputed_work, traced_step
    flops, written = recomputed_work(analysis.graph, traced_step(analysis, recompute))
    return (seconds * flops / plan_flops(analysis)
            + written / math.prod(analysis.mesh_shape) / memory_bandwidth(gpu))


def priced_seconds(analysis, profile, choices) -> float:
    """Of the step ``choices`` composes from a mocked profile, the seconds priced rather than
    timed: each window's collectives (``Measurement.priced_s``) and every resharding. The
    composition of a profile whose windows take only their priced seconds."""
    results = lambda p: {c: dataclasses.replace(m, time_s=m.priced_s)  # noqa: E731
                         for c, m in p.results.items()}
    priced = dataclasses.replace(profile, window_profiles={
        k: dataclasses.replace(p, results=results(p)) for k, p in profile.window_profiles.items()})
    return predicted_seconds(build_problem(analysis, priced, None)[0], choices, 0.0)


# The leanest plans: within these shares, in turn, of the least any plan can compose to
LEANEST_SHARES = (1.05, 1.25, 1.5, 2.0)


def _fitting_once_compiled(analysis, problem: Problem, profile, sol: Solution | None,
                           time_limit_s: float, gpus: str, hand=(), compiled_before=None
                           ) -> tuple[Solution, int, object, tuple]:
    """The fastest plan whose whole step, compiled for ``gpus``, fits the budget, and that
    peak, of those compiled: ``sol`` (the plan the composition fits; None where it fits
    none, as XLA may hold less than it counts: the fastest plan with no budget), and while
    the last one compiled does not fit, the plan the composition gives calibrated on it
    (``calibrated``), up to ``CALIBRATIONS`` compiles; from the second on, beside the plan
    the composition counts leanest, and where that does not fit either, no more (no plan
    fits without recomputing); and the hand plans (``hand``: (name, solution, compiled
    peak, None where not compiled) each). A plan over the budget once compiled is dropped;
    where none fits, plans are compiled recomputing their layers (``_recomputing``), and
    where none fits so either, "no plan fits" is said from the compiled figures. Returns
    the plan, its peak, what it recomputes (None: nothing) and the hand plans' lines
    recomputing (none where some plan fits without)."""
    budget = problem.memory_budget
    if budget is None:
        return sol, plan_peaks(analysis, problem, profile, [sol], gpus)[0], None, ()
    tried = {}  # choices -> (solution, compiled peak) of each plan compiled

    def compiled(sols: list) -> None:  # side by side, each once
        sols = [s for s in {s.choices: s for s in sols}.values() if s.choices not in tried]
        for s, peak in zip(sols, plan_peaks(analysis, problem, profile, sols, gpus)):
            tried[s.choices] = (s, peak)
            log.info("composed %.3f GiB, compiled for %s %.3f GiB", s.memory / 2**30, gpus,
                     peak / 2**30)

    def solved(p: Problem) -> Solution | None:
        try:
            return top_plans(p, 1, time_limit_s, relative_gap=PREDICTION_GAP,
                             exclude=list(tried))[0]
        except CfpError:  # none composes within it, but those compiled already
            return None

    def leanest() -> Solution | None:
        least = least_memory(problem)  # a bound: the leanest plan may compose to more
        for share in LEANEST_SHARES:
            lean = solved(dataclasses.replace(problem, memory_budget=int(least * share)))
            if lean is not None:
                return lean
        return None

    def fits(sol: Solution) -> bool:
        return compiled_fits(tried[sol.choices][1], budget, "gpu")

    sol = sol or solved(dataclasses.replace(problem, memory_budget=None))
    lean = None
    for n in range(CALIBRATIONS):
        if sol is None:
            break
        compiled([sol] + ([lean] if lean is not None else []))
        if fits(sol) or (lean is not None and not fits(lean)):
            break  # where the leanest plan does not fit, no calibration finds one that does
        if n == 0:  # compiled beside the next calibration's plan
            lean = leanest()
        # solved against the budget scaled by this plan's composed / compiled bytes
        sol = solved(calibrated(analysis, problem, profile.windows, [tried[sol.choices]],
                                first=False, budget_bytes=int(budget * COMPILED_FIT_SHARE)))
    if not any(compiled_fits(p, budget, "gpu") for _, p in tried.values()):
        lean = lean or leanest()
        if lean is not None:
            compiled([lean])
    fits = [(s, p) for s, p in list(tried.values()) + [(s, p) for _, s, p in hand]
            if p is not None and compiled_fits(p, budget, "gpu")]
    if fits:
        return min(fits, key=lambda sp: predicted_seconds(problem, sp[0].choices,
                                                          profile.launch_overhead_s)) + (None, ())
    found = _recomputing(analysis, problem, profile, list(tried.values()), hand, gpus)
    if isinstance(found, tuple):
        return found
    from cfp.gpu_compile import label
    peaks = [p for _, p in tried.values()] + [p for _, _, p in hand if p is not None] or [0]
    hands = [f"{name} {p / 2**30:.1f} GiB" for name, _, p in hand if p is not None]
    raise CfpError(f"no plan fits the memory budget of {budget / 2**30:.3f} GiB per device once "
                   f"compiled for {label(gpus)} (within {COMPILED_FIT_SHARE:.0%} of it, XLA's "
                   f"own rematerialization off): the least of the {len(peaks)} plans compiled "
                   f"peaks at {min(peaks) / 2**30:.1f} GiB"
                   + (f"; the hand plans compile to {', '.join(hands)}" if hands else "")
                   + (f"; recomputing every layer, the least peaks at {found / 2**30:.1f} GiB"
                      if found is not None else ""))


def _recomputing(analysis, problem: Problem, profile, ours: list, hand, gpus: str):
    """Where no plan fits once compiled (``ours``: (solution, compiled peak) of cfp's plans
    compiled, ``hand``: (name, solution, compiled peak or None) of the hand plans): the plans
    compiled again with every layer recomputed (``nothing_saveable``, MaxText's default),
    fastest first, two side by side (the fastest not yet compiled, and the fastest hand plan
    not yet compiled beside it: the step-time lines compare with it), until the fastest that
    fits is faster than every plan not compiled so; that plan's layers then recompute in
    the three runs priced least that fit (``_cheapest_recompute``). ``(plan, peak,
    recompute, the hand plans' lines recomputing every layer)``, a line's peak None where
    it was not compiled so (it is slower than the plan found); where none fits even so, the
    least peak recomputing every layer; None where nothing has a backward pass to
    recompute."""
    from cfp.recompute import RECOMPUTING_EVERY_LAYER, forced
    full = forced(analysis, "nothing_saveable")
    if full is None:
        return None
    budget = problem.memory_budget
    seconds = lambda s: predicted_seconds(problem, s.choices,  # noqa: E731
                                          profile.launch_overhead_s)
    stored = {s.choices: plan_storage(analysis, problem, profile.windows, s.choices)
              for s, _ in ours}
    rules = load_rules()
    stored.update((s.choices, Storage(rules[name].storage)) for name, s, _ in hand)
    plans = sorted({s.choices: s for s in [s for s, _ in ours] + [s for _, s, _ in hand]
                    }.values(), key=seconds)
    hands = {s.choices for _, s, _ in hand}
    peaks = {}  # choices -> compiled peak recomputing every layer
    while True:
        pending = [s for s in plans if s.choices not in peaks]
        fitting = [s for s in plans
                   if s.choices in peaks and compiled_fits(peaks[s.choices], budget, "gpu")]
        if not pending or (fitting and seconds(fitting[0]) <= seconds(pending[0])):
            break
        beside = [s for s in pending[1:] if s.choices in hands] + pending[1:]
        batch = pending[:1] + beside[:1]
        peaks.update(zip([s.choices for s in batch], compiled_peaks_for(
            analysis, [(s.strategies, stored[s.choices], full) for s in batch], gpus)))
    composed = build_problem(analysis, profile, None, full)[0]  # every layer recomputed
    lines = tuple((name + RECOMPUTING_EVERY_LAYER,
                   seconds(s) + recompute_seconds(analysis, full, seconds(s), gpus),
                   evaluate(composed, s.choices)[1], peaks.get(s.choices))
                  for name, s, _ in hand)
    if not fitting:
        return min(peaks.values())
    best = fitting[0]
    recompute, peak = _cheapest_recompute(analysis, best, stored[best.choices], full,
                                          peaks[best.choices], seconds(best), budget, gpus)
    return best, peak, recompute, lines


# Between recomputing a layer whole and not at all: saving its contractions without a batch
# dimension (the projections) and computing the rest again (attention's scores, the
# elementwise operators), most of a layer's FLOPs for a part of its activations.
LIGHTER = "dots_with_no_batch_dims_saveable"
RECOMPUTE_ROUNDS = 3  # most rounds of two compiles choosing the layers' policies


def _cheapest_recompute(analysis, plan: Solution, storage, full, full_peak: int,
                        seconds: float, budget: int, gpus: str):
    """The plan's layers in three runs, ``nothing_saveable``, then ``LIGHTER``, then none,
    priced least (``recompute_seconds``, per layer) of those whose whole step compiled for
    ``gpus`` fits, ``full`` (every layer ``nothing_saveable``, compiling to ``full_peak``)
    where none does. The peak is taken as linear in the counts: a layer not recomputed
    adds what the plan compiled with its first half recomputed says, a layer under
    ``LIGHTER`` what it compiled with every layer so says (both compiled first, side by side).
    Each round then compiles the two counts that save the most and that the line puts within
    the budget; a count the compile puts over it raises the line by what it was off, for
    the rounds after. ``(recompute, peak)``."""
    from cfp.recompute import mixed
    n = len(full.layers)
    half = n // 2
    probes = [(half, 0), (0, n)]  # (layers not recomputed, layers under LIGHTER)
    compiled = {(0, 0): full_peak}

    def compile_(counts):  # (layers not recomputed, layers under LIGHTER) each
        compiled.update(zip(counts, compiled_peaks_for(analysis, [
            (plan.strategies, storage, mixed(full, n - c - b, b, LIGHTER)) for c, b in counts],
            gpus)))
    compile_(probes)
    per_none = max(0.0, (compiled[probes[0]] - full_peak) / max(1, n - half))
    per_light = max(0.0, (compiled[probes[1]] - full_peak) / n)
    t_whole = recompute_seconds(analysis, full, seconds, gpus) / n
    t_light = recompute_seconds(analysis, mixed(full, 0, n, LIGHTER), seconds, gpus) / n
    saved = lambda c, b: c * t_whole + b * (t_whole - t_light)  # noqa: E731
    line = lambda c, b: full_peak + c * per_none + b * per_light  # noqa: E731
    room, off = budget * COMPILED_FIT_SHARE, 0.0
    for _ in range(RECOMPUTE_ROUNDS):
        ranked = sorted(((saved(c, b), c, b) for c in range(n) for b in range(n - c + 1)
                         if line(c, b) + off <= room and (c, b) not in compiled), reverse=True)
        fits = [cb for cb, p in compiled.items() if compiled_fits(p, budget, "gpu")]
        best = max(fits, key=lambda cb: saved(*cb))
        todo = [(c, b) for s, c, b in ranked[:2] if s > saved(*best)]
        if not todo:
            break
        compile_(todo)
        off = max([off] + [compiled[cb] - line(*cb) for cb in todo])
    fits = [cb for cb, p in compiled.items() if compiled_fits(p, budget, "gpu")]
    c, b = max(fits, key=lambda cb: saved(*cb))
    log.info("recomputing in three runs, compiled (layers not recomputed, under %s: GiB): %s",
             LIGHTER, {cb: round(p / 2**30, 3) for cb, p in compiled.items()})
    return mixed(full, n - c - b, b, LIGHTER), compiled[(c, b)]


def plan_peaks(analysis, problem: Problem, profile, sols: list, gpus: str, storages=()
               ) -> list[int]:
    """The peak per device of each of ``sols``' whole steps compiled for ``gpus``, side by
    side; the first ``storages`` keep the state so (the hand plans), the others as each
    plan's windows say."""
    storages = list(storages) + [plan_storage(analysis, problem, profile.windows, s.choices)
                                 for s in sols[len(storages):]]
    return compiled_peaks_for(analysis, [(s.strategies, storage)
                                         for s, storage in zip(sols, storages)], gpus)


def gpu_mesh_of(analysis, gpu: str):
    """The analysis's mesh of ``gpu`` described, not present (``cfp.gpu_compile``)."""
    from cfp.gpu_compile import gpu_mesh
    return gpu_mesh(gpu, analysis.mesh_shape, AXIS_NAMES[:len(analysis.mesh_shape)])


def compiled_peak_for(analysis, strategies, storage, gpu: str | None) -> int | None:
    """The peak per device of the plan's whole step compiled, compile only, for ``gpu``
    (``cfp.gpu_compile``); None without GPUs to compile for."""
    if gpu is None:
        return None
    return compiled_peaks_for(analysis, [(strategies, storage)], gpu)[0]


def compiled_peaks_for(analysis, plans, gpu: str) -> list[int]:
    """``compiled_peak_for`` of each of ``plans`` ((strategies, storage) each, or with a
    ``cfp.recompute.Recompute`` third), compiled on every core at once (a compile for
    described GPUs times no kernel), each plan once."""
    import os
    from concurrent.futures import ThreadPoolExecutor
    from cfp.execute import PlannedStep
    from cfp.jax_compat import no_compilation_cache
    from cfp.measure import memory_of
    from cfp.recompute import traced_step
    mesh = gpu_mesh_of(analysis, gpu)
    plans = [(tuple(p[0]), p[1], p[2] if len(p) > 2 else None) for p in plans]
    distinct = list(dict.fromkeys(plans))

    def peak(plan):
        step = traced_step(analysis, plan[2])
        return memory_of(PlannedStep(step, analysis, plan[0], mesh, plan[1]).compile()
                         )["peak_bytes"]
    with no_compilation_cache(), ThreadPoolExecutor(
            max_workers=max(1, min(os.cpu_count() or 1, len(distinct)))) as pool:
        peaks = dict(zip(distinct, pool.map(peak, distinct)))
    return [peaks[plan] for plan in plans]


@dataclasses.dataclass(frozen=True)
class MeshCandidate:
    mesh_shape: tuple[int, ...]
    prediction: Prediction | None  # None: no plan (see note)
    note: str = ""


def rank_meshes(spec, cluster, graph, grouping, *, max_combinations: int,
                memory_budget_bytes: int | None, time_limit_s: float) -> list[MeshCandidate]:
    """Every logical mesh of the cluster's devices (up to 3 axes, laid row-major over its
    network levels) planned analytically from the step's ``graph`` and its blocks'
    ``grouping`` (``cfp.grouping.group_blocks``), on every core (``cfp.pool``), best
    predicted step time first. Shapes are ranked by their best plan whose repeated layers
    are alike; the chosen one is then planned whole, from that plan (``predict_plan``)."""
    from cfp.cluster import logical_meshes
    from cfp.pool import map_meshes
    out = map_meshes(_mesh_candidate, (spec, cluster, graph, grouping, max_combinations,
                                       memory_budget_bytes, time_limit_s),
                     logical_meshes(cluster.num_devices))
    return sorted(out, key=lambda c: (c.prediction is None,
                                      c.prediction.predicted_s if c.prediction else 0.0))


def _mesh_candidate(spec, cluster, graph, grouping, max_combinations, memory_budget_bytes,
                    time_limit_s, shape) -> MeshCandidate:
    from cfp.passes.analysis import run_analysis
    from cfp.passes.profile import ProfileOptions, run_profile
    try:
        analysis = run_analysis(spec, shape, graph, grouping)
        profile = run_profile(analysis, ProfileOptions(
            cost="analytic", max_combinations=max_combinations,
            cost_model=cluster.cost_model(shape)))
        return MeshCandidate(shape, predict_plan(  # a mesh is ranked by cfp's plan alone
            analysis, profile, memory_budget_bytes, time_limit_s, alike_only=True,
            hand_plans=False))
    except CfpError as e:
        return MeshCandidate(shape, None, str(e))
