"""Compiling for GPUs that are not here.

XLA's GPU compiler, given a description of the GPUs (a ``GpuTargetConfigProto``, one file per
GPU in ``cfp/gpu_targets/``), compiles a program for a mesh of them on a machine with no GPU,
through JAX's CUDA plugin (``pip install -e ".[gpu-compile]"``: the plugin and its PJRT
library, without the NVIDIA libraries). A program compiled so runs nowhere, but it is the
program those GPUs would run: its memory is XLA's GPU allocation (``memory_analysis``), its
collectives are the GPU's (reduce-scatters where CPU all-reduces), and its operations are
there to price. XLA picks kernels untimed, since nothing can be timed, and
``cost_analysis()`` returns None, so ``hlo_cost`` reads FLOPs and bytes from the compiled
HLO. A program that needs the NVIDIA libraries (cuDNN attention) does not compile this way.

``quiet_cuda_plugin`` runs before JAX starts (``import cfp``): with the plugin installed and
no NVIDIA driver on the machine, it skips the plugin's library check, which would print a
traceback at every JAX start, asks JAX for the CPU, and loads the plugin's libraries quietly.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import logging
import math
import os
import re
import sys
from pathlib import Path

log = logging.getLogger(__name__)

GPUS = ("a100", "h100", "h200")
TARGETS = Path(__file__).resolve().parent / "gpu_targets"
INSTALL = 'pip install -e ".[gpu-compile]"'


class Unavailable(Exception):
    """No GPU compile here: the one line that says why."""


def quiet_cuda_plugin() -> None:
    """Before JAX starts, on a machine with JAX's CUDA plugin and no NVIDIA driver: the
    plugin loads without checking for CUDA libraries, JAX uses the CPU (what the user set is
    kept), and the plugin's libraries are loaded now with the standard error closed, since
    at every load they say on it that they find no CUDA driver. JAX itself is not imported:
    its flags can still be set."""
    if not _no_gpu_but_plugin():
        return
    os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")  # XLA's INFO lines on loading it
    import pkgutil
    with plugin_quiet():  # the plugin's extensions, which jaxlib loads as JAX is imported
        plugin = cuda_plugin()
        for package in (f"jax_{plugin[4:]}_plugin", "jaxlib"):
            try:
                path = importlib.import_module(package).__path__
            except ImportError:
                continue
            for module in pkgutil.iter_modules(path):
                if package != "jaxlib" or module.name.startswith("gpu_"):
                    try:
                        importlib.import_module(f"{package}.{module.name}")
                    except (ImportError, OSError, RuntimeError):  # JAX reports it at start
                        pass
        spec = importlib.util.find_spec(f"jax_plugins.{plugin}")
        library = Path(spec.origin or "").parent / "xla_cuda_plugin.so"  # JAX loads it at start
        if spec.origin and library.exists():
            import ctypes
            ctypes.CDLL(str(library))


def _no_gpu_but_plugin() -> bool:
    return not Path("/proc/driver/nvidia/version").exists() and _plugin_installed()


@contextlib.contextmanager
def plugin_quiet():
    """On a machine with JAX's CUDA plugin and no NVIDIA driver, the plugin's libraries say
    at every load, on the process's standard error, that they find no CUDA driver: what runs
    inside has that stream closed (``os.devnull``); elsewhere nothing changes."""
    if not _no_gpu_but_plugin():
        yield
        return
    sys.stderr.flush()
    saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def _plugin_installed() -> bool:
    return cuda_plugin() is not None


def cuda_plugin() -> str | None:
    """The module name of JAX's CUDA plugin here (``xla_cuda12``, ``xla_cuda13``), or None."""
    try:
        import jax_plugins
    except ImportError:
        return None
    import pkgutil
    return next((m.name for m in sorted(pkgutil.iter_modules(jax_plugins.__path__),
                                        key=lambda m: m.name)
                 if m.name.startswith("xla_cuda")), None)


def mock_unavailable_reason() -> str | None:
    """None where this machine has a GPU for ``cfp.jax_compat.mock_gpus`` (an NVIDIA driver,
    and a CUDA plugin for JAX); else why not, in words. Starts no JAX backend."""
    if not os.path.exists("/proc/driver/nvidia/version"):
        return "this machine has no NVIDIA GPU (no driver)"
    if cuda_plugin() is None and importlib.util.find_spec("jaxlib.cuda") is None:
        return "JAX here has no CUDA plugin (pip install \"jax[cuda12]\" or \"jax[cuda13]\")"
    return None


def description(gpu: str) -> str:
    """The ``GpuTargetConfigProto`` text of ``gpu`` (one of ``GPUS``)."""
    if gpu not in GPUS:
        raise ValueError(f"no description of the GPU {gpu!r}: one of {', '.join(GPUS)}")
    return (TARGETS / f"{gpu}.txtpb").read_text()


def device_name(gpu: str) -> str:
    """The GPU's name as its description gives it (``NVIDIA A100-SXM4-80GB``)."""
    return re.search(r'device_description_str:\s*"([^"]+)"', description(gpu)).group(1)


def memory_bandwidth(gpu: str) -> float:
    """Bytes per second of the GPU's memory, as its description gives it."""
    return float(re.search(r"memory_bandwidth:\s*(\d+)", description(gpu)).group(1))


def label(gpu: str) -> str:
    """The short name the console prints (``A100``)."""
    return gpu.upper()


def memory_bytes(gpu: str) -> int:
    return int(re.search(r"device_memory_size:\s*(\d+)", description(gpu)).group(1))


def gpu_mesh(gpu: str, mesh_shape: tuple[int, ...], axis_names: tuple[str, ...]):
    """A mesh of ``prod(mesh_shape)`` of ``gpu``, described, not present: programs lowered
    for it compile only. Raises ``Unavailable`` where this JAX cannot compile for it."""
    if not _plugin_installed():
        raise Unavailable(f"JAX's CUDA plugin is not installed ({INSTALL} compiles for "
                          f"{label(gpu)}s without a GPU)")
    from cfp.jax_compat import deviceless_gpu_mesh
    with plugin_quiet():
        mesh = deviceless_gpu_mesh(description(gpu), tuple(mesh_shape), tuple(axis_names))
    if mesh is None:
        started = "" if os.environ.get("JAX_SKIP_CUDA_CONSTRAINTS_CHECK") else (
            ": JAX started before cfp was imported; import cfp first, or set "
            "JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1")
        raise Unavailable(f"JAX's CUDA plugin gives no {label(gpu)} topology here{started}")
    return mesh


def unavailable_reason(gpu: str) -> str | None:
    """None where programs compile for ``gpu`` here; else why not, in one line."""
    try:
        _probe(gpu)
    except Unavailable as e:
        return str(e)
    return None


@functools.lru_cache(maxsize=None)
def _probe(gpu: str) -> None:
    gpu_mesh(gpu, (1,), ("probe",))


def needs_nvidia_libraries(error: BaseException) -> bool:
    """Whether a compile for described GPUs failed for want of the NVIDIA libraries (cuDNN
    attention, say), which a compile without a GPU does not load."""
    return bool(re.search(r"cuDNN|cuBLAS|cudnn|libcuda|CUDA driver", str(error)))


# ---------------------------------------------------------------------------------------------
# What a compiled program computes and moves, from its HLO text

_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
_ARRAY = re.compile(r"(pred|[a-z]+\d+)\[([\d,]*)\]")
_NO_TRAFFIC = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast", "after-all",
               "partition-id", "replica-id", "iota", "opt-barrier"}


def _arrays(type_text: str) -> list[tuple[str, list[int]]]:
    return [(t, [int(d) for d in dims.split(",") if d]) for t, dims in _ARRAY.findall(type_text)]


def _nbytes(type_text: str, item_bytes: dict) -> int:
    return sum(item_bytes.get(t, 4) * math.prod(d) for t, d in _arrays(type_text))


def _dims(type_text: str) -> list[int]:
    arrays = _arrays(type_text)
    return arrays[0][1] if arrays else []


def _int_list(text: str, key: str) -> list[int]:
    m = re.search(key + r"=\{([\d,]*)\}", text)
    return [int(x) for x in m.group(1).split(",") if x] if m else []


def hlo_cost(hlo_text: str) -> tuple[float, float]:
    """(FLOPs, bytes accessed) per device of a compiled HLO module.

    FLOPs are the contractions': ``2 x result elements x contracted elements`` of every
    ``dot`` (and cuBLAS GEMM call) in any computation, fusions' included, and of every
    convolution; elementwise work is left to the bytes. Bytes are what the entry
    computation's instructions (fusions, GEMMs, collectives, copies) read and write: each
    one's operands and result, as XLA's cost analysis counts them at the fusion level."""
    from cfp.collectives import HLO_BYTES
    flops, nbytes = 0.0, 0.0
    shapes: dict[str, str] = {}
    entry = False
    for line in hlo_text.splitlines():
        if line.startswith("ENTRY"):
            entry = True
            continue
        if line and not line[0].isspace():  # another computation's header, or its end
            entry = False
            continue
        m = _INSTR.match(line)
        if not m:
            continue
        name, type_text, opcode, rest = m.groups()
        shapes[name] = type_text
        operands = re.findall(r"%([\w.\-]+)", rest.split("), ")[0])
        if opcode == "dot":
            lhs = _dims(shapes.get(operands[0], ""))
            contracted = math.prod(lhs[d] for d in _int_list(rest, "lhs_contracting_dims")
                                   if d < len(lhs))
            flops += 2.0 * math.prod(_dims(type_text)) * contracted
        elif opcode == "custom-call" and "gemm" in rest and "dot_dimension_numbers" in rest:
            dnums = json.loads(re.search(r'"dot_dimension_numbers":(\{[^}]*\})', rest).group(1))
            lhs = _dims(shapes.get(operands[0], ""))
            contracted = math.prod(lhs[int(d)] for d in dnums.get("lhs_contracting_dimensions",
                                                                  []))
            flops += 2.0 * math.prod(_dims(type_text)) * contracted
        elif opcode == "convolution":
            rhs = _dims(shapes.get(operands[1], ""))
            labels = re.search(r"dim_labels=\w+_(\w+)->", rest)
            out_feature = labels.group(1).index("o") if labels else len(rhs) - 1
            flops += 2.0 * math.prod(_dims(type_text)) * math.prod(rhs) / max(rhs[out_feature], 1)
        if entry and opcode not in _NO_TRAFFIC and not opcode.endswith("-done"):
            nbytes += _nbytes(type_text, HLO_BYTES) + sum(
                _nbytes(shapes.get(o, ""), HLO_BYTES) for o in operands)
    return flops, nbytes
