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
import statistics
import sys
import time
import traceback
from typing import Iterator

from cfp import host_memory, multihost
from cfp.errors import CfpError
from cfp.jax_compat import JAX_ERRORS
from cfp.measure import Measurement
from cfp.phases import Phases

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
        # The step's records go through the pipe, not the spawn: a spawned process that dies
        # importing the user's script again leaves a large spawn payload half written, and
        # the parent waiting on it.
        self.proc = ctx.Process(target=_main, args=(child, generation, os.getpid()),
                                daemon=True)
        before = {k: os.environ.get(k) for k in host_memory.POOLED}
        os.environ.update(host_memory.POOLED)  # the worker's heap keeps its blocks
        try:
            self.proc.start()
        finally:
            for k, v in before.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
        child.close()
        try:
            self.conn.send(self.args)
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
                           f"{self.proc.exitcode}); a script that runs cfp must do so under "
                           f"`if __name__ == '__main__':`, since workers are spawned processes "
                           f"that import it again")
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
        src spec, dst spec)`` (see ``_measure_reshards``). One that kills the worker (out of
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


def _main(conn, generation: int = 0, parent_pid: int | None = None):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    _exit_with_parent(parent_pid or os.getppid())
    analysis, options = conn.recv()
    phases = Phases()
    if options.cost == "mock":  # before JAX's backends start
        from cfp.jax_compat import mock_gpus
        mock_gpus(math.prod(analysis.mesh_shape))
    try:
        if options.runtime is not None:
            conn.send(("joining", _quiet_log(options.runtime, generation)))
            multihost.join(options.runtime, generation)
        from cfp.jax_compat import enable_compilation_cache
        if options.compile_for is None and options.cost != "mock":  # a program compiled
            enable_compilation_cache(options.compilation_cache)  # for absent GPUs cannot
        state = _setup(analysis, phases, options.compile_for)  # be loaded back from it
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
        msg = conn.recv()
        if msg[0] == "stop":
            return
        try:
            if msg[0] == "window":
                _measure_window(conn, state, options, *msg[1:])
                conn.send(("done", phases.take()))
            elif msg[0] == "reshard":
                with phases("resharding timing"):
                    known = _measure_reshards(state, options, msg[1])
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


def _setup(analysis, phases: Phases, compile_for: str | None = None):
    from cfp.timing import launch_overhead, speed_anchor
    from cfp.tracing import trace_step
    with phases("tracing"):
        program = trace_step(analysis.spec.build())
        if program.graph().fingerprint() != analysis.graph.fingerprint():
            raise CfpError("the step traced now differs from the one analysed: rerun "
                           "--mode analysis")
        fingerprints = multihost.gather(analysis.graph.fingerprint())
        differ = [i for i, fp in enumerate(fingerprints) if fp != fingerprints[0]]
        if differ:  # each process analyses for itself: no shared work dir is needed
            raise CfpError(f"process {differ[0]} traced another step than process 0: run "
                           f"the same cfp, JAX and flags on every host")
    cpu_mesh = None
    if compile_for is not None:  # nothing runs: the programs are compiled for those GPUs
        from cfp.gpu_compile import gpu_mesh
        from cfp.mesh import AXIS_NAMES
        mesh = gpu_mesh(compile_for, analysis.mesh_shape, AXIS_NAMES[:len(analysis.mesh_shape)])
        overhead, anchor = 0.0, None
        import jax
        if len(jax.devices()) >= math.prod(analysis.mesh_shape):  # to check collectives on
            cpu_mesh = analysis.mesh()
    else:
        import jax
        from cfp.jax_compat import mocked_gpus
        if mocked_gpus() and (jax.devices()[0].platform != "gpu"
                              or len(jax.devices()) != mocked_gpus()):
            raise CfpError(f"--cost mock needs a GPU to stand for {mocked_gpus()} GPUs; JAX "
                           f"here has {len(jax.devices())} {jax.devices()[0].platform} "
                           f"devices")
        with phases("running"):
            mesh = analysis.mesh()
            overhead = launch_overhead(mesh)
            anchor = speed_anchor(mesh)
        cpus = jax.devices("cpu") if mocked_gpus() else []
        if len(cpus) >= math.prod(analysis.mesh_shape):  # to check collectives on, as above
            import numpy as np
            from cfp.jax_compat import auto_axis_types
            cpu_mesh = jax.sharding.Mesh(
                np.array(cpus[:len(mesh.devices.flat)]).reshape(mesh.devices.shape),
                mesh.axis_names, **auto_axis_types(len(mesh.axis_names)))
    return {"analysis": analysis, "program": program, "mesh": mesh, "overhead": overhead,
            "anchor": anchor, "inputs": {}, "programs": {},
            "cpu_mesh": cpu_mesh}


def _measure_window(conn, state, options: WorkerOptions, window, combos, best_s,
                    one_at_a_time=False):
    """Compile a batch of combinations (in threads: XLA releases the GIL), then time them with
    nothing else running; on a host with cores to spare (8 or more) the next batch compiles
    while this one is timed."""
    import os
    from concurrent.futures import ThreadPoolExecutor
    from cfp.measure import WindowProgram, valid_inputs
    phases = state["phases"]
    with phases("tracing"):
        wp = WindowProgram(state["program"], state["analysis"], window, state["mesh"])
        cpu = state.get("cpu_mesh")
        check_wp = cpu and WindowProgram(state["program"], state["analysis"], window, cpu)
        if window.type not in state["inputs"]:  # priced programs need no data
            state["inputs"] = {window.type: valid_inputs(wp.graph, wp.sub, seed=window.type)
                               if options.cost in ("measure", "mock") else None}
            state["programs"] = {}  # normalised program -> (combination, its measurement)
    host_inputs = state["inputs"][window.type]
    cores = os.cpu_count() or 1
    overlap = cores >= 8
    size = 1 if one_at_a_time else options.batch
    batches = [combos[i:i + size] for i in range(0, len(combos), size)]
    with ThreadPoolExecutor(max_workers=max(1, min(cores - (1 if overlap else 0), 8))) as pool:
        submit = lambda batch: [(c, pool.submit(_compile_one, wp, c, check_wp))  # noqa
                                for c in batch]
        pending = submit(batches[0]) if batches else []
        for i in range(len(batches)):
            conn.send(("compiling", [c for c, _ in pending]))
            with phases("compiling"):
                ready = [(c, f.result()) for c, f in pending]
            pending = submit(batches[i + 1]) if overlap and i + 1 < len(batches) else []
            with phases("running"):
                best_s = _time_batch(conn, state, options, wp, ready, host_inputs, best_s)
            if not overlap and i + 1 < len(batches):
                pending = submit(batches[i + 1])


def _compile_one(wp, combo, check_wp=None):
    """A combination compiled: (program, input shardings, compile seconds, memory fields,
    collectives, what differs from its strategies, the program's identity), or its
    ``compile_error``. For GPUs that are not here (``check_wp`` the same window on the CPU
    devices), XLA's GPU passes can leave a collective it made without the tag that ties it to
    its operator (a reduction's all-reduce over a concatenated buffer, say): where the GPU
    program has one, the combination's collectives are checked on its CPU program instead."""
    import hashlib
    import time as _time
    from cfp.measure import normalized_hlo
    from cfp.collectives import collectives
    t0 = _time.perf_counter()
    try:
        exe, shardings = wp.compile(combo)
    except JAX_ERRORS as e:  # a strategy XLA cannot compile; anything else is cfp's bug
        return Measurement("compile_error", note=f"{type(e).__name__}: {str(e)[:300]}")
    text = exe.as_text()
    colls = tuple((c.kind, c.axes, c.bytes) for c in collectives(text, wp.mesh_shape))
    program = (normalized_hlo(exe), repr(shardings), repr(exe.output_shardings),
               wp.donated(combo))
    unnamed = wp.unnamed_collectives(exe, combo)
    if unnamed and check_wp is not None:
        try:
            unnamed = check_wp.unnamed_collectives(check_wp.compile(combo)[0], combo)
        except JAX_ERRORS:  # the CPU cannot compile it: the GPU program's verdict stands
            pass
    mem = dict(wp.memory(exe, text), unnamed_collectives=tuple(unnamed),
               program_sha1=hashlib.sha1(program[0].encode()).hexdigest())
    return (exe, shardings, _time.perf_counter() - t0, mem, colls,
            wp.check_compiled(exe, combo), program)


def _time_batch(conn, state, options, wp, ready, host_inputs, best_s):
    """Time the compiled combinations of ``ready`` together, in interleaved rounds
    (``_run``). Across processes, a combination runs only where every process compiled it and
    process 0 finds it worth running (``_verdict``), and its result is process 0's (whose
    times are the slowest process's). A combination compiled to the program of another in
    the batch is not run: it gets that one's measurement."""
    verdicts, runnable, first_of, twin_of = {}, [], {}, {}  # keyed by position in ready
    for i, (combo, got) in enumerate(ready):
        failed = [f for f in multihost.gather(got if isinstance(got, Measurement) else None)
                  if f is not None]
        if failed:
            verdicts[i] = failed[0]
            continue
        twin_of[i] = multihost.share(first_of.get(got[-1]))
        if twin_of[i] is None:
            m = multihost.share(_verdict(state, options, wp, got))
            if m is None:
                first_of[got[-1]] = i
                runnable.append(i)
            else:
                verdicts[i] = m
    if runnable:
        conn.send(("timing", [ready[i][0] for i in runnable]))
        timed = _run(state, [ready[i] for i in runnable], host_inputs, best_s)
        verdicts.update(zip(runnable, multihost.share(timed)))
    for i, (combo, got) in enumerate(ready):
        if twin_of.get(i) is not None:
            j = twin_of[i]
            verdicts[i] = _twin(ready[j][0], verdicts[j], got[2])
        m = verdicts[i]
        if (not isinstance(got, Measurement)
                and m.status in ("ok", "mismatch", "unexpected_collective", "oom")
                and not m.note.startswith("stopped early")):
            state["programs"].setdefault(got[-1], (combo, m))
        if m.status == "ok" and (best_s is None or m.time_s < best_s):
            best_s = m.time_s
        conn.send(("result", (combo, m)))
    return best_s


def _twin(combo, m: Measurement, compile_s: float) -> Measurement:
    """The measurement of a combination compiled to the same program as ``combo``."""
    return dataclasses.replace(m, compile_s=compile_s, same_program_as=combo,
                               note=f"the same program as {list(combo)}, measured once")


def _verdict(state, options, wp, got) -> Measurement | None:
    """The measurement a compiled combination gets without running (a program measured
    before, a mismatch, a collective its strategies do not name, over the memory budget,
    priced by the model), or ``None``: run it."""
    from cfp.cost_model import model_cost
    exe, shardings, compile_s, mem, colls, note, program = got
    twin = state["programs"].get(program)
    if twin is not None:  # the same program as a combination measured before: reuse
        return _twin(twin[0], twin[1], compile_s)
    if note:
        return Measurement("mismatch", compile_s=compile_s, collectives=colls, note=note, **mem)
    if mem["unnamed_collectives"]:  # not the communication-free plan it names: not timed
        return Measurement("unexpected_collective", compile_s=compile_s, collectives=colls,
                           note="; ".join(mem["unnamed_collectives"][:3]), **mem)
    if mem["peak_bytes"] > options.memory_budget_bytes:
        return Measurement("oom", compile_s=compile_s, collectives=colls,
                           note=f"compiled peak {mem['peak_bytes']} B over the budget", **mem)
    if options.cost == "model":
        t, colls = model_cost(exe, wp.mesh_shape, options.cost_model)
        return Measurement("ok", t, t, t, 0, compile_s, collectives=colls, **mem)
    return None


def _run(state, runnable, host_inputs, best_s) -> list[Measurement]:
    """Measurements of the compiled combinations ``runnable`` ((combination, compiled),
    ...), in order: each run once alone (a program XLA fails running is that combination's
    ``run_error`` or ``oom``), then the rest timed in interleaved rounds against the speed
    anchor (``timing.time_rounds``), the launch overhead subtracted."""
    import jax
    from cfp.cost_model import collectives_cost
    from cfp.timing import CpuShare, Fresh, time_rounds
    out, programs = {}, []
    for k, (combo, got) in enumerate(runnable):
        exe, shardings, compile_s, mem, colls, _, _ = got
        args = Fresh([multihost.put(x, s) for x, s in zip(host_inputs, shardings)],
                     got[-1][-1])
        try:
            jax.block_until_ready(exe(*args()))  # the warm-up run
        except JAX_ERRORS as e:  # XLA failed running it (out of device memory, say)
            if multihost.processes() > 1:  # the others wait on this run: all workers end
                log.error("combination %s failed running: %s", list(combo), e)
                os._exit(multihost.RUN_FAILED_EXIT)
            status = "oom" if "RESOURCE_EXHAUSTED" in str(e) else "run_error"
            out[k] = Measurement(status, compile_s=compile_s, collectives=colls,
                                 note=f"{type(e).__name__}: {str(e)[:300]}", **mem)
            continue
        programs.append((k, got, exe, args))
    cpu = CpuShare().start()
    timed, anchor_times = time_rounds([(exe, args) for _, _, exe, args in programs],
                                      best_s=best_s, warmup=0, anchor=state["anchor"],
                                      overhead_s=state["overhead"])
    others, stolen = cpu.share()
    for (k, got, exe, _), (times, early) in zip(programs, timed):
        _, _, compile_s, mem, colls, _, _ = got
        priced = 0.0
        if state.get("cost_model") is not None:  # mocked GPUs: the collectives were skipped
            priced = collectives_cost(exe.as_text(), tuple(state["mesh"].devices.shape),
                                      state["cost_model"])[0]
        out[k] = Measurement(
            "ok", statistics.median(times) + priced, min(times) + priced, max(times) + priced,
            len(times), compile_s, collectives=colls,
            note="stopped early: 1.5x slower than the best" if early else "",
            others_cpu_share=others, stolen_cpu_share=stolen,
            anchor_s=statistics.median(anchor_times[:len(times)]), priced_s=priced, **mem)
    return [out[k] for k in range(len(runnable))]


def _measure_reshards(state, options, items):
    """Per resharding ``(seconds, interval low, interval high)``: timed after the op
    producing its value (``timing.time_in_context``), or with ``cost == "model"`` priced
    from its compiled collectives (so too under mocked GPUs, whose GPU here skips them, and a
    resharding is all collectives); ``None`` where XLA could not compile or run it (on any
    process). The batch compiles in threads (XLA releases the GIL), then each is timed with
    nothing else running."""
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec
    from cfp.jax_compat import to_dtype
    from cfp.cost_model import model_cost
    from cfp.timing import time_in_context
    mesh = state["mesh"]
    priced = options.cost in ("model", "mock")
    producers = state.setdefault("producers", {})  # (shape, dtype, src) -> compiled
    wanted = [] if priced else [  # the reshardings are timed against them
        key for key in dict.fromkeys(k[:3] for k in items) if key not in producers]
    done = compile_reshards(mesh, list(items) + [key + (key[2],) for key in wanted])
    compiled = done[:len(items)]
    producers.update(zip(wanted, done[len(items):]))
    out = {}
    for key, with_reshard in zip(items, compiled):
        shape, dtype, src, _ = key
        producer = producers.get(key[:3])
        runs = with_reshard is not None and (priced or producer is not None)
        if not all(multihost.gather(runs)):
            out[key] = None
        elif priced:  # priced from its collectives: no data needed
            t = model_cost(with_reshard, tuple(mesh.devices.shape), options.cost_model)[0]
            out[key] = (t, t, t)
        else:
            x = multihost.put(np.ones(shape, to_dtype(dtype)),
                              NamedSharding(mesh, PartitionSpec(*src)))
            try:
                out[key] = time_in_context(producer, with_reshard, (x,))
            except JAX_ERRORS as e:
                if multihost.processes() > 1:  # the others wait on this run: all workers end
                    log.error("resharding %s failed running: %s", key, e)
                    os._exit(multihost.RUN_FAILED_EXIT)
                out[key] = None
    return multihost.share(out)


def compile_reshards(mesh, items, threads: int | None = None) -> list:
    """``_compile_reshard`` of each ``(shape, dtype, src, dst)``, in ``threads`` threads (XLA
    releases the GIL; by default one per core, at most 8)."""
    from concurrent.futures import ThreadPoolExecutor
    threads = threads or max(1, min(os.cpu_count() or 1, 8))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        return list(pool.map(lambda key: _compile_reshard(mesh, *key), items))


def _compile_reshard(mesh, shape, dtype, src, dst):
    """The op producing a value of ``shape`` and ``dtype`` laid out as ``src``, its result
    laid out as ``dst``, compiled; None where XLA cannot."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    from cfp.jax_compat import to_dtype
    s_src = NamedSharding(mesh, PartitionSpec(*src))
    s_dst = NamedSharding(mesh, PartitionSpec(*dst))
    arg = jax.ShapeDtypeStruct(shape, to_dtype(dtype), sharding=s_src)
    try:
        return jax.jit(_producer_op(dtype), in_shardings=s_src, out_shardings=s_dst).lower(
            arg).compile()
    except JAX_ERRORS:
        return None


def _producer_op(dtype: str):
    """The op a timed resharding's value comes from: elementwise, of its shape and dtype
    (PRNG keys have no arithmetic: there the value passes through unchanged)."""
    from cfp.jax_compat import is_key
    if is_key(dtype):
        return lambda a: a
    if dtype == "bool":
        return lambda a: ~a
    return lambda a: a + a
