"""The profile pass: measure every unique window's strategy combinations.

``run_profile`` splits each unique segment into windows that fit ``max_combinations``
(``cfp.windows``), and for each window type compiles every combination of its blocks'
strategies, checks it against the compiled HLO, and times it on the mesh in a worker process
(``cfp.worker``). It then times every resharding a boundary between windows can need. Results
go to ``segment_<k>.pkl`` (one per window type, rewritten atomically after every result, so an
interrupted run resumes where it stopped), ``reshard.pkl``, ``profile.pkl`` (the index search
reads) and ``profile.csv``. With ``cost="model"`` nothing runs: compiled programs are priced by
the analytic model, and the files go to ``<workdir>/model/``.
"""
from __future__ import annotations

import csv
import dataclasses
import itertools
import math
import sys
import time
from pathlib import Path
from typing import Callable, Literal

from cfp.errors import CfpError
from cfp.measure import CostModel, Measurement
from cfp.records import read_record, write_record
from cfp.windows import Boundary, Window, boundaries, boundary_specs, split_windows
from cfp.worker import Worker, WorkerOptions

SEGMENT_FORMAT = "cfp-segment-profile"
INDEX_FORMAT = "cfp-profile"
RESHARD_FORMAT = "cfp-reshard-profile"


@dataclasses.dataclass(frozen=True)
class ProfileOptions:
    cost: Literal["measure", "model"] = "measure"
    max_combinations: int = 128  # per window; larger segments are split into windows
    budget_s: float | None = None  # wall-clock budget of the whole pass; the rest is pruned
    memory_budget_bytes: int = 2**62  # per device; over it a combination is recorded oom
    batch: int = 16  # combinations compiled before timing them
    cost_model: CostModel | None = None  # for cost == "model"


@dataclasses.dataclass(frozen=True)
class WindowProfile:
    """segment_<k>.pkl: every measured combination of window type k."""

    window_type: int
    blocks: tuple[int, ...]  # the representative instance's block indices
    space: tuple[int, ...]
    results: dict  # combination tuple -> Measurement


@dataclasses.dataclass(frozen=True)
class ProfileRecord:
    """profile.pkl: what search needs besides the per-window files."""

    windows: tuple[Window, ...]
    representatives: tuple[int, ...]
    boundaries: tuple[Boundary, ...]
    reshard_s: dict  # (shape, dtype, src spec, dst spec) -> seconds
    launch_overhead_s: float
    cost: str
    time_s: float
    compiled: int  # combinations compiled in this run


def profile_dir(workdir: Path, cost: str) -> Path:
    return Path(workdir) if cost == "measure" else Path(workdir) / "model"


def profile_fingerprint(run_fp: tuple, analysis, options: ProfileOptions) -> tuple:
    return run_fp + (("graph", analysis.graph.fingerprint()), ("cost", options.cost),
                     ("max_combinations", options.max_combinations))


def run_profile(analysis, analysis_path: Path, run_fp: tuple, options: ProfileOptions,
                workdir: Path, say: Callable[[str], None]) -> ProfileRecord:
    """Profile every unique window of ``analysis``; see the module docstring."""
    start = time.perf_counter()
    out_dir = profile_dir(workdir, options.cost)
    out_dir.mkdir(parents=True, exist_ok=True)
    fp = profile_fingerprint(run_fp, analysis, options)
    windows, reps = split_windows(analysis, options.max_combinations)
    worker = Worker(str(analysis_path), run_fp, WorkerOptions(
        options.cost, options.memory_budget_bytes, options.batch, options.cost_model))
    say(f"NUM SEGMENT is {len(reps)}")
    compiled = 0
    try:
        for k, rep in enumerate(reps):
            compiled += _profile_window(k, windows[rep], analysis, worker, options, fp,
                                        out_dir, start, say)
        bounds = boundaries(analysis, windows)
        reshard = _profile_reshards(analysis, bounds, worker, fp, out_dir, say)
        worker.ensure()
        overhead = worker.overhead_s
    finally:
        worker.close()
    rec = ProfileRecord(tuple(windows), tuple(reps), tuple(bounds), reshard, overhead,
                        options.cost, time.perf_counter() - start, compiled)
    write_record(out_dir / "profile.pkl", INDEX_FORMAT, fp, rec)
    write_csv(out_dir, len(reps), fp)
    say(f"overlapped_profiling overall time: {rec.time_s:.1f}")
    return rec


def _profile_window(k, window: Window, analysis, worker: Worker, options, fp, out_dir,
                    start, say) -> int:
    blocks = tuple(range(window.start, window.end))
    space = tuple(len(analysis.blocks.blocks[b].strategies) for b in blocks)
    path = out_dir / f"segment_{k}.pkl"
    results: dict = {}
    if path.exists():
        prev = read_record(path, SEGMENT_FORMAT, fp, hint=f"delete {path} to profile afresh")
        results = {c: m for c, m in prev.results.items() if m.status != "worker_died"}
    say(f"RUN AutoSharding FOR SEGMENT {k} segment_{k} (blocks {window.start}..{window.end - 1})")
    say(f"segment PB search space: {list(space)}")
    combos = list(itertools.product(*[range(n) for n in space]))
    todo = [c for c in combos if c not in results]
    if len(todo) < len(combos):
        say(f"resuming: {len(combos) - len(todo)} combinations already measured")
    best = min((m.time_s for m in results.values() if m.status == "ok"), default=None)
    progress = _Progress(len(todo), say)
    done = 0
    for i in range(0, len(todo), options.batch):
        if options.budget_s is not None and time.perf_counter() - start > options.budget_s:
            for c in todo[i:]:
                results[c] = Measurement("pruned", note="--profile-budget spent")
            say(f"profile budget spent: {len(todo) - i} combinations of segment {k} pruned")
            break
        for combo, m in worker.measure_window(window, todo[i:i + options.batch], best):
            results[combo] = m
            done += 1
            if m.status == "ok":
                best = m.time_s if best is None else min(best, m.time_s)
            # Saved after every result: an interruption loses nothing already measured.
            write_record(path, SEGMENT_FORMAT, fp, WindowProfile(k, blocks, space, dict(results)))
            progress.result(k, combo, m)
    write_record(path, SEGMENT_FORMAT, fp, WindowProfile(k, blocks, space, dict(results)))
    return done


def _profile_reshards(analysis, bounds, worker, fp, out_dir, say) -> dict:
    names = ("m0", "m1", "m2")[:len(analysis.mesh_shape)]
    blocks = analysis.blocks.blocks
    needed = set()
    for b in bounds:
        for s in blocks[b.src].strategies:
            for t in blocks[b.dst].strategies:
                src, dst = boundary_specs(b, s, t, names)
                if src != dst:
                    needed.add((b.shape, b.dtype, src, dst))
    path = out_dir / "reshard.pkl"
    known = read_record(path, RESHARD_FORMAT, fp, hint=f"delete {path}") if path.exists() else {}
    todo = sorted(needed - set(known), key=repr)
    say(f"boundaries between windows: {len(bounds)}; distinct reshardings to time: "
        f"{len(needed)} ({len(needed) - len(todo)} already known)")
    for i in range(0, len(todo), 64):
        known.update(worker.measure_reshards(todo[i:i + 64]))
        write_record(path, RESHARD_FORMAT, fp, known)
    write_record(path, RESHARD_FORMAT, fp, known)
    return known


class _Progress:
    """A progress bar with an ETA on a terminal; one line per combination otherwise."""

    def __init__(self, total: int, say):
        self.total, self.say, self.n, self.t0 = total, say, 0, time.perf_counter()
        self.tty = sys.stdout.isatty()

    def result(self, k, combo, m: Measurement):
        self.n += 1
        line = (f"SegmentIdx: {k} ParallelBlock Strategy: {list(combo)} "
                + (f"avgcost: {m.time_s:.6g} mem_cost(GB): {m.peak_bytes / 2**30:.4g}"
                   if m.status == "ok" else f"status: {m.status} {m.note}"))
        if self.tty:
            eta = (time.perf_counter() - self.t0) / self.n * (self.total - self.n)
            bar = "#" * int(30 * self.n / max(1, self.total))
            print(f"\r[{bar:<30}] {self.n}/{self.total} ETA {eta:5.0f}s  {line[:60]}",
                  end="" if self.n < self.total else "\n", flush=True)
        else:
            self.say(line)


def load_profiles(workdir: Path, run_fp: tuple, analysis, options: ProfileOptions):
    """(ProfileRecord, {window type: WindowProfile}) as search reads them."""
    out_dir = profile_dir(workdir, options.cost)
    fp = profile_fingerprint(run_fp, analysis, options)
    hint = "run --mode profile first (with the same flags)"
    rec = read_record(out_dir / "profile.pkl", INDEX_FORMAT, fp, hint=hint)
    segs = {k: read_record(out_dir / f"segment_{k}.pkl", SEGMENT_FORMAT, fp, hint=hint)
            for k in range(len(rec.representatives))}
    return rec, segs


def write_csv(out_dir: Path, num_types: int, fp) -> None:
    rows = []
    for k in range(num_types):
        seg = read_record(out_dir / f"segment_{k}.pkl", SEGMENT_FORMAT, fp, hint="rerun profile")
        for combo, m in sorted(seg.results.items()):
            rows.append({"segment": k, "combination": " ".join(map(str, combo)),
                         "status": m.status, "time_median_s": m.time_s,
                         "time_min_s": m.time_min_s, "time_max_s": m.time_max_s,
                         "runs": m.runs, "memory_gb": m.peak_bytes / 2**30,
                         "compile_s": m.compile_s, "note": m.note})
    tmp = out_dir / ".profile.csv.tmp"
    with open(tmp, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["segment"])
        w.writeheader()
        w.writerows(rows)
    tmp.replace(out_dir / "profile.csv")


def plan_space(windows, segs) -> float:
    """log10 of the number of whole-model combinations the windows span."""
    return sum(math.log10(max(1, math.prod(segs[w.type].space))) for w in windows)


def check_complete(segs) -> None:
    for k, seg in segs.items():
        if not any(m.status == "ok" for m in seg.results.values()):
            raise CfpError(f"segment {k} has no feasible combination (all oom, failed or "
                           f"pruned): raise --memory-budget or --profile-budget and profile again")
