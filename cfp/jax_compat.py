"""The JAX calls whose spelling depends on the JAX version, in one place.

cfp is tested on JAX 0.10.x (CPU) and 0.11.x (GPU); everything else it calls is public API
that both spell alike.
"""
from __future__ import annotations

import contextlib
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np

from cfp.errors import CfpError

log = logging.getLogger(__name__)

# What JAX raises when XLA fails to compile or run a program (out of memory, an unsupported
# layout): the failure of the item measured, not of cfp. 0.10 and 0.11 name it alike.
JAX_ERRORS = (jax.errors.JaxRuntimeError,)


def cost_analysis(compiled) -> dict:
    """XLA's cost analysis of a compiled program (flops, bytes accessed, ...): a dict, which
    some versions return inside a one-element list."""
    analysis = compiled.cost_analysis()
    if isinstance(analysis, (list, tuple)):
        analysis = analysis[0] if analysis else {}
    return dict(analysis or {})


def enable_compilation_cache(directory: str | None) -> None:
    """Keep every compiled program in JAX's persistent compilation cache at ``directory``
    (no size or compile-time threshold), so a rerun or a resumed profile loads what it
    compiled before instead of compiling it again. ``None`` leaves JAX's setting alone."""
    if not directory:
        return
    jax.config.update("jax_compilation_cache_dir", str(directory))
    for name, value in (("jax_persistent_cache_min_compile_time_secs", 0.0),
                        ("jax_persistent_cache_min_entry_size_bytes", 0)):
        try:
            jax.config.update(name, value)
        except AttributeError:  # an option this JAX does not have: its default applies
            log.info("JAX has no option %s", name)


@contextlib.contextmanager
def no_compilation_cache():
    """Compile without JAX's persistent cache: a program compiled for devices that are not
    here (``deviceless_gpu_mesh``) cannot be loaded back from it."""
    before = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", before)


# Typed PRNG keys (``jax.random.key``) have an extended dtype, spelled ``key<impl>``; cfp's
# records keep dtypes as names, and these map a key's name back to the implementation.
_KEY_IMPLS = {"fry": "threefry2x32", "rbg": "rbg", "urbg": "unsafe_rbg"}


@functools.lru_cache(maxsize=None)  # a trace asks once per value: tens of thousands of times
def dtype_name(dtype) -> str:
    """A dtype as the name records keep: ``float32``, ``bfloat16``, or ``key<fry>``."""
    if jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
        return str(dtype)
    return str(np.dtype(dtype))


def is_key(name: str) -> bool:
    """Whether a dtype name is a typed PRNG key's."""
    return name.startswith("key<")


def _key_impl(name: str) -> str:
    short = name[len("key<"):-1]
    if short not in _KEY_IMPLS:
        raise CfpError(f"a PRNG key of an implementation cfp does not know: {name}")
    return _KEY_IMPLS[short]


def to_dtype(name: str):
    """The dtype a name stands for (a key's extended dtype for ``key<...>``)."""
    if is_key(name):
        return jax.random.key(0, impl=_key_impl(name)).dtype
    return jnp.dtype(name)


@functools.lru_cache(maxsize=None)
def itemsize(name: str) -> int:
    """Bytes per element; a key's are those of its key data (8 for threefry)."""
    if is_key(name):
        return jax.random.key_data(jax.random.key(0, impl=_key_impl(name))).nbytes
    return jnp.dtype(name).itemsize


def random_keys(name: str, shape: tuple[int, ...], seed: int):
    """An array of distinct typed keys of ``shape``."""
    import math
    keys = jax.random.split(jax.random.key(seed, impl=_key_impl(name)), max(1, math.prod(shape)))
    return keys[:math.prod(shape)].reshape(shape)


def join_runtime(address: str, num_processes: int, process_id: int, *, join_timeout_s: int,
                 heartbeat_timeout_s: int) -> None:
    """Join JAX's multi-controller runtime at ``address`` (``jax.distributed.initialize``),
    with cross-process collectives switched on for CPU devices (gloo). A process that does not
    join within ``join_timeout_s``, or stops sending heartbeats for ``heartbeat_timeout_s``,
    ends every process of the runtime (JAX aborts them)."""
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except AttributeError:  # a JAX whose CPU client has cross-process collectives already
        log.info("JAX has no option jax_cpu_collectives_implementation")
    jax.distributed.initialize(address, num_processes=num_processes, process_id=process_id,
                               initialization_timeout=join_timeout_s,
                               heartbeat_timeout_seconds=heartbeat_timeout_s)


def auto_axis_types(num_axes: int) -> dict:
    """``jax.sharding.Mesh`` keywords for a mesh whose axes are all Auto (XLA propagates
    shardings between the constraints cfp puts in)."""
    from jax.sharding import AxisType
    return {"axis_types": (AxisType.Auto,) * num_axes}


def explicit_axes(mesh) -> tuple[str, ...]:
    """The axes of ``mesh`` whose type is Explicit (sharding in the types of arrays)."""
    from jax.sharding import AxisType
    return tuple(a for a, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit)


def auto_inside(fn, mesh, out_shardings):
    """``fn`` with the Explicit axes of ``mesh`` Auto in its body, so that its sharding
    constraints and XLA's propagation place what it computes; its outputs come back typed
    with ``out_shardings`` on ``mesh`` (``jax.sharding.auto_axes``). A mesh with no Explicit
    axis: ``fn`` itself."""
    axes = explicit_axes(mesh)
    if not axes:
        return fn
    return jax.sharding.auto_axes(fn, axes=axes, out_sharding=out_shardings)


def constraint_mesh(mesh):
    """The mesh a sharding constraint inside ``auto_inside`` names: ``mesh``'s devices and
    axis names, every axis Auto (as the body sees them)."""
    if not explicit_axes(mesh):
        return mesh
    return jax.sharding.Mesh(mesh.devices, mesh.axis_names,
                             **auto_axis_types(len(mesh.axis_names)))


def bind_equation(eqn, args) -> list:
    """The results of a jaxpr equation applied to ``args``, as ``jax.core.eval_jaxpr`` binds
    it: ``get_bind_params`` gives the bind parameters (0.10+), or before that the
    sub-functions and parameters."""
    got = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = got if isinstance(got, tuple) else ((), got)
    out = eqn.primitive.bind(*subfuns, *args, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def deviceless_gpu_mesh(target_config: str, mesh_shape: tuple[int, ...],
                        axis_names: tuple[str, ...]):
    """A mesh of ``prod(mesh_shape)`` GPUs described by ``target_config`` (XLA's
    ``GpuTargetConfigProto`` in text) that need not be here: programs lowered for it compile
    only (``Compiled.memory_analysis``), as XLA compiles for those GPUs. Needs JAX's CUDA
    plugin installed, loaded with ``JAX_PLATFORMS=cpu`` and
    ``JAX_SKIP_CUDA_CONSTRAINTS_CHECK=1`` set before JAX starts, so that no GPU is looked for;
    ``None`` without it."""
    from jax.experimental import topologies
    n = int(np.prod(mesh_shape))
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=target_config,
                                                topology=f"1x1x{n}")
    except (NotImplementedError, RuntimeError) as e:
        log.info("no deviceless GPU topology: %s", e)
        return None
    return topologies.make_mesh(topology, tuple(mesh_shape), tuple(axis_names))


# XLA's options for programs compiled for GPUs described, not present (``compiler_options``)
DESCRIBED_GPU_OPTIONS = {"xla_disable_hlo_passes": "rematerialization"}


def compiler_options(mesh) -> dict | None:
    """XLA's options for a program compiled for ``mesh``: for GPUs described, not present
    (``deviceless_gpu_mesh``), its own rematerialization off. XLA's GPU compiler otherwise
    recomputes, unpriced, until a program's temporaries fit 80% of the device less its
    arguments (times ``xla_gpu_memory_limit_slop_factor``, 95%): a 24-layer stack's gradient
    compiles for an A100 to under 64 GiB with it and over 100 GiB without
    (``cfp_test/test_gpu_compile.py``). Off, the peak is the program's as planned. None: XLA's
    defaults (devices here)."""
    if mesh.devices.flat[0] in jax.devices():
        return None
    return dict(DESCRIBED_GPU_OPTIONS)


def xla_flags(options: dict) -> str:
    """``options`` as ``XLA_FLAGS`` spells them: what runs a program as it was compiled."""
    return " ".join(f"--{name}={value}" for name, value in options.items())


# XLA's mock GPU topology: one GPU stands for a node of them. Set in a process before its
# backends start (``mock_gpus``); its number of mocked GPUs, 0 where none.
_mocked_gpus = 0


def mock_gpus(num_gpus: int) -> None:
    """Before this process's JAX backends start: its one GPU stands for ``num_gpus`` GPUs
    (``jax_mock_gpu_topology`` ``1 x num_gpus x 1``: one GPU per mocked host; PJRT's
    ``enable_mock_nccl``). Programs compile for all of them, and running one runs partition
    0's program on the GPU here, its collectives skipped; autotuning is not sharded across
    the mocked peers, which never answer (openxla/xla#28959)."""
    global _mocked_gpus
    import os
    from jax._src import xla_bridge
    if getattr(xla_bridge, "backends_are_initialized", lambda: False)():
        raise RuntimeError("mock_gpus: JAX's backends have started; mock before any device use")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    if not any("xla_gpu_shard_autotuning" in f for f in flags):
        flags.append("--xla_gpu_shard_autotuning=false")
    # as many CPU devices, to compile a program on where its GPU form is unclear
    flags.append(f"--xla_force_host_platform_device_count={num_gpus}")
    os.environ["XLA_FLAGS"] = " ".join(flags)
    jax.config.update("jax_cuda_visible_devices", "0")  # one GPU per mocked host
    jax.config.update("jax_mock_gpu_topology", f"1x{num_gpus}x1")
    _mocked_gpus = num_gpus


def mocked_gpus() -> int:
    """How many GPUs this process's one GPU stands for (``mock_gpus``); 0: none mocked."""
    return _mocked_gpus
