"""A measurement worker process, so that an XLA abort or an OOM kill ends it, not the pass.

The parent sends jobs over a pipe, the analysis record among the start-up arguments; the worker
re-traces the step (checking it against the analysis), compiles a batch of combinations first and then times them with nothing else
running (a compile beside a timing corrupts it on a machine with few cores), streaming one
result per combination.

Failures: a JAX/XLA error raised while compiling or running a combination is that
combination's ``compile_error`` or ``run_error``, with XLA's message; a worker killed by a
signal or out of memory is charged to the combination in flight (``worker_died``): when it died
compiling a batch, the rest is sent again one combination at a time until the culprit is found.
Any other exception is a bug in cfp and is raised in the parent with the worker's traceback.
The worker ignores SIGINT: Ctrl-C reaches the parent, which stops it. The worker reports its wall seconds per
phase (tracing, compiling, running, resharding timing) with each reply.
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import signal
import statistics
import time
import traceback
from typing import Iterator

from cfp.errors import CfpError
from cfp.jax_compat import JAX_ERRORS
from cfp.measure import Measurement
from cfp.phases import Phases

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WorkerOptions:
    cost: str  # "measure" | "model"
    memory_budget_bytes: int  # per device; a combination whose compiled peak exceeds it is oom
    batch: int  # combinations compiled before timing
    cost_model: object | None = None  # cfp.measure.CostModel for cost == "model"
    compilation_cache: str | None = None  # JAX's persistent compilation cache directory


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

    def _start(self):
        t0 = time.perf_counter()
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_main, args=(child,) + self.args, daemon=True)
        self.proc.start()
        child.close()
        kind, payload = self._recv()
        if kind == "bug":
            raise WorkerBug(f"the measurement worker failed:\n{payload}")
        if kind == "error":  # the step cannot be measured as analysed
            raise CfpError(payload)
        if kind != "ready":
            raise CfpError(f"the measurement worker died while starting (exit code "
                           f"{self.proc.exitcode})")
        self.overhead_s, setup_phases = payload
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
                if kind in ("compiling", "start"):
                    in_flight = list(payload) if kind == "compiling" else [payload]
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
                    self.proc.join(timeout=5)
                    code = self.proc.exitcode
                    self.proc = None
                    suspects = [c for c in in_flight if c in pending]
                    log.warning("the measurement worker died (exit code %s) with %d "
                                "combinations in flight", code, len(suspects))
                    if len(suspects) == 1:
                        pending.remove(suspects[0])
                        yield suspects[0], Measurement(
                            "worker_died", note=f"worker exit code {code}")
                    else:  # died compiling a batch: find the culprit one by one
                        one_at_a_time = True
                    break

    def measure_reshards(self, items: list[tuple]) -> dict[tuple, float]:
        """Seconds of each resharding ``(shape, dtype, src spec, dst spec)``."""
        self.ensure()
        self.conn.send(("reshard", items))
        kind, payload = self._recv()
        if kind == "bug":
            raise WorkerBug(f"the measurement worker failed:\n{payload}")
        if kind != "reshards":
            raise CfpError(f"the measurement worker died while timing reshardings (exit code "
                           f"{self.proc.exitcode}); profile again to retry them")
        known, phases = payload
        self.phases.add(phases)
        return known


def _main(conn, analysis, options: WorkerOptions):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    phases = Phases()
    try:
        from cfp.jax_compat import enable_compilation_cache
        enable_compilation_cache(options.compilation_cache)
        state = _setup(analysis, phases)
        state["phases"] = phases
        conn.send(("ready", (state["overhead"], phases.take())))
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
                conn.send(("reshards", (known, phases.take())))
        except Exception:  # noqa: BLE001 - a bug: the parent raises it with this traceback
            conn.send(("bug", traceback.format_exc()))


def _setup(analysis, phases: Phases):
    from cfp.measure import launch_overhead
    from cfp.workloads import make_mesh, trace_step
    with phases("tracing"):
        program = trace_step(analysis.spec.build())
        if program.graph().fingerprint() != analysis.graph.fingerprint():
            raise CfpError("the step traced now differs from the one analysed: rerun "
                           "--mode analysis")
    with phases("running"):
        mesh = make_mesh(analysis.mesh_shape)
        overhead = launch_overhead(mesh)
    return {"analysis": analysis, "program": program, "mesh": mesh, "overhead": overhead,
            "inputs": {}, "programs": {}}


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
        if window.type not in state["inputs"]:  # priced programs need no data
            state["inputs"] = {window.type: valid_inputs(wp.graph, wp.sub, seed=window.type)
                               if options.cost == "measure" else None}
            state["programs"] = {}  # normalised program -> (combination, its measurement)
    host_inputs = state["inputs"][window.type]
    cores = os.cpu_count() or 1
    overlap = cores >= 8
    size = 1 if one_at_a_time else options.batch
    batches = [combos[i:i + size] for i in range(0, len(combos), size)]
    with ThreadPoolExecutor(max_workers=max(1, min(cores - (1 if overlap else 0), 8))) as pool:
        submit = lambda batch: [(c, pool.submit(_compile_one, wp, c)) for c in batch]  # noqa
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


def _compile_one(wp, combo):
    import time as _time
    from cfp.measure import memory_of, normalized_hlo
    from cfp.sharding import collectives
    t0 = _time.perf_counter()
    try:
        exe, shardings = wp.compile(combo)
    except JAX_ERRORS as e:  # a strategy XLA cannot compile; anything else is cfp's bug
        return Measurement("compile_error", note=f"{type(e).__name__}: {str(e)[:300]}")
    colls = tuple((c.kind, c.axes, c.bytes) for c in collectives(exe.as_text(), wp.mesh_shape))
    program = (normalized_hlo(exe), repr(shardings), repr(exe.output_shardings))
    mem = dict(memory_of(exe), unnamed_collectives=tuple(wp.unnamed_collectives(exe, combo)))
    return (exe, shardings, _time.perf_counter() - t0, mem, colls,
            wp.check_compiled(exe, combo), program)


def _time_batch(conn, state, options, wp, ready, host_inputs, best_s):
    import jax
    from cfp.measure import model_cost, time_runs
    for combo, got in ready:
        if isinstance(got, Measurement):
            conn.send(("result", (combo, got)))
            continue
        exe, shardings, compile_s, mem, colls, note, program = got
        conn.send(("start", combo))
        twin = state["programs"].get(program)
        if twin is not None:  # the same program as a combination measured before: reuse
            m = dataclasses.replace(twin[1], compile_s=compile_s, same_program_as=twin[0],
                                    note=f"the same program as {list(twin[0])}, measured once")
            conn.send(("result", (combo, m)))
            continue
        if note:
            m = Measurement("mismatch", compile_s=compile_s, collectives=colls, note=note, **mem)
        elif mem["peak_bytes"] > options.memory_budget_bytes:
            m = Measurement("oom", compile_s=compile_s, collectives=colls,
                            note=f"compiled peak {mem['peak_bytes']} B over the budget", **mem)
        elif options.cost == "model":
            t, colls = model_cost(exe, wp.mesh_shape, options.cost_model)
            m = Measurement("ok", t, t, t, 0, compile_s, collectives=colls, **mem)
        else:
            args = [jax.device_put(x, s) for x, s in zip(host_inputs, shardings)]
            try:
                times, early = time_runs(exe, args, best_s=best_s)
            except JAX_ERRORS as e:  # XLA failed running it (out of device memory, say)
                status = "oom" if "RESOURCE_EXHAUSTED" in str(e) else "run_error"
                conn.send(("result", (combo, Measurement(
                    status, compile_s=compile_s, collectives=colls,
                    note=f"{type(e).__name__}: {str(e)[:300]}", **mem))))
                continue
            times = [max(0.0, t - state["overhead"]) for t in times]
            med = statistics.median(times)
            m = Measurement("ok", med, min(times), max(times), len(times), compile_s,
                            collectives=colls, note="stopped early: 1.5x slower than the best"
                            if early else "", **mem)
            del args
        if m.status == "ok" and (best_s is None or m.time_s < best_s):
            best_s = m.time_s
        if m.status in ("ok", "mismatch", "oom") and not m.note.startswith("stopped early"):
            state["programs"][program] = (combo, m)
        conn.send(("result", (combo, m)))
    return best_s


def _measure_reshards(state, options, items):
    """Seconds per resharding: timed, or with ``cost == "model"`` priced from its compiled
    collectives; ``None`` where XLA could not compile or run it."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec
    from cfp.jax_compat import to_dtype
    from cfp.measure import model_cost, time_runs
    mesh = state["mesh"]
    out = {}
    for shape, dtype, src, dst in items:
        s_src = NamedSharding(mesh, PartitionSpec(*src))
        s_dst = NamedSharding(mesh, PartitionSpec(*dst))
        f = jax.jit(lambda a: a, in_shardings=s_src, out_shardings=s_dst)
        key = (shape, dtype, src, dst)
        try:
            if options.cost == "model":  # compiled for its collectives: no data needed
                abstract = jax.ShapeDtypeStruct(shape, to_dtype(dtype), sharding=s_src)
                out[key] = model_cost(f.lower(abstract).compile(), tuple(mesh.devices.shape),
                                      options.cost_model)[0]
                continue
            x = jax.device_put(np.ones(shape, dtype=np.float32).astype(dtype)
                               if dtype != "bfloat16" else jax.numpy.ones(shape, dtype), s_src)
            times, _ = time_runs(f, (x,), best_s=None)
        except JAX_ERRORS:
            out[key] = None
            continue
        out[key] = max(0.0, statistics.median(times) - state["overhead"])
    return out
