"""One GPU against what cfp assumes of it without one: its description, the memory XLA's GPU
compiler gives for the described GPU, and bfloat16 numerics against the CPU.

Run on a machine with one NVIDIA GPU (``--tiny``: toy sizes, to check the script here). Each
part runs in its own process, under its own time limit, and writes rows as it goes to
``<out>-checks.csv`` (check, measured, reference, ratio, note) and its output to
``<out>-log.txt``:

- ``describe``: what the GPU reports (name, streaming multiprocessors, compute capability,
  memory) against ``cfp/gpu_targets/<gpu>.txtpb``.
- ``memory``: per case, the one-device training step (Adam, state donated) compiled three
  ways: for the GPU here, for the described GPU with no device (``cfp.gpu_compile``, what
  ``--cost model`` and ``--cluster`` use), and for the CPU; then run 3 steps in a loop with its
  peak read from the GPU. Compiled without autotuning, like the compile for a described GPU,
  so that no trial buffer sets the peak.
- ``bf16``: 3 steps of a small GPT in a loop, state donated, on the GPU and on the CPU in
  one process: each step's loss and, after 3 steps, the parameter that differs most
  (its difference over the norm of its update), in bfloat16 and, for scale, in float32.

Usage: ``python scripts/gpu_compile_check.py --out scripts/results/<date>-gpu-compile``
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (name, WorkloadSpec arguments): one-device steps that fill a good part of the GPU
CASES = [("gpt 1.3b, 2 layers, batch 16, bf16", ("gpt", "1.3b", 16, "bfloat16",
                                                  (("num_layers", 2),))),
         ("gpt 1.3b, 2 layers, batch 16, f32 weights, bf16 compute",
          ("gpt", "1.3b", 16, "float32", (("num_layers", 2), ("compute_dtype", "bfloat16")))),
         ("llama 7b, 2 layers, batch 4, seq 1024, bf16",
          ("llama", "7b", 4, "bfloat16", (("num_layers", 2), ("seq_len", 1024))))]
TINY_CASES = [("gpt tiny, bf16", ("gpt", "tiny", 8, "bfloat16", ())),
              ("gpt tiny, f32 weights, bf16 compute",
               ("gpt", "tiny", 8, "float32", (("compute_dtype", "bfloat16"),)))]
BF16_STEP = ("gpt", "125m", 8, (("num_layers", 2), ("seq_len", 256)))
TINY_BF16_STEP = ("gpt", "tiny", 8, ())


def describe(out: Path) -> None:
    import jax
    from cfp import gpu_compile
    from mock_gpu_check import gpu_name, row  # scripts/, beside this file
    dev = jax.local_devices()[0]
    gpu = gpu_name()
    text = gpu_compile.description(gpu)
    import re
    field = lambda k: re.search(rf"{k}:\s*([\d.]+)", text).group(1)  # noqa: E731
    row(out, f"{gpu}: device name", None, None,
        f"reported {dev.device_kind!r}, described {gpu_compile.device_name(gpu)!r}")
    row(out, f"{gpu}: streaming multiprocessors", getattr(dev, "core_count", None),
        int(field("core_count")))
    cc = getattr(dev, "compute_capability", None)
    row(out, f"{gpu}: compute capability", float(cc) if cc else None,
        float(field("major")), "reported against the description's major version")
    limit = (dev.memory_stats() or {}).get("bytes_limit")
    share = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75))
    row(out, f"{gpu}: memory (bytes)", limit, gpu_compile.memory_bytes(gpu),
        f"JAX's allocation limit against the description's device memory; JAX's allocator "
        f"may use {share} of it (XLA_PYTHON_CLIENT_MEM_FRACTION)")


def memory(out: Path, tiny: bool, case: int) -> None:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_gpu_autotune_level=0").strip()
    import cfp  # noqa: F401 - before JAX starts, so the CUDA plugin loads for a described GPU
    import jax
    from jax.sharding import NamedSharding, PartitionSpec as P
    from cfp import gpu_compile
    from cfp.measure import memory_of
    from cfp.models import adam_init
    from cfp.workloads import WorkloadSpec
    from mock_gpu_check import gpu_name, row
    gpu = "h100" if tiny else gpu_name()
    described = gpu_compile.gpu_mesh(gpu, (1,), ("m0",))
    dev, cpu = jax.local_devices()[0], jax.devices("cpu")[0]
    for name, spec in (TINY_CASES if tiny else CASES)[case:case + 1]:  # a process each: the
        w = WorkloadSpec(*spec).build()  # GPU's peak in use is the process's
        step = jax.jit(w.train_step(), donate_argnums=(0, 1))
        with jax.default_device(cpu):  # made off the GPU: its peak is the step's
            params = w.init_params(jax.random.key(0))
            args = (params, (w.opt_init or adam_init)(params), w.make_batch(jax.random.key(1)))
        shape = lambda s: jax.tree_util.tree_map(  # noqa: E731
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), args)
        figures = {}
        for where, sharding in (("described", NamedSharding(described, P())),
                                ("cpu", jax.sharding.SingleDeviceSharding(cpu)),
                                ("here", jax.sharding.SingleDeviceSharding(dev))):
            t0 = time.perf_counter()
            compiled = step.lower(*shape(sharding)).compile()
            figures[where] = dict(memory_of(compiled), compile_s=time.perf_counter() - t0)
        stats = lambda: dev.memory_stats() or {}  # noqa: E731 - None on CPU
        state = jax.device_put(args, dev)
        before = stats().get("bytes_in_use", 0)
        for _ in range(3):
            p, o, loss = compiled(state[0], state[1], state[2])
            jax.block_until_ready(loss)
            state = (p, o, state[2])
        peak = stats().get("peak_bytes_in_use", 0)
        note = lambda k: ", ".join(f"{x} {figures[k][x + '_bytes']}"  # noqa: E731
                                   for x in ("argument", "temp", "output"))
        row(out, f"{name}: temporaries compiled for the {gpu} described vs here (bytes)",
            figures["described"]["temp_bytes"], figures["here"]["temp_bytes"],
            f"described: {note('described')}; here: {note('here')}")
        row(out, f"{name}: temporaries compiled for the CPU vs here (bytes)",
            figures["cpu"]["temp_bytes"], figures["here"]["temp_bytes"], note("cpu"))
        row(out, f"{name}: compiled peak for the {gpu} described vs the GPU's measured peak "
                 "(bytes)", figures["described"]["peak_bytes"], peak,
            f"measured: the most in use over 3 steps ({before} in use before them); compiled "
            f"here: {figures['here']['peak_bytes']}")

def bf16(out: Path, tiny: bool) -> None:
    import jax
    import numpy as np
    from cfp.models import adam_init, get_workload
    from mock_gpu_check import row
    model, preset, batch, overrides = TINY_BF16_STEP if tiny else BF16_STEP
    devices = {"gpu": jax.local_devices()[0], "cpu": jax.devices("cpu")[0]}
    for dtype in ("bfloat16", "float32"):
        w = get_workload(model, preset, batch_size=batch, dtype=dtype, **dict(overrides))
        runs = {}
        for where, dev in devices.items():
            with jax.default_device(dev):
                params = w.init_params(jax.random.key(0))
                state = (params, (w.opt_init or adam_init)(params))
                data = w.make_batch(jax.random.key(1))
                names = [jax.tree_util.keystr(k) for k, _ in
                         jax.tree_util.tree_leaves_with_path(params)]
                start = [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(params)]
                step = jax.jit(w.train_step(), donate_argnums=(0, 1))
                losses = []
                for _ in range(3):
                    p, o, loss = step(*state, data)
                    losses.append(float(loss))
                    state = (p, o)
                end = [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(state[0])]
            runs[where] = (losses, start, end)
        (g_loss, g0, g1), (c_loss, c0, c1) = runs["gpu"], runs["cpu"]
        for k, (a, b) in enumerate(zip(g_loss, c_loss)):
            row(out, f"{dtype} step {k + 1}: loss on the GPU vs the CPU", a, b,
                f"relative difference {abs(a - b) / abs(b):.2e}")
        worst = max(range(len(g1)), key=lambda i: np.linalg.norm(g1[i] - c1[i])
                    / max(np.linalg.norm(c1[i] - c0[i]), 1e-30))
        row(out, f"{dtype}: after 3 steps, the parameter that differs most: GPU vs CPU "
                 "difference over its update's norm", float(np.linalg.norm(
                     g1[worst] - c1[worst])), float(np.linalg.norm(c1[worst] - c0[worst])),
            f"{names[worst]}, leaf {worst} of {len(g1)}, shape {g1[worst].shape} (a leaf whose "
            f"gradient is 0 in exact arithmetic, as a key bias's is, takes Adam steps of "
            f"rounding noise); starting values equal: "
            f"{bool(np.array_equal(g0[worst], c0[worst]))}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("part", nargs="?", choices=("all", "describe", "memory", "bf16"),
                    default="all")
    ap.add_argument("--out", default=f"scripts/results/{time.strftime('%Y-%m-%d')}-gpu-compile")
    ap.add_argument("--tiny", action="store_true", help="toy sizes, to check the script here")
    ap.add_argument("--case", type=int, default=0, help="memory: which of the cases")
    args = ap.parse_args()
    out = Path(args.out)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if args.part == "describe":
        return describe(out)
    if args.part == "bf16":
        return bf16(out, args.tiny)
    if args.part == "memory":
        return memory(out, args.tiny, args.case)
    out.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", XLA_PYTHON_CLIENT_PREALLOCATE="false",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in os.environ.get(
                   "PYTHONPATH", "").split(os.pathsep) if p]))
    cases = len(TINY_CASES if args.tiny else CASES)
    parts = ([("describe", [], 60)] * (not args.tiny) + [("bf16", [], 120)]
             + [("memory", ["--case", str(k)], 100) for k in range(cases)])
    with Path(f"{out}-log.txt").open("a") as log:
        for part, extra, limit_s in parts:
            cmd = ([sys.executable, __file__, part, "--out", str(out)] + extra
                   + ["--tiny"] * args.tiny)
            log.write(f"$ {' '.join(cmd[1:])}\n")
            log.flush()
            t0 = time.perf_counter()
            try:
                code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                      cwd=ROOT, timeout=limit_s).returncode
            except subprocess.TimeoutExpired:
                code = f"killed at its limit of {limit_s} s"
            log.write(f"[{part}: exit {code} in {time.perf_counter() - t0:.1f} s]\n")
            log.flush()
    print(Path(f"{out}-log.txt").read_text())


if __name__ == "__main__":
    main()
