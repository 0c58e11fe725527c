"""The GPU check: what one accelerator does with each model's step, and cfp on it.

Run by ``scripts/gpu_check.sh`` on a machine with one GPU and whatever JAX it has (``--tiny``
runs the same code on the CPU at toy sizes, so the script is known to work before a GPU is
lent). Writes to ``--out``:

- ``gpu-steps.csv``: per model, the single-device training step (bf16, jitted, parameters,
  Adam state and batch on the device) at a size that keeps the GPU busy: median step
  seconds, the step's FLOPs (cfp's count of every traced operator, forward, backward and
  update), TFLOP/s, and that as a share of a bf16 matmul measured on the same device
  (8192^3, the usual peak reference);
- ``gpu-pipeline.csv``: cfp's passes on the one-device mesh (``--mode`` all) with measured
  profiles and with ``--cost model`` (the ``h100`` and ``a100`` presets): the predicted step
  (the composition of the window profiles) next to the measured one, and each pass's time;
- the versions (Python, JAX, jaxlib, device kind) in every row.

Rows are written as they are measured, so a run stopped at a time limit keeps what it has.
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

# (model, preset, overrides, batch): sizes that fill a good part of one 80 GB GPU while
# compiling in well under a minute (fewer layers than the preset; the layers keep its width).
GPU_SIZES = [
    ("gpt", "1.3b", {"num_layers": 8}, 16),
    ("llama", "7b", {"num_layers": 4, "seq_len": 2048}, 8),
    ("moe", "1.3b", {"num_layers": 4}, 16),
    ("bert", "large", {"num_layers": 8}, 32),
    ("mlp", "wide", {}, 8192),
]
TINY_SIZES = [(m, "tiny", {}, 8) for m in ("gpt", "llama", "moe", "bert", "mlp")]
# cfp's whole pipeline on the one-device mesh: sizes whose profile runs in about a minute.
GPU_PIPELINE = {"gpt": ("gpt", "125m", {"num_layers": 4}, 16),
                "llama": ("llama", "7b", {"num_layers": 2, "seq_len": 1024}, 4),
                "moe": ("moe", "380m", {"num_layers": 4}, 16),
                "bert": ("bert", "base", {"num_layers": 4}, 16)}
TINY_PIPELINE = {m: (m, "tiny", {}, 8) for m in GPU_PIPELINE}


def versions() -> dict:
    import jax
    import jaxlib
    dev = jax.devices()[0]
    return {"python": platform.python_version(), "jax": jax.__version__,
            "jaxlib": jaxlib.__version__, "backend": dev.platform,
            "device": getattr(dev, "device_kind", str(dev))}


def time_call(fn, args, *, warmup: int = 2, reps: int = 10) -> list[float]:
    import jax
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        out.append(time.perf_counter() - t0)
    return out


def matmul_peak(n: int) -> float:
    """Median bf16 FLOP/s of an n x n x n matmul on the default device."""
    import jax
    import jax.numpy as jnp
    k1, k2 = jax.random.split(jax.random.key(0))
    a = jax.random.normal(k1, (n, n), jnp.bfloat16)
    b = jax.random.normal(k2, (n, n), jnp.bfloat16)
    f = jax.jit(lambda x, y: x @ y)
    return 2 * n**3 / statistics.median(time_call(f, (a, b)))


def step_row(model, preset, overrides, batch, peak, ver) -> dict:
    import jax
    from cfp.models import get_workload, adam_init
    from cfp.tracing import trace_step
    w = get_workload(model, preset, batch_size=batch, dtype="bfloat16", **overrides)
    flops = float(sum(op.flops for op in trace_step(w).graph().ops))
    params = w.init_params(jax.random.key(0))
    opt = (w.opt_init or adam_init)(params)
    data = w.make_batch(jax.random.key(1))
    step = jax.jit(w.train_step(), donate_argnums=(0, 1))
    t0 = time.perf_counter()
    compiled = step.lower(params, opt, data).compile()
    compile_s = time.perf_counter() - t0
    state = [params, opt]

    def run(_):
        state[0], state[1], loss = compiled(state[0], state[1], data)
        return loss

    times = time_call(run, (None,), warmup=2, reps=10)
    med = statistics.median(times)
    mem = compiled.memory_analysis()
    n_params = sum(x.size for x in jax.tree_util.tree_leaves(state[0]))
    return dict(ver, model=model, preset=preset,
                overrides=" ".join(f"{k}={v}" for k, v in overrides.items()), batch=batch,
                dtype="bfloat16", params_millions=round(n_params / 1e6, 1),
                compile_s=round(compile_s, 2), step_median_ms=round(med * 1e3, 3),
                step_min_ms=round(min(times) * 1e3, 3), step_max_ms=round(max(times) * 1e3, 3),
                step_tflop=round(flops / 1e12, 4), tflops=round(flops / med / 1e12, 2),
                matmul_peak_tflops=round(peak / 1e12, 1),
                share_of_matmul_peak=round(flops / med / peak, 3),
                temp_gb=round(getattr(mem, "temp_size_in_bytes", 0) / 2**30, 2))


def append_row(path: Path, row: dict) -> None:
    """Add ``row`` to the CSV at ``path``, rewriting it with the union of the columns."""
    rows = list(csv.DictReader(open(path))) if path.exists() else []
    rows.append(row)
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        w.writerows(rows)


def pipeline_rows(case, root: Path, ver, *, cpu: bool, log, cost_model: bool) -> list[dict]:
    """cfp's passes on the one-device mesh, measured (and with the analytic cost model)."""
    model, preset, overrides, batch = case
    rows = []
    runs = [("measure", [])] + [("model", ["--cost", "model", "--device-preset", p])
                                for p in ("h100", "a100") if cost_model]
    for cost, extra in runs:
        workdir = root / f"pipeline-{model}-{preset}-{cost}{'-' + extra[-1] if extra else ''}"
        cmd = [sys.executable, "-m", "cfp", "--model", model, "--config", preset,
               "--batch-size", str(batch), "--dtype", "bfloat16", "--mesh", "1",
               "--num-devices", "1", "--workdir", str(workdir)] + extra
        for k, v in overrides.items():
            cmd += [f"--{k.replace('_', '-')}", str(v)]
        if cpu:
            cmd += ["--memory-budget", "4"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        log(f"$ {' '.join(cmd[1:])}\n{proc.stdout}{proc.stderr}(exit {proc.returncode}, "
            f"{wall:.1f} s)")
        row = dict(ver, model=model, preset=preset,
                   overrides=" ".join(f"{k}={v}" for k, v in overrides.items()), batch=batch,
                   cost=cost + (f" ({extra[-1]})" if extra else ""), exit=proc.returncode,
                   wall_s=round(wall, 1))
        rep = workdir / "debug_search" / "report.json"
        if proc.returncode == 0 and rep.exists():
            r = json.loads(rep.read_text())
            row.update(predicted_step_ms=round(r["predicted_step_s"] * 1e3, 3),
                       measured_step_ms=round(r["measured_median_s"] * 1e3, 3),
                       prediction_error=round(r["predicted_step_s"] / r["measured_median_s"]
                                              - 1, 3),
                       memory_gb=round(r["memory_gb"], 3),
                       composed_memory_gb=round(r["composed_memory_gb"], 3),
                       tflops=round(r["tflop_count"] / r["measured_median_s"], 2))
        rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the CSVs and the log")
    p.add_argument("--tiny", action="store_true", help="toy sizes, to check the script on CPU")
    p.add_argument("--models", default="gpt,llama,moe,bert,mlp")
    p.add_argument("--skip-pipeline", action="store_true")
    p.add_argument("--pipeline-models", default=",".join(GPU_PIPELINE),
                   help="models whose pipeline runs (the first also with --cost model): "
                        + ",".join(GPU_PIPELINE))
    p.add_argument("--workdirs", default="profiles/gpu-check",
                   help="where cfp's work dirs for the pipeline runs go")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "gpu-check-log.txt"

    def log(text):
        print(text, flush=True)
        with open(log_path, "a") as f:
            f.write(text + "\n")

    ver = versions()
    log(f"versions: {ver}")
    peak = matmul_peak(512 if args.tiny else 8192)
    log(f"bf16 matmul: {peak / 1e12:.1f} TFLOP/s")
    wanted = args.models.split(",")
    for case in (TINY_SIZES if args.tiny else GPU_SIZES):
        if case[0] not in wanted:
            continue
        try:
            row = step_row(*case, peak, ver)
        except Exception as e:  # noqa: BLE001 - one model's failure is a result, not the end
            row = dict(ver, model=case[0], preset=case[1], error=f"{type(e).__name__}: "
                       f"{str(e).splitlines()[0][:200]}")
        log(f"step: {row}")
        append_row(out / "gpu-steps.csv", row)
    if not args.skip_pipeline:
        cases = TINY_PIPELINE if args.tiny else GPU_PIPELINE
        for i, model in enumerate(args.pipeline_models.split(",")):
            for row in pipeline_rows(cases[model], Path(args.workdirs), ver, cpu=args.tiny,
                                     log=log, cost_model=i == 0):
                log(f"pipeline: {row}")
                append_row(out / "gpu-pipeline.csv", row)
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.fspath(Path(__file__).resolve().parent.parent))
    raise SystemExit(main())
