"""The options of a run, checked before any work: the ones a user gives (``Options``, the command
line's flags), and what they resolve to (``RunOptions``: the workload, the mesh, the cluster,
the processes), with every check that needs no compiled program. A mistake is one
``CfpError`` line."""
from __future__ import annotations

import dataclasses
import math
import os
import re
import sys
from pathlib import Path
from typing import Literal

from cfp.errors import CfpError
from cfp.workloads import MAX_ARRAY_ELEMENTS

# The most each numeric option may be, checked (positive and finite, too) before any work and
# stated in --help; alpha and beta may be zero.
MAX_LAYERS, MAX_VIRTUAL_DEVICES = 1024, 512


MODES = ("analysis", "profile", "search")


DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cfp" / "jax"


@dataclasses.dataclass(frozen=True)
class Options:
    """What to plan and how: one field per command-line flag (``--memory-budget`` is
    ``memory_budget_gb``), checked by ``run`` before any work."""

    mode: Literal["analysis", "profile", "search", "stages"] | None = None  # None: all three
    verbose: bool = False  # print blocks, segments and candidates too
    # print the lines benchmark drivers read (searched ParallelBlock Strategies solution,
    # searched training cost, TFLOP_COUNT)
    driver_lines: bool = False
    # workload
    model: str = "gpt"  # a zoo key (mlp, gpt, llama, moe, bert) or package.module:factory
    config: str | None = None  # size preset; None: tiny
    batch_size: int | None = None  # global batch; None: the preset's
    num_layers: int | None = None  # size overrides of the preset (None: the preset's)
    seq_len: int | None = None
    hidden_size: int | None = None
    num_heads: int | None = None
    vocab_size: int | None = None
    num_experts: int | None = None
    dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] | None = None  # None: dtype's
    step: Literal["train", "forward"] = "train"  # forward: the loss alone (no gradients)
    # devices
    num_devices: int | None = None  # devices to use; None: the mesh's size, or 8
    # "8", "2x4" (axes m0, m1), "data=2,model=4" (named axes the plan speaks), or a
    # jax.sharding.Mesh (measured on its devices in its order); None: one axis of all devices
    mesh: object = None
    cluster: str | None = None  # plan for a described cluster (preset or .json), run nothing
    workdir: str | Path | None = None  # None: profiles/<model>-<config>-<mesh>/
    compilation_cache: str | None = str(DEFAULT_CACHE)  # JAX's persistent cache; None: off
    # profile
    # measure, price compiled programs, or (with a cluster of GPUs) "mock": compile for its
    # GPUs on the one GPU here, time what one of them computes, price the collectives
    cost: Literal["measure", "model", "mock"] = "measure"
    max_combinations: int = 32  # largest strategy space profiled as one window
    whole_segments: bool = False  # every segment one window, the cheapest combinations
    profile_all: bool = False  # measure every combination, not those search asks for
    profile_budget: float | None = None  # seconds for the profile pass; None: no limit
    memory_budget_gb: float | None = None  # per device; None: the GPU's (required on CPU)
    device_preset: Literal["a100", "h100", "h200", "here"] | None = None  # cost model's figures
    alpha: str | None = None  # cost model: seconds per collective, one per mesh axis "5e-6,3e-6"
    beta: str | None = None  # cost model: seconds per byte, one per mesh axis
    device_flops: float | None = None  # cost model: FLOP/s of one device
    device_bandwidth: float | None = None  # cost model: memory bytes/s of one device
    # search
    time_limit: float = 60.0  # CP-SAT seconds per solve
    validate_top: int = 3  # predicted plans run end to end
    # recompute forced on every layer (``cfp.recompute``), for tests and benchmarks
    recompute: Literal["none", "dots_saveable", "dots_with_no_batch_dims_saveable",
                       "nothing_saveable"] = "none"
    validate_baselines: bool = True  # run the rule-file hand plans too
    iters: int | None = None  # steps per measurement; None: at least 5 steps and 0.1 s
    # several processes
    coordinator: str | None = None  # HOST:PORT of process 0
    num_processes: int = 1
    process_id: int = 0
    join_timeout: int = 30  # seconds the processes' workers wait for each other
    # stages
    micro_batches: int = 8


def _check_choices(options: Options) -> None:
    """Every ``Literal`` field holds one of its values (the flags' ``choices``)."""
    import typing
    for name, hint in typing.get_type_hints(Options).items():
        allowed = [a for arg in (typing.get_args(hint) if "Literal" in str(hint) else ())
                   for a in (typing.get_args(arg) or (arg,)) if isinstance(a, str)]
        value = getattr(options, name)
        if allowed and value is not None and value not in allowed:
            raise CfpError(f"{_flag(name)} must be one of {', '.join(allowed)}, got {value!r}")


_KINDS = {bool: "true or false", int: "a whole number", float: "a number", str: "text",
          Path: "a path"}


def _check_types(options) -> None:
    """Every field holds a value of its annotated type (an ``int`` is a ``float`` too, a
    ``bool`` neither, a ``str`` a path): the API's arguments are not parsed as flags are."""
    import typing
    if not isinstance(options, Options):
        raise CfpError(f"cfp.run takes cfp.Options, not a {type(options).__name__}")
    for name, hint in typing.get_type_hints(Options).items():
        value = getattr(options, name)
        kinds = [k for k in (typing.get_args(hint) or (hint,)) if k in _KINDS]
        if value is None or not kinds or "Literal" in str(hint):
            continue  # None where allowed is checked with what needs it; choices apart
        fits = any(isinstance(value, str if k is Path else k)
                   and (k is bool or not isinstance(value, bool)) for k in kinds)
        fits = fits or (float in kinds and isinstance(value, int) and not isinstance(
            value, bool)) or (Path in kinds and isinstance(value, os.PathLike))
        if not fits:
            raise CfpError(f"{_flag(name)} must be {' or '.join(_KINDS[k] for k in kinds)}, "
                           f"got {value!r}")
    if options.model is None:
        raise CfpError("--model must be a zoo key (mlp, gpt, llama, moe, bert) or "
                       "package.module:factory, got None")


def _check_mock(options: Options) -> None:
    """``--cost mock`` profiles one mesh of a described node's GPUs on the GPU here."""
    from cfp.gpu_compile import mock_unavailable_reason
    if options.cluster is None:
        raise CfpError("--cost mock stands the GPU here for a node of them: give --cluster "
                       "(h100-8, h200-8, a100-8, or a .json file)")
    if options.mesh == "auto" or options.mode == "stages":
        raise CfpError("--cost mock profiles the windows of one mesh: give --mesh (or leave "
                       "it out) with --mode analysis, profile or search")
    if options.num_processes > 1:
        raise CfpError("--cost mock runs in one process, on one GPU")
    why = mock_unavailable_reason()
    if why is not None:
        raise CfpError(f"--cost mock times programs on a GPU here, and {why}")


def _flag(field: str) -> str:
    """The command-line flag of an ``Options`` field, as messages name it."""
    return "--" + {"memory_budget_gb": "memory-budget"}.get(field, field.replace("_", "-"))


BOUNDS = {
    "num_layers": MAX_LAYERS, "batch_size": MAX_ARRAY_ELEMENTS,
    **dict.fromkeys(("seq_len", "hidden_size", "num_heads", "vocab_size", "num_experts"),
                    MAX_ARRAY_ELEMENTS),
    "num_devices": MAX_VIRTUAL_DEVICES, "max_combinations": 2**16, "profile_budget": 1e7,
    "memory_budget_gb": 2**20, "alpha": 1, "beta": 1, "device_flops": 1e18,
    "device_bandwidth": 1e16, "time_limit": 86400, "validate_top": 64, "iters": 10**4,
    "num_processes": 4096, "join_timeout": 86400, "micro_batches": 4096,
}


_PER_AXIS = ("alpha", "beta")  # text: one number per mesh axis, each may be zero


def bounds_text(dest: str) -> str:
    high = BOUNDS[dest]
    return (f"{'zero or more' if dest in _PER_AXIS else 'positive'}, at most "
            f"{high if isinstance(high, int) else f'{high:g}'}")


def _check_number(dest: str, value: float) -> None:
    """``value`` of the flag ``dest`` is finite and within ``BOUNDS``; a ``CfpError`` if not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CfpError(f"{_flag(dest)} must be a number, got {value!r}")
    low_ok = value >= 0 if dest in _PER_AXIS else value > 0
    if not (math.isfinite(value) and low_ok and value <= BOUNDS[dest]):
        raise CfpError(f"{_flag(dest)} must be {bounds_text(dest)}, got {value}")


def per_axis_figures(flag: str, text: str, num_axes: int) -> tuple[float, ...]:
    """``--alpha``/``--beta``: one number per mesh axis, each checked."""
    try:
        values = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise CfpError(f"--{flag} {text!r} is not a list of numbers: give one per mesh axis, "
                       f"e.g. 5e-6,3e-6") from None
    if len(values) != num_axes:
        raise CfpError(f"--{flag}: give one value per mesh axis ({num_axes}), got {text!r}")
    for v in values:
        _check_number(flag, v)
    return values


@dataclasses.dataclass(frozen=True)
class RunOptions:
    """``Options`` checked and resolved: the workload spec, the mesh and the devices."""

    spec: object  # WorkloadSpec
    mesh_shape: tuple[int, ...]
    num_devices: int
    workdir: Path | None
    modes: tuple[str, ...]
    cluster: object = None  # cfp.cluster.Cluster; mesh_shape None: --mesh auto, chosen later
    runtime: object = None  # cfp.multihost.Runtime when several processes take part
    mesh_axes: tuple[str, ...] | None = None  # the mesh's axis names; None: m0, m1, ...
    device_ids: tuple[int, ...] | None = None  # the user's Mesh's device order; None: JAX's
    # --mesh auto: (the traced step, its grouping, the chosen cfp.passes.search.MeshCandidate)
    chosen_mesh: tuple | None = None

    @property
    def reports(self) -> bool:
        """Whether this process writes the work dir and prints (process 0 of several)."""
        return self.runtime is None or self.runtime.process_id == 0


def check_options(options) -> RunOptions:
    """Every check that needs no device: sizes, mesh against device count, budgets."""
    from cfp.mesh import check_mesh, device_order, mesh_from, mesh_text, parse_mesh
    from cfp.workloads import WorkloadSpec
    _check_types(options)
    device_ids = None
    if options.mesh is not None and not isinstance(options.mesh, str):  # the user's Mesh
        shape_and_names = mesh_from(options.mesh)
        if options.cluster is None:  # measured here: on its devices, in its order
            device_ids = device_order(options.mesh)
        options = dataclasses.replace(options, mesh=mesh_text(*shape_and_names))
    _check_choices(options)
    overrides = tuple((k, getattr(options, k)) for k in (
        "num_layers", "seq_len", "hidden_size", "num_heads", "vocab_size", "num_experts",
        "compute_dtype") if getattr(options, k) is not None)
    for k in BOUNDS:
        if k not in _PER_AXIS and getattr(options, k) is not None:
            _check_number(k, getattr(options, k))
    from cfp.tracing import users_step
    if users_step(options.model) and options.config is not None:
        raise CfpError(f"--config picks a size preset of cfp's own models; {options.model} "
                       f"takes its sizes as the keywords its factory declares (--num-layers, "
                       f"--hidden-size, ...)")
    spec = WorkloadSpec(options.model, options.config, options.batch_size, options.dtype,
                        overrides, options.step)
    if options.mode == "stages" and options.step == "forward":
        raise CfpError("--mode stages plans the pipeline of a training step (its 1F1B "
                       "schedule): leave out --step forward")
    workdir = Path(options.workdir) if options.workdir else None
    modes = (options.mode,) if options.mode else MODES
    if options.cluster is not None and options.num_processes > 1:
        raise CfpError("--cluster plans without running anything: run it in one process "
                       "(without --num-processes)")
    if options.cost == "mock":
        _check_mock(options)
    if options.cluster is not None:
        from cfp.cluster import load_cluster
        cluster = load_cluster(options.cluster)
        if options.mesh == "auto":
            return RunOptions(spec, None, cluster.num_devices, workdir, modes, cluster)
        mesh_shape, axes = ((cluster.mesh_shape, None) if options.mesh is None
                            else parse_mesh(options.mesh))
        if math.prod(mesh_shape) != cluster.num_devices:
            raise CfpError(f"mesh {options.mesh} has {math.prod(mesh_shape)} devices; cluster "
                           f"{cluster.name} has {cluster.num_devices}")
        check_mesh(mesh_shape, cluster.num_devices)
        _check_per_axis(options, mesh_shape)
        return RunOptions(spec, mesh_shape, cluster.num_devices, workdir, modes, cluster,
                          mesh_axes=axes)
    if options.mesh == "auto":
        raise CfpError("--mesh auto compares the logical meshes of a described cluster: give "
                       "--cluster too")
    if options.mesh is None:
        num = 8 if options.num_devices is None else options.num_devices
        mesh_shape, axes = (num,), None
    else:
        mesh_shape, axes = parse_mesh(options.mesh)
        num = math.prod(mesh_shape) if options.num_devices is None else options.num_devices
    if num > MAX_VIRTUAL_DEVICES:
        raise CfpError(f"mesh {options.mesh} has {num} devices, over the {MAX_VIRTUAL_DEVICES} a "
                       f"run here may use: plan for more with --cluster")
    check_mesh(mesh_shape, num)
    _check_per_axis(options, mesh_shape)
    return RunOptions(spec, mesh_shape, num, workdir, modes, runtime=_runtime(options, num),
                      mesh_axes=axes, device_ids=device_ids)


def _check_per_axis(options, mesh_shape: tuple[int, ...]) -> None:
    for flag in ("alpha", "beta"):
        if getattr(options, flag) is not None:
            per_axis_figures(flag, getattr(options, flag), len(mesh_shape))


def _runtime(options, num_devices: int):
    """The processes taking part, when there are several (``--num-processes``)."""
    from cfp.multihost import Runtime
    if options.num_processes < 1:
        raise CfpError(f"--num-processes must be positive, got {options.num_processes}")
    if options.num_processes == 1:
        return None
    if not options.coordinator:
        raise CfpError("several processes need --coordinator HOST:PORT (process 0's host)")
    if options.mode == "stages":
        raise CfpError("--mode stages runs in one process: plan stages for a cluster with "
                       "--cluster, or run them here without --num-processes")
    if num_devices % options.num_processes:
        raise CfpError(f"{num_devices} devices do not split evenly over "
                       f"{options.num_processes} processes")
    return Runtime(options.coordinator, options.num_processes, options.process_id,
                   options.join_timeout)


def check_devices(opts: RunOptions, options) -> None:
    """The checks that need JAX's devices (none compiles anything): the mesh fits them, and
    search on CPU has a memory budget."""
    import jax
    from cfp.mesh import make_mesh
    if opts.cluster is not None:
        return  # planned, not run: analysis and analytic pricing need no devices
    if opts.runtime is not None:  # the global mesh exists only in the workers' runtime
        local, n = len(jax.local_devices()), opts.runtime.num_processes
        if local * n < opts.num_devices:
            raise CfpError(f"{opts.num_devices} devices over {n} processes need "
                           f"{opts.num_devices // n} per process; JAX sees {local} here")
    else:
        make_mesh(opts.mesh_shape, device_ids=opts.device_ids)
    if (("search" in opts.modes or "stages" in opts.modes) and options.memory_budget_gb is None
            and jax.devices()[0].platform == "cpu"):
        raise CfpError("on CPU the virtual devices share host memory: give --memory-budget GiB "
                       "(per device)")


def default_workdir(opts: RunOptions) -> Path:
    """profiles/<model>-<config>[-overrides][-forward][-b<batch>][-<cluster>]-<mesh>
    [-devices-<digest of the user's mesh's device order>], from the flags as given."""
    import hashlib
    from cfp.mesh import mesh_text
    spec = opts.spec
    from cfp.tracing import users_step
    if spec.config is None and not users_step(spec.model):
        spec = dataclasses.replace(spec, config="tiny")
    label = spec.label
    if spec.batch_size is not None:
        label += f"-b{spec.batch_size}"
    if opts.cluster is not None:
        label += f"-{opts.cluster.name}"
    label += f"-{mesh_text(opts.mesh_shape, opts.mesh_axes)}"
    if opts.device_ids is not None:  # another order is another run's
        label += f"-devices-{hashlib.sha1(repr(opts.device_ids).encode()).hexdigest()[:8]}"
    # one path component under profiles/, whatever the names that went into it
    return Path("profiles") / re.sub(r"[^A-Za-z0-9._=,-]", "_", label).lstrip(".")


def setup_devices(num_devices: int) -> None:
    """Ask for ``num_devices`` virtual CPU devices; effective only before JAX starts."""
    flag = f"--xla_force_host_platform_device_count={num_devices}"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    if "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = " ".join(flags + [flag])
        # A GPU is shared by this process and its measurement worker: neither takes it all.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def check_workdir(workdir: Path, modes=MODES) -> None:
    """The work dir can be written: created by a run that analyses (``modes``); a run that
    starts after the analysis creates none (``require_workdir`` says it is missing)."""
    if not _analyses(modes) and not workdir.is_dir():
        return
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = workdir / ".cfp-write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise CfpError(f"cannot write to the work dir {workdir} ({e.strerror}): "
                       f"choose another with --workdir") from None


def _analyses(modes) -> bool:
    return "analysis" in modes or "stages" in modes


def require_workdir(workdir: Path, modes) -> None:
    """A run that starts after the analysis finds its work dir there."""
    if not _analyses(modes) and not workdir.is_dir():
        raise CfpError(f"no work dir {workdir}: run python -m cfp --mode analysis with the same "
                       f"flags first")


def memory_budget_bytes(options, opts: RunOptions, *, required: bool = False) -> int:
    import jax
    if options.memory_budget_gb is not None:
        return int(options.memory_budget_gb * 2**30)
    if opts.cluster is not None:
        return opts.cluster.memory_per_device_bytes
    dev = jax.devices()[0]
    if dev.platform == "gpu":
        stats = dev.memory_stats() or {}
        if stats.get("bytes_limit"):
            return int(stats["bytes_limit"])
    if required:
        raise CfpError("on CPU the virtual devices share host memory: give --memory-budget GiB "
                       "(per device)")
    return 2**62


def preset_gpu(options) -> str | None:
    """The GPUs a named ``--device-preset`` has programs compiled for (``cfp.gpu_compile``);
    None for none named, for ``here`` (figures fitted on these devices) and for a preset
    without GPUs. Read without fitting anything."""
    from cfp.cost_model import DEVICE_PRESETS
    if options.device_preset in (None, "here"):
        return None
    return DEVICE_PRESETS[options.device_preset].get("gpu")


def cost_model_of(options, mesh_shape, device_ids=None):
    from cfp.cost_model import DEVICE_PRESETS, CostModel, fit_cost_model
    if options.device_preset == "here":
        from cfp.mesh import make_mesh
        fitted = fit_cost_model(make_mesh(mesh_shape, device_ids=device_ids))
        from cfp import report
        report.say(f"fitted here: alpha {fitted.alpha} s, beta {fitted.beta} s/B, "
                   f"{fitted.device_flops:.3g} FLOP/s, {fitted.device_bandwidth:.3g} B/s")
        preset = {"alpha": fitted.alpha, "beta": fitted.beta,
                  "device_flops": fitted.device_flops,
                  "device_bandwidth": fitted.device_bandwidth, "platform": fitted.platform}
    else:
        preset = dict(DEVICE_PRESETS[options.device_preset or "a100"])
    n = len(mesh_shape)

    def per_axis(flag, default):
        if getattr(options, flag) is None:
            vals = list(default)[-n:] if len(default) >= n else [default[-1]] * n
            return tuple(float(v) for v in vals)
        return per_axis_figures(flag, getattr(options, flag), n)

    return CostModel(per_axis("alpha", preset["alpha"]), per_axis("beta", preset["beta"]),
                     options.device_flops or preset["device_flops"],
                     options.device_bandwidth or preset["device_bandwidth"], preset["platform"],
                     preset_gpu(options))  # named: compiled for
