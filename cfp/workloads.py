"""What a run is about: the workload spec, and the fingerprint of a run's files.

``WorkloadSpec`` names a workload as plain data (so it can live in a record): a model of the
zoo (``gpt``, ``llama``, ...), a user's own step given as ``package.module:factory``, where
``factory(batch_size=..., dtype=..., **overrides)`` returns a ``cfp.models.Workload``, or a step
handed to ``cfp.autoshard`` in this process (``hand_in``), named ``<name>@<fingerprint>`` by
the fingerprint of its traced program. A handed step reaches the measurement workers by value
(``handed_steps``, sent over their pipe, never through a file); a record keeps only its name.

Example:
    >>> spec = WorkloadSpec("gpt", "tiny", batch_size=8)
    >>> spec.build().model
    'gpt'
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import math
import os

from cfp.errors import CfpError
from cfp.mesh import mesh_text
from cfp.tracing import _user_error, user_code, users_step

log = logging.getLogger(__name__)

MAX_ARRAY_ELEMENTS = 2**31  # the most elements of one array of a step measured here


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    # a zoo model name, "package.module:factory" for a user's own step, or "<name>@<fingerprint>"
    # for a step handed to cfp.autoshard in this process
    model: str
    config: str | None = None  # preset key; None: the model's default
    batch_size: int | None = None  # None: the preset's default
    dtype: str = "float32"  # "float32" | "bfloat16"
    overrides: tuple[tuple[str, int], ...] = ()  # (field, value) size overrides
    step: str = "train"  # "train": value-and-grad plus the optimizer; "forward": the loss alone

    def build(self):
        """The ``cfp.models.Workload`` this spec names: built once per process (per factory,
        for a user's step), so its abstract trees are traced once for every pass."""
        from cfp.models.workload import STEPS
        if self.step not in STEPS:
            raise CfpError(f"--step {self.step!r} is not one of {', '.join(STEPS)}")
        factory = _user_factory(self.model) if users_step(self.model) else None
        try:
            hash(factory)
        except TypeError:  # a factory object that cannot key a cache: built each time
            return _built.__wrapped__(self, factory)
        return _built(self, factory)

    def resolved(self) -> "WorkloadSpec":
        """The same spec with the preset and batch size filled in (checks them, too)."""
        w = self.build()
        return dataclasses.replace(self, config=self.config or w.config_name,
                                   batch_size=w.batch_size)

    @property
    def label(self) -> str:
        """``<model>-<config>`` plus the overrides (``-forward`` for a forward step), e.g.
        ``gpt-tiny-L4``; a user's ``pkg.module:make`` is ``pkg_module_make``, a step handed
        in, its name (``train_step``)."""
        short = {"num_layers": "L", "seq_len": "S", "hidden_size": "H", "num_heads": "A",
                 "vocab_size": "V", "num_experts": "E", "compute_dtype": "C"}
        # a user's factory by its module too: two modules' ``make`` are two runs
        name = self.model.partition("@")[0].replace(":", "_").replace(".", "_")
        parts = [name] + ([self.config] if self.config else [])
        parts += [f"{short.get(k, k)}{v}" for k, v in self.overrides]
        return "-".join(parts + (["forward"] if self.step == "forward" else []))


@functools.lru_cache(maxsize=32)
def _built(spec: WorkloadSpec, factory):
    overrides = dict(spec.overrides)
    compute = overrides.pop("compute_dtype", None)
    plain = dataclasses.replace(spec, overrides=tuple(overrides.items()))
    if factory is not None:
        workload = _user_workload(plain, factory)
    else:
        from cfp.models import get_workload
        workload = get_workload(spec.model, spec.config, batch_size=spec.batch_size,
                                dtype=spec.dtype, **overrides)
    if compute is not None and compute != spec.dtype:
        from cfp.models.workload import computing_in
        workload = computing_in(workload, compute)
    return dataclasses.replace(workload, step=spec.step)


def _user_factory(model: str):
    """The factory that ``package.module:factory`` names, or the step handed in as
    ``<name>@<fingerprint>`` (``hand_in``)."""
    if "@" in model:
        if model not in _HANDED:
            raise CfpError(f"the step {model.partition('@')[0]!r} was handed to cfp.autoshard "
                           f"in its own process, and a work dir keeps its fingerprint "
                           f"({model.partition('@')[2]}), not the step: call cfp.autoshard "
                           f"with it again")
        return _HANDED[model][0]
    module_name, _, attr = model.partition(":")
    if not (module_name and attr):
        raise CfpError(f"--model {model!r} names no factory: give it as "
                       f"package.module:factory with the module on PYTHONPATH")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise CfpError(f"cannot load the user step {model!r} ({e}); give it as "
                       f"package.module:factory with the module on PYTHONPATH") from None
    except (Exception, SystemExit) as e:  # a module that fails to parse, raises, or exits
        raise _user_error(model, e, f"importing {module_name}") from None


def _user_workload(spec: WorkloadSpec, factory):
    kwargs = dict(spec.overrides, dtype=spec.dtype)
    if spec.batch_size is not None:
        kwargs["batch_size"] = spec.batch_size
    declared = _declared_keywords(factory)
    if declared is not None:  # a factory gets only the keywords it declares
        unknown = [k for k, _ in spec.overrides if k not in declared]
        if spec.dtype != "float32" and "dtype" not in declared:  # float32: the default
            unknown.append("dtype")
        if unknown:
            raise CfpError(f"{spec.model} takes no {', '.join(unknown)} (it declares "
                           f"{', '.join(sorted(declared)) or 'no keywords'})")
        kwargs = {k: v for k, v in kwargs.items() if k in declared}
    from cfp.models import Workload
    with user_code(spec.model):
        workload = factory(**kwargs)
    if not isinstance(workload, Workload):
        raise CfpError(f"{spec.model} returned a {type(workload).__name__}, not a "
                       f"cfp.models.Workload (see cfp.models.user_workload)")
    if workload.model == "user":  # user_workload's name: messages give the factory's
        workload = dataclasses.replace(workload, model=spec.model)
    if spec.batch_size is not None and workload.batch_size != spec.batch_size:
        raise CfpError(f"{spec.model} takes no batch_size: its batch is "
                       f"{workload.batch_size}")
    return workload


def _declared_keywords(factory) -> set[str] | None:
    """The keyword arguments ``factory`` declares (None: it takes any, ``**kwargs``)."""
    from cfp.models.workload import signature_params
    params = signature_params(factory)
    if params is None or any(p.kind == p.VAR_KEYWORD for p in params):
        return None
    return {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}


def check_fits_host(graph, host_bytes: int) -> None:
    """Refuse a step to be run here whose largest array has more than
    ``MAX_ARRAY_ELEMENTS`` elements or more bytes than the host's memory, before any worker
    starts (one would die allocating it)."""
    largest = max(graph.values.values(), key=lambda v: (v.nbytes, math.prod(v.shape)))
    elements = max(math.prod(v.shape) for v in graph.values.values())
    if elements > MAX_ARRAY_ELEMENTS:
        raise CfpError(f"the step has an array of {elements} elements, over the "
                       f"{MAX_ARRAY_ELEMENTS} a step run here may have: choose smaller sizes, "
                       f"or plan without running it (--cost model or --cluster)")
    if largest.nbytes > host_bytes:
        raise CfpError(f"the step's largest array ({largest.type_str}, "
                       f"{largest.nbytes / 2**30:.3g} GiB) does not fit this host's "
                       f"{host_bytes / 2**30:.3g} GiB of memory: choose smaller sizes, or plan "
                       f"without running it (--cost model or --cluster)")


def host_memory_bytes() -> int:
    """This host's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def spec_fingerprint(spec: WorkloadSpec) -> tuple:
    """The workload's part of a run's fingerprint: every field of its spec."""
    return (("model", spec.model), ("config", spec.config), ("batch", spec.batch_size),
            ("dtype", spec.dtype), ("overrides", spec.overrides), ("step", spec.step))


def run_fingerprint(spec: WorkloadSpec, mesh_shape: tuple[int, ...],
                    axis_names: tuple[str, ...] | None = None,
                    device_ids: tuple[int, ...] | None = None) -> tuple:
    """What identifies a run's files: workload, mesh (its axis names among it, and its
    devices' order where the user's mesh gave one: ``device_order``) and the JAX version."""
    import jax
    devices = () if device_ids is None else (("devices", tuple(device_ids)),)
    return spec_fingerprint(spec) + (("mesh", mesh_text(mesh_shape, axis_names)), *devices,
                                     ("jax", jax.__version__))


# Steps handed to cfp.autoshard in this process, by the name their spec carries
# (``<name>@<fingerprint>``): (the factory that builds the workload, the same for the
# measurement workers as cloudpickle's bytes, where the example arrays stand as shapes).
_HANDED: dict[str, tuple] = {}

STEP_FORMS = ("train_step(params, opt_state, batch) -> (params, opt_state, metrics), "
              "train_step(state, batch) -> (state, metrics) with a Flax TrainState, an NNX "
              "train_step(model, optimizer, batch), or with step='forward' "
              "loss(params, batch)")


@dataclasses.dataclass(frozen=True, eq=False)
class HandedStep:
    """A user's step function and its example arguments (arrays, or ``ShapeDtypeStruct``s):
    called, the ``cfp.models.Workload`` that plans it (``step_workload``)."""
    fn: object
    args: tuple
    step: str = "train"

    def __call__(self):
        return step_workload(self.fn, self.args, self.step)

    def shapes_only(self) -> "HandedStep":
        """The same step with its example arrays as ``ShapeDtypeStruct``s: what the workers
        trace (they make their own inputs), without the arrays' bytes."""
        import jax
        from cfp.models.common import is_array
        shapes = jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                           weak_type=getattr(x, "weak_type", False))
            if is_array(x) else x, self.args)
        return HandedStep(self.fn, shapes, self.step)


def step_name(fn) -> str:
    """What messages and the work dir call a handed step: its function's name."""
    name = fn if isinstance(fn, str) else getattr(fn, "__name__", None) or type(fn).__name__
    return "".join(c if c.isalnum() or c in "_-" else "_" for c in name) or "step"


def step_workload(fn, args: tuple, step: str = "train"):
    """The ``cfp.models.Workload`` of ``fn`` on the example arguments ``args``, in one of the
    forms cfp plans (``STEP_FORMS``). Where an argument holds ``ShapeDtypeStruct``s, cfp makes
    those inputs (``made_inputs``); arrays are used as they are (the check against one device
    runs on them)."""
    from cfp.models.workload import _positional_arity, user_workload
    name = step_name(fn)
    if not callable(fn):
        raise CfpError(f"autoshard takes a step function, a factory of a cfp.models.Workload, "
                       f"a Workload or a zoo model's name, not a {type(fn).__name__}")
    counts = {"train": (2, 3), "forward": (2,)}[step]
    if len(args) not in counts:
        raise CfpError(f"{name} was given {len(args)} example argument"
                       f"{'' if len(args) == 1 else 's'}; cfp plans {STEP_FORMS}")
    arity = _positional_arity(fn)
    if arity is not None and arity != len(args):
        raise CfpError(f"{name} takes {arity} positional argument{'' if arity == 1 else 's'}, "
                       f"but {len(args)} example arguments were given; cfp plans {STEP_FORMS}")
    if step == "train" and len(args) == 2 and not hasattr(args[0], "params"):
        raise CfpError(f"{name}(state, batch) takes a Flax TrainState first (a record with "
                       f"params and replace), not a {type(args[0]).__name__}; a step that "
                       f"returns only the loss, loss(params, batch), is planned with "
                       f"step='forward'")
    made = made_inputs(args, step)
    if step == "forward":
        workload = user_workload(loss_fn=fn, init_params=lambda key: made[0],
                                 make_batch=lambda key: made[1])
        return dataclasses.replace(workload, step="forward")
    state = made[0] if len(made) == 2 else tuple(made[:2])
    return user_workload(train_step=fn, init_state=lambda key: state,
                         make_batch=lambda key: made[-1])


def has_shapes(tree) -> bool:
    """Whether ``tree`` holds a ``ShapeDtypeStruct`` (an input cfp makes)."""
    import jax
    return any(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree_util.tree_leaves(tree))


def made_inputs(args: tuple, step: str) -> tuple:
    """``args`` with each ``ShapeDtypeStruct`` made an array: parameters and floating batch
    values drawn from N(0, 0.1²) (fixed seeds), integers 0, booleans true, PRNG keys from
    seed 0, and the optimizer state (a TrainState's other fields) zeros, as an optimizer
    starts. Arrays stay as they are."""
    import jax
    if not has_shapes(args):
        return args
    keys = iter(jax.random.split(jax.random.key(0), 64))

    def make(tree, zeros=False):
        def leaf(x):
            if not isinstance(x, jax.ShapeDtypeStruct):
                return x
            import jax.numpy as jnp
            if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
                return jax.random.split(jax.random.key(0), x.shape) if x.shape else \
                    jax.random.key(0)
            if zeros or not jnp.issubdtype(x.dtype, jnp.inexact):
                return (jnp.ones if x.dtype == bool else jnp.zeros)(x.shape, x.dtype)
            return (0.1 * jax.random.normal(next(keys), x.shape)).astype(x.dtype)
        return jax.tree_util.tree_map(leaf, tree)

    if step == "forward":
        return make(args[0]), make(args[1])
    if len(args) == 3:  # (params, opt_state, batch), or NNX's (model, optimizer, batch)
        return make(args[0]), make(args[1], zeros=True), make(args[2])
    state = args[0]
    rest = make(state.replace(params=None), zeros=True)
    return rest.replace(params=make(state.params)), make(args[1])


def hand_in(handed, example_args: tuple, spec: WorkloadSpec) -> WorkloadSpec:
    """The spec of a step handed to ``cfp.autoshard`` (``spec.model`` aside): a step function
    with its example arguments, a factory of a ``Workload``, or a ``Workload``. Built and
    traced here, named by its program's fingerprint, and kept in this process (with its
    bytes for the workers, checked here: one that cannot be sent is refused now)."""
    from cfp.models import Workload
    from cfp.tracing import trace_step
    if isinstance(handed, Workload):
        if example_args:
            raise CfpError("a Workload holds its inputs: hand it to autoshard without example "
                           "arguments")
        workload = handed
        factory = lambda: workload  # noqa: E731
        name = step_name(workload if workload.model == "user" else workload.model)
    elif not callable(handed):
        raise CfpError(f"autoshard takes a step function with its example arguments, a "
                       f"factory of a cfp.models.Workload, a Workload or a model's name "
                       f"(\"gpt\", \"package.module:factory\"), not {handed!r:.40}")
    elif example_args:
        factory, name = HandedStep(handed, example_args, spec.step), step_name(handed)
    else:
        from cfp.models.workload import _positional_arity
        factory, name = handed, step_name(handed)
        if _positional_arity(handed):
            raise CfpError(f"{name} takes {_positional_arity(handed)} positional arguments: "
                           f"hand it to autoshard with example arguments, autoshard({name}, "
                           f"params, opt_state, batch, ...), or hand in a factory of a "
                           f"cfp.models.Workload")
    for_workers = factory.shapes_only() if isinstance(factory, HandedStep) else factory
    import cloudpickle
    try:
        sent = cloudpickle.dumps(for_workers)
    except Exception as e:  # noqa: BLE001 - whatever the step holds that cannot be pickled
        raise CfpError(f"{name} cannot be sent to cfp's measurement workers (processes of "
                       f"their own): cloudpickle cannot pickle what it holds "
                       f"({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})"
                       f"; define what the step uses at the top level of a module, or hand in "
                       f"a package.module:factory") from None
    if isinstance(for_workers, HandedStep):
        _check_rebuilt(name, for_workers)
    draft = dataclasses.replace(spec, model=f"{name}@")
    _HANDED[draft.model] = (factory, sent)
    try:
        fingerprint = trace_step(draft.build()).graph().fingerprint()
    finally:
        del _HANDED[draft.model]
    named = dataclasses.replace(spec, model=f"{name}@{fingerprint}")
    _HANDED[named.model] = (factory, sent)
    return named


def forget_arrays(model: str) -> None:
    """After ``autoshard``: the handed step ``model`` keeps its example arguments' shapes
    only (and no workload built from them is kept), so that the arrays the user's loop
    donates are not held here."""
    factory, sent = _HANDED[model]
    if isinstance(factory, HandedStep):
        _HANDED[model] = (factory.shapes_only(), sent)
    _built.cache_clear()
    from cfp import execute
    execute.forget_reference_run()


_PATHS_THERE = """
import json, sys, cloudpickle, jax
args = cloudpickle.loads(sys.stdin.buffer.read()).args
print(json.dumps([jax.tree_util.keystr(p) for p, _ in
                  jax.tree_util.tree_flatten_with_path(args)[0]]))
"""


def _check_rebuilt(name: str, for_workers: "HandedStep") -> None:
    """Where the example arguments hold pytree classes the workers get by value (defined in
    ``__main__``, a notebook's cell or a function), check in a fresh process that they
    rebuild to the same tree: cloudpickle rebuilds such a class before its fields are set,
    so one that registers itself as a pytree as it is made (an Equinox module, a Flax
    ``TrainState`` subclass) flattens to another tree there, and one registered by a call
    after its definition is no pytree there at all."""
    import json
    import os
    import subprocess
    import sys
    import cloudpickle
    import jax
    classes = set()

    def visit(x):
        cls = type(x)
        if ((cls.__module__ == "__main__" or "<locals>" in cls.__qualname__)
                and not hasattr(cls, "_fields")  # a namedtuple rebuilds as one
                and not jax.tree_util.treedef_is_leaf(jax.tree_util.tree_structure(x))):
            classes.add(cls.__qualname__)
        return False
    jax.tree_util.tree_leaves(for_workers.args, is_leaf=visit)
    if not classes:
        return
    here = [jax.tree_util.keystr(p)
            for p, _ in jax.tree_util.tree_flatten_with_path(for_workers.args)[0]]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
               JAX_PLATFORMS="cpu")
    done = subprocess.run([sys.executable, "-c", _PATHS_THERE], env=env, timeout=300,
                          input=cloudpickle.dumps(for_workers), capture_output=True)
    there = json.loads(done.stdout) if done.returncode == 0 else None
    if there != here:
        raise CfpError(f"{name}'s example arguments hold {', '.join(sorted(classes))}, "
                       f"defined in __main__ or a function, which cfp's measurement workers "
                       f"cannot rebuild as the same pytree (cloudpickle makes such a class "
                       f"before its fields): define {'it' if len(classes) == 1 else 'them'} "
                       f"at the top level of an importable module")


def handed_steps(model: str | None = None) -> dict[str, bytes]:
    """The steps handed in, as the workers get them: ``model``'s, or all (a pool's)."""
    return {k: sent for k, (_, sent) in _HANDED.items() if model in (None, k)}


def receive_handed(steps: dict[str, bytes]) -> None:
    """In a worker: the steps ``handed_steps`` sent, ready for ``WorkloadSpec.build``."""
    import cloudpickle
    for model, sent in steps.items():
        _HANDED[model] = (cloudpickle.loads(sent), sent)
