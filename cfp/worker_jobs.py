"""What the measurement worker (``cfp.worker``) does with each request, in its process: set up
the traced step and the mesh (``setup``), measure a window's combinations (compile a batch in
threads, then time it with nothing else running, in interleaved rounds; under mocked GPUs, price
the collectives the GPU here skipped), and time or price reshardings."""
from __future__ import annotations

import dataclasses
import logging
import math
import os
import statistics

from cfp import multihost
from cfp.errors import CfpError
from cfp.jax_compat import JAX_ERRORS
from cfp.measure import OVER_BUDGET, Measurement
from cfp.phases import Phases

log = logging.getLogger(__name__)


def setup(analysis, phases: Phases, compile_for: str | None = None):
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
        try:
            cpus = jax.devices("cpu") if mocked_gpus() else []
        except RuntimeError:  # JAX started without its CPU backend
            cpus = []
        if len(cpus) >= math.prod(analysis.mesh_shape):  # to check collectives on, as above
            import numpy as np
            from cfp.jax_compat import auto_axis_types
            cpu_mesh = jax.sharding.Mesh(
                np.array(cpus[:len(mesh.devices.flat)]).reshape(mesh.devices.shape),
                mesh.axis_names, **auto_axis_types(len(mesh.axis_names)))
    return {"analysis": analysis, "program": program, "mesh": mesh, "overhead": overhead,
            "anchor": anchor, "inputs": {}, "programs": {},
            "cpu_mesh": cpu_mesh}


def measure_window(conn, state, options, window, combos, best_s,
                    one_at_a_time=False):
    """Compile a batch of combinations (in threads: XLA releases the GIL), then time them with
    nothing else running; on a CPU host with cores to spare (8 or more) the next batch
    compiles while this one is timed."""
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
    # A GPU compile autotunes its kernels on the GPU: it would time beside a batch being
    # timed, and many at once contend for the device. There, compiles overlap no timing and
    # run 2 at a time.
    on_gpu = options.cost != "model" and state["mesh"].devices.flat[0].platform != "cpu"
    overlap = cores >= 8 and not on_gpu
    threads = max(1, min(cores - (1 if overlap else 0), 2 if on_gpu else 8))
    size = 1 if one_at_a_time else options.batch
    batches = [combos[i:i + size] for i in range(0, len(combos), size)]
    with ThreadPoolExecutor(max_workers=threads) as pool:
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
    """The measurement of a combination compiled to the same program as ``combo`` (its
    note, after the one that says so)."""
    return dataclasses.replace(m, compile_s=compile_s, same_program_as=combo,
                               note=f"the same program as {list(combo)}, measured once"
                               + (f"; {m.note}" if m.note else ""))


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
                           note=f"compiled peak {mem['peak_bytes']} B {OVER_BUDGET}", **mem)
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


def measure_reshards(state, options, items):
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
