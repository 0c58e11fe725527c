"""Timing programs on the devices: one run, runs until steady, interleaved rounds against a
speed anchor, a resharding after the op producing its value; the launch overhead; the share
of the machine's cores that other processes took meanwhile (``CpuShare``); and when one
program is measurably slower than another."""
from __future__ import annotations

import contextlib
import math
import os
import statistics
import time
from typing import Sequence

import numpy as np


# Over this share of the cores taken by others while a batch is timed, its times read high:
# one other JAX process on 8 virtual devices takes about half of 2 cores and slows a program
# 1.5x; an idle machine leaves a few percent to daemons.
BUSY_SHARE = 0.15

# Where a timed run's prints go: a step's effects (``jax.debug.print``) are kept in every
# program cfp runs, and the thousands of steps it times are no part of the user's training.
_NOWHERE = open(os.devnull, "w")


class CpuShare:
    """The share of the machine's CPU time (all its cores) that others took between
    ``start()`` and ``share()``: the cores' busy and stolen time from ``/proc/stat``, less this
    process's own CPU time, and the stolen part alone (the hypervisor ran another machine on
    these cores). NaN where ``/proc/stat`` cannot be read (not Linux) or several processes
    measure together (on one host each would count the others' device threads)."""

    def start(self) -> "CpuShare":
        self.before = _cpu_counters()
        return self

    def share(self) -> tuple[float, float]:
        """(others' share, the stolen part of it)."""
        after = _cpu_counters()
        if self.before is None or after is None:
            return float("nan"), float("nan")
        machine_s, stolen_s, own_s, wall_s = (a - b for a, b in zip(after[:4], self.before[:4]))
        capacity_s = max(1e-9, wall_s * after[4])
        return max(0.0, machine_s - own_s) / capacity_s, max(0.0, stolen_s) / capacity_s


def _cpu_counters() -> tuple[float, float, float, float, int] | None:
    """(seconds the machine's cores were busy or stolen, seconds stolen, this process's CPU
    seconds, wall seconds, cores), or None."""
    import os
    from cfp.multihost import processes
    if processes() > 1:
        return None
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    ticks = [int(x) for x in lines[0].split()[1:]] + [0] * 8
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks[:8]
    cores = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    own, tick_s = os.times(), 1 / os.sysconf("SC_CLK_TCK")
    return ((user + nice + system + irq + softirq + steal) * tick_s, steal * tick_s,
            own.user + own.system, time.perf_counter(), cores)


class Fresh:
    """Inputs for a program that donates some (``donated`` positions): each call gives
    ``args`` with fresh copies there, since a run deletes what it donates."""

    def __init__(self, args, donated: Sequence[int]):
        self.args, self.donated = list(args), sorted(set(donated))

    def __call__(self) -> list:
        import jax
        out = list(self.args)
        # one call copies what this process holds whole (a window may donate dozens of
        # leaves, and a copy each costs a dispatch); an array spread over several hosts is
        # copied by itself
        here = [k for k in self.donated if out[k].is_fully_addressable]
        for k, x in zip(here, jax.device_put([out[k] for k in here], may_alias=False)):
            out[k] = x
        for k in set(self.donated) - set(here):
            out[k] = out[k].copy()
        return out


def inputs(args) -> list:
    """``args``, or what a ``Fresh`` gives, made and waited for before any clock starts."""
    import jax
    return jax.block_until_ready(args()) if callable(args) else args


def run_once_s(fn, args) -> float:
    """Seconds of one run of ``fn(*args)``, waited for; on several hosts the slowest
    process's, so that every process takes the same decisions from it. ``args`` may be a
    ``Fresh``: its copies are made before the clock starts."""
    import jax
    from cfp.multihost import slowest
    args = inputs(args)
    with contextlib.redirect_stdout(_NOWHERE):  # the step's prints, once per timed run
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        elapsed_s = time.perf_counter() - t0
    return slowest(elapsed_s)


def time_runs(fn, args, *, best_s: float | None, warmup: int = 1, min_runs: int = 3,
              max_runs: int = 30, rel_error: float = 0.02) -> tuple[list[float], bool]:
    """Timed runs of ``fn(*args)`` (seconds each) and whether it stopped early because it was
    already 1.5x slower than ``best_s``.

    The number of runs follows the measured spread: after ``min_runs``, runs stop once the
    median's standard error (1.253 sigma / sqrt(n), sigma estimated as 1.4826 times the median
    absolute deviation) is within ``rel_error`` of the median, or at ``max_runs``. A steady
    program needs ``min_runs``; a noisy one gets more."""
    import jax
    for _ in range(warmup):
        jax.block_until_ready(fn(*inputs(args)))
    times: list[float] = []
    while len(times) < max_runs:
        times.append(run_once_s(fn, args))
        if best_s and len(times) >= 3 and statistics.median(times) > 1.5 * best_s:
            return times, True
        if len(times) >= min_runs and median_rel_error(times) <= rel_error:
            break
    return times, False


def time_rounds(programs: Sequence[tuple], *, best_s: float | None, warmup: int = 1,
                min_rounds: int = 7, max_rounds: int = 30, rel_error: float = 0.02,
                anchor: tuple | None = None,
                overhead_s: float = 0.0) -> tuple[list[tuple[list[float], bool]], list[float]]:
    """Timed runs of several ``(fn, args)`` in interleaved rounds: per program its times
    (seconds, ``overhead_s`` subtracted) and whether it stopped early because it was already
    1.5x slower than the best (``best_s`` or the best of these); and the times of ``anchor``
    (a ``(fn, args)`` run first in every round, launch included; none without one).

    Each round runs every program still being timed once, so a change of the machine's speed
    during the batch falls on all of them alike instead of on whichever ran then; the anchor
    tells how fast the machine ran during the batch, against other batches. Each timed run
    follows an untimed run of the same program: in the step a window reads what the window
    before it just wrote, while a program run right after another one (another combination,
    the anchor) finds the caches holding that one's data, so that a small model's windows
    add up to more than its step (``scripts/composed_memory.py --search``). The order
    rotates each round besides. A program leaves
    after ``min_rounds`` once its median's standard error is within ``rel_error`` (see
    ``time_runs``), or at ``max_rounds``."""
    import jax
    for fn, args in list(programs) + ([anchor] if anchor else []):
        for _ in range(warmup):
            jax.block_until_ready(fn(*inputs(args)))
    times: list[list[float]] = [[] for _ in programs]
    anchor_times: list[float] = []
    early = [False] * len(programs)
    live = list(range(len(programs)))
    rounds = 0
    while live:
        if anchor:
            anchor_times.append(run_once_s(*anchor))  # whole: a gauge, not a window
        for i in live[rounds % len(live):] + live[:rounds % len(live)]:
            fn, args = programs[i]
            jax.block_until_ready(fn(*inputs(args)))  # untimed: the caches as in the step
            times[i].append(max(0.0, run_once_s(fn, args) - overhead_s))
        rounds += 1
        best = min([statistics.median(t) for t, e in zip(times, early) if t and not e]
                   + ([best_s] if best_s else []))
        still = []
        for i in live:
            if rounds >= 3 and statistics.median(times[i]) > 1.5 * best:
                early[i] = True
            elif rounds < max_rounds and (rounds < min_rounds
                                          or median_rel_error(times[i]) > rel_error):
                still.append(i)
        live = still
    return list(zip(times, early)), anchor_times


def time_in_context(producer, with_reshard, args, *, min_rounds: int = 5,
                    max_rounds: int = 12, rel_width: float = 0.1,
                    warmup: int = 2) -> tuple[float, float, float]:
    """Seconds a resharding adds after the op producing its value: ``producer`` alone and
    ``with_reshard`` (the same op, its result resharded) timed interleaved. A round runs the
    pair in both orders (producer, resharded, resharded, producer, after one untimed run)
    and takes the mean of the two differences, so a steady drift, and what a run pays for
    following the other program, cancel within the round. Returns the median of the rounds'
    differences and its 95% bootstrap interval; where the interval does not lie above 0,
    the resharding counts as 0. Rounds stop after ``min_rounds`` once the interval is narrower than
    ``rel_width`` of the resharded program's median, or at ``max_rounds``.

    Both programs launch alike, so the launch cost drops out of the difference, and the
    resharding is timed on a value just written, as in the step."""
    import jax
    for _ in range(warmup):
        jax.block_until_ready(producer(*args)), jax.block_until_ready(with_reshard(*args))
    diffs, whole = [], []
    for _ in range(max(min_rounds, max_rounds)):
        seconds = {"p": [], "r": []}
        jax.block_until_ready(producer(*args))  # untimed: the first run after a pause is slow
        for name, fn in (("p", producer), ("r", with_reshard), ("r", with_reshard),
                         ("p", producer)):
            seconds[name].append(run_once_s(fn, args))
        diffs.append(statistics.fmean(seconds["r"]) - statistics.fmean(seconds["p"]))
        whole.extend(seconds["r"])
        if len(diffs) >= min_rounds:
            low, high = median_interval(diffs)
            if high - low <= rel_width * statistics.median(whole):
                break
    return (0.0 if low <= 0 else statistics.median(diffs)), low, high


def median_interval(samples: Sequence[float], *, resamples: int = 1000,
                    seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the median of ``samples`` (a fixed seed: the same samples
    give the same interval on every process)."""
    x = np.asarray(samples, float)
    rng = np.random.default_rng(seed)
    medians = np.median(x[rng.integers(0, len(x), size=(resamples, len(x)))], axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def median_rel_error(times: Sequence[float]) -> float:
    """Standard error of the median of ``times``, relative to the median."""
    med = statistics.median(times)
    mad = statistics.median(abs(t - med) for t in times)
    return 1.253 * 1.4826 * mad / math.sqrt(len(times)) / med if med > 0 else 0.0


def launch_overhead(mesh, repeats: int = 50) -> float:
    """Median wall time of launching a trivial sharded program on the mesh."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    from cfp.multihost import put
    n = math.prod(mesh.devices.shape)
    x = put(np.ones((n, 8), np.float32), NamedSharding(mesh, PartitionSpec(mesh.axis_names)))
    f = jax.jit(lambda a: a + 1)
    times, _ = time_runs(f, (x,), best_s=None, warmup=5, min_runs=repeats, max_runs=repeats)
    return statistics.median(times)


def speed_anchor(mesh, rows_per_device: int = 512, width: int = 256, layers: int = 6):
    """``(fn, args)``: a fixed program on the mesh, timed in every round of every batch as the
    machine's speed gauge (a data-parallel stack of ``tanh(x @ w)``: every device computes,
    as in a window). It depends on the mesh alone, so every window type, every batch and a
    resumed profile time against the same program. On a GPU it is launch-bound and gauges
    the launch path, which varies little there."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec
    from cfp.multihost import put
    n = math.prod(mesh.devices.shape)
    rng = np.random.default_rng(0)
    x = put(rng.uniform(-1, 1, (n * rows_per_device, width)).astype(np.float32),
            NamedSharding(mesh, PartitionSpec(mesh.axis_names)))
    w = put((rng.uniform(-1, 1, (width, width)) / math.sqrt(width)).astype(np.float32),
            NamedSharding(mesh, PartitionSpec()))

    def stack(x, w):
        for _ in range(layers):
            x = jnp.tanh(x @ w)
        return x
    fn = jax.jit(stack)
    jax.block_until_ready(fn(x, w))  # compiled here, not in the first round it is timed in
    return fn, (x, w)


def slower(a_s: Sequence[float], b_s: Sequence[float]) -> bool:
    """Whether program ``a`` is measurably slower than ``b``, from their times in the same
    interleaved rounds (a round's drift hits both): the 95% interval of the median of the
    per-round ratios lies above 1."""
    return median_interval([a / b for a, b in zip(a_s, b_s)])[0] > 1
