"""A measurement worker process, so that an XLA abort or an OOM kill ends it, not the pass.

The parent sends jobs over a pipe, the analysis record among the start-up arguments; the worker
re-traces the step (checking it against the analysis), compiles a batch of combinations first
and then times them with nothing else running (a compile beside a timing corrupts it on a
machine with few cores), in interleaved rounds (a change of the machine's speed during the
batch falls on every combination alike), streaming one result per combination.

Failures: a JAX/XLA error raised while compiling or running a combination is that
combination's ``compile_error`` or ``run_error``, with XLA's message; a worker killed by a
signal or out of memory is charged to the combination in flight (``worker_died``): when it died
compiling a batch, the rest is sent again one combination at a time until the culprit is found.
Any other exception is a bug in cfp and is raised in the parent with the worker's traceback.
The worker ignores SIGINT: Ctrl-C reaches the parent, which stops it. The worker reports its wall seconds per
phase (tracing, compiling, running, resharding timing) with each reply.

Across processes (``WorkerOptions.runtime``, ``cfp.multihost``) each start of the worker joins
a fresh runtime, and the workers of every process measure the same combinations in lockstep:
each verdict that decides whether a program runs is process 0's, each timing the slowest
process's, each result process 0's. After a death, the next generation's workers agree on
what it is charged to from every process's account (``_agree_on_death``); a program that
fails while running ends every worker and is charged ``worker_died``. The worker also serves
its parent's ``share`` and ``gather`` and runs whole passes (``call``) on the global mesh.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
from typing import Iterator

from cfp import host_memory, multihost
from cfp.errors import CfpError
from cfp.measure import Measurement
from cfp.phases import Phases
from cfp.pool import main_left_out
from cfp.workloads import handed_steps, receive_handed
from cfp.worker_jobs import measure_reshards, measure_window, setup

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    # "measure" | "model" | "mock": timed on this one GPU standing for the mesh's GPUs
    # (``cfp.jax_compat.mock_gpus``), each program's collectives priced by ``cost_model``
    cost: str
    memory_budget_bytes: int  # per device; a combination whose compiled peak exceeds it is oom
    batch: int  # combinations compiled before timing
    cost_model: object | None = None  # cfp.cost_model.CostModel for cost == "model" or "mock"
    compilation_cache: str | None = None  # JAX's persistent compilation cache directory
    runtime: multihost.Runtime | None = None  # the processes measured across, when several
    # cost == "model" only: the GPUs (``cfp.gpu_compile.GPUS``) the programs are compiled for,
    # described, not present; None compiles for the devices here
    compile_for: str | None = None


PARENT_GONE_EXIT = 75  # a worker's exit status when its parent has ended


class WorkerDied(CfpError):
    """The worker ended while it answered a request."""


class WorkerBug(RuntimeError):
    """An exception in the worker that is not a JAX/XLA failure of the item measured."""


class Worker:
    """The parent's handle on a worker process; restarted after a death."""

    def __init__(self, analysis, options: WorkerOptions, phases: Phases | None = None):
        self.args = (analysis, options)
        self.options = options
        self.phases = phases or Phases()
        self.proc = None
        self.overhead_s = 0.0
        self.device_ids: tuple[int, ...] = ()  # the worker's mesh's devices, in its order
        self.platform = "cpu"  # theirs (``ProfileRecord.platform``)
        self.log_path = None  # the worker's output, across processes

    def _start(self):
        t0 = time.perf_counter()
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        runtime = self.options.runtime
        generation = multihost.next_generation() if runtime is not None else 0
        # The step's records go through the pipe, not the spawn, and the user's script is
        # not run again in the worker (``main_left_out``): a step handed in reaches it by
        # value (``cfp.workloads.handed_steps``).
        self.proc = ctx.Process(target=_main, args=(child, generation, os.getpid()),
                                daemon=True)
        env = dict(host_memory.POOLED, **_device_count_flag(self.args[0], runtime))
        before = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # the worker's heap keeps its blocks
        try:
            with main_left_out():
                self.proc.start()
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
        child.close()
        try:
            self.conn.send(self.args + (handed_steps(self.args[0].spec.model),))
        except OSError:
            pass  # it died before taking them: its end of the pipe reads as closed below
        kind, payload = self._recv()
        if kind == "joining":
            self.log_path = payload
            kind, payload = self._recv()
            if kind == "died":
                raise CfpError(
                    f"not every one of the {runtime.num_processes} processes joined the "
                    f"runtime at {runtime.address(generation)} within "
                    f"{runtime.join_timeout_s} s (one has stopped or was never started; worker "
                    f"log {self.log_path}); what was measured is kept: relaunch every process "
                    f"to resume")
        if kind == "bug":
            raise WorkerBug(f"the measurement worker failed:\n{payload}")
        if kind == "error":  # the step cannot be measured as analysed
            raise CfpError(payload)
        if kind != "ready":
            self.proc.join(timeout=5)
            raise CfpError(f"the measurement worker died while starting (exit code "
                           f"{self.proc.exitcode})")
        self.overhead_s, self.device_ids, self.platform, setup_phases = payload
        log.info("worker %d ready in %.1f s; launch overhead %.3f ms", self.proc.pid,
                 time.perf_counter() - t0, self.overhead_s * 1e3)
        self.phases.add(setup_phases)
        self.phases.add({"worker start": time.perf_counter() - t0
                         - sum(setup_phases.values())})

    def _recv(self):
        try:
            return self.conn.recv()
        except (EOFError, ConnectionError, OSError):
            return ("died", None)

    def ensure(self):
        if self.proc is None or not self.proc.is_alive():
            self._start()

    def kill(self):
        """Stop the worker now (an interrupted pass does not wait for its compiles)."""
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)

    def close(self):
        if self.proc is not None and self.proc.is_alive():
            try:
                self.conn.send(("stop",))
            except OSError:
                pass
            self.proc.join(timeout=10)
            if self.proc.is_alive():
                self.proc.kill()
            elif self.proc.exitcode == 0 and self.log_path:  # kept only when it failed
                os.remove(self.log_path)

    def measure_window(self, window, combos: list[tuple], best_s: float | None
                       ) -> Iterator[tuple[tuple, Measurement]]:
        """Measurements of ``combos`` of ``window``, one by one, surviving worker deaths."""
        pending = list(combos)
        one_at_a_time = False
        while pending:
            self.ensure()
            self.conn.send(("window", window, pending, best_s, one_at_a_time))
            in_flight: list = []
            while True:
                kind, payload = self._recv()
                if kind in ("compiling", "timing"):
                    in_flight = list(payload)
                elif kind == "result":
                    combo, m = payload
                    pending.remove(combo)
                    if m.status == "ok" and (best_s is None or m.time_s < best_s):
                        best_s = m.time_s
                    yield combo, m
                elif kind == "done":
                    self.phases.add(payload)
                    break
                elif kind == "bug":
                    raise WorkerBug(f"the measurement worker failed:\n{payload}")
                elif kind == "error":  # the step cannot be measured as analysed
                    raise CfpError(payload)
                else:  # died
                    charged, note = self._agree_on_death([c for c in in_flight
                                                          if c in pending])
                    if charged is not None:
                        pending.remove(charged)
                        yield charged, Measurement("worker_died", note=note)
                    else:  # died compiling a batch: find the culprit one by one
                        one_at_a_time = True
                    break

    def _agree_on_death(self, suspects: list) -> tuple[tuple | None, str]:
        """The combination a death is charged to (``None``: find it one at a time) and why.
        Across processes every process's worker leaves when one dies; the next generation
        gathers each process's account, and a worker that left because a peer did is no
        witness."""
        self.proc.join(timeout=5)
        code, self.proc = self.proc.exitcode, None
        # Across processes every worker dies with one: the report says what it was charged.
        log.log(logging.INFO if self.options.runtime is not None else logging.WARNING,
                "the measurement worker died (exit code %s) with %d combinations in flight",
                code, len(suspects))
        accounts = self.gather((code, suspects))
        witnesses = [a for a in accounts if a[0] != multihost.PEER_LOST_EXIT] or accounts
        union = sorted({c for _, s in witnesses for c in s})
        if len(union) != 1:
            return None, ""
        codes = ", ".join(f"{c}" for c, s in witnesses if union[0] in s)
        return union[0], f"worker exit code {codes}"

    def share(self, value):
        """Process 0's ``value`` (``cfp.multihost.share``), through the worker's runtime."""
        return self._ask("share", value)

    def gather(self, value) -> list:
        """Every process's ``value`` (``cfp.multihost.gather``)."""
        return self._ask("gather", value)

    def call(self, fn, *args):
        """``fn(*args)`` run in the worker on the global mesh, with process 0's ``args``."""
        return self._ask("call", (fn, args))

    def _ask(self, kind, payload):
        self.ensure()
        try:
            self.conn.send((kind, payload))
        except OSError:
            pass  # it has died: its end of the pipe reads as closed below
        kind, payload = self._recv()
        if kind == "bug":
            raise WorkerBug(f"the measurement worker failed:\n{payload}")
        if kind == "error":
            raise CfpError(payload)
        if kind != "value":
            self.proc.join(timeout=5)
            code = self.proc.exitcode
            if code == multihost.PEER_LOST_EXIT:
                raise CfpError("another process of the runtime stopped (or lost its "
                               "connection); what was measured is kept: relaunch every "
                               "process to resume")
            raise WorkerDied(f"the worker died (exit code {code}); what was measured is "
                             f"kept: run again to resume")
        return payload

    def measure_reshards(self, items: list[tuple]) -> dict[tuple, tuple | None]:
        """``(seconds, interval low, interval high)`` of each resharding ``(shape, dtype,
        src spec, dst spec)`` (see ``measure_reshards``). One that kills the worker (out of
        memory, an abort) is charged ``None``, as one XLA cannot run, and the others are
        timed again one at a time (across processes a death still stops the pass)."""
        try:
            known, phases = self._ask("reshard", items)
        except WorkerDied:
            if self.options.runtime is not None:
                raise
            if len(items) == 1:
                log.warning("the worker died timing the resharding %s: charged as one that "
                            "cannot run", items[0])
                return {items[0]: None}
            return {k: v for item in items for k, v in self.measure_reshards([item]).items()}
        self.phases.add(phases)
        return known


def _device_count_flag(analysis, runtime) -> dict[str, str]:
    """``XLA_FLAGS`` for a worker when the caller's own say nothing of the number of CPU
    devices (JAX started by the user, its devices set with ``jax_num_cpu_devices``): the
    mesh's devices (this process's share of them)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" in flags:
        return {}
    count = math.prod(analysis.mesh_shape) // (runtime.num_processes if runtime else 1)
    return {"XLA_FLAGS": f"{flags} --xla_force_host_platform_device_count={count}".strip()}


def _main(conn, generation: int = 0, parent_pid: int | None = None):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _exit_with_parent(parent_pid or os.getppid())
    # The programs measured here keep the step's effects (a jax.debug.print runs in each of
    # their thousands of steps): what they print is no line of the user's training.
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    analysis, options, handed = conn.recv()
    phases = Phases()
    if options.cost == "mock":  # before JAX's backends start
        from cfp.jax_compat import mock_gpus
        mock_gpus(math.prod(analysis.mesh_shape))
    try:
        if options.runtime is not None:
            conn.send(("joining", _quiet_log(options.runtime, generation)))
            multihost.join(options.runtime, generation)
        receive_handed(handed)
        from cfp.jax_compat import enable_compilation_cache
        if options.compile_for is None and options.cost != "mock":  # a program compiled
            enable_compilation_cache(options.compilation_cache)  # for absent GPUs cannot
        state = setup(analysis, phases, options.compile_for)  # be loaded back from it
        state["cost_model"] = options.cost_model if options.cost == "mock" else None
        state["phases"] = phases
        conn.send(("ready", (state["overhead"],
                             tuple(int(d.id) for d in state["mesh"].devices.flat),
                             state["mesh"].devices.flat[0].platform, phases.take())))
    except multihost.RuntimeLost:
        os._exit(multihost.PEER_LOST_EXIT)
    except CfpError as e:  # the step cannot be measured as analysed: the user's to fix
        conn.send(("error", str(e)))
        return
    except Exception:  # noqa: BLE001 - a bug: the parent raises it with this traceback
        conn.send(("bug", traceback.format_exc()))
        return
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the parent closed its end: nothing more to do
            return
        if msg[0] == "stop":
            return
        try:
            if msg[0] == "window":
                measure_window(conn, state, options, *msg[1:])
                conn.send(("done", phases.take()))
            elif msg[0] == "reshard":
                with phases("resharding timing"):
                    known = measure_reshards(state, options, msg[1])
                conn.send(("value", (known, phases.take())))
            elif msg[0] == "share":
                conn.send(("value", multihost.share(msg[1])))
            elif msg[0] == "gather":
                conn.send(("value", multihost.gather(msg[1])))
            elif msg[0] == "call":
                fn, args = msg[1]
                conn.send(("value", multihost.share(fn(*multihost.share(args)))))
        except multihost.RuntimeLost:
            os._exit(multihost.PEER_LOST_EXIT)
        except CfpError as e:
            conn.send(("error", str(e)))
        except Exception:  # noqa: BLE001 - a bug: the parent raises it with this traceback
            conn.send(("bug", traceback.format_exc()))


def _exit_with_parent(parent_pid: int, interval_s: float = 0.2) -> None:
    """End this worker as soon as its parent ``parent_pid`` ends: a parent killed (SIGKILL,
    or SIGTERM, which it does not catch) tells it nothing, and a compile or a timing would
    keep it running for seconds. On Linux the kernel kills it then (``PR_SET_PDEATHSIG``);
    elsewhere, and as a second guard, a thread that watches the parent ends it within
    ``interval_s`` whenever it gets the interpreter. The parent's resource tracker ends with
    its last worker."""
    import threading
    if sys.platform.startswith("linux"):
        import ctypes
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass

    def watch():
        while os.getppid() == parent_pid:
            time.sleep(interval_s)
        os._exit(PARENT_GONE_EXIT)

    if os.getppid() != parent_pid:  # it ended before the guard was set
        os._exit(PARENT_GONE_EXIT)
    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _quiet_log(runtime, generation: int) -> str:
    """Send this worker's output (JAX's and the collective library's chatter, and JAX's
    report when the runtime aborts the process) to a log file; its path."""
    import tempfile
    path = os.path.join(tempfile.gettempdir(),
                        f"cfp-worker-p{runtime.process_id}-g{generation}-{os.getpid()}.log")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    return path


