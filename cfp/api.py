"""The Python API: a training step through the three passes, and the plan they find.

    >>> import cfp  # doctest: +SKIP
    >>> plan = cfp.autoshard(train_step, params, opt_state, batch, mesh="2x4",
    ...                      memory_budget_gb=4, workdir="profiles/mine")  # doctest: +SKIP
    >>> step = plan.jit(train_step, params, opt_state, batch)  # doctest: +SKIP

The step is handed in as the function with example arguments (``cfp.workloads.hand_in``),
from a script with or without a main guard, standard input or a notebook: the measurement
workers get it by value over their pipe and never run the caller's script again. A factory
of a ``cfp.models.Workload`` (``cfp.models.user_workload(...)``), a ``Workload``, or by name
``"package.module:factory"`` (the command line's form: the factory gets only the keyword
arguments it declares, ``batch_size``, ``dtype``, size overrides) and the zoo's ``"gpt"``,
``"moe"``... are taken too.

``run(Options(...))`` runs the passes ``Options.mode`` asks for and returns the work dir; the
command line (``cfp.cli``) only parses its flags into ``Options`` and calls it.
``autoshard`` runs all three and returns a ``Plan``. Bad input raises ``CfpError`` with its
one-line reason before any work; Ctrl-C raises ``KeyboardInterrupt`` (everything measured is
kept in the work dir).

What it changes in the caller's process: the console lines of each pass are printed to
``sys.stdout``; when JAX is not yet imported, ``XLA_FLAGS`` asks for the mesh's number of
virtual CPU devices (with JAX already started, the devices JAX has are used); in a process
other than 0 of several, cfp prints nothing while it runs. JAX's settings, the logging setup and
signal handlers are left as they were (the measurement workers, which are processes of their
own, use ``Options.compilation_cache``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
from pathlib import Path

from cfp.errors import CfpError
from cfp.options import (Options, RunOptions, check_devices, check_options, check_workdir,
                         cost_model_of, default_workdir, memory_budget_bytes, preset_gpu,
                         require_workdir, setup_devices)


class Plan:
    """A plan ``cfp.autoshard`` found: ``plan.json``'s content (``data``) and what to do with
    it. ``jit`` compiles the user's own ``train_step(params, opt_state, batch) -> (params,
    opt_state, loss)`` (a forward plan's ``forward(params, batch)``) to the program cfp
    measured, state donated; ``shardings`` gives the ``in_shardings``/``out_shardings`` for a
    plain ``jax.jit``."""

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

    def shardings(self, *args) -> tuple[tuple, tuple]:
        """``(in_shardings, out_shardings)`` for ``jax.jit(train_step, ...,
        donate_argnums=(0, 1))``; ``args``, ``(params, opt_state, batch)`` (a forward plan's:
        ``(params, batch)``), arrays or ``ShapeDtypeStruct``s, fix the trees."""
        from cfp.plan import step_shardings
        return step_shardings(self.data, self.mesh, *args)

    def jit(self, train_step, *args):
        """``train_step`` jitted with the plan's layouts and its blocks' constraints inside,
        ``params`` and ``opt_state`` donated; ``args`` as ``shardings`` takes them. The
        traced step must be the analysed one."""
        from cfp.plan import jit
        return jit(train_step, self.data, self.mesh, *args)

    def describe(self) -> str:
        """The plan in words: which mesh axis splits which role, per segment type."""
        lines = self.data.get("description") or [
            f"block {b['block']}: {b['strategy']}" for b in self.data.get("blocks", ())]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return (f"Plan(mesh {'x'.join(map(str, self.data['mesh']['shape']))}, "
                f"{len(self.data.get('blocks', ()))} blocks, {self.data.get('source', '')!r})")


def autoshard(model, *example_args, mesh: str | None = None,
              memory_budget_gb: float | None = None, workdir: str | Path | None = None,
              **options) -> Plan:
    """Analyse, profile and search a step on ``mesh``; the plan kept.

    ``model`` is the step itself with its example arguments (arrays, or
    ``jax.ShapeDtypeStruct``s: cfp then makes the inputs it checks the step on), in one of
    the forms ``cfp.workloads.STEP_FORMS`` lists; or a factory of a ``cfp.models.Workload``,
    a ``Workload``, or by name, a zoo model (``"gpt"``) or ``"package.module:factory"``. A
    step handed in is named by the fingerprint of its traced program: a second call on the
    same step, shapes and mesh finds the work dir's profile. ``options`` are further
    ``Options`` fields (``step="forward"``, ``batch_size``, ``max_combinations``,
    ``validate_top``, ``iters``, ...). ``workdir`` None: ``profiles/<name>-<mesh>/``
    (``cfp.options.default_workdir``)."""
    unknown = sorted(set(options) - {f.name for f in dataclasses.fields(Options)})
    if unknown:
        raise CfpError(f"autoshard() takes no option {unknown[0]!r} (see cfp.Options for "
                       f"the ones it takes)")
    handed = not isinstance(model, str)
    if handed:
        model = _hand_in(model, example_args, dict(options, mesh=mesh, workdir=workdir))
    elif example_args:
        raise CfpError(f"{model!r} names a model, which makes its own inputs: hand in the step "
                       f"function itself with example arguments")
    try:
        workdir, plan = _run(Options(model=model, mesh=mesh, memory_budget_gb=memory_budget_gb,
                                     workdir=workdir, **options))
    finally:
        if handed:  # the user's loop donates them: cfp keeps no reference to the arrays
            from cfp.workloads import forget_arrays
            forget_arrays(model)
    # Process 0 wrote the plan; another process of several has it from its own search.
    return Plan(plan) if plan is not None else Plan.load(Path(workdir) / "plan.json")


def _hand_in(handed, example_args: tuple, options: dict) -> str:
    """The model name of a step handed in (``cfp.workloads.hand_in``), the options it is
    built with checked first."""
    from cfp.workloads import hand_in
    opts = check_options(Options(**dict(options, model="step@")))
    _setup_devices(opts)  # before the step's trace can start JAX's backends
    from cfp import report
    from cfp.workloads import has_shapes
    model = hand_in(handed, example_args, opts.spec).model
    if has_shapes(example_args):
        report.made_inputs_console()
    return model


def run(options: Options, *, own_process: bool = False) -> Path:
    """The passes ``options.mode`` asks for (all three in order when None); returns the work
    dir. ``own_process``: the caller is the command line, whose process this is: JAX's
    compilation cache is turned on in it too."""
    return _run(options, own_process=own_process)[0]


def _run(options: Options, *, own_process: bool = False) -> tuple[Path, dict | None]:
    """``run``'s work dir, and the plan on a process of several that writes none (None
    elsewhere: the plan is in the work dir)."""
    opts = check_options(options)
    _setup_devices(opts)
    from cfp import report
    with report.silenced(not opts.reports):
        return _run_passes(opts, options, own_process)


def _setup_devices(opts: RunOptions) -> None:
    # A described cluster is compiled for here only up to 64 devices (cluster_pricing).
    setup_devices(opts.num_devices // opts.runtime.num_processes if opts.runtime
                  else opts.num_devices if opts.cluster is None or opts.num_devices <= 64
                  else 8)


def _run_passes(opts: RunOptions, options: Options, own_process: bool
                ) -> tuple[Path, dict | None]:
    if opts.reports and opts.workdir is not None:
        check_workdir(opts.workdir, opts.modes)  # before any work: --mesh auto ranks meshes first
    if opts.mesh_shape is None:
        chosen = _choose_mesh(opts, options)
        opts = dataclasses.replace(opts, mesh_shape=chosen[2].mesh_shape, chosen_mesh=chosen)
    if opts.workdir is None:
        opts = dataclasses.replace(opts, workdir=default_workdir(opts))
        if opts.reports:
            check_workdir(opts.workdir, opts.modes)
    opts = dataclasses.replace(opts, spec=opts.spec.resolved())
    check_devices(opts, options)
    if opts.reports:
        require_workdir(opts.workdir, opts.modes)
    if own_process:
        from cfp.jax_compat import enable_compilation_cache
        enable_compilation_cache(_cache_dir(options))  # before anything compiles
    from cfp.interrupts import CtrlC, interrupted
    from cfp.workdir import locked
    try:
        with (locked(opts.workdir) if opts.reports else contextlib.nullcontext(),
              CtrlC() as ctrl_c):
            if opts.reports and "@" in opts.spec.model and "analysis" in opts.modes:
                from cfp import report
                from cfp.workdir import clear_other_handed_step
                if clear_other_handed_step(opts.workdir, opts.spec.model):
                    report.say(f"the step differs from the one {opts.workdir} was profiled "
                               f"for: profiled again")
            plan = None
            for mode in opts.modes:
                plan = _RUNNERS[mode](opts, options)
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
    return opts.workdir, plan




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
    opts = check_options(options)
    if opts.mesh_shape is None:
        raise CfpError("--mesh auto chooses the mesh while it runs: give the mesh it chose")
    if not options.workdir:
        opts = dataclasses.replace(opts, workdir=default_workdir(opts))
    return _workdir(dataclasses.replace(opts, spec=opts.spec.resolved()))


def _workdir(opts: RunOptions):
    from cfp.workdir import WorkDir
    from cfp.workloads import run_fingerprint
    fp = run_fingerprint(opts.spec, opts.mesh_shape, opts.mesh_axes, opts.device_ids)
    if opts.cluster is not None:
        fp += (("cluster", repr(opts.cluster)),)
    return WorkDir(opts.workdir, fp)


def _choose_mesh(opts: RunOptions, options) -> tuple:
    """(the traced step, its blocks' grouping, the best ``MeshCandidate``): the passes on
    the chosen mesh start from all three."""
    from cfp import report
    from cfp.grouping import group_blocks
    from cfp.passes.search import rank_meshes
    from cfp.tracing import trace_step
    report.say(f"cluster {opts.cluster.describe()}")
    spec = opts.spec.resolved()
    program = trace_step(spec.build())
    grouping = group_blocks(program.graph())
    ranked = rank_meshes(spec, opts.cluster, program.graph(), grouping,
                         max_combinations=options.max_combinations,
                         memory_budget_bytes=memory_budget_bytes(options, opts),
                         time_limit_s=options.time_limit)
    report.meshes_console(ranked, opts.cluster)
    if ranked[0].prediction is None:
        raise CfpError(f"no logical mesh of {opts.cluster.name} has a plan: "
                       f"{ranked[0].note}")
    return program, grouping, ranked[0]


def _cache_dir(options) -> str | None:
    cache = options.compilation_cache
    return None if not cache or str(cache).lower() == "none" else str(cache)


def _run_analysis(opts: RunOptions, options) -> None:
    from cfp import dumps, report
    from cfp.passes.analysis import run_analysis

    if options.verbose:
        report.say("***********Analysis Pass****************")
    program, grouping, _ = opts.chosen_mesh or (None, None, None)
    with report.ticking("analysis") as on_stage:
        rec = run_analysis(opts.spec, opts.mesh_shape, program and program.graph(), grouping,
                           axis_names=opts.mesh_axes, device_ids=opts.device_ids,
                           on_stage=on_stage)
    _check_fits_host(opts, options, rec)
    report.analysis_console(rec, options.verbose)
    if not opts.reports:  # each process analyses for itself; process 0 keeps the record
        return
    wd = _workdir(opts)
    path = wd.write_analysis(rec)
    dumps.write_analysis_dumps(rec, wd.path / "debug_analysis_global")
    if options.verbose or opts.modes == ("analysis",):
        report.say(f"wrote {path} and {wd.path / 'debug_analysis_global'}/")


def _profile_options(opts: RunOptions, options):
    from cfp.passes.profile import ProfileOptions
    return ProfileOptions(
        cost=options.cost, max_combinations=options.max_combinations,
        whole_segments=options.whole_segments, budget_s=options.profile_budget,
        memory_budget_bytes=memory_budget_bytes(options, opts),
        cost_model=(cost_model_of(options, opts.mesh_shape, opts.device_ids)
                    if options.cost == "model" else None),
        compilation_cache=_cache_dir(options), exhaustive=options.profile_all,
        plans=options.validate_top, solve_s=min(options.time_limit, 10.0))


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
                                          max_devices=CLUSTER_COMPILE_DEVICES,
                                          compile_for=_compile_for(cost_model),
                                          limit_s=options.budget_s or 60.0,
                                          program=opts.chosen_mesh and opts.chosen_mesh[0])
        report.say(f"priced for {opts.cluster.name} ({cost}): {why}")
        options = dataclasses.replace(options, cost=cost, cost_model=cost_model,
                                      compile_for=gpus)
    elif options.cost == "model":
        options = dataclasses.replace(options, compile_for=_compile_for(options.cost_model))
        if options.compile_for is not None:
            from cfp.gpu_compile import label
            report.say(f"compile-only for {math.prod(opts.mesh_shape)} "
                       f"{label(options.compile_for)}s (XLA's GPU compiler, described GPUs)")
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


CLUSTER_COMPILE_DEVICES = 64  # the most devices of a cluster whose windows are compiled here
WHOLE_STEP_COMPILE_DEVICES = 8  # the most whose whole steps are (one node)


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


def _run_search(opts: RunOptions, options) -> dict | None:
    from cfp import dumps, report
    from cfp.passes.search import SearchOptions, run_search
    wd = _workdir(opts)
    analysis = _analysis(opts, options, wd)
    if opts.cluster is not None:
        return _predict(opts, options, wd, analysis)
    # Across processes the search runs on process 0's profile.
    gpus = preset_gpu(options) if options.cost == "model" else None  # nothing fitted again
    tried = [(options.cost, gpus), (options.cost, None)]
    profile = _last_profile(wd, analysis, options, tried) if opts.reports else None
    budget = memory_budget_bytes(options, opts, required=True)
    if _asks_under(opts, profile, budget):  # its top plans may use what was not measured
        if opts.reports:
            report.say(f"the profile measured what plans under "
                       f"{profile.driven_budget_bytes / 2**30:g} GiB use; measuring what "
                       f"plans under {budget / 2**30:g} GiB use")
        _run_profile(opts, options)
        profile = _last_profile(wd, analysis, options, tried) if opts.reports else None
    search_options = SearchOptions(budget, options.time_limit, options.validate_top,
                                   options.validate_baselines, options.iters,
                                   runtime=opts.runtime, compilation_cache=_cache_dir(options),
                                   recompute=options.recompute)
    if options.verbose:
        report.say("***********Search Pass****************")
    before = _search_found_before(opts, wd, search_options, profile)
    if before is not None:  # a handed step called again: its plan is the work dir's
        report.search_console(before, analysis, opts.num_devices, budget, options.verbose,
                              options.driver_lines, found_before=True)
        report.usage_console(wd.path, analysis.spec.step, _holds_state(analysis))
        return None
    rec = run_search(analysis, profile, search_options)
    if not opts.reports:  # process 0 writes the plan; this process has it all the same
        import json
        return json.loads(json.dumps(dumps.plan_of(analysis, rec)))
    from cfp.workdir import search_inputs
    wd.write_search(dataclasses.replace(rec, inputs=search_inputs(search_options, profile)))
    report.search_console(rec, analysis, opts.num_devices, budget, options.verbose,
                          options.driver_lines)
    dumps.write_search_dumps(wd.path, analysis, profile, rec)
    _write_logical_rules(wd.path, analysis, options.verbose)
    report.usage_console(wd.path, analysis.spec.step, _holds_state(analysis))


def _asks_under(opts: RunOptions, profile, budget: int) -> bool:
    """Whether the measured profile chose what to measure under another memory budget
    (process 0's answer, shared). A ``--cost model`` profile is searched as it is: resuming
    it would fit its figures again."""
    from cfp.multihost import share
    return share(bool(opts.reports and profile.cost == "measure"
                      and profile.asks_under(budget)))


def _holds_state(analysis) -> bool:
    """Whether the step carries one state (a TrainState, NNX's model and optimizer) that the
    user splits to use the plan."""
    layout_of = getattr(analysis.spec.build().state_step, "layout_of", None)
    return layout_of is not None and not layout_of().plain


def _search_found_before(opts: RunOptions, wd, search_options, profile):
    """For a step handed to ``cfp.autoshard``: the work dir's search record where it was
    searched from the same profile and options (``cfp.workdir.search_inputs``) and its plan
    is there; else None."""
    from cfp.workdir import search_inputs
    if not (opts.reports and "@" in opts.spec.model and (wd.path / "plan.json").exists()
            and (wd.path / "search.pkl").exists()):
        return None
    try:
        before = wd.read_search()
    except CfpError:
        return None
    return before if before.inputs == search_inputs(search_options, profile) else None


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


def _last_profile(wd, analysis, options, tried: list[tuple[str, str | None]]):
    """The profile the last profile pass wrote: the first of ``tried`` (its cost, and the
    GPUs its programs were compiled for, None for the devices here) in the work dir."""
    tried = list(dict.fromkeys(tried))
    for k, (cost, gpus) in enumerate(tried):
        try:
            return wd.read_profile(analysis, cost, options.max_combinations,
                                   options.whole_segments, gpus)
        except CfpError:
            if k + 1 == len(tried):
                raise


def _predict(opts: RunOptions, options, wd, analysis) -> None:
    from cfp import dumps, report
    from cfp.passes.search import predict_plan
    from cfp.plan import make_plan, write_plan
    profile = _last_profile(wd, analysis, options, [("mock", None)] if options.cost == "mock"
                            else [("analytic", None), ("model", opts.cluster.gpu),
                                  ("model", None)])
    report.say("***********Search Pass (predicted, nothing runs)****************")
    # The whole steps are compiled for the cluster's GPUs where they are described and the
    # mesh is one node's: a whole step of GPT-39B compiled for 64 A100s takes about 90 s here,
    # and a budget that binds asks for a dozen of them
    from cfp.gpu_compile import unavailable_reason
    gpus = opts.cluster.gpu  # (the profile pass said once why it could not compile for them)
    if (gpus is None or math.prod(analysis.mesh_shape) > WHOLE_STEP_COMPILE_DEVICES
            or unavailable_reason(gpus) is not None):
        gpus = None
    rec = predict_plan(analysis, profile, memory_budget_bytes(options, opts), options.time_limit,
                       ranked=opts.chosen_mesh[2].prediction if opts.chosen_mesh else None,
                       compile_for=gpus)
    report.prediction_console(rec, opts.cluster, options.driver_lines, analysis)
    path = wd.path / "plan.json"
    plan = make_plan(analysis, rec.strategies, storage=rec.storage,
                     source=f"predicted for {opts.cluster.name} ({rec.pricing})",
                     recompute=rec.recompute)
    from cfp.describe import plan_words
    plan["description"] = plan_words(analysis, rec.strategies, rec.storage, rec.recompute)
    plan["memory_per_device"] = dumps.prediction_memory(rec)
    plan["predicted_step"] = {"seconds": rec.predicted_s, "pricing": rec.pricing}
    if rec.pricing == "mock":  # of the seconds, those priced rather than timed here
        plan["predicted_step"]["priced_seconds"] = rec.priced_s
    write_plan(path, plan)
    report.say(f"wrote {path}")


def _run_stages(opts: RunOptions, options) -> None:
    from cfp import dumps, report
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
        options.micro_batches, memory_budget_bytes(options, opts, required=True),
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
    write_plan(path, dumps.stages_json(rec))
    report.say(f"wrote {path}")


def _draws_randomness(workload) -> bool:
    """Whether the loss takes a key, or the batch holds one (dropout keys as step data)."""
    import jax
    from cfp.jax_compat import dtype_name, is_key
    return workload.loss_takes_key or any(
        is_key(dtype_name(x.dtype)) for x in jax.tree_util.tree_leaves(workload.abstract_batch()))


def _local_cluster(opts: RunOptions, options):
    """This machine's devices as one node, priced by --device-preset (a100 when left out);
    its links, those of the mesh's slowest axis (``--alpha``/``--beta`` give one per axis)."""
    from cfp.cluster import Cluster, Level
    model = cost_model_of(options, opts.mesh_shape, opts.device_ids)
    alpha, beta = max(model.alpha), max(model.beta)
    return Cluster("here", (Level("node", 1, alpha, beta),
                            Level("device", opts.num_devices, alpha, beta)),
                   memory_budget_bytes(options, opts, required=True), model.device_flops,
                   model.device_bandwidth, ("priced by the " + (options.device_preset or "a100")
                                            + " device preset",), model.platform)


_RUNNERS = {"analysis": _run_analysis, "profile": _run_profile, "search": _run_search,
            "stages": _run_stages}
