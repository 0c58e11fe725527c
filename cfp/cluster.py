"""Clusters described, not owned: devices, their network levels, and how a logical mesh maps
onto them.

A ``Cluster`` is a stack of network *levels*, outermost first (``50 nodes x 4 GPUs``: a node
level over a GPU level), each with its alpha (seconds per collective) and beta (seconds per
byte), plus per-device memory, peak FLOP/s and memory bandwidth; the devices are GPUs unless
said otherwise (their memory follows XLA's GPU fusion: ``cfp.window_memory.expensive``). Devices
are numbered
row-major over the levels (the innermost level varies fastest), and a logical mesh is laid
over them row-major too, so its last axis is the fastest-varying one. A mesh axis whose devices
differ in an outer level's coordinate crosses that level: it takes the slowest alpha and beta
of the levels it spans (``Cluster.cost_model``).

Clusters come from a named preset (``PRESETS``) or a small JSON file::

    {"name": "my-cluster", "levels": [
        {"name": "node", "size": 4, "alpha_s": 1e-5, "bandwidth_GBps": 25},
        {"name": "gpu", "size": 8, "alpha_s": 5e-6, "bandwidth_GBps": 150}],
     "memory_per_device_GB": 80, "peak_TFLOPs": 312, "memory_bandwidth_GBps": 2039,
     "assumed": ["alpha_s"], "gpu": "a100"}

Bandwidths are in GB/s (10**9 bytes), and ``memory_per_device_GB`` is read in GiB (2**30
bytes, as budgets and the console count memory). ``gpu`` (optional) names the devices'
description (``cfp.gpu_compile.GPUS``: a100, h100, h200): with JAX's CUDA plugin installed,
the cluster's programs are compiled for those GPUs.

Example:
    >>> c = load_cluster("alpa-50x4")
    >>> c.mesh_shape, c.num_devices
    ((50, 4), 200)
    >>> c.cost_model((50, 4)).beta == (1 / 1e9, 1 / 100e9)
    True
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

from cfp.errors import CfpError

MAX_DEVICES = 2**16  # the most devices of a described cluster


@dataclasses.dataclass(frozen=True)
class Level:
    name: str
    size: int
    alpha_s: float  # seconds per collective across this level
    beta_s_per_byte: float  # seconds per byte across this level (1 / bandwidth)


@dataclasses.dataclass(frozen=True)
class Cluster:
    name: str
    levels: tuple[Level, ...]  # outermost first
    memory_per_device_bytes: int
    device_flops: float  # peak FLOP/s of one device
    device_bandwidth: float  # memory bytes/s of one device
    assumed: tuple[str, ...] = ()  # figures that are assumptions, not documented values
    platform: str = "gpu"  # the devices' XLA platform (``cfp.cost_model.CostModel.platform``)
    gpu: str | None = None  # the devices' description (``cfp.gpu_compile.GPUS``), if any

    @property
    def num_devices(self) -> int:
        return math.prod(level.size for level in self.levels)

    @property
    def mesh_shape(self) -> tuple[int, ...]:
        """One mesh axis per level of more than one device (``50x4``)."""
        return tuple(level.size for level in self.levels if level.size > 1) or (1,)

    def levels_of_axis(self, mesh_shape, axis: int) -> tuple[int, ...]:
        """The levels whose coordinate changes along mesh axis ``axis`` (both row-major)."""
        stride = math.prod(mesh_shape[axis + 1:])
        spans = set()
        for t in range(1, mesh_shape[axis]):
            device = t * stride
            for lv in range(len(self.levels)):
                inner = math.prod(level.size for level in self.levels[lv + 1:])
                if (device // inner) % self.levels[lv].size:
                    spans.add(lv)
        return tuple(sorted(spans))

    def cost_model(self, mesh_shape):
        """``cfp.cost_model.CostModel``: alpha-beta per mesh axis (the slowest level each axis
        spans) and the roofline."""
        from cfp.cost_model import CostModel  # imports JAX, which must not start before the CLI
        # has set the device count
        if math.prod(mesh_shape) != self.num_devices:
            raise CfpError(f"mesh {'x'.join(map(str, mesh_shape))} has "
                           f"{math.prod(mesh_shape)} devices; cluster {self.name} has "
                           f"{self.num_devices}")
        alpha, beta = [], []
        for a in range(len(mesh_shape)):
            lv = self.levels_of_axis(mesh_shape, a) or (len(self.levels) - 1,)
            alpha.append(max(self.levels[i].alpha_s for i in lv))
            beta.append(max(self.levels[i].beta_s_per_byte for i in lv))
        return CostModel(tuple(alpha), tuple(beta), self.device_flops, self.device_bandwidth,
                         self.platform, self.gpu)

    @property
    def nodes(self) -> tuple[int, int]:
        """(nodes, devices per node): the outermost level over the rest."""
        if len(self.levels) == 1:
            return 1, self.levels[0].size
        return self.levels[0].size, math.prod(level.size for level in self.levels[1:])

    def submesh(self, nodes: int, devices_per_node: int) -> "Cluster":
        """The cluster of ``nodes`` of its nodes, ``devices_per_node`` devices of each: a
        pipeline stage's submesh. The levels inside a node become one, at the slowest's
        alpha and beta."""
        inner = self.levels[1:] or self.levels
        levels = ((dataclasses.replace(self.levels[0], size=nodes),) if len(self.levels) > 1
                  else (dataclasses.replace(self.levels[0], size=1),))
        levels += (Level(inner[-1].name, devices_per_node, max(lv.alpha_s for lv in inner),
                         max(lv.beta_s_per_byte for lv in inner)),)
        return dataclasses.replace(self, name=f"{self.name}[{nodes}x{devices_per_node}]",
                                   levels=levels)

    def describe(self) -> str:
        levels = " x ".join(f"{lv.size} {lv.name}s ({1 / lv.beta_s_per_byte / 1e9:g} GB/s, "
                            f"alpha {lv.alpha_s:g} s)" for lv in self.levels)
        text = (f"{self.name}: {levels}; {self.memory_per_device_bytes / 2**30:g} GiB and "
                f"{self.device_flops / 1e12:g} TFLOP/s per device")
        return text + (f"; assumed: {', '.join(self.assumed)}" if self.assumed else "")


def _cluster(name, levels, memory_gb, tflops, hbm_gbps, assumed=(), gpu=None) -> Cluster:
    return Cluster(name, tuple(Level(n, size, alpha, 1 / (gbps * 1e9))
                               for n, size, alpha, gbps in levels),
                   int(memory_gb * 2**30), tflops * 1e12, hbm_gbps * 1e9, tuple(assumed),
                   gpu=gpu)


# Per-device figures are the vendors' (dense bf16 peak, HBM bandwidth, memory); per-link
# bandwidth is one direction per device: A100 NVLink 3 (600 GB/s both ways, about 150 GB/s
# effective for a ring collective), H100 NVLink 4 (450 GB/s), one 200 or 400 Gb/s NIC per GPU
# across nodes. Alphas are assumed everywhere. ``alpa-50x4`` is the case of Alpa's notes: 32 GiB
# and 125 TFLOP/s per device (V100-class), 100 GB/s inside a node and 1 GB/s across, the
# notes' 100:1 ratio; its memory bandwidth is assumed (V100's 900 GB/s).
PRESETS = {
    "a100-8": _cluster("a100-8", [("node", 1, 5e-6, 25), ("gpu", 8, 5e-6, 150)],
                       80, 312, 2039, ["alpha_s"], "a100"),
    "h100-8": _cluster("h100-8", [("node", 1, 5e-6, 50), ("gpu", 8, 3e-6, 450)],
                       80, 989, 3350, ["alpha_s"], "h100"),
    "h200-8": _cluster("h200-8", [("node", 1, 5e-6, 50), ("gpu", 8, 3e-6, 450)],
                       140, 989, 4800, ["alpha_s"], "h200"),
    "a100-64": _cluster("a100-64", [("node", 8, 1e-5, 25), ("gpu", 8, 5e-6, 150)],
                        80, 312, 2039, ["alpha_s"], "a100"),
    "h100-64": _cluster("h100-64", [("node", 8, 1e-5, 50), ("gpu", 8, 3e-6, 450)],
                        80, 989, 3350, ["alpha_s"], "h100"),
    "alpa-50x4": _cluster("alpa-50x4", [("node", 50, 1e-5, 1), ("gpu", 4, 5e-6, 100)],
                          32, 125, 900, ["alpha_s", "memory_bandwidth"]),
}


# What a cluster file holds, each number with the bounds a real cluster can have (the command
# line's own, ``cfp.options.BOUNDS``): per key, its lowest and highest value.
FIGURES = {"memory_per_device_GB": (2**-10, 2**20), "peak_TFLOPs": (1e-6, 1e6),
           "memory_bandwidth_GBps": (1e-6, 1e7)}
LEVEL_FIGURES = {"alpha_s": (0.0, 1.0), "bandwidth_GBps": (1e-9, 1e7)}
KEYS, LEVEL_KEYS = {"name", "levels", "assumed", "gpu", *FIGURES}, {"name", "size",
                                                                     *LEVEL_FIGURES}
# A name that goes into a path (the default work dir) is one plain path component.
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")


def load_cluster(name_or_path: str) -> Cluster:
    """A preset by name, or a cluster from a JSON file (see the module docstring), every key
    known and every value checked before anything uses it."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if not path.suffix == ".json":
        raise CfpError(f"unknown cluster {name_or_path!r}: give a preset "
                       f"({', '.join(PRESETS)}) or a .json file")
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        raise CfpError(f"no cluster file {path}") from None
    except OSError as e:  # a directory, or a file it may not read
        raise CfpError(f"cannot read the cluster file {path} ({e.strerror})") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CfpError(f"{path}: not a cluster description ({type(e).__name__}); see "
                       f"cfp/cluster.py for the format") from None
    return _checked(d, path)


def _checked(d, path: Path) -> Cluster:
    def refuse(what: str):
        raise CfpError(f"{path}: {what}; see cfp/cluster.py for the format")

    def known(obj, keys, where: str) -> None:
        if not isinstance(obj, dict):
            refuse(f"{where} must be an object of {', '.join(sorted(keys))}")
        unknown = sorted(map(str, set(obj) - keys))
        if unknown:
            refuse(f"{where} has the unknown key {unknown[0]!r} (known: "
                   f"{', '.join(sorted(keys))})")

    def number(obj, key: str, bounds, what: str) -> float:
        if key not in obj:
            refuse(f"{what} is missing")
        value, (low, high) = obj[key], bounds
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            refuse(f"{what} must be a number, got {value!r}")
        if not (math.isfinite(value) and low <= value <= high):
            refuse(f"{what} must be a finite number from {low:g} to {high:g}, got {value}")
        return float(value)

    def text(value, what: str, pattern=SAFE_NAME) -> str:
        if not isinstance(value, str) or not pattern.fullmatch(value):
            refuse(f"{what} must be a name of letters, digits, '.', '_' and '-' (at most 64, "
                   f"not starting with '.' or '-'), got {value!r}")
        return value

    known(d, KEYS, "the cluster")
    name = text(d.get("name", UNSAFE_CHARS.sub("_", path.stem).lstrip("._-")[:64] or
                      "cluster"), "name")
    raw_levels = d.get("levels")
    if not isinstance(raw_levels, list) or not raw_levels:
        refuse("levels must be a list of one level or more")
    levels = []
    for k, lv in enumerate(raw_levels):
        known(lv, LEVEL_KEYS, f"level {k}")
        lv_name = text(lv.get("name"), f"level {k}'s name")
        size = lv.get("size")
        if type(size) is not int or not 1 <= size <= MAX_DEVICES:
            refuse(f"level {lv_name}'s size must be a whole number from 1 to {MAX_DEVICES}, "
                   f"got {size!r}")
        levels.append((lv_name, size, *(number(lv, key, bounds, f"{lv_name} {key}")
                                        for key, bounds in LEVEL_FIGURES.items())))
    num_devices = math.prod(lv[1] for lv in levels)
    if num_devices > MAX_DEVICES:
        refuse(f"{num_devices} devices, over the {MAX_DEVICES} cfp plans for")
    figures = {key: number(d, key, bounds, key) for key, bounds in FIGURES.items()}
    assumed = d.get("assumed", [])
    if not isinstance(assumed, list):
        refuse(f"assumed must be a list of the figures assumed, got {assumed!r}")
    assumed = tuple(text(a, "each of assumed") for a in assumed)
    gpu = d.get("gpu")
    from cfp.gpu_compile import GPUS
    if gpu is not None and (not isinstance(gpu, str) or gpu not in GPUS):
        refuse(f"gpu {gpu!r} has no description: one of {', '.join(GPUS)}, or leave it out")
    return _cluster(name, levels, figures["memory_per_device_GB"], figures["peak_TFLOPs"],
                    figures["memory_bandwidth_GBps"], assumed, gpu)


def logical_meshes(num_devices: int, max_axes: int = 3) -> list[tuple[int, ...]]:
    """Every ordered factorization of ``num_devices`` into 1 to ``max_axes`` axes > 1."""
    out = []

    def rec(rest, prefix):
        if rest == 1 and prefix:
            out.append(tuple(prefix))
            return
        if len(prefix) == max_axes:
            return
        for d in range(2, rest + 1):
            if rest % d == 0:
                rec(rest // d, prefix + [d])

    rec(num_devices, [])
    return sorted(out, key=lambda s: (len(s), s)) or [(1,)]
