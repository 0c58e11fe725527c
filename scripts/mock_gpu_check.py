"""An 8-GPU node planned on the one GPU here (``--cost mock``), and the checks one GPU allows.

Run by ``scripts/mock_gpu_check.sh`` on a machine with one NVIDIA GPU. Each part runs in its
own process, since XLA's mock topology is fixed when a process's backends start, and writes
as it goes, so a run stopped at a time limit keeps what it has:

- ``probe``: under ``jax_mock_gpu_topology=1x8x1`` (8 mocked hosts of one GPU each), what JAX
  shows (devices, processes), whether a collective runs (an all-reduce of 32 MiB per GPU
  timed against the same program without it), and a Megatron MLP (forward and backward, the first weight
  split by columns, the second by rows) timed as partition 0 of the 8-GPU program against
  the same per-device computation written for one GPU and run alone. Where this JAX can
  describe a node of 8 GPUs (``topologies``, ``1x1x8``), the MLP is compiled for it too and
  its collectives compared with the mocked compile's.
- ``cfp``: ``python -m cfp --cluster <gpu>-8 --cost mock --max-combinations 8`` (analysis,
  profile, search; windows of at most 8 combinations keep the GPU compiles to about 160).
- ``step``: the plan's whole step compiled on the mocked mesh and run in a loop with its
  state donated (partition 0 timed), its collectives priced as the profile prices them,
  against the composition cfp predicted; ``step-memory``: the same step compiled without
  autotuning in a fresh process, its compiled memory against the GPU's measured peak.

Writes ``<out>-log.txt`` (every part's output), ``<out>-checks.csv`` (check, measured,
reference, ratio, note), and cfp's ``<out>-plan.json`` and ``<out>-profile.csv``. Each part
stops at its own time limit (60, 300, 75 and 75 s), so the run ends within 9 minutes.
Usage: ``python scripts/mock_gpu_check.py --out scripts/results/<date>-gpu-mock``
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# gpt 1.3b at 2 layers, batch 16, sequence 1024 (the preset's), bfloat16
MODEL = ("gpt", "1.3b", 16, "bfloat16", (("num_layers", 2),))
NUM_GPUS = 8


def versions() -> dict:
    import jax
    import jaxlib
    dev = jax.local_devices()[0]
    return {"python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "device": getattr(dev, "device_kind", str(dev))}


def row(out: Path, check: str, measured, reference, note: str = "") -> None:
    path = Path(f"{out}-checks.csv")
    new = not path.exists()
    with path.open("a", newline="") as f:
        w = csv.writer(f)
        if new:
            w.writerow(["check", "measured", "reference", "ratio", "note"])
        ratio = (measured / reference) if measured is not None and reference else ""
        w.writerow([check, measured, reference, f"{ratio:.4f}" if ratio != "" else "", note])
    print(f"{check}: {measured} against {reference} ({note})", flush=True)


def median_s(fn, args) -> float:
    """Median seconds of ``fn(*args)`` after 3 warm-up runs, over 20 (the GPU check's timer)."""
    from gpu_check import time_call  # scripts/, beside this file
    return statistics.median(time_call(fn, args, warmup=3, reps=20))


def global_array(x, sharding):
    """``x`` (NumPy) laid out by ``sharding``, of which this process holds one GPU's part."""
    import jax
    return jax.make_array_from_callback(x.shape, sharding, lambda idx: x[idx])


def probe(out: Path) -> None:
    from cfp.jax_compat import mock_gpus
    mock_gpus(NUM_GPUS)
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from cfp.cost_model import collectives_cost
    from cfp.cluster import load_cluster
    info = dict(versions(), device_count=jax.device_count(),
                local_device_count=jax.local_device_count(),
                process_count=jax.process_count(), platform=jax.devices()[0].platform)
    print("mocked:", json.dumps(info), flush=True)
    mesh = Mesh(np.array(jax.devices()), ("m0",))
    # A collective under mock: an all-reduce of 32 MiB per GPU (a sum over a split dim)
    # against the same elementwise work with no collective.
    n = 2**26 // NUM_GPUS
    x = global_array(np.ones((NUM_GPUS, n), np.float32), NamedSharding(mesh, P("m0", None)))
    reduce = jax.jit(lambda v: (v * 2).sum(0), out_shardings=NamedSharding(mesh, P()))
    local = jax.jit(lambda v: v * 2, out_shardings=NamedSharding(mesh, P("m0", None)))
    t_reduce, t_local = median_s(reduce, (x,)), median_s(local, (x,))
    got = np.asarray(reduce(x).addressable_shards[0].data[:4])
    row(out, "all-reduce of 32 MiB per GPU under mock (s)", t_reduce, t_local,
        f"against the same work without it; partition 0's result {got.tolist()} "
        f"(the true sum is {2 * NUM_GPUS})")
    # Megatron MLP at gpt-1.3b's width, one layer's forward and backward.
    batch, seq, hidden = 16, 1024, 2048
    ffn = 4 * hidden
    rng = np.random.default_rng(0)
    xs = rng.standard_normal((batch, seq, hidden), np.float32).astype(jnp.bfloat16)
    w1 = (rng.standard_normal((hidden, ffn), np.float32) / 45).astype(jnp.bfloat16)
    w2 = (rng.standard_normal((ffn, hidden), np.float32) / 90).astype(jnp.bfloat16)

    def mlp_loss(w1, w2, x):
        return jnp.sum(jax.nn.gelu(x @ w1) @ w2, dtype=jnp.float32)

    # the loss and every gradient: the loss's partial sums and the input's gradient are
    # all-reduced over the 8 GPUs (Megatron's g and f)
    grad = jax.value_and_grad(mlp_loss, argnums=(0, 1, 2))
    s_x, s_w1, s_w2 = (NamedSharding(mesh, P()), NamedSharding(mesh, P(None, "m0")),
                       NamedSharding(mesh, P("m0", None)))
    outs = (NamedSharding(mesh, P()), (s_w1, s_w2, s_x))
    tp = jax.jit(grad, in_shardings=(s_w1, s_w2, s_x), out_shardings=outs)
    args = (global_array(w1, s_w1), global_array(w2, s_w2), global_array(xs, s_x))
    compiled = tp.lower(*args).compile()
    text = compiled.as_text()
    cost = load_cluster(f"{gpu_name()}-8").cost_model((NUM_GPUS,))
    priced, colls = collectives_cost(text, (NUM_GPUS,), cost)
    t_tp = median_s(compiled, args)
    dev = jax.local_devices()[0]
    alone = jax.jit(grad)
    local_args = [jax.device_put(a, dev) for a in
                  (w1[:, :ffn // NUM_GPUS], w2[:ffn // NUM_GPUS], xs)]
    t_alone = median_s(alone, local_args)
    row(out, "tensor-parallel MLP window, partition 0 under mock vs alone (s)", t_tp, t_alone,
        f"hidden {hidden}, ffn {ffn}, batch {batch}x{seq}, bf16, forward+backward; its "
        f"collectives {[c[0] for c in colls]} priced {priced * 1e3:.3f} ms (not in the time)")
    mem = compiled.memory_analysis()
    print("TP MLP compiled under mock: temp", mem.temp_size_in_bytes, "args",
          mem.argument_size_in_bytes, flush=True)
    # One node of 8 GPUs described (no devices needed), where this JAX can.
    try:
        from jax.experimental import topologies
        target = (ROOT / "cfp" / "gpu_targets" / f"{gpu_name()}.txtpb").read_text()
        topo = topologies.get_topology_desc(platform="cuda", target_config=target,
                                            topology=f"1x1x{NUM_GPUS}")
        node = topologies.make_mesh(topo, (NUM_GPUS,), ("m0",))
        sh = lambda s: NamedSharding(node, s.spec)  # noqa: E731
        abstract = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh(s))
                    for a, s in zip((w1, w2, xs), (s_w1, s_w2, s_x))]
        node_compiled = jax.jit(grad, in_shardings=tuple(sh(s) for s in (s_w1, s_w2, s_x)),
                                out_shardings=(sh(outs[0]), tuple(sh(s) for s in outs[1]))
                                ).lower(*abstract).compile()
        node_colls = collectives_cost(node_compiled.as_text(), (NUM_GPUS,), cost)[1]
        row(out, "TP MLP temporaries: one node described (1x1x8) vs mocked hosts (1x8x1), "
                 "bytes", node_compiled.memory_analysis().temp_size_in_bytes,
            mem.temp_size_in_bytes,
            f"collectives one node {sorted(node_colls)}; mocked hosts {sorted(colls)}")
    except Exception as e:  # noqa: BLE001 - a finding to record, not a failure of the check
        row(out, "one node described (1x1x8)", None, None,
            f"not compiled here: {type(e).__name__}: {str(e)[:200]}")


def gpu_name() -> str:
    """The GPU here as cfp's presets name it (nvidia-smi's words: no CUDA context made)."""
    kind = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout
    return "h200" if "H200" in kind else "a100" if "A100" in kind else "h100"


def step(out: Path, workdir: Path, memory_only: bool) -> None:
    """The plan's whole step in a loop. ``memory_only``: compiled without autotuning, whose
    trial buffers would set the GPU's peak before the step runs, and run 3 steps for the
    peak alone; else compiled as the profile compiled its windows and timed."""
    if memory_only:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_gpu_autotune_level=0").strip()
    from cfp.jax_compat import mock_gpus
    mock_gpus(NUM_GPUS)
    import jax
    import numpy as np
    from cfp import plan as cfp_plan
    from cfp.cluster import load_cluster
    from cfp.execute import real_inputs
    from cfp.measure import memory_of
    from cfp.cost_model import collectives_cost
    plan = cfp_plan.load_plan(workdir / "plan.json")
    mesh = cfp_plan.mesh_of(plan)
    from cfp.workloads import WorkloadSpec
    workload = WorkloadSpec(*MODEL).build()
    with jax.default_device(jax.devices("cpu")[0]):  # made off the GPU: its peak is the step's
        leaves = real_inputs(workload)
    params_def = jax.tree_util.tree_structure(workload.abstract_params())
    opt_def = jax.tree_util.tree_structure(workload.abstract_opt_state())
    n_p, n_o = params_def.num_leaves, opt_def.num_leaves
    params = jax.tree_util.tree_unflatten(params_def, leaves[:n_p])
    opt_state = jax.tree_util.tree_unflatten(opt_def, leaves[n_p:n_p + n_o])
    batch = jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(
        workload.abstract_batch()), leaves[n_p + n_o:])
    abstract = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype),
                                      (params, opt_state, batch))
    jitted = cfp_plan.jit(workload.step_fn(), plan, mesh, *abstract)
    in_shardings, _ = cfp_plan.step_shardings(plan, mesh, *abstract)
    compiled = jitted.lower(*abstract).compile()
    memory = memory_of(compiled)
    dev = jax.local_devices()[0]
    stats = lambda: dev.memory_stats() or {}  # noqa: E731 - None on CPU
    before = stats().get("bytes_in_use", 0)
    args = jax.tree_util.tree_map(lambda x, s: global_array(np.asarray(x), s),
                                  (params, opt_state, batch), in_shardings)
    state, times = args[:2], []
    for k in range(3 if memory_only else 12):  # a loop, the state donated and fed back
        t0 = time.perf_counter()
        new_params, new_opt, loss = compiled(*state, args[2])
        jax.block_until_ready(loss)
        if k >= 2:
            times.append(time.perf_counter() - t0)
        state = (new_params, new_opt)
    peak = stats().get("peak_bytes_in_use", 0) - before
    cost = load_cluster(f"{gpu_name()}-8").cost_model(tuple(mesh.devices.shape))
    priced, colls = collectives_cost(compiled.as_text(), tuple(mesh.devices.shape), cost)
    measured = statistics.median(times)
    predicted = plan.get("predicted_step", {})
    composed = predicted.get("seconds", float("nan")) - predicted.get("priced_seconds", 0.0)
    if not memory_only:
        row(out, "plan's whole step, partition 0 under mock vs the composed windows (s)",
            measured, composed, f"median of 10 steps in a loop, state donated; its "
            f"{len(colls)} collectives priced {priced * 1e3:.3f} ms, cfp's composition "
            f"priced {predicted.get('priced_seconds', float('nan')) * 1e3:.3f} ms")
        return
    row(out, "plan's whole step: GPU's measured peak vs compiled memory (bytes)", peak,
        memory["peak_bytes"], f"compiled without autotuning; arguments {memory['argument_bytes']}, temporaries "
        f"{memory['temp_bytes']}, outputs {memory['output_bytes']}; cfp composed "
        f"{plan.get('memory_per_device', {}).get('composed_bytes')}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", nargs="?", choices=("all", "probe", "step", "step-memory"),
                    default="all")
    ap.add_argument("--out", default=f"scripts/results/{time.strftime('%Y-%m-%d')}-gpu-mock")
    ap.add_argument("--workdir", default="/tmp/cfp-mock-gpt-1.3b")
    ap.add_argument("--profile-budget", default=None,
                    help="cfp's --profile-budget (none when left out)")
    args = ap.parse_args()
    out, workdir = Path(args.out), Path(args.workdir)
    if args.part == "probe":
        return probe(out)
    if args.part in ("step", "step-memory"):
        return step(out, workdir, args.part == "step-memory")
    out.parent.mkdir(parents=True, exist_ok=True)
    log = Path(f"{out}-log.txt")
    me = [sys.executable, str(Path(__file__).resolve())]
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get(
                   "PYTHONPATH", "").split(os.pathsep) if p]))
    cluster = f"{gpu_name()}-8"
    runs = [("probe", 60, me + ["probe", "--out", str(out)]),
            ("cfp", 300, [sys.executable, "-m", "cfp", "--model", MODEL[0], "--config", MODEL[1],
                     "--batch-size", str(MODEL[2]), "--dtype", MODEL[3], "--num-layers",
                     str(dict(MODEL[4])["num_layers"]), "--cluster", cluster, "--cost",
                     "mock", "--max-combinations", "8", "--workdir", str(workdir), "-v"]
             + (["--profile-budget", args.profile_budget] if args.profile_budget else [])),
            ("step", 75, me + ["step", "--out", str(out), "--workdir", str(workdir)]),
            ("step-memory", 75, me + ["step-memory", "--out", str(out), "--workdir",
                                      str(workdir)])]
    for name, limit_s, cmd in runs:
        with log.open("a") as f:
            f.write(f"$ {' '.join(cmd[1:])}\n")
            f.flush()
            t0 = time.perf_counter()
            proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=limit_s)
            except subprocess.TimeoutExpired:  # the part and its workers, not the rest
                os.killpg(proc.pid, 9)
                code = f"killed at its limit of {limit_s} s"
            f.write(f"[{name}: exit {code} in {time.perf_counter() - t0:.1f} s]\n")
        if name == "cfp":
            for src, dst in ((workdir / "plan.json", f"{out}-plan.json"),
                             (workdir / "mock" / "profile.csv", f"{out}-profile.csv")):
                if src.exists():
                    Path(dst).write_text(src.read_text())
    print(log.read_text())


if __name__ == "__main__":
    main()
