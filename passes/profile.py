"""The profile pass: measure every unique window's strategy combinations.

``run_profile(analysis, options)`` splits each unique segment into windows that fit
``max_combinations`` (``cfp.windows``), and for each window type compiles every combination of
its blocks' strategies, checks it against the compiled HLO, and times it on the mesh in a
worker process (``cfp.worker``). It then times every resharding a boundary between windows can
need, and returns a ``ProfileRecord`` holding every window type's results. Each result is
handed to ``checkpoint`` as it comes (the CLI saves it to the work dir, so an interrupted run
resumes where it stopped). With ``cost="model"`` nothing runs: compiled programs are priced by
the analytic model.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import time
from typing import Callable, Literal

from cfp.measure import CostModel, Measurement
from cfp.phases import Phases
from cfp.windows import Boundary, Window, boundaries, boundary_specs, split_windows
from cfp.worker import Worker, WorkerOptions

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ProfileOptions:
    cost: Literal["measure", "model"] = "measure"
    max_combinations: int = 32  # per window; larger segments are split into windows
    budget_s: float | None = None  # wall-clock budget of the whole pass; the rest not_measured
    memory_budget_bytes: int = 2**62  # per device; over it a combination is recorded oom
    batch: int = 16  # combinations compiled before timing them
    cost_model: CostModel | None = None  # for cost == "model"
    compilation_cache: str | None = None  # JAX's persistent compilation cache directory


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
    reshard_s: dict  # (shape, dtype, src spec, dst spec) -> seconds
    launch_overhead_s: float
    cost: str
    max_combinations: int
    time_s: float
    compiled: int  # combinations compiled in this run
    phase_s: dict  # wall seconds per phase of this run (cfp.phases)

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
    windows, reps = split_windows(analysis, options.max_combinations)
    known = [_known(k, windows[rep], analysis, checkpoint) for k, rep in enumerate(reps)]
    notify("start", num_types=len(reps), total=sum(len(todo) for _, _, todo in known),
           known=sum(len(results) for _, results, _ in known))
    worker = Worker(analysis, WorkerOptions(
        options.cost, options.memory_budget_bytes, options.batch, options.cost_model,
        options.compilation_cache), phases)
    compiled, window_profiles = 0, {}
    try:
        for k, rep in enumerate(reps):
            window_profiles[k], n = _profile_window(k, windows[rep], *known[k],
                                                    worker, options, checkpoint, start, notify)
            compiled += n
        bounds = boundaries(analysis, windows)
        reshard = _profile_reshards(analysis, bounds, worker, checkpoint, options, start,
                                    notify)
        worker.ensure()
        overhead = worker.overhead_s
    except BaseException:  # Ctrl-C included: what was measured is in the checkpoint
        worker.kill()
        raise
    finally:
        worker.close()
    rec = ProfileRecord(tuple(windows), tuple(reps), window_profiles, tuple(bounds), reshard,
                        overhead, options.cost, options.max_combinations,
                        time.perf_counter() - start, compiled, dict(phases.seconds))
    log.info("profile pass: %.1f s, phases %s", rec.time_s, rec.phase_s)
    return rec


def _known(k, window: Window, analysis, checkpoint) -> tuple[tuple, dict, list]:
    """(strategies per block, results an earlier run measured, combinations still to
    measure) of window type k; what a budget cut off is measured now."""
    space = tuple(len(analysis.blocks.blocks[b].strategies)
                  for b in range(window.start, window.end))
    results = {c: m for c, m in checkpoint.load_window(k).items() if m.status != "not_measured"}
    return space, results, [c for c in itertools.product(*map(range, space)) if c not in results]


def _profile_window(k, window: Window, space, results, todo, worker: Worker,
                    options, checkpoint, start, notify) -> tuple[WindowProfile, int]:
    blocks = tuple(range(window.start, window.end))
    notify("window", k=k, window=window, space=space, todo=len(todo), known=len(results))
    log.info("window type %d (blocks %d..%d): %d combinations to measure, %d known", k,
             window.start, window.end - 1, len(todo), len(results))
    best = min((m.time_s for m in results.values() if m.status == "ok"), default=None)
    done = 0
    for i in range(0, len(todo), options.batch):
        if _spent(options, start):
            for c in todo[i:]:
                results[c] = Measurement("not_measured", note="--profile-budget spent")
            notify("not_measured", k=k, count=len(todo) - i)
            break
        for combo, m in worker.measure_window(window, todo[i:i + options.batch], best):
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


def _spent(options: ProfileOptions, start: float) -> bool:
    """Whether ``--profile-budget`` is spent (it covers the whole pass: worker start,
    compiling, running and resharding timing)."""
    return options.budget_s is not None and time.perf_counter() - start > options.budget_s


def _profile_reshards(analysis, bounds, worker, checkpoint, options, start, notify) -> dict:
    names = ("m0", "m1", "m2")[:len(analysis.mesh_shape)]
    blocks = analysis.blocks.blocks
    needed = set()
    for b in bounds:
        for s in blocks[b.src].strategies:
            for t in blocks[b.dst].strategies:
                src, dst = boundary_specs(b, s, t, names)
                if src != dst:
                    needed.add((b.shape, b.dtype, src, dst))
    known = dict(checkpoint.load_reshards())
    todo = sorted(needed - set(known), key=repr)
    notify("reshards", boundaries=len(bounds), needed=len(needed),
           known=len(needed) - len(todo))
    for i in range(0, len(todo), 16):
        if _spent(options, start):
            notify("not_measured", k=None, count=len(todo) - i)
            break
        known.update(worker.measure_reshards(todo[i:i + 16]))
        checkpoint.save_reshards(known)
    checkpoint.save_reshards(known)
    return known
