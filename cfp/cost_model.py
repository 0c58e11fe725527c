"""Alpa's alpha-beta cost model per mesh axis, with a compute roofline: documented presets,
a fit on the devices at hand, and the price of a compiled program (its compute from XLA's cost
analysis, or from its HLO where XLA gives none, plus its collectives)."""
from __future__ import annotations

import dataclasses
import math
import re
import statistics

import numpy as np

from cfp.collectives import collectives
from cfp.gpu_compile import hlo_cost
from cfp.jax_compat import cost_analysis
from cfp.timing import time_runs


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Alpa's alpha-beta model per mesh axis plus a compute roofline."""

    alpha: tuple[float, ...]  # seconds per collective, per mesh axis
    beta: tuple[float, ...]  # seconds per byte, per mesh axis
    device_flops: float  # FLOP/s of one device
    device_bandwidth: float  # bytes/s of one device's memory
    # the devices' XLA platform: which elementwise results its fusion recomputes
    # (``cfp.window_memory.expensive``) and so which the forward pass holds
    platform: str = "cpu"
    # the GPUs' description (``cfp.gpu_compile.GPUS``): where JAX's CUDA plugin is installed,
    # compile-only programs are compiled for them, not for the devices here
    gpu: str | None = None

    def collective_s(self, kind: str, axes: tuple[int, ...] | None, nbytes: int,
                     mesh_shape) -> float:
        axes = axes if axes else tuple(range(len(mesh_shape)))
        n = math.prod(mesh_shape[a] for a in axes)
        if n <= 1:
            return 0.0
        a = max(self.alpha[x] for x in axes)
        b = max(self.beta[x] for x in axes)
        if kind == "all-reduce":
            return a + b * 2 * (n - 1) / n * nbytes
        if kind in ("all-gather", "reduce-scatter"):
            return a + b * (n - 1) / n * nbytes
        if kind == "all-to-all":
            return a + b * (n - 1) / n / n * nbytes
        return a + b * nbytes  # collective-permute


# Documented presets (per device): peak dense bf16/fp32-TF32 FLOP/s, HBM bandwidth, and
# alpha-beta for NVLink inside a node (axis 1) and the network across nodes (axis 0).
DEVICE_PRESETS = {
    "a100": {"device_flops": 312e12, "device_bandwidth": 2.039e12,  # the 80 GB SXM4
             "alpha": (5e-6, 5e-6), "beta": (1 / 25e9, 1 / 150e9), "platform": "gpu",
             "gpu": "a100"},
    "h100": {"device_flops": 989e12, "device_bandwidth": 3.35e12,
             "alpha": (5e-6, 3e-6), "beta": (1 / 50e9, 1 / 450e9), "platform": "gpu",
             "gpu": "h100"},
    "h200": {"device_flops": 989e12, "device_bandwidth": 4.8e12,
             "alpha": (5e-6, 3e-6), "beta": (1 / 50e9, 1 / 450e9), "platform": "gpu",
             "gpu": "h200"},
}


def fit_cost_model(mesh, sizes=(2**12, 2**15, 2**18, 2**21)) -> CostModel:
    """Alpha-beta per mesh axis and a compute roofline, measured on the devices at hand.

    Per axis, all-reduces of ``sizes`` bytes (a sum over a dim split on that axis) are timed and
    ``t = alpha + beta * 2(n-1)/n * bytes`` is fitted by least squares; FLOP/s come from a
    matmul split over every device, bandwidth from an elementwise add."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec
    names, shape = mesh.axis_names, mesh.devices.shape
    alpha, beta = [], []
    for a, n in enumerate(shape):
        if n == 1:
            alpha.append(0.0), beta.append(0.0)
            continue
        xs, ys = [], []
        for nbytes in sizes:
            x = jax.device_put(jnp.ones((n, nbytes // 4), jnp.float32),
                               NamedSharding(mesh, PartitionSpec(names[a], None)))
            f = jax.jit(lambda v: v.sum(0), out_shardings=NamedSharding(mesh, PartitionSpec()))
            times, _ = time_runs(f, (x,), best_s=None, warmup=3, min_runs=20, max_runs=20)
            xs.append(2 * (n - 1) / n * nbytes)
            ys.append(statistics.median(times))
        slope, icept = np.polyfit(np.array(xs, float), np.array(ys, float), 1)
        alpha.append(max(float(icept), 1e-7)), beta.append(max(float(slope), 1e-13))
    n = math.prod(shape)
    k = 512
    a = jax.device_put(jnp.ones((n * k, k), jnp.float32),
                       NamedSharding(mesh, PartitionSpec(tuple(names), None)))
    w = jax.device_put(jnp.ones((k, k), jnp.float32), NamedSharding(mesh, PartitionSpec()))
    mm = jax.jit(lambda u, v: u @ v)
    t_mm = statistics.median(time_runs(mm, (a, w), best_s=None, warmup=3, min_runs=10,
                                       max_runs=10)[0])
    add = jax.jit(lambda u: u + 1.0)
    t_add = statistics.median(time_runs(add, (a,), best_s=None, warmup=3, min_runs=10,
                                        max_runs=10)[0])
    flops = 2 * k * k * k / t_mm  # per device: each holds k rows
    bandwidth = 2 * 4 * k * k / t_add
    return CostModel(tuple(alpha), tuple(beta), flops, bandwidth,
                     mesh.devices.flat[0].platform)


def model_cost(compiled, mesh_shape, cost: CostModel) -> tuple[float, tuple]:
    """Predicted seconds of a compiled program: roofline compute + alpha-beta collectives."""
    text = compiled.as_text()
    analysis = cost_analysis(compiled)
    if analysis:
        flops = float(analysis.get("flops", 0.0))
        nbytes = float(analysis.get("bytes accessed", 0.0))
    else:  # compiled for described GPUs: XLA gives no cost analysis there
        flops, nbytes = hlo_cost(text)
    compute = max(flops / cost.device_flops, nbytes / cost.device_bandwidth)
    if compute <= 0:
        raise RuntimeError("a compiled program priced at zero compute time: no FLOPs and no "
                           "bytes read from its HLO")
    comm, colls = collectives_cost(text, mesh_shape, cost)
    return compute + comm, colls


def collectives_cost(hlo_text: str, mesh_shape, cost: CostModel) -> tuple[float, tuple]:
    """Alpha-beta seconds of a compiled program's collectives, and those collectives
    ``((kind, mesh axes, bytes), ...)``. CPU's reduce-scatter (an all-reduce whose result is
    then sliced) is priced as one where the slices are ops of their own; a slice fused into
    the op that reads it is not seen, and the all-reduce is priced whole."""
    colls = collectives(hlo_text, mesh_shape)
    sliced = _sliced_allreduces(hlo_text)
    comm = 0.0
    for c in colls:
        kind = "reduce-scatter" if c.kind == "all-reduce" and c.line.split("=")[0].strip(
            " %") in sliced else c.kind
        comm += cost.collective_s(kind, c.axes, c.bytes, mesh_shape)
    return comm, tuple((c.kind, c.axes, c.bytes) for c in colls)


_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*.*?\s([\w\-]+)\((.*)$")


def _sliced_allreduces(text: str) -> set[str]:
    """Names of all-reduces whose every use is a dynamic-slice (CPU's reduce-scatter)."""
    users: dict[str, list[str]] = {}  # all-reduce name -> the opcodes of its users
    for line in text.splitlines():
        m = _INSTRUCTION.match(line)
        if m is None:
            continue
        name, opcode, rest = m.groups()
        if opcode == "all-reduce":
            users.setdefault(name, [])
        for used in set(re.findall(r"%([\w.\-]+)", rest)):
            if used in users:
                users[used].append(opcode)
    return {n for n, ops in users.items() if ops and all(op == "dynamic-slice" for op in ops)}


def fit_cost_model_for(mesh_shape, device_ids=None) -> CostModel:
    """``fit_cost_model`` on a mesh of this shape over JAX's devices, or those of
    ``device_ids`` in that order (run in the worker)."""
    from cfp.mesh import make_mesh
    return fit_cost_model(make_mesh(tuple(mesh_shape), device_ids=device_ids))
