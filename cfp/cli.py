"""``python -m cfp``: the three passes from the command line.

The CLI parses and checks the options, sets up the devices before JAX starts, and for the
requested pass (or all of them in order when ``--mode`` is left out) reads the previous pass's
record from the work dir (``cfp.workdir``), runs the pass, writes its record and prints it
(``cfp.report``). A ``CfpError`` becomes one line on stderr and exit status 2.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import logging
import math
import os
import sys
from pathlib import Path

from cfp.errors import CfpError
from cfp.workloads import MAX_ARRAY_ELEMENTS

MODES = ("analysis", "profile", "search")
DEFAULT_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "cfp" / "jax"


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, where it has one (the help says what None means)."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, status 2, no usage dump (main prints it)
        raise CfpError(f"{message} (see python -m cfp --help)")

    def format_help(self):  # the presets are listed from the zoo, which imports JAX: only here
        self.epilog = f"size presets: {_presets_text()}"
        return super().format_help()


def _presets_text() -> str:
    from cfp.models.registry import PRESETS
    return "; ".join(f"{m}: {', '.join(p)}" for m, p in PRESETS.items())


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m cfp", description=__doc__.splitlines()[0],
                formatter_class=_Help)
    p.add_argument("--mode", choices=MODES + ("stages",), default=None,
                   help="the pass to run; all three in order when left out; 'stages' plans "
                        "pipeline stages (run here and checked when there is no --cluster)")
    p.add_argument("-v", "--verbose", action="store_true", help="log the library's progress")
    w = p.add_argument_group(
        "workload", "a step run here (not priced with --cost model, nor planned with --cluster) "
        "may have no array of more than 2^31 elements, nor one larger than the host's memory")
    w.add_argument("--model", default="gpt",
                   help="mlp, gpt, llama, moe, bert, or package.module:factory for your own step")
    w.add_argument("--config", default=None,
                   help="size preset (tiny when left out; all presets listed below)")
    w.add_argument("--batch-size", type=int, default=None,
                   help="global batch size (the preset's when left out)")
    for name, what in (("num-layers", "layers"), ("seq-len", "sequence length"),
                       ("hidden-size", "hidden size"), ("num-heads", "attention heads"),
                       ("vocab-size", "vocabulary size"), ("num-experts", "MoE experts")):
        w.add_argument(f"--{name}", type=int, default=None,
                       help=f"{what}, overriding the preset's")
    w.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="parameter and activation type")
    w.add_argument("--step", default="train", choices=("train", "forward"),
                   help="the step planned: train (value-and-grad plus the optimizer) or "
                        "forward (the loss alone, for inference or evaluation: no gradients "
                        "nor optimizer state)")
    m = p.add_argument_group("devices")
    m.add_argument("--num-devices", type=int, default=None,
                   help="devices to use; on CPU, this many virtual devices (the mesh's size, "
                        "or 8)")
    m.add_argument("--mesh", default=None,
                   help="mesh shape, e.g. 8 or 2x4 (axes m0, m1), or named axes, e.g. "
                        "data=2,model=4, which the plan speaks (one axis of all devices "
                        "when left out); with --cluster, 'auto' plans every logical mesh and "
                        "keeps the best")
    m.add_argument("--cluster", default=None,
                   help="plan for a described cluster instead of these devices: a preset "
                        "(a100-8, h100-8, a100-64, h100-64, alpa-50x4) or a .json file (see "
                        "cfp/cluster.py); sets the mesh (its levels), the memory budget and "
                        "the prices; search predicts and runs nothing")
    p.add_argument("--workdir", default=None,
                   help="where the passes read and write (profiles/<model>-<config>-<mesh>/ "
                        "when left out)")
    p.add_argument("--compilation-cache", default=str(DEFAULT_CACHE),
                   help="JAX's persistent compilation cache, so reruns and resumed profiles "
                        "do not compile again ('none' turns it off)")
    f = p.add_argument_group("profile")
    f.add_argument("--cost", choices=("measure", "model"), default="measure",
                   help="measure on the devices, or price compiled programs analytically")
    f.add_argument("--max-combinations", type=int, default=32,
                   help="largest strategy space profiled as one window (with "
                        "--whole-segments: combinations measured per window)")
    f.add_argument("--whole-segments", action="store_true",
                   help="profile every segment as one window; where its space is over "
                        "--max-combinations, measure the combinations cheapest by an additive "
                        "analytic price and those the baselines use")
    f.add_argument("--profile-budget", type=float, default=None,
                   help="seconds for the whole profile pass; what it does not reach is "
                        "not_measured, and profiling again measures it")
    f.add_argument("--memory-budget", type=float, default=None,
                   help="GB per device (the GPU's memory when left out; required on CPU)")
    f.add_argument("--device-preset", choices=("a100", "h100", "here"), default=None,
                   help="--cost model: documented device and network figures (a100 when left "
                        "out), or 'here': alpha-beta and roofline fitted on these devices")
    f.add_argument("--alpha", default=None,
                   help="--cost model: seconds per collective, one per mesh axis, e.g. 5e-6,3e-6")
    f.add_argument("--beta", default=None,
                   help="--cost model: seconds per byte, one per mesh axis")
    f.add_argument("--device-flops", type=float, default=None,
                   help="--cost model: FLOP/s of one device (the preset's when left out)")
    f.add_argument("--device-bandwidth", type=float, default=None,
                   help="--cost model: memory bytes/s of one device (the preset's)")
    s = p.add_argument_group("search")
    s.add_argument("--time-limit", type=float, default=60.0, help="CP-SAT seconds per solve")
    s.add_argument("--validate-top", type=int, default=3,
                   help="run the K best predicted plans end to end and keep the fastest")
    s.add_argument("--no-validate-baselines", dest="validate_baselines", action="store_false",
                   help="validate only the predicted plans, not the rule-file baselines too")
    s.add_argument("--iters", type=int, default=None,
                   help="steps per measurement (at least 5 steps and 0.3 s when left out)")
    h = p.add_argument_group(
        "several processes", "one python -m cfp per host, each with the same flags but "
        "--process-id; on a Slurm or Open MPI cluster the count and rank are read from it")
    h.add_argument("--coordinator", default=os.environ.get("JAX_COORDINATOR_ADDRESS"),
                   help="HOST:PORT of process 0; its workers' runtimes use the ports above it "
                        "(JAX_COORDINATOR_ADDRESS when left out)")
    h.add_argument("--num-processes", type=int, default=_env_int("SLURM_NTASKS",
                                                                 "OMPI_COMM_WORLD_SIZE") or 1,
                   help="processes taking part, one per host")
    h.add_argument("--process-id", type=int, default=_env_int("SLURM_PROCID",
                                                              "OMPI_COMM_WORLD_RANK") or 0,
                   help="this process's rank; process 0 writes the work dir and reports")
    h.add_argument("--join-timeout", type=int, default=30,
                   help="seconds every process's workers wait for the others to join; one "
                        "that does not join in time stops the run")
    st = p.add_argument_group("stages")
    st.add_argument("--micro-batches", type=int, default=8,
                    help="micro-batches per step; must divide the batch size")
    for action in p._actions:
        if action.dest in _BOUNDS:
            action.help += f" [{_bounds_text(action.dest)}]"
    return p


# The most each numeric flag may be, checked (positive and finite, too) before any work and
# stated in --help; --alpha and --beta may be zero.
MAX_LAYERS, MAX_VIRTUAL_DEVICES = 1024, 512
_BOUNDS = {
    "num_layers": MAX_LAYERS, "batch_size": MAX_ARRAY_ELEMENTS,
    **dict.fromkeys(("seq_len", "hidden_size", "num_heads", "vocab_size", "num_experts"),
                    MAX_ARRAY_ELEMENTS),
    "num_devices": MAX_VIRTUAL_DEVICES, "max_combinations": 2**16, "profile_budget": 1e7,
    "memory_budget": 2**20, "alpha": 1, "beta": 1, "device_flops": 1e18,
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
    low_ok = value >= 0 if dest in _PER_AXIS else value > 0
    if not (math.isfinite(value) and low_ok and value <= _BOUNDS[dest]):
        raise CfpError(f"--{dest.replace('_', '-')} must be {_bounds_text(dest)}, got {value}")


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


def _env_int(*names: str) -> int | None:
    for name in names:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


@dataclasses.dataclass(frozen=True)
class RunOptions:
    spec: object  # WorkloadSpec
    mesh_shape: tuple[int, ...]
    num_devices: int
    workdir: Path | None
    modes: tuple[str, ...]
    cluster: object = None  # cfp.cluster.Cluster; mesh_shape None: --mesh auto, chosen later
    runtime: object = None  # cfp.multihost.Runtime when several processes take part
    mesh_axes: tuple[str, ...] | None = None  # --mesh's axis names; None: m0, m1, ...

    @property
    def reports(self) -> bool:
        """Whether this process writes the work dir and prints (process 0 of several)."""
        return self.runtime is None or self.runtime.process_id == 0


def _options(args) -> RunOptions:
    """Every check that needs no device: sizes, mesh against device count, budgets."""
    from cfp.workloads import WorkloadSpec, check_mesh, parse_mesh
    overrides = tuple((k, getattr(args, k)) for k in (
        "num_layers", "seq_len", "hidden_size", "num_heads", "vocab_size", "num_experts")
        if getattr(args, k) is not None)
    for k in _BOUNDS:
        if k not in _PER_AXIS and getattr(args, k) is not None:
            _check_number(k, getattr(args, k))
    spec = WorkloadSpec(args.model, args.config, args.batch_size, args.dtype, overrides,
                        args.step)
    workdir = Path(args.workdir) if args.workdir else None
    modes = (args.mode,) if args.mode else MODES
    if args.mode == "stages" and args.step == "forward":
        raise CfpError("--mode stages plans the pipeline of a training step (its 1F1B "
                       "schedule): leave out --step forward")
    if args.cluster is not None and args.num_processes > 1:
        raise CfpError("--cluster plans without running anything: run it in one process "
                       "(without --num-processes)")
    if args.cluster is not None:
        from cfp.cluster import load_cluster
        cluster = load_cluster(args.cluster)
        if args.mesh == "auto":
            return RunOptions(spec, None, cluster.num_devices, workdir, modes, cluster)
        mesh_shape, axes = ((cluster.mesh_shape, None) if args.mesh is None
                            else parse_mesh(args.mesh))
        if math.prod(mesh_shape) != cluster.num_devices:
            raise CfpError(f"mesh {args.mesh} has {math.prod(mesh_shape)} devices; cluster "
                           f"{cluster.name} has {cluster.num_devices}")
        check_mesh(mesh_shape, cluster.num_devices)
        _check_per_axis(args, mesh_shape)
        return RunOptions(spec, mesh_shape, cluster.num_devices, workdir, modes, cluster,
                          mesh_axes=axes)
    if args.mesh == "auto":
        raise CfpError("--mesh auto compares the logical meshes of a described cluster: give "
                       "--cluster too")
    if args.mesh is None:
        num = 8 if args.num_devices is None else args.num_devices
        mesh_shape, axes = (num,), None
    else:
        mesh_shape, axes = parse_mesh(args.mesh)
        num = math.prod(mesh_shape) if args.num_devices is None else args.num_devices
    if num > MAX_VIRTUAL_DEVICES:
        raise CfpError(f"mesh {args.mesh} has {num} devices, over the {MAX_VIRTUAL_DEVICES} a "
                       f"run here may use: plan for more with --cluster")
    check_mesh(mesh_shape, num)
    _check_per_axis(args, mesh_shape)
    return RunOptions(spec, mesh_shape, num, workdir, modes, runtime=_runtime(args, num),
                      mesh_axes=axes)


def _check_per_axis(args, mesh_shape: tuple[int, ...]) -> None:
    for flag in ("alpha", "beta"):
        if getattr(args, flag) is not None:
            _per_axis(flag, getattr(args, flag), len(mesh_shape))


def _runtime(args, num_devices: int):
    """The processes taking part, when there are several (``--num-processes``)."""
    from cfp.multihost import Runtime
    if args.num_processes < 1:
        raise CfpError(f"--num-processes must be positive, got {args.num_processes}")
    if args.num_processes == 1:
        return None
    if not args.coordinator:
        raise CfpError("several processes need --coordinator HOST:PORT (process 0's host)")
    if args.mode == "stages":
        raise CfpError("--mode stages runs in one process: plan stages for a cluster with "
                       "--cluster, or run them here without --num-processes")
    if num_devices % args.num_processes:
        raise CfpError(f"{num_devices} devices do not split evenly over "
                       f"{args.num_processes} processes")
    return Runtime(args.coordinator, args.num_processes, args.process_id, args.join_timeout)


def _check_devices(opts: RunOptions, args) -> None:
    """The checks that need JAX's devices (none compiles anything): the mesh fits them, and
    search on CPU has a memory budget."""
    import jax
    from cfp.workloads import make_mesh
    if opts.cluster is not None:
        return  # planned, not run: analysis and analytic pricing need no devices
    if opts.runtime is not None:  # the global mesh exists only in the workers' runtime
        local, n = len(jax.local_devices()), opts.runtime.num_processes
        if local * n < opts.num_devices:
            raise CfpError(f"{opts.num_devices} devices over {n} processes need "
                           f"{opts.num_devices // n} per process; JAX sees {local} here")
    else:
        make_mesh(opts.mesh_shape)
    if (("search" in opts.modes or "stages" in opts.modes) and args.memory_budget is None
            and jax.devices()[0].platform == "cpu"):
        raise CfpError("on CPU the virtual devices share host memory: give --memory-budget GB "
                       "(per device)")


def _default_workdir(opts: RunOptions) -> Path:
    """profiles/<model>-<config>[-overrides][-b<batch>]-<mesh>, from the flags as given."""
    from cfp.workloads import mesh_text
    spec = opts.spec
    if spec.config is None and ":" not in spec.model:
        spec = dataclasses.replace(spec, config="tiny")
    label = spec.label
    if spec.batch_size is not None:
        label += f"-b{spec.batch_size}"
    if opts.cluster is not None:
        label += f"-{opts.cluster.name}"
    return Path("profiles") / f"{label}-{mesh_text(opts.mesh_shape, opts.mesh_axes)}"


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


def main(argv: list[str] | None = None) -> int:
    """The command line: runs ``argv``'s passes; a ``CfpError`` is one line and status 2."""
    from cfp.interrupts import interrupted
    try:
        args = build_parser().parse_args(argv)
        logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING,
                            format="%(name)s: %(message)s")
        run_args(args)
    except CfpError as e:
        print(f"cfp: error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Exception) as e:
        if not interrupted(e):
            raise
        print("cfp: interrupted; everything measured so far is kept in the work dir",
              file=sys.stderr)
        return 130
    return 0


def run(argv: list[str]) -> Path:
    """The passes ``argv`` asks for, as the command line runs them; returns the work dir.
    Bad input raises ``CfpError`` (argument errors too), Ctrl-C ``KeyboardInterrupt``."""
    from cfp.interrupts import interrupted
    try:
        return run_args(build_parser().parse_args(argv))
    except Exception as e:
        if interrupted(e):
            raise KeyboardInterrupt from e
        raise


def run_args(args) -> Path:
    """The passes of parsed ``args``; returns the work dir."""
    opts = _options(args)
    # A described cluster is compiled for here only up to 64 devices (cluster_pricing).
    _setup_devices(opts.num_devices // opts.runtime.num_processes if opts.runtime
                   else opts.num_devices if opts.cluster is None or opts.num_devices <= 64
                   else 8)
    if not opts.reports:
        from cfp import report
        report.silence()
    if opts.mesh_shape is None:
        opts = dataclasses.replace(opts, mesh_shape=_choose_mesh(opts, args))
    if not args.workdir:
        opts = dataclasses.replace(opts, workdir=_default_workdir(opts))
    opts = dataclasses.replace(opts, spec=opts.spec.resolved())
    if opts.reports:
        _check_workdir(opts.workdir)
    _check_devices(opts, args)
    from cfp.jax_compat import enable_compilation_cache
    enable_compilation_cache(_cache_dir(args))  # before anything compiles
    from cfp.interrupts import CtrlC
    from cfp.workdir import locked
    try:
        with (locked(opts.workdir) if opts.reports else contextlib.nullcontext(),
              CtrlC() as ctrl_c):
            for mode in opts.modes:
                _RUNNERS[mode](opts, args)
                ctrl_c.check()
    except OSError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise CfpError(f"the disk of the work dir {opts.workdir} is full (writing "
                       f"{e.filename or 'a file'}); kept there: {_kept(opts.workdir)}: free "
                       f"some space and run again, which resumes from them") from None
    return opts.workdir


def _kept(workdir: Path) -> str:
    """The records a work dir holds, for the line that says what a failed run kept."""
    from cfp.workdir import record_files
    names = [str(p.relative_to(workdir)) for p in record_files(workdir)]
    windows = [n for n in names if Path(n).name.startswith("window_")]
    rest = [n for n in names if n not in windows]
    counted = [f"{len(windows)} window file{'s' if len(windows) > 1 else ''}"] if windows else []
    return ", ".join(rest + counted) or "nothing"


def _workdir(opts: RunOptions):
    from cfp.workdir import WorkDir
    from cfp.workloads import run_fingerprint
    fp = run_fingerprint(opts.spec, opts.mesh_shape, opts.mesh_axes)
    if opts.cluster is not None:
        fp += (("cluster", repr(opts.cluster)),)
    return WorkDir(opts.workdir, fp)


def _choose_mesh(opts: RunOptions, args) -> tuple[int, ...]:
    from cfp import report
    from cfp.passes.search import rank_meshes
    report.say(f"cluster {opts.cluster.describe()}")
    ranked = rank_meshes(opts.spec.resolved(), opts.cluster,
                         max_combinations=args.max_combinations,
                         memory_budget_bytes=_memory_budget_bytes(args, opts),
                         time_limit_s=args.time_limit)
    report.meshes_console(ranked, opts.cluster)
    if ranked[0].prediction is None:
        raise CfpError(f"no logical mesh of {opts.cluster.name} has a plan: "
                       f"{ranked[0].note}")
    return ranked[0].mesh_shape


def _cache_dir(args) -> str | None:
    return None if args.compilation_cache.lower() == "none" else args.compilation_cache


def _run_analysis(opts: RunOptions, args) -> None:
    from cfp import report
    from cfp.passes.analysis import run_analysis

    report.say("***********Analysis Pass****************")
    rec = run_analysis(opts.spec, opts.mesh_shape, axis_names=opts.mesh_axes)
    _check_fits_host(opts, args, rec)
    report.analysis_console(rec)
    if not opts.reports:  # each process analyses for itself; process 0 keeps the record
        return
    wd = _workdir(opts)
    path = wd.write_analysis(rec)
    report.write_analysis_dumps(rec, wd.path / "debug_analysis_global")
    report.say(f"wrote {path} and {wd.path / 'debug_analysis_global'}/")


def _memory_budget_bytes(args, opts: RunOptions, *, required: bool = False) -> int:
    import jax
    if args.memory_budget is not None:
        return int(args.memory_budget * 2**30)
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


def _cost_model(args, mesh_shape):
    from cfp.measure import DEVICE_PRESETS, CostModel, fit_cost_model
    if args.device_preset == "here":
        from cfp.workloads import make_mesh
        fitted = fit_cost_model(make_mesh(mesh_shape))
        from cfp import report
        report.say(f"fitted here: alpha {fitted.alpha} s, beta {fitted.beta} s/B, "
                   f"{fitted.device_flops:.3g} FLOP/s, {fitted.device_bandwidth:.3g} B/s")
        preset = {"alpha": fitted.alpha, "beta": fitted.beta,
                  "device_flops": fitted.device_flops,
                  "device_bandwidth": fitted.device_bandwidth}
    else:
        preset = dict(DEVICE_PRESETS[args.device_preset or "a100"])
    n = len(mesh_shape)

    def per_axis(flag, default):
        if getattr(args, flag) is None:
            vals = list(default)[-n:] if len(default) >= n else [default[-1]] * n
            return tuple(float(v) for v in vals)
        return _per_axis(flag, getattr(args, flag), n)

    return CostModel(per_axis("alpha", preset["alpha"]), per_axis("beta", preset["beta"]),
                     args.device_flops or preset["device_flops"],
                     args.device_bandwidth or preset["device_bandwidth"])


def _profile_options(opts: RunOptions, args):
    from cfp.passes.profile import ProfileOptions
    return ProfileOptions(
        cost=args.cost, max_combinations=args.max_combinations,
        whole_segments=args.whole_segments, budget_s=args.profile_budget,
        memory_budget_bytes=_memory_budget_bytes(args, opts),
        cost_model=_cost_model(args, opts.mesh_shape) if args.cost == "model" else None,
        compilation_cache=_cache_dir(args))


def _analysis(opts: RunOptions, args, wd):
    """The analysis record: process 0's from the work dir; any other process analyses again,
    so that no shared file system is needed (its workers check it traced process 0's step)."""
    if opts.reports:
        rec = wd.read_analysis()
    else:
        from cfp.passes.analysis import run_analysis
        rec = run_analysis(opts.spec, opts.mesh_shape, axis_names=opts.mesh_axes)
    _check_fits_host(opts, args, rec)
    return rec


def _check_fits_host(opts: RunOptions, args, analysis) -> None:
    """A step that will run here has arrays this host can hold (a run planned for a cluster,
    or priced by the cost model, uses abstract shapes only)."""
    if opts.cluster is None and args.cost == "measure":
        from cfp.workloads import check_fits_host, host_memory_bytes
        check_fits_host(analysis.graph, host_memory_bytes())


def _run_profile(opts: RunOptions, args) -> None:
    from cfp import report
    from cfp.passes.profile import MemoryCheckpoint, run_profile
    wd = _workdir(opts)
    analysis = _analysis(opts, args, wd)
    options = dataclasses.replace(_profile_options(opts, args), runtime=opts.runtime)
    report.say("***********Profiling Pass****************")
    if opts.cluster is not None:
        from cfp.passes.profile import cluster_pricing
        cost, why = cluster_pricing(analysis, args.max_combinations)
        report.say(f"priced for {opts.cluster.name} ({cost}): {why}")
        options = dataclasses.replace(options, cost=cost,
                                      cost_model=opts.cluster.cost_model(opts.mesh_shape))
    checkpoint = (wd.profile_checkpoint(analysis, options.cost, options.max_combinations,
                                        options.whole_segments)
                  if opts.reports else MemoryCheckpoint())
    progress = report.ProfileProgress()
    try:
        rec = run_profile(analysis, options, checkpoint, progress)
    finally:
        progress.close()
    if not opts.reports:
        return
    out = wd.write_profile(rec, analysis)
    report.profile_console(rec, analysis.plan_space_log10())
    report.say(f"wrote {out / 'profile.pkl'} and {out / 'profile.csv'}")


def _run_search(opts: RunOptions, args) -> None:
    from cfp import report
    from cfp.passes.search import SearchOptions, run_search
    wd = _workdir(opts)
    analysis = _analysis(opts, args, wd)
    if opts.cluster is not None:
        return _predict(opts, args, wd, analysis)
    # Across processes the search runs on process 0's profile.
    profile = (wd.read_profile(analysis, args.cost, args.max_combinations, args.whole_segments)
               if opts.reports else None)
    budget = _memory_budget_bytes(args, opts, required=True)
    options = SearchOptions(budget, args.time_limit, args.validate_top,
                            args.validate_baselines, args.iters, runtime=opts.runtime,
                            compilation_cache=_cache_dir(args))
    report.say("***********Search Pass****************")
    rec = run_search(analysis, profile, options)
    if not opts.reports:
        return
    wd.write_search(rec)
    report.search_console(rec, opts.num_devices)
    report.write_search_dumps(wd.path, analysis, profile, rec)
    _write_logical_rules(wd.path, analysis)
    report.say(f"wrote {wd.path / 'plan.json'}, {wd.path / 'search.pkl'} and "
               f"{wd.path / 'debug_search'}/")


def _write_logical_rules(workdir: Path, analysis) -> None:
    """logical_rules.json beside plan.json, when the params carry Flax logical names."""
    from cfp import report
    from cfp.logical_rules import workload_rules, write_logical_rules
    from cfp.plan import load_plan
    plan = load_plan(workdir / "plan.json")
    rules = workload_rules(plan, analysis.spec.build())
    if rules is None:
        report.say("no logical-axis rules: the params carry no logical axis names "
                   "(nn.with_logical_partitioning, left boxed)")
        return
    write_logical_rules(workdir / "logical_rules.json", plan, rules)
    report.say(f"wrote {workdir / 'logical_rules.json'}" + ("" if rules.expressible else
               f": the plan is not expressible as logical-axis rules ({rules.conflicts[0]})"))


def _predict(opts: RunOptions, args, wd, analysis) -> None:
    from cfp import report
    from cfp.passes.search import predict_plan
    from cfp.plan import make_plan, write_plan
    try:
        profile = wd.read_profile(analysis, "analytic", args.max_combinations,
                                  args.whole_segments)
    except CfpError:
        profile = wd.read_profile(analysis, "model", args.max_combinations,
                                  args.whole_segments)
    report.say("***********Search Pass (predicted, nothing runs)****************")
    rec = predict_plan(analysis, profile, _memory_budget_bytes(args, opts), args.time_limit)
    report.prediction_console(rec, opts.cluster)
    path = wd.path / "plan.json"
    write_plan(path, make_plan(analysis, rec.strategies, storage=rec.storage,
                               source=f"predicted for {opts.cluster.name} ({rec.pricing})"))
    report.say(f"wrote {path}")


def _run_stages(opts: RunOptions, args) -> None:
    from cfp import report
    from cfp.passes.stages import StageOptions, micro_batch_spec, run_stages
    from cfp.plan import write_plan
    micro_batch_spec(opts.spec, args.micro_batches)  # a batch it does not divide: no work
    if opts.cluster is None and _draws_randomness(opts.spec.build()):
        raise CfpError("the staged run here checks the step against one device, but this "
                       "loss draws randomness from a key, which micro-batches draw apart: "
                       "plan its stages with --cluster instead")
    cluster = opts.cluster or _local_cluster(opts, args)
    report.say("***********Stages Pass****************")
    rec = run_stages(opts.spec, cluster, StageOptions(
        args.micro_batches, _memory_budget_bytes(args, opts, required=True),
        args.max_combinations,
        args.time_limit))
    report.stages_console(rec, cluster)
    if opts.cluster is None:
        from cfp.execute import numerics_error, reference_loss_and_grads
        from cfp.passes.stages import run_staged
        got, seconds, programs = run_staged(opts.spec, rec.stages, args.micro_batches, iters=5)
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


def _local_cluster(opts: RunOptions, args):
    """This machine's devices as one node, priced by --device-preset (a100 when left out)."""
    from cfp.cluster import Cluster, Level
    model = _cost_model(args, (opts.num_devices,))
    return Cluster("here", (Level("node", 1, model.alpha[0], model.beta[0]),
                            Level("device", opts.num_devices, model.alpha[0], model.beta[0])),
                   _memory_budget_bytes(args, opts, required=True), model.device_flops,
                   model.device_bandwidth, ("priced by the " + (args.device_preset or "a100")
                                            + " device preset",))


_RUNNERS = {"analysis": _run_analysis, "profile": _run_profile, "search": _run_search,
            "stages": _run_stages}
