"""The Python API: a training step through the three passes, and the plan they find.

    >>> import cfp  # doctest: +SKIP
    >>> plan = cfp.autoshard("mypkg.train:make_workload", mesh="2x4",
    ...                      memory_budget_gb=4, workdir="profiles/mine")  # doctest: +SKIP
    >>> step = plan.jit(train_step, params, opt_state, batch)  # doctest: +SKIP

``make_workload`` returns a ``cfp.models.Workload``, most simply through
``cfp.models.user_workload(loss_fn, init_params, make_batch, optimizer=tx)``; it gets only the
keyword arguments it declares (``batch_size``, ``dtype``, size overrides). It is named by import
path because measurement runs in worker processes that build it afresh; ``"gpt"``, ``"moe"``
and the other zoo models are named by their key.

``run(Options(...))`` runs the passes ``Options.mode`` asks for and returns the work dir; the
command line (``cfp.cli``) only parses its flags into ``Options`` and calls it.
``autoshard`` runs all three and returns a ``Plan``. Bad input raises ``CfpError`` with its
one-line reason before any work; Ctrl-C raises ``KeyboardInterrupt`` (everything measured is
kept in the work dir).

What it changes in the caller's process: the console lines of each pass are printed to
``sys.stdout``; when JAX is not yet imported, ``XLA_FLAGS`` asks for the mesh's number of
virtual CPU devices (with JAX already started, the devices JAX has are used); in a process
other than 0 of several, ``sys.stdout`` is silenced. JAX's settings, the logging setup and
signal handlers are left as they were (the measurement workers, which are processes of their
own, use ``Options.compilation_cache``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
import os
import sys
from pathlib import Path
from typing import Literal

from cfp.errors import CfpError
from cfp.workloads import MAX_ARRAY_ELEMENTS

MODES = ("analysis", "profile", "search")
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cfp" / "jax"


@dataclasses.dataclass(frozen=True)
class Options:
    """What to plan and how: one field per command-line flag (``--memory-budget`` is
    ``memory_budget_gb``), checked by ``run`` before any work."""

    mode: Literal["analysis", "profile", "search", "stages"] | None = None  # None: all three
    verbose: bool = False  # print blocks, segments and candidates too
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
    validate_baselines: bool = True  # run the rule-file hand plans too
    iters: int | None = None  # steps per measurement; None: at least 5 steps and 0.3 s
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


def _check_mock(options: Options) -> None:
    """``--cost mock`` profiles one mesh of a described node's GPUs on the GPU here."""
    from cfp.jax_compat import mock_unavailable_reason
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


class Plan:
    """A plan ``cfp.autoshard`` found: ``plan.json``'s content (``data``) and what to do with
    it. ``jit`` compiles the user's own ``train_step(params, opt_state, batch) -> (params,
    opt_state, loss)`` to the program cfp measured, state donated; ``shardings`` gives the
    ``in_shardings``/``out_shardings`` for a plain ``jax.jit``."""

    def __init__(self, data: dict):
        self.data = data

    @classmethod
    def load(cls, path) -> "Plan":
        """A ``plan.json`` (checked: format and version)."""
        from cfp.plan import load_plan
        return cls(load_plan(path))

    def save(self, path) -> None:
        """Write ``plan.json`` at ``path`` (atomically)."""
        from cfp.plan import write_plan
        write_plan(Path(path), self.data)

    @property
    def mesh(self):
        """The plan's mesh: over the devices it was measured on, in that order."""
        from cfp.plan import mesh_of
        return mesh_of(self.data)

    def shardings(self, params, opt_state, batch) -> tuple[tuple, tuple]:
        """``(in_shardings, out_shardings)`` for ``jax.jit(train_step, ...,
        donate_argnums=(0, 1))``; the arguments (arrays or ``ShapeDtypeStruct``s) fix the
        trees."""
        from cfp.plan import step_shardings
        return step_shardings(self.data, self.mesh, params, opt_state, batch)

    def jit(self, train_step, params, opt_state, batch):
        """``train_step`` jitted with the plan's layouts and its blocks' constraints inside,
        ``params`` and ``opt_state`` donated; the traced step must be the analysed one."""
        from cfp.plan import jit
        return jit(train_step, self.data, self.mesh, params, opt_state, batch)

    def describe(self) -> str:
        """The plan in words: which mesh axis splits which role, per segment type."""
        lines = self.data.get("description") or [
            f"block {b['block']}: {b['strategy']}" for b in self.data.get("blocks", ())]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Plan(mesh {'x'.join(map(str, self.data['mesh']['shape']))}, "
                f"{len(self.data.get('blocks', ()))} blocks, {self.data.get('source', '')!r})")


def autoshard(model: str, *, mesh: str | None = None, memory_budget_gb: float | None = None,
              workdir: str | Path | None = None, **options) -> Plan:
    """Analyse, profile and search ``model``'s step on ``mesh``; the plan kept.

    ``options`` are further ``Options`` fields (``batch_size``, ``max_combinations``,
    ``validate_top``, ``iters``, ...). ``workdir`` None: ``profiles/<model>-<mesh>/``."""
    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(Options)})
    if unknown:
        raise CfpError(f"autoshard() takes no option {unknown[0]!r} (see cfp.Options for "
                       f"the ones it takes)")
    workdir = run(Options(model=model, mesh=mesh, memory_budget_gb=memory_budget_gb,
                          workdir=workdir, **options))
    return Plan.load(Path(workdir) / "plan.json")


def run(options: Options, *, own_process: bool = False) -> Path:
    """The passes ``options.mode`` asks for (all three in order when None); returns the work
    dir. ``own_process``: the caller is the command line, whose process this is: JAX's
    compilation cache is turned on in it too."""
    opts = _options(options)
    # A described cluster is compiled for here only up to 64 devices (cluster_pricing).
    _setup_devices(opts.num_devices // opts.runtime.num_processes if opts.runtime
                   else opts.num_devices if opts.cluster is None or opts.num_devices <= 64
                   else 8)
    if not opts.reports:
        from cfp import report
        report.silence()
    if opts.mesh_shape is None:
        opts = dataclasses.replace(opts, mesh_shape=_choose_mesh(opts, options))
    if not options.workdir:
        opts = dataclasses.replace(opts, workdir=_default_workdir(opts))
    opts = dataclasses.replace(opts, spec=opts.spec.resolved())
    if opts.reports:
        _check_workdir(opts.workdir)
    _check_devices(opts, options)
    if own_process:
        from cfp.jax_compat import enable_compilation_cache
        enable_compilation_cache(_cache_dir(options))  # before anything compiles
    from cfp.interrupts import CtrlC, interrupted
    from cfp.workdir import locked
    try:
        with (locked(opts.workdir) if opts.reports else contextlib.nullcontext(),
              CtrlC() as ctrl_c):
            for mode in opts.modes:
                _RUNNERS[mode](opts, options)
                ctrl_c.check()
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise CfpError(f"the disk of the work dir {opts.workdir} is full (writing "
                       f"{e.filename or 'a file'}); kept there: {_kept(opts.workdir)}: free "
                       f"some space and run again, which resumes from them") from None
    except Exception as e:
        if interrupted(e):  # an extension module interrupted while it was imported
            raise KeyboardInterrupt from e
        raise
    return opts.workdir


# The most each numeric option may be, checked (positive and finite, too) before any work and
# stated in --help; alpha and beta may be zero.
MAX_LAYERS, MAX_VIRTUAL_DEVICES = 1024, 512
_BOUNDS = {
    "num_layers": MAX_LAYERS, "batch_size": MAX_ARRAY_ELEMENTS,
    **dict.fromkeys(("seq_len", "hidden_size", "num_heads", "vocab_size", "num_experts"),
                    MAX_ARRAY_ELEMENTS),
    "num_devices": MAX_VIRTUAL_DEVICES, "max_combinations": 2**16, "profile_budget": 1e7,
    "memory_budget_gb": 2**20, "alpha": 1, "beta": 1, "device_flops": 1e18,
    "device_bandwidth": 1e16, "time_limit": 86400, "validate_top": 64, "iters": 10**4,
    "num_processes": 4096, "join_timeout": 86400, "micro_batches": 4096,
}
_PER_AXIS = ("alpha", "beta")  # text: one number per mesh axis, each may be zero


def _bounds_text(dest: str) -> str:
    high = _BOUNDS[dest]
    return (f"{'zero or more' if dest in _PER_AXIS else 'positive'}, at most "
            f"{high if isinstance(high, int) else f'{high:g}'}")


def _check_number(dest: str, value: float) -> None:
    """``value`` of the flag ``dest`` is finite and within ``_BOUNDS``; a ``CfpError`` if not."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CfpError(f"{_flag(dest)} must be a number, got {value!r}")
    low_ok = value >= 0 if dest in _PER_AXIS else value > 0
    if not (math.isfinite(value) and low_ok and value <= _BOUNDS[dest]):
        raise CfpError(f"{_flag(dest)} must be {_bounds_text(dest)}, got {value}")


def _per_axis(flag: str, text: str, num_axes: int) -> tuple[float, ...]:
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

    @property
    def reports(self) -> bool:
        """Whether this process writes the work dir and prints (process 0 of several)."""
        return self.runtime is None or self.runtime.process_id == 0


def _options(options) -> RunOptions:
    """Every check that needs no device: sizes, mesh against device count, budgets."""
    from cfp.mesh import check_mesh, device_order, mesh_from, mesh_text, parse_mesh
    from cfp.workloads import WorkloadSpec
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
    for k in _BOUNDS:
        if k not in _PER_AXIS and getattr(options, k) is not None:
            _check_number(k, getattr(options, k))
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
            _per_axis(flag, getattr(options, flag), len(mesh_shape))


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


def _check_devices(opts: RunOptions, options) -> None:
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
        raise CfpError("on CPU the virtual devices share host memory: give --memory-budget GB "
                       "(per device)")


def _default_workdir(opts: RunOptions) -> Path:
    """profiles/<model>-<config>[-overrides][-b<batch>]-<mesh>[-devices-<digest of the user's
    mesh's device order>], from the flags as given."""
    import hashlib
    from cfp.mesh import mesh_text
    spec = opts.spec
    if spec.config is None and ":" not in spec.model:
        spec = dataclasses.replace(spec, config="tiny")
    label = spec.label
    if spec.batch_size is not None:
        label += f"-b{spec.batch_size}"
    if opts.cluster is not None:
        label += f"-{opts.cluster.name}"
    label += f"-{mesh_text(opts.mesh_shape, opts.mesh_axes)}"
    if opts.device_ids is not None:  # another order is another run's
        label += f"-devices-{hashlib.sha1(repr(opts.device_ids).encode()).hexdigest()[:8]}"
    return Path("profiles") / label


def _setup_devices(num_devices: int) -> None:
    """Ask for ``num_devices`` virtual CPU devices; effective only before JAX starts."""
    flag = f"--xla_force_host_platform_device_count={num_devices}"
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    if "jax" not in sys.modules:
        os.environ["XLA_FLAGS"] = " ".join(flags + [flag])
        # A GPU is shared by this process and its measurement worker: neither takes it all.
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")


def _check_workdir(workdir: Path) -> None:
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        probe = workdir / ".cfp-write-test"
        probe.write_text("ok")
        probe.unlink()
    except OSError as e:
        raise CfpError(f"cannot write to the work dir {workdir} ({e.strerror}): "
                       f"choose another with --workdir") from None

def _kept(workdir: Path) -> str:
    """The records a work dir holds, for the line that says what a failed run kept."""
    from cfp.workdir import record_files
    names = [str(p.relative_to(workdir)) for p in record_files(workdir)]
    windows = [n for n in names if Path(n).name.startswith("window_")]
    rest = [n for n in names if n not in windows]
    counted = [f"{len(windows)} window file{'s' if len(windows) > 1 else ''}"] if windows else []
    return ", ".join(rest + counted) or "nothing"


def workdir_of(options: Options):
    """The ``cfp.workdir.WorkDir`` that ``run(options)`` reads and writes (its records are
    read with ``read_analysis``, ``read_profile`` and ``read_search``)."""
    opts = _options(options)
    if opts.mesh_shape is None:
        raise CfpError("--mesh auto chooses the mesh while it runs: give the mesh it chose")
    if not options.workdir:
        opts = dataclasses.replace(opts, workdir=_default_workdir(opts))
    return _workdir(dataclasses.replace(opts, spec=opts.spec.resolved()))


def _workdir(opts: RunOptions):
    from cfp.workdir import WorkDir
    from cfp.workloads import run_fingerprint
    fp = run_fingerprint(opts.spec, opts.mesh_shape, opts.mesh_axes, opts.device_ids)
    if opts.cluster is not None:
        fp += (("cluster", repr(opts.cluster)),)
    return WorkDir(opts.workdir, fp)


def _choose_mesh(opts: RunOptions, options) -> tuple[int, ...]:
    from cfp import report
    from cfp.passes.search import rank_meshes
    report.say(f"cluster {opts.cluster.describe()}")
    ranked = rank_meshes(opts.spec.resolved(), opts.cluster,
                         max_combinations=options.max_combinations,
                         memory_budget_bytes=_memory_budget_bytes(options, opts),
                         time_limit_s=options.time_limit)
    report.meshes_console(ranked, opts.cluster)
    if ranked[0].prediction is None:
        raise CfpError(f"no logical mesh of {opts.cluster.name} has a plan: "
                       f"{ranked[0].note}")
    return ranked[0].mesh_shape


def _cache_dir(options) -> str | None:
    cache = options.compilation_cache
    return None if not cache or str(cache).lower() == "none" else str(cache)


def _run_analysis(opts: RunOptions, options) -> None:
    from cfp import report
    from cfp.passes.analysis import run_analysis

    if options.verbose:
        report.say("***********Analysis Pass****************")
    rec = run_analysis(opts.spec, opts.mesh_shape, axis_names=opts.mesh_axes,
                       device_ids=opts.device_ids)
    _check_fits_host(opts, options, rec)
    report.analysis_console(rec, options.verbose)
    if not opts.reports:  # each process analyses for itself; process 0 keeps the record
        return
    wd = _workdir(opts)
    path = wd.write_analysis(rec)
    report.write_analysis_dumps(rec, wd.path / "debug_analysis_global")
    if options.verbose or opts.modes == ("analysis",):
        report.say(f"wrote {path} and {wd.path / 'debug_analysis_global'}/")


def _memory_budget_bytes(options, opts: RunOptions, *, required: bool = False) -> int:
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
        raise CfpError("on CPU the virtual devices share host memory: give --memory-budget GB "
                       "(per device)")
    return 2**62


def _cost_model(options, mesh_shape, device_ids=None):
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
        return _per_axis(flag, getattr(options, flag), n)

    return CostModel(per_axis("alpha", preset["alpha"]), per_axis("beta", preset["beta"]),
                     options.device_flops or preset["device_flops"],
                     options.device_bandwidth or preset["device_bandwidth"], preset["platform"],
                     preset.get("gpu") if options.device_preset else None)  # named: compiled for


def _profile_options(opts: RunOptions, options):
    from cfp.passes.profile import ProfileOptions
    return ProfileOptions(
        cost=options.cost, max_combinations=options.max_combinations,
        whole_segments=options.whole_segments, budget_s=options.profile_budget,
        memory_budget_bytes=_memory_budget_bytes(options, opts),
        cost_model=(_cost_model(options, opts.mesh_shape, opts.device_ids)
                    if options.cost == "model" else None),
        compilation_cache=_cache_dir(options))


def _analysis(opts: RunOptions, options, wd):
    """The analysis record: process 0's from the work dir; any other process analyses again,
    so that no shared file system is needed (its workers check it traced process 0's step)."""
    if opts.reports:
        rec = wd.read_analysis()
    else:
        from cfp.passes.analysis import run_analysis
        rec = run_analysis(opts.spec, opts.mesh_shape, axis_names=opts.mesh_axes,
                           device_ids=opts.device_ids)
    _check_fits_host(opts, options, rec)
    return rec


def _check_fits_host(opts: RunOptions, options, analysis) -> None:
    """A step that will run here has arrays this host can hold (a run planned for a cluster,
    or priced by the cost model, uses abstract shapes only)."""
    if opts.cluster is None and options.cost == "measure":
        from cfp.workloads import check_fits_host, host_memory_bytes
        check_fits_host(analysis.graph, host_memory_bytes())


def _run_profile(opts: RunOptions, options) -> None:
    from cfp import report
    from cfp.passes.profile import MemoryCheckpoint, run_profile
    wd = _workdir(opts)
    analysis = _analysis(opts, options, wd)
    verbose = options.verbose
    options = dataclasses.replace(_profile_options(opts, options), runtime=opts.runtime)
    if verbose:
        report.say("***********Profiling Pass****************")
    if options.cost == "mock":
        options = dataclasses.replace(options, cost_model=opts.cluster.cost_model(
            opts.mesh_shape))
        report.say(f"profiled for {opts.cluster.name} on the GPU here: each program compiled "
                   f"for its {opts.num_devices} GPUs (XLA's mock topology), one GPU's share "
                   f"timed, the collectives priced by the cluster's alpha-beta")
    elif opts.cluster is not None:
        from cfp.passes.profile import cluster_pricing
        cost_model = opts.cluster.cost_model(opts.mesh_shape)
        cost, why, gpus = cluster_pricing(analysis, options.max_combinations,
                                          compile_for=_compile_for(cost_model),
                                          limit_s=options.budget_s or 60.0)
        report.say(f"priced for {opts.cluster.name} ({cost}): {why}")
        options = dataclasses.replace(options, cost=cost, cost_model=cost_model,
                                      compile_for=gpus)
    elif options.cost == "model":
        options = dataclasses.replace(options, compile_for=_compile_for(options.cost_model))
        if options.compile_for is not None:
            from cfp.gpu_compile import label
            report.say(f"compile-only for {math.prod(opts.mesh_shape)} "
                       f"{label(options.compile_for)}s (XLA's GPU compiler, no GPU here)")
    if (opts.cluster is None and options.cost == "measure" and opts.runtime is None
            and not any(wd.path.glob("window_*.pkl"))):  # a resumed profile was checked
        _check_step(analysis)  # (several processes: search's check, on the global mesh)
    checkpoint = (wd.profile_checkpoint(analysis, options.cost, options.max_combinations,
                                        options.whole_segments, options.compile_for)
                  if opts.reports else MemoryCheckpoint())
    progress = report.ProfileProgress(verbose=verbose)
    try:
        rec = run_profile(analysis, options, checkpoint, progress)
    finally:
        progress.close()
    if not opts.reports:
        return
    out = wd.write_profile(rec, analysis)
    report.profile_console(rec, analysis.plan_space_log10(), verbose)
    if verbose or opts.modes == ("profile",):
        report.say(f"wrote {out / 'profile.pkl'} and {out / 'profile.csv'}")


def _compile_for(cost_model) -> str | None:
    """The GPUs a compile-only profile is compiled for: those ``cost_model`` names, where JAX
    here can compile for them; else None (the devices here), said in one line."""
    from cfp import gpu_compile, report
    gpu = cost_model.gpu if cost_model is not None else None
    if gpu is None:
        return None
    why = gpu_compile.unavailable_reason(gpu)
    if why is not None:
        report.say(f"not compiled for {gpu_compile.label(gpu)}s: {why}")
        return None
    return gpu


def _check_step(analysis) -> None:
    """Refuse, before any profile, a step whose data-parallel hand plan does not match one
    device (``cfp.execute.compare_numerics``): no plan of it could pass search's check."""
    from cfp.baselines import applies, baseline_plan, load_rules
    from cfp.execute import checkable, compare_numerics
    if not checkable(analysis):
        return
    rules = load_rules()
    rule = rules["dp"] if applies(rules["dp"], analysis) else rules["batch_only"]
    hand = baseline_plan(rule, analysis)
    check = compare_numerics(analysis.spec.build(), analysis, hand.strategies, analysis.mesh(),
                             hand.storage)
    if not check.ok:
        raise CfpError(f"the step cannot be checked against one device: under the "
                       f"{rule.name} hand plan its {check.describe()}")


def _run_search(opts: RunOptions, options) -> None:
    from cfp import report
    from cfp.passes.search import SearchOptions, run_search
    wd = _workdir(opts)
    analysis = _analysis(opts, options, wd)
    if opts.cluster is not None:
        return _predict(opts, options, wd, analysis)
    # Across processes the search runs on process 0's profile.
    profile = (wd.read_profile(analysis, options.cost, options.max_combinations,
                               options.whole_segments)
               if opts.reports else None)
    budget = _memory_budget_bytes(options, opts, required=True)
    search_options = SearchOptions(budget, options.time_limit, options.validate_top,
                                   options.validate_baselines, options.iters,
                                   runtime=opts.runtime, compilation_cache=_cache_dir(options))
    if options.verbose:
        report.say("***********Search Pass****************")
    rec = run_search(analysis, profile, search_options)
    if not opts.reports:
        return
    wd.write_search(rec)
    report.search_console(rec, analysis, opts.num_devices, budget, options.verbose)
    report.write_search_dumps(wd.path, analysis, profile, rec)
    _write_logical_rules(wd.path, analysis, options.verbose)
    report.usage_console(wd.path)


def _write_logical_rules(workdir: Path, analysis, verbose: bool) -> None:
    """logical_rules.json beside plan.json, when the params carry Flax logical names."""
    from cfp import report
    from cfp.logical_rules import workload_rules, write_logical_rules
    from cfp.plan import load_plan
    plan = load_plan(workdir / "plan.json")
    rules = workload_rules(plan, analysis.spec.build())
    if rules is None:
        if verbose:
            report.say("no logical-axis rules: the params carry no logical axis names "
                       "(nn.with_logical_partitioning, left boxed)")
        return
    write_logical_rules(workdir / "logical_rules.json", plan, rules)
    report.say(f"wrote {workdir / 'logical_rules.json'}" + ("" if rules.expressible else
               f": the plan is not expressible as logical-axis rules ({rules.conflicts[0]})"))


def _predict(opts: RunOptions, options, wd, analysis) -> None:
    from cfp import report
    from cfp.passes.search import predict_plan
    from cfp.plan import make_plan, write_plan
    tried = ([("mock", None)] if options.cost == "mock" else
             [("analytic", None), ("model", opts.cluster.gpu), ("model", None)])
    for k, (cost, gpus) in enumerate(tried):  # the profile the last profile pass wrote
        try:
            profile = wd.read_profile(analysis, cost, options.max_combinations,
                                      options.whole_segments, gpus)
            break
        except CfpError:
            if k + 1 == len(tried):
                raise
    report.say("***********Search Pass (predicted, nothing runs)****************")
    rec = predict_plan(analysis, profile, _memory_budget_bytes(options, opts), options.time_limit)
    report.prediction_console(rec, opts.cluster)
    path = wd.path / "plan.json"
    plan = make_plan(analysis, rec.strategies, storage=rec.storage,
                     source=f"predicted for {opts.cluster.name} ({rec.pricing})")
    plan["memory_per_device"] = report.prediction_memory(rec)
    plan["predicted_step"] = {"seconds": rec.predicted_s, "pricing": rec.pricing}
    if rec.pricing == "mock":  # of the seconds, those priced rather than timed here
        plan["predicted_step"]["priced_seconds"] = rec.priced_s
    write_plan(path, plan)
    report.say(f"wrote {path}")


def _run_stages(opts: RunOptions, options) -> None:
    from cfp import report
    from cfp.passes.stages import StageOptions, micro_batch_spec, run_stages
    from cfp.plan import write_plan
    micro_batch_spec(opts.spec, options.micro_batches)  # a batch it does not divide: no work
    if opts.cluster is None and _draws_randomness(opts.spec.build()):
        raise CfpError("the staged run here checks the step against one device, but this "
                       "loss draws randomness from a key, which micro-batches draw apart: "
                       "plan its stages with --cluster instead")
    cluster = opts.cluster or _local_cluster(opts, options)
    report.say("***********Stages Pass****************")
    rec = run_stages(opts.spec, cluster, StageOptions(
        options.micro_batches, _memory_budget_bytes(options, opts, required=True),
        options.max_combinations,
        options.time_limit))
    report.stages_console(rec, cluster)
    if opts.cluster is None:
        from cfp.execute import numerics_error, reference_loss_and_grads
        from cfp.passes.stages import run_staged
        got, seconds, programs = run_staged(opts.spec, rec.stages, options.micro_batches, iters=5)
        loss_err, grad_excess = numerics_error(got, reference_loss_and_grads(opts.spec.build()))
        if loss_err > 1e-4 or grad_excess > 0:
            raise RuntimeError(f"the staged step does not match the single-device step (loss "
                               f"rel. error {loss_err:.2e}, gradients off by {grad_excess:.2e} "
                               f"beyond tolerance)")
        report.staged_run_console(seconds, programs, loss_err, len(rec.stages))
    path = _workdir(opts).path / "stages" / "plan.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_plan(path, report.stages_json(rec))
    report.say(f"wrote {path}")


def _draws_randomness(workload) -> bool:
    """Whether the loss takes a key, or the batch holds one (dropout keys as step data)."""
    import jax
    from cfp.jax_compat import dtype_name, is_key
    return workload.loss_takes_key or any(
        is_key(dtype_name(x.dtype)) for x in jax.tree_util.tree_leaves(workload.abstract_batch()))


def _local_cluster(opts: RunOptions, options):
    """This machine's devices as one node, priced by --device-preset (a100 when left out)."""
    from cfp.cluster import Cluster, Level
    model = _cost_model(options, (opts.num_devices,))
    return Cluster("here", (Level("node", 1, model.alpha[0], model.beta[0]),
                            Level("device", opts.num_devices, model.alpha[0], model.beta[0])),
                   _memory_budget_bytes(options, opts, required=True), model.device_flops,
                   model.device_bandwidth, ("priced by the " + (options.device_preset or "a100")
                                            + " device preset",), model.platform)


_RUNNERS = {"analysis": _run_analysis, "profile": _run_profile, "search": _run_search,
            "stages": _run_stages}
