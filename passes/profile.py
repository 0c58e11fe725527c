"""The profile pass: measure every unique window's strategy combinations.

``run_profile(analysis, options)`` splits each unique segment into windows that fit
``max_combinations`` (``cfp.windows``), and for each window type compiles every combination of
its blocks' strategies, checks it against the compiled HLO, and times it on the mesh in a
worker process (``cfp.worker``). With ``whole_segments`` each segment is one window, and where
its space exceeds ``max_combinations`` only the combinations ``cfp.ranking`` chooses are
measured. It then times every resharding a boundary between windows can
need, and returns a ``ProfileRecord`` holding every window type's results, each batch's times
put on one scale through the speed anchor timed in every round (``on_one_scale``), so that a
window type timed while the machine ran slower does not read slower. Each result is
handed to ``checkpoint`` as it comes (the CLI saves it to the work dir, so an interrupted run
resumes where it stopped). Across processes (``ProfileOptions.runtime``) every process's
worker measures the same combinations in lockstep, and what is known and when the budget is
spent are process 0's to say. With ``cost="model"`` nothing runs: compiled programs are priced by
the analytic model; with ``cost="analytic"`` nothing compiles either: each combination and
resharding is priced from the analysis alone (``cfp.analytic``), for meshes too large to
compile for here.
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
        expected = [expected_state_variants(analysis, windows[rep], known[k][1], windows)
                    for k, rep in enumerate(reps)]
        notify("start", num_types=len(reps),
               total=sum(len(todo) for _, _, todo in known) + sum(expected),
               known=sum(len(results) for _, results, _ in known))
        for k, rep in enumerate(reps):
            window_profiles[k], n = _profile_window(k, windows[rep], *known[k],
                                                    worker, options, checkpoint, start, notify,
                                                    analysis, windows, compiled,
                                                    expected[k])
            compiled += n
        bounds = boundaries(analysis, windows)
        timed = _profile_reshards(analysis, bounds, worker, checkpoint, options, start,
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
                        anchor_s, device_ids, platform, options.compile_for)
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
    """(strategies per block, results an earlier run measured, combinations still to
    measure: ``chosen`` or every one) of window type k; what a profile budget cut off, and
    what a smaller memory budget refused and ``memory_budget_bytes`` fits, are measured now."""
    space = tuple(window_space(analysis, window))
    results = {c: m for c, m in checkpoint.load_window(k).items()
               if m.status != "not_measured"
               and not (m.over_budget() and m.peak_bytes <= memory_budget_bytes)}
    every = chosen if chosen is not None else with_state_layouts(
        analysis, window, itertools.product(*map(range, space[:window.end - window.start])))
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


STATE_VARIANTS = 4  # per window type, the fastest combinations also measured with split state


def state_variants(analysis, window: Window, results: dict, windows) -> list[tuple[int, ...]]:
    """The combinations to measure under the split state layouts (``zero1``, ``fsdp``): those
    of the ``STATE_VARIANTS`` fastest measured with the state as the blocks compute it, and
    those of the plans people write (``ranking.baseline_combinations``); how many, the
    timings decide (``expected_state_variants`` counts the most). Measuring every
    combination three times would triple the profile. A pruning: a split layout's gain differs
    by combination (more on tensor-parallel ones), and the order under the plain layout is
    within the timing noise, so a plan of combinations ranked lower can be missed."""
    from cfp import ranking
    n = window.end - window.start
    if len(window_space(analysis, window)) == n:
        return []
    plain = sorted((m.time_s, c[:n]) for c, m in results.items()
                   if m.status == "ok" and c[n] == 0)
    picked = [c for _, c in plain[:STATE_VARIANTS]]
    picked += ranking.baseline_combinations(analysis, window, windows)
    return [c for c in with_state_layouts(analysis, window, dict.fromkeys(picked),
                                          range(1, len(STATE_LAYOUTS)))
            if c not in results]


def expected_state_variants(analysis, window: Window, results: dict, windows) -> int:
    """The most combinations ``state_variants`` can give, known before any is measured (the
    progress total counts them from its first line, and comes down where the fastest are
    baselines' too): every baseline's and ``STATE_VARIANTS`` others' under each split
    layout, less those measured before."""
    from cfp import ranking
    n = window.end - window.start
    if len(window_space(analysis, window)) == n:
        return 0
    baselines = len(dict.fromkeys(ranking.baseline_combinations(analysis, window, windows)))
    measured = sum(1 for c in results if c[n] != 0)
    return max(0, (baselines + STATE_VARIANTS) * (len(STATE_LAYOUTS) - 1) - measured)


def _profile_window(k, window: Window, space, results, todo, worker: Worker,
                    options, checkpoint, start, notify, analysis=None, windows=(),
                    measured_in_run: int = 0, expected_variants: int = 0
                    ) -> tuple[WindowProfile, int]:
    """Measure ``todo`` of window type ``k``, then its state variants (``state_variants``).
    A run measures one batch at least, however small ``--profile-budget``: the next run
    then goes on from there (``measured_in_run``: what this run measured before).
    ``expected_variants``: the state variants the progress total counted."""
    blocks = tuple(range(window.start, window.end))
    notify("window", k=k, window=window, space=space, todo=len(todo), known=len(results))
    log.info("window type %d (blocks %d..%d): %d combinations to measure, %d known", k,
             window.start, window.end - 1, len(todo), len(results))
    best = min((m.time_s for m in results.values() if m.status == "ok"), default=None)
    done = 0
    for phase in ("blocks", "state"):
        if phase == "state":
            todo = state_variants(analysis, window, results, windows)
            if len(todo) != expected_variants:  # the progress total, corrected
                notify("state_variants", k=k, count=len(todo), expected=expected_variants)
            if not todo:
                break
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
    profile = WindowProfile(k, blocks, space, dict(results))
    checkpoint.save_window(k, profile)
    return profile, done


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
