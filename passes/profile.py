"""The profile pass: measure the unique windows' strategy combinations a plan can need.

``run_profile(analysis, options)`` splits each unique segment into windows that fit
``max_combinations`` (``cfp.windows``), and for each window type compiles combinations of its
blocks' strategies (each under a state layout where the window holds state), checks each
against the compiled HLO, and times it on the mesh in a worker process (``cfp.worker``). Which
combinations, search decides (``_search_driven``): every one under ``plan`` and the hand
plans', then the split state layouts the top plans use while an unmeasured one, at the least
it may take, could make a better plan; ``exhaustive`` measures them all. With
``whole_segments`` each segment is one window, and where its space exceeds
``max_combinations`` only the combinations ``cfp.ranking`` chooses are candidates. It times
every resharding a boundary between windows can need, and returns a ``ProfileRecord`` holding
every window type's results (what was not measured ``estimated``), each batch's times put on
one scale through the speed anchor timed in every round (``on_one_scale``), so that a window
type timed while the machine ran slower does not read slower. Each result is handed to
``checkpoint`` as it comes (the CLI saves it to the work dir, so an interrupted run resumes
where it stopped). Across processes (``ProfileOptions.runtime``) every process's worker
measures the same combinations in lockstep, and what is known, what search asks for and when
the budget is spent are process 0's to say. With ``cost="model"`` nothing runs: compiled
programs are priced by the analytic model; with ``cost="analytic"`` nothing compiles either:
each combination and resharding is priced from the analysis alone (``cfp.analytic``), for
meshes too large to compile for here.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import statistics
import time
from typing import Callable, Literal

from cfp.cost_model import CostModel
from cfp.measure import Measurement
from cfp.mesh import AXIS_NAMES
from cfp.phases import Phases
from cfp.sharding import STATE_LAYOUTS
from cfp.windows import (Boundary, Window, boundaries, layouts, priced_alike, split_windows,
                         window_space)
from cfp.worker import Worker, WorkerOptions

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ProfileOptions:
    # mock: compiled for the cluster's GPUs on the one GPU here (``cfp.jax_compat.mock_gpus``),
    # partition 0 timed on it, the collectives it skips priced by ``cost_model``
    cost: Literal["measure", "model", "analytic", "mock"] = "measure"
    max_combinations: int = 32  # per window; larger segments are split into windows
    whole_segments: bool = False  # one window per segment, measured in part (cfp.ranking)
    budget_s: float | None = None  # wall-clock budget of the whole pass; the rest not_measured
    memory_budget_bytes: int = 2**62  # per device; over it a combination is recorded oom
    batch: int = 16  # at most this many combinations compiled, then timed together
    cost_model: CostModel | None = None  # for cost == "model", "analytic" or "mock"
    compilation_cache: str | None = None  # JAX's persistent compilation cache directory
    runtime: object = None  # cfp.multihost.Runtime: measure across these processes' devices
    # cost == "model": the GPUs the programs are compiled for (``cfp.gpu_compile``), described,
    # not present; None compiles for the devices here
    compile_for: str | None = None
    # every combination measured under every state layout, not those search asks for
    # (``_search_driven``): for benchmarks and research
    exhaustive: bool = False
    plans: int = 3  # the top plans whose combinations the profile search drives measures
    solve_s: float = 10.0  # CP-SAT seconds per solve of that profile


@dataclasses.dataclass(frozen=True)
class WindowProfile:
    """Every measured combination of one window type."""

    window_type: int
    blocks: tuple[int, ...]  # the representative instance's block indices
    space: tuple[int, ...]
    results: dict  # combination tuple -> Measurement


@dataclasses.dataclass(frozen=True)
class ProfileRecord:
    """What the profile pass hands to search."""

    windows: tuple[Window, ...]
    representatives: tuple[int, ...]
    window_profiles: dict  # window type -> WindowProfile
    boundaries: tuple[Boundary, ...]
    reshard_s: dict  # (shape, dtype, src spec, dst spec) -> seconds (None: cannot)
    launch_overhead_s: float
    cost: str
    max_combinations: int
    time_s: float
    compiled: int  # combinations compiled in this run
    phase_s: dict  # wall seconds per phase of this run (cfp.phases)
    whole_segments: bool = False
    # resharding -> 95% interval (s) of what it adds after its producer; where the interval
    # does not lie above 0 the resharding counts as 0 (timing.time_in_context)
    reshard_interval_s: dict = dataclasses.field(default_factory=dict)
    # the speed anchor's median seconds over the profile: the scale of every window time
    # (``on_one_scale``; NaN where nothing was timed against it)
    anchor_s: float = float("nan")
    # the ids of the devices measured on, in the mesh's order (empty: priced, nothing ran)
    device_ids: tuple[int, ...] = ()
    # the XLA platform the memory follows: the devices compiled on, or those priced
    # (``CostModel.platform``); it decides which activations the forward pass holds
    platform: str = "cpu"
    # the GPUs the programs were compiled for (``cfp.gpu_compile.GPUS``), None: the devices here
    compiled_for: str | None = None
    # the memory budget per device the top plans that chose what to measure were solved
    # under (``_search_driven``); None: every combination measured, or priced
    driven_budget_bytes: int | None = None

    def asks_under(self, memory_budget_bytes: int | None) -> bool:
        """Whether a search under ``memory_budget_bytes`` may use combinations this profile
        left unmeasured: it chose what to measure under another budget."""
        return (self.driven_budget_bytes is not None
                and self.driven_budget_bytes != memory_budget_bytes)

    def memory_source(self) -> str:
        """Where the windows' memory comes from, in words."""
        from cfp.gpu_compile import label
        if self.cost == "analytic":
            return "the analysis (no window compiled)"
        if self.cost == "mock":
            return "windows compiled on the GPU here for the mocked GPUs"
        if self.compiled_for is not None:
            return f"windows compiled for {label(self.compiled_for)}"
        return f"windows compiled on {self.platform.upper()}"

    def reshards_counted_zero(self) -> int:
        """Timed reshardings whose interval does not lie above 0, so counted as 0."""
        return sum(1 for low, _ in self.reshard_interval_s.values() if low <= 0)

    def busy_window_types(self) -> dict[int, int]:
        """Window type -> how many of its combinations were timed while the machine was busy
        (``Measurement.busy``): those times read high."""
        counts = {k: sum(m.busy() for m in seg.results.values())
                  for k, seg in self.window_profiles.items()}
        return {k: n for k, n in counts.items() if n}

    def plan_space_log10(self) -> float:
        """log10 of the number of whole-model combinations the windows span."""
        return sum(math.log10(max(1, math.prod(self.window_profiles[w.type].space)))
                   for w in self.windows)


class MemoryCheckpoint:
    """Keeps nothing between runs: the checkpoint of a profile that is not resumed."""

    def load_window(self, k):
        return {}

    def save_window(self, k, window_profile):
        pass

    def load_reshards(self):
        return {}

    def save_reshards(self, known):
        pass

    def load_chosen(self):
        return None

    def save_chosen(self, chosen):
        pass

    def load_prices(self):
        return None

    def save_prices(self, cost_model):
        pass


def run_profile(analysis, options: ProfileOptions, checkpoint=None,
                on_result: Callable | None = None) -> ProfileRecord:
    """Profile every unique window of ``analysis``; see the module docstring.

    ``checkpoint`` (``cfp.workdir.ProfileCheckpoint`` or ``MemoryCheckpoint``) gives what an
    earlier run measured and takes every new result; ``on_result(event, **fields)`` is told of
    progress (the CLI prints it)."""
    start = time.perf_counter()
    checkpoint = checkpoint or MemoryCheckpoint()
    notify = on_result or (lambda event, **fields: None)
    phases = Phases()
    windows, reps = split_windows(analysis, options.max_combinations, options.whole_segments)
    if options.cost == "analytic":
        return _priced(analysis, options, windows, reps, start, checkpoint)
    worker = Worker(analysis, WorkerOptions(
        options.cost, options.memory_budget_bytes, options.batch, options.cost_model,
        options.compilation_cache, options.runtime, options.compile_for), phases)
    compiled, window_profiles = 0, {}
    try:
        chosen = _chosen(analysis, windows, reps, options, worker, notify, checkpoint)
        # Across processes what is known is process 0's checkpoint's.
        known = worker.share([_known(k, windows[rep], analysis, checkpoint, chosen.get(k),
                                     options.memory_budget_bytes)
                              for k, rep in enumerate(reps)])
        bounds = boundaries(analysis, windows)
        if options.exhaustive:
            notify("start", num_types=len(reps), total=sum(len(todo) for _, _, todo in known),
                   known=sum(len(results) for _, results, _ in known))
            for k, rep in enumerate(reps):
                window_profiles[k], n = _profile_window(k, windows[rep], *known[k], worker,
                                                        options, checkpoint, start, notify,
                                                        compiled)
                compiled += n
            timed = _profile_reshards(analysis, bounds, worker, checkpoint, options, start,
                                      notify)
        else:
            window_profiles, compiled, timed = _search_driven(
                analysis, windows, reps, known, bounds, options, worker, checkpoint, start,
                notify)
        worker.ensure()
        overhead, device_ids, platform = worker.overhead_s, worker.device_ids, worker.platform
    except BaseException:  # Ctrl-C included: what was measured is in the checkpoint
        worker.kill()
        raise
    finally:
        worker.close()
    window_profiles, anchor_s = on_one_scale(window_profiles)
    rec = ProfileRecord(tuple(windows), tuple(reps), window_profiles, tuple(bounds),
                        {k: t and t[0] for k, t in timed.items()}, overhead, options.cost,
                        options.max_combinations, time.perf_counter() - start, compiled,
                        dict(phases.seconds),
                        options.whole_segments,
                        {k: t[1:] for k, t in timed.items() if t and options.cost == "measure"},
                        anchor_s, device_ids, platform, options.compile_for,
                        None if options.exhaustive else options.memory_budget_bytes)
    log.info("profile pass: %.1f s, phases %s", rec.time_s, rec.phase_s)
    return rec


def on_one_scale(window_profiles: dict) -> tuple[dict, float]:
    """``window_profiles`` with every timed measurement rescaled from its batch's speed anchor
    time (``Measurement.anchor_s``) to the anchor's median over the whole profile, and that
    median. Each batch is timed in its own stretch of time; the anchor, the same program in
    every round of every batch (of a resumed run too), tells how fast the machine ran then.
    Measurements with no anchor time (priced, or from a profile before the anchor) stay."""
    anchors = [m.anchor_s for p in window_profiles.values() for m in p.results.values()
               if m.anchor_s > 0]  # NaN compares False
    if not anchors:
        return window_profiles, float("nan")
    scale_s = statistics.median(anchors)

    def rescaled(m: Measurement) -> Measurement:
        if not m.anchor_s > 0:
            return m
        f, p = scale_s / m.anchor_s, m.priced_s  # what was priced ran on no machine
        return dataclasses.replace(m, time_s=(m.time_s - p) * f + p,
                                   time_min_s=(m.time_min_s - p) * f + p,
                                   time_max_s=(m.time_max_s - p) * f + p)
    return {k: dataclasses.replace(p, results={c: rescaled(m) for c, m in p.results.items()})
            for k, p in window_profiles.items()}, scale_s


def _known(k, window: Window, analysis, checkpoint, chosen,
           memory_budget_bytes: int) -> tuple[tuple, dict, list]:
    """(strategies per block, results an earlier run measured, combinations not measured:
    ``chosen`` or every one, each under every state layout) of window type k; what a profile
    budget cut off, and what a smaller memory budget refused and ``memory_budget_bytes``
    fits, are measured now."""
    n = window.end - window.start
    space = tuple(window_space(analysis, window))
    results = {c: m for c, m in checkpoint.load_window(k).items()
               if m.status != "not_measured"
               and not (m.over_budget() and m.peak_bytes <= memory_budget_bytes)}
    combos = (dict.fromkeys(c[:n] for c in chosen) if chosen is not None
              else itertools.product(*map(range, space[:n])))
    every = with_state_layouts(analysis, window, combos, range(len(STATE_LAYOUTS)))
    return space, results, [c for c in every if c not in results]


def _chosen(analysis, windows, reps, options: ProfileOptions, worker, notify,
            checkpoint) -> dict:
    """Per window type whose space is over ``max_combinations`` (with whole segments), the
    combinations measured (``cfp.ranking``): the cheapest by the additive analytic price,
    with the options' cost model or, where none is given, one fitted on the mesh, and those
    the baselines use. The choice is kept in ``checkpoint``, and a later profile of the work
    dir takes it whatever its cost: a fitted model differs from run to run, so a resumed
    profile measures what the first run chose, and ``--cost model`` prices the combinations
    the measured profile holds (its top plan is then one search could compose)."""
    from cfp import ranking
    from cfp.mesh import AXIS_NAMES
    large = [k for k, rep in enumerate(reps)
             if ranking.space_size(analysis, windows[rep]) > options.max_combinations]
    if not large:
        return {}
    share = worker.share if worker is not None else (lambda value: value)
    chosen = share(checkpoint.load_chosen())  # process 0's decides for all
    if chosen is not None:
        return chosen
    cost = options.cost_model
    if cost is None:
        from cfp.cost_model import fit_cost_model_for
        cost = worker.call(fit_cost_model_for, tuple(analysis.mesh_shape), analysis.device_ids)
    names = AXIS_NAMES[:len(analysis.mesh_shape)]
    out = {}
    for k in large:
        w = windows[reps[k]]
        also = ranking.baseline_combinations(analysis, w, windows)
        ranked = ranking.ranked_combinations(analysis, w, options.max_combinations, cost,
                                             names, also)
        out[k] = with_state_layouts(analysis, w, ranked)
        notify("ranked", k=k, space=ranking.space_size(analysis, w),
               cheapest=options.max_combinations, baselines=len(ranked) - options.max_combinations)
    checkpoint.save_chosen(out)
    return out


def with_state_layouts(analysis, window: Window, combos, layouts=(0,)) -> list[tuple[int, ...]]:
    """``combos`` (a strategy per block) under each of the state layouts ``layouts`` (indices
    into ``STATE_LAYOUTS``) when the window holds state (``cfp.windows.held_state``), else as
    they are."""
    if len(window_space(analysis, window)) == window.end - window.start:
        return list(combos)
    return [tuple(c) + (z,) for c in combos for z in layouts]


def _profile_window(k, window: Window, space, results, todo, worker: Worker, options,
                    checkpoint, start, notify, measured_in_run: int = 0
                    ) -> tuple[WindowProfile, int]:
    """Measure ``todo`` of window type ``k``: its whole space, less what was measured before
    (the exhaustive profile)."""
    blocks = tuple(range(window.start, window.end))
    notify("window", k=k, window=window, space=space, todo=len(todo), known=len(results))
    log.info("window type %d (blocks %d..%d): %d combinations to measure, %d known", k,
             window.start, window.end - 1, len(todo), len(results))
    best = min((m.time_s for m in results.values() if m.status == "ok"), default=None)
    done, best = _measure(k, window, space, todo, results, best, worker, options, checkpoint,
                          start, notify, measured_in_run)
    profile = WindowProfile(k, blocks, space, dict(results))
    checkpoint.save_window(k, profile)
    return profile, done


def _measure(k, window: Window, space, todo, results: dict, best, worker: Worker, options,
             checkpoint, start, notify, measured_in_run: int) -> tuple[int, float | None]:
    """Measure ``todo`` of window type ``k`` into ``results``, each handed to ``checkpoint``
    as it comes, until ``--profile-budget`` is spent (a run measures one batch at least,
    however small the budget: the next run goes on from there; ``measured_in_run``: what
    this run measured before). How many were measured, and the best time."""
    blocks, done = tuple(range(window.start, window.end)), 0
    for i, batch in even_batches(todo, options.batch):
        if measured_in_run + done and worker.share(_spent(options, start)):
            for c in todo[i:]:
                results[c] = Measurement("not_measured", note="--profile-budget spent")
            notify("not_measured", k=k, count=len(todo) - i)
            break
        for combo, m in worker.measure_window(window, batch, best):
            results[combo] = m
            done += 1
            if m.status == "ok":
                best = m.time_s if best is None else min(best, m.time_s)
            # Saved after every result: an interruption loses nothing already measured.
            checkpoint.save_window(k, WindowProfile(k, blocks, space, dict(results)))
            notify("result", k=k, combo=combo, measurement=m)
    return done, best


PLAN_ROUNDS = 40  # most solves of the profile search drives


def _search_driven(analysis, windows, reps, known, bounds, options: ProfileOptions,
                   worker: Worker, checkpoint, start, notify) -> tuple[dict, int, dict]:
    """The profile search drives. Every combination of every window type, each state layout
    included, has a price (``_low_ends``): a split state layout, its combination's time under
    ``plan`` times the least ratio measured between the layout and ``plan``; else its analytic
    price's parts (``cfp.pricing``) weighted by a fit to what this run measured, at the low
    end of the band the measured times fall in around the fit. Every combination under
    ``plan`` and the hand plans' are measured first, and every resharding timed. Then, round
    by round, the top ``options.plans`` plans are solved with each unmeasured combination at
    that low end, and the unmeasured combinations they use are measured, until they use
    measured ones only: no unmeasured combination, at the least it may take, gives a better
    plan (or until ``PLAN_ROUNDS`` solves, or the profile budget). Returns the window
    profiles (what was measured, and the rest ``estimated``, at the low end), how many were
    measured in this run, and the reshardings timed."""
    from cfp import analytic, pricing
    from cfp.cost_model import fit_cost_model_for
    from cfp.errors import CfpError
    from cfp.problem import build_problem, predicted_plans
    names = AXIS_NAMES[:len(analysis.mesh_shape)]
    cost = options.cost_model or worker.share(checkpoint.load_prices())
    if cost is None:  # fitted on the mesh once, kept: a resumed run prices as this one
        cost = worker.share(worker.call(fit_cost_model_for, tuple(analysis.mesh_shape),
                                        analysis.device_ids))
        checkpoint.save_prices(cost)
    space = {k: known[k][0] for k in range(len(reps))}
    results = {k: dict(known[k][1]) for k in range(len(reps))}
    priced, parts = {}, {}
    for k, rep in enumerate(reps):
        w, memo = windows[rep], {}
        operators = sum(len(analysis.blocks.blocks[b].members) for b in range(w.start, w.end))
        priced[k] = {c: analytic.window_measurement(analysis, w, c, cost, names, memo)
                     for c in sorted(known[k][2] + list(known[k][1]))}  # ties: one order
        parts[k] = {c: pricing.parts(m, operators, cost, analysis.mesh_shape)
                    for c, m in priced[k].items()}
    held = {k for k, rep in enumerate(reps)
            if len(space[k]) > windows[rep].end - windows[rep].start}  # state layout last
    seeds = {}
    for k, rep in enumerate(reps):
        plain = [c for c in priced[k] if k not in held or c[-1] == 0]
        seeds[k] = [c for c in dict.fromkeys(
                        plain + hand_combinations(analysis, windows[rep], windows))
                    if c in priced[k] and c not in results[k]]
    notify("start", num_types=len(reps), at_most=True,
           total=sum(len(p) for p in priced.values()) - sum(map(len, results.values())),
           known=sum(map(len, results.values())))
    best = {k: min((m.time_s for m in results[k].values() if m.status == "ok"), default=None)
            for k in results}
    compiled = 0
    for k, rep in enumerate(reps):
        n, best[k] = _measure(k, windows[rep], space[k], seeds[k], results[k], best[k], worker,
                              options, checkpoint, start, notify, compiled)
        compiled += n
    timed = _profile_reshards(analysis, bounds, worker, checkpoint, options, start, notify)
    worker.ensure()  # its platform decides what the forward pass holds
    rounds, stop = 0, "the profile budget is spent"
    while rounds < PLAN_ROUNDS and not (compiled and worker.share(_spent(options, start))):
        rounds += 1
        estimated = _low_ends(results, priced, parts, held)
        rec = _record_of(analysis, windows, reps, space,
                         {k: {**estimated[k], **results[k]} for k in results}, bounds, timed,
                         options, worker.platform)
        try:
            problem, combos = build_problem(analysis, rec, options.memory_budget_bytes)
            sols = predicted_plans(problem, options.plans, options.solve_s)
        except CfpError as e:  # no plan fits, even at the low end: search says so
            log.info("the profile search drives: no plan to ask for (%s)", e)
            stop = "no plan fits the budget"
            break
        wanted: dict = {}
        for sol in sols:
            for gi, choice in enumerate(sol.choices):
                k, combo = windows[gi].type, combos[gi][choice]
                if combo not in results[k]:
                    wanted.setdefault(k, []).append(combo)
        wanted = worker.share({k: list(dict.fromkeys(v)) for k, v in sorted(wanted.items())})
        log.info("profile round %d: the top %d plans use %d combinations not measured", rounds,
                 len(sols), sum(map(len, wanted.values())))
        if not wanted:
            stop = "the top plans use measured combinations only"
            break
        notify("round", round=rounds, count=sum(map(len, wanted.values())))
        for k, todo in wanted.items():
            n, best[k] = _measure(k, windows[reps[k]], space[k], todo, results[k], best[k],
                                  worker, options, checkpoint, start, notify, compiled)
            compiled += n
    else:
        stop = f"{PLAN_ROUNDS} rounds" if rounds >= PLAN_ROUNDS else stop
    estimated = _low_ends(results, priced, parts, held)
    log.info("the profile search drives: %d rounds, stopped as %s", rounds, stop)
    window_profiles = {}
    for k, rep in enumerate(reps):
        blocks = tuple(range(windows[rep].start, windows[rep].end))
        checkpoint.save_window(k, WindowProfile(k, blocks, space[k], dict(results[k])))
        rest = {c: dataclasses.replace(m, status="estimated") for c, m in estimated[k].items()}
        window_profiles[k] = WindowProfile(k, blocks, space[k], {**rest, **results[k]})
    return window_profiles, compiled, timed


def _low_ends(results: dict, priced: dict, parts: dict, held: set) -> dict:
    """Per window type, each combination not measured as its analytic ``Measurement`` (status
    ``ok``), its temporaries scaled by the least ratio of measured to analytic temporaries,
    at the least it may take given what was measured (on one scale: ``on_one_scale``): a
    split state layout whose combination was measured under ``plan``, that time times the
    least ratio measured between the layout and ``plan`` of one combination of the window
    type (of any, where none of the type was measured under both); any other, the
    low end of its fitted price (``cfp.pricing``). ``held``: the window types whose
    combinations end in a state layout."""
    import numpy as np
    from cfp import pricing
    scaled, _ = on_one_scale({k: WindowProfile(k, (), (), r) for k, r in results.items()})
    times = {(k, c): m.time_s for k, p in scaled.items() for c, m in p.results.items()
             if m.status == "ok" and c in parts[k]}
    ok = [(k, c, results[k][c]) for k, c in times]
    fit = (pricing.fit_prices(np.array([parts[k][c] for k, c in times]),
                              np.array(list(times.values()))) if times else None)
    # state layout, and (window type, state layout) -> least time under it over the time
    # under plan of one combination
    split_ratio: dict = {}
    for (k, c), t in times.items():
        twin = times.get((k, c[:-1] + (0,))) if k in held else None
        if c[-1] and twin:
            split_ratio[c[-1]] = min(split_ratio.get(c[-1], np.inf), t / twin)
            split_ratio[k, c[-1]] = min(split_ratio.get((k, c[-1]), np.inf), t / twin)
    temp_ratio = min([m.temp_bytes / priced[k][c].temp_bytes for k, c, m in ok
                      if priced[k][c].temp_bytes > 0] + [1.0])

    def low_end(k, c) -> float:
        twin = times.get((k, c[:-1] + (0,))) if k in held and c[-1] else None
        if twin and c[-1] in split_ratio:
            return twin * split_ratio.get((k, c[-1]), split_ratio[c[-1]])
        return fit.low_end(parts[k][c]) if fit is not None else 0.0
    return {k: {c: dataclasses.replace(m, time_s=low_end(k, c),
                                       temp_bytes=int(m.temp_bytes * temp_ratio))
                for c, m in priced[k].items() if c not in results[k]} for k in priced}


def _record_of(analysis, windows, reps, space, results, bounds, timed, options,
               platform: str) -> "ProfileRecord":
    """A ``ProfileRecord`` of ``results`` (window type -> combination -> ``Measurement``), for
    a solve inside the pass."""
    profiles = {k: WindowProfile(k, tuple(range(windows[rep].start, windows[rep].end)),
                                 space[k], results[k]) for k, rep in enumerate(reps)}
    return ProfileRecord(tuple(windows), tuple(reps), profiles, tuple(bounds),
                         {key: t and t[0] for key, t in timed.items()}, 0.0, options.cost,
                         options.max_combinations, 0.0, 0, {}, options.whole_segments,
                         platform=platform, compiled_for=options.compile_for)


def hand_combinations(analysis, window: Window, windows) -> list[tuple[int, ...]]:
    """The combinations, with their state layouts, that the rule-file hand plans
    (``cfp.ranking.baseline_combinations``) put the instances of ``window``'s type on."""
    from cfp.ranking import baseline_combinations
    return list(dict.fromkeys(
        c for combo, layout in baseline_combinations(analysis, window, windows, storage=True)
        for c in with_state_layouts(analysis, window, [combo], (STATE_LAYOUTS.index(layout),))))


def even_batches(items: list, most: int) -> list[tuple[int, list]]:
    """``items`` in consecutive batches of even size, at most ``most`` each, with the index of
    each batch's first item: 34 at most 16 go as 12, 12, 10, since a last batch of two would
    be timed nearly alone, unlike the rest."""
    size = max(1, math.ceil(len(items) / max(1, math.ceil(len(items) / most))))
    return [(i, items[i:i + size]) for i in range(0, len(items), size)]


def _spent(options: ProfileOptions, start: float) -> bool:
    """Whether ``--profile-budget`` is spent (it covers the whole pass: worker start,
    compiling, running and resharding timing)."""
    return options.budget_s is not None and time.perf_counter() - start > options.budget_s


def _priced(analysis, options: ProfileOptions, windows, reps, start,
            checkpoint) -> ProfileRecord:
    """The profile of ``cost="analytic"``: every combination (of a window too large to
    measure whole, those ``_chosen`` gives) and resharding priced."""
    from cfp import analytic
    from cfp.mesh import AXIS_NAMES
    names = AXIS_NAMES[:len(analysis.mesh_shape)]
    cost = options.cost_model
    window_profiles = {}
    chosen = _chosen(analysis, windows, reps, options, None, lambda event, **f: None,
                     checkpoint)
    for k, rep in enumerate(reps):
        w = windows[rep]
        space = tuple(window_space(analysis, w))
        every = chosen.get(k)
        every = (itertools.product(*map(range, space)) if every is None else with_state_layouts(
            analysis, w, dict.fromkeys(c[:w.end - w.start] for c in every),
            range(len(STATE_LAYOUTS))))
        known: dict = {}  # what a combination's strategies give, shared by its state layouts
        results = {c: analytic.window_measurement(analysis, w, c, cost, names, known)
                   for c in every}
        window_profiles[k] = WindowProfile(k, tuple(range(w.start, w.end)), space, results)
    bounds = boundaries(analysis, windows)
    reshard = _priced_reshards(analysis, bounds, cost)
    return ProfileRecord(tuple(windows), tuple(reps), window_profiles, tuple(bounds), reshard,
                         0.0, "analytic", options.max_combinations,
                         time.perf_counter() - start, 0, {}, options.whole_segments,
                         platform=cost.platform)


def _priced_reshards(analysis, bounds, cost: CostModel) -> dict:
    """Every resharding the boundaries can need, priced without compiling."""
    from cfp import analytic
    from cfp.mesh import AXIS_NAMES
    names = AXIS_NAMES[:len(analysis.mesh_shape)]
    return {key: analytic.reshard_s(*key, analysis.mesh_shape, names, cost)
            for key in needed_reshards(bounds, analysis.blocks.blocks, names)}


def needed_reshards(bounds, blocks, names) -> set[tuple]:
    """Every (shape, dtype, source layout, destination layout) a boundary can need; a tensor
    between the alike blocks of repeated layers is looked at once."""
    needed = set()
    for b in dict(zip(priced_alike(bounds, blocks), bounds)).values():
        for src in layouts(b.src_labels, blocks[b.src].strategies, names)[0]:
            for dst in layouts(b.dst_labels, blocks[b.dst].strategies, names)[0]:
                if src != dst:
                    needed.add((b.shape, b.dtype, src, dst))
    return needed


def _profile_reshards(analysis, bounds, worker, checkpoint, options, start, notify) -> dict:
    """Resharding -> (seconds, interval low, interval high), or None where it cannot run."""
    names = AXIS_NAMES[:len(analysis.mesh_shape)]
    blocks = analysis.blocks.blocks
    needed = needed_reshards(bounds, blocks, names)
    known = worker.share(dict(checkpoint.load_reshards()))  # process 0's
    todo = sorted(needed - set(known), key=repr)
    notify("reshards", boundaries=len(bounds), needed=len(needed),
           known=len(needed) - len(todo))
    for i in range(0, len(todo), 16):
        if worker.share(_spent(options, start)):
            notify("not_measured", k=None, count=len(todo) - i)
            break
        known.update(worker.measure_reshards(todo[i:i + 16]))
        checkpoint.save_reshards(known)
        notify("reshards_timed", done=min(i + 16, len(todo)))
    checkpoint.save_reshards(known)
    return known


def cluster_pricing(analysis, max_combinations: int, *, max_devices: int = 64,
                    limit_s: float = 60.0, compile_for: str | None = None,
                    program=None) -> tuple[str, str, str | None]:
    """How to price a profile for a described cluster, and why: compile-only (``"model"``)
    where the mesh has at most ``max_devices`` devices, and compiling every combination and
    resharding would take at most ``limit_s`` (one combination is compiled to find out; the
    command line's ``--profile-budget``, 60 s when left out);
    analytically (``"analytic"``) otherwise. The programs are compiled for the GPUs
    ``compile_for`` names (``cfp.gpu_compile``), or else for JAX's devices here, which must be
    as many. The third value is the GPUs compiled for: ``compile_for``, or None where a
    program needs what a compile without a GPU does not have (cuDNN), and the devices here
    are used instead. ``program``: the step traced already (``trace_step``'s), if it was."""
    import jax
    from cfp.gpu_compile import gpu_mesh, label, needs_nvidia_libraries
    from cfp.jax_compat import no_compilation_cache
    from cfp.measure import WindowProgram
    from cfp.mesh import AXIS_NAMES
    from cfp.tracing import trace_step
    n = math.prod(analysis.mesh_shape)
    names = AXIS_NAMES[:len(analysis.mesh_shape)]
    if n > max_devices:
        return "analytic", f"{n} devices, more than the {max_devices} compiled for here", None
    windows, reps = split_windows(analysis, max_combinations)
    programs = sum(math.prod(window_space(analysis, windows[r])) for r in reps)
    programs += len(needed_reshards(boundaries(analysis, windows), analysis.blocks.blocks,
                                    names))
    program = program or trace_step(analysis.spec.build())
    first = (0,) * (windows[reps[0]].end - windows[reps[0]].start)
    fallback = ""
    if compile_for is not None:
        mesh = gpu_mesh(compile_for, analysis.mesh_shape, names)
        t0 = time.perf_counter()
        try:
            with no_compilation_cache():
                WindowProgram(program, analysis, windows[reps[0]], mesh).compile(first)
        except RuntimeError as e:  # XLA's errors among them
            if not needs_nvidia_libraries(e):
                raise
            fallback = (f"not compiled for {label(compile_for)}s, which needs the NVIDIA "
                        f"libraries ({str(e).splitlines()[0][:80]}); ")
            compile_for = None
    if compile_for is None:
        if len(jax.devices()) < n:
            return "analytic", f"{fallback}{n} devices, JAX here has {len(jax.devices())}", None
        t0 = time.perf_counter()
        WindowProgram(program, analysis, windows[reps[0]], analysis.mesh()).compile(first)
    seconds = time.perf_counter() - t0
    estimate = programs * seconds
    why = f"{programs} programs x {seconds:.2f} s, about {estimate:.0f} s"
    if estimate > limit_s:
        return "analytic", (f"{fallback}compiling would take {why}, over {limit_s:.0f} s "
                            f"(--profile-budget gives more)"), None
    where = (f"for {n} {label(compile_for)}s (XLA's GPU compiler, described GPUs)"
             if compile_for else f"on {n} {jax.devices()[0].platform.upper()} devices")
    return "model", f"{fallback}compile-only {where}: {why}", compile_for
