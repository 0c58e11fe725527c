"""What a run is about: the workload spec and the mesh, and how to trace the step.

``WorkloadSpec`` names a workload as plain data (so it can live in a record): a model of the
zoo (``gpt``, ``llama``, ...) or a user's own step given as ``package.module:factory``, where
``factory(batch_size=..., dtype=..., **overrides)`` returns a ``cfp.models.Workload``.

Example:
    >>> spec = WorkloadSpec("gpt", "tiny", batch_size=8)
    >>> spec.build().model
    'gpt'
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import logging
import math
import os
import sys
import traceback

from cfp.errors import CfpError

log = logging.getLogger(__name__)

AXIS_NAMES = ("m0", "m1", "m2")
MAX_ARRAY_ELEMENTS = 2**31  # the most elements of one array of a step measured here


@dataclasses.dataclass(frozen=True)
class WorkloadSpec:
    model: str  # a zoo model name, or "package.module:factory" for a user's own step
    config: str | None = None  # preset key; None: the model's default
    batch_size: int | None = None  # None: the preset's default
    dtype: str = "float32"  # "float32" | "bfloat16"
    overrides: tuple[tuple[str, int], ...] = ()  # (field, value) size overrides
    step: str = "train"  # "train": value-and-grad plus the optimizer; "forward": the loss alone

    def build(self):
        """The ``cfp.models.Workload`` this spec names."""
        from cfp.models.workload import STEPS
        if self.step not in STEPS:
            raise CfpError(f"--step {self.step!r} is not one of {', '.join(STEPS)}")
        overrides = dict(self.overrides)
        compute = overrides.pop("compute_dtype", None)
        spec = dataclasses.replace(self, overrides=tuple(overrides.items()))
        if ":" in self.model:
            workload = _user_workload(spec)
        else:
            from cfp.models import get_workload
            workload = get_workload(self.model, self.config, batch_size=self.batch_size,
                                    dtype=self.dtype, **overrides)
        if compute is not None and compute != self.dtype:
            from cfp.models.workload import computing_in
            workload = computing_in(workload, compute)
        return dataclasses.replace(workload, step=self.step)

    def resolved(self) -> "WorkloadSpec":
        """The same spec with the preset and batch size filled in (checks them, too)."""
        w = self.build()
        return dataclasses.replace(self, config=self.config or w.config_name,
                                   batch_size=w.batch_size)

    @property
    def label(self) -> str:
        """``<model>-<config>`` plus the overrides, e.g. ``gpt-tiny-L4-b16``."""
        short = {"num_layers": "L", "seq_len": "S", "hidden_size": "H", "num_heads": "A",
                 "vocab_size": "V", "num_experts": "E", "compute_dtype": "C"}
        name = self.model.rsplit(":", 1)[-1].replace(".", "_")
        parts = [name] + ([self.config] if self.config else [])
        parts += [f"{short.get(k, k)}{v}" for k, v in self.overrides]
        return "-".join(parts + (["forward"] if self.step == "forward" else []))


def _user_workload(spec: WorkloadSpec):
    module_name, _, attr = spec.model.partition(":")
    if not (module_name and attr):
        raise CfpError(f"--model {spec.model!r} names no factory: give it as "
                       f"package.module:factory with the module on PYTHONPATH")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise CfpError(f"cannot load the user step {spec.model!r} ({e}); give it as "
                       f"package.module:factory with the module on PYTHONPATH") from None
    except (Exception, SystemExit) as e:  # a module that fails to parse, raises, or exits
        raise _user_error(spec.model, e, f"importing {module_name}") from None
    kwargs = dict(spec.overrides, dtype=spec.dtype)
    if spec.batch_size is not None:
        kwargs["batch_size"] = spec.batch_size
    declared = _declared_keywords(factory)
    if declared is not None:  # a factory gets only the keywords it declares
        unknown = [k for k, _ in spec.overrides if k not in declared]
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


def parse_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``--mesh`` text as ``(shape, axis names)``: ``"8"`` -> ``((8,), ("m0",))``, ``"2x4"`` ->
    axes m0, m1; ``"data=2,model=4"`` names the axes. A named axis of one device splits
    nothing and is left out, as in ``mesh_from``."""
    if "=" in text:
        return _named_mesh(text)
    parts = text.split("x")
    shape = tuple(int(p) for p in parts if p.isdigit())  # digits only: no signs, spaces, 'X'
    if len(shape) != len(parts) or len(shape) > len(AXIS_NAMES) or any(n < 1 for n in shape):
        raise CfpError(f"--mesh {text!r} is not a mesh shape: write N or NxM (e.g. 8 or 2x4), "
                       f"or name the axes (data=2,model=4)")
    if len(shape) > 1 and 1 in shape:
        raise CfpError(f"--mesh {text!r} has an axis of one device, which splits nothing: "
                       f"write {mesh_text(tuple(n for n in shape if n > 1) or (1,))}")
    return shape, AXIS_NAMES[:len(shape)]


def _named_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    pairs = [part.partition("=") for part in text.split(",")]
    if not all(name.isidentifier() and sep and size.isdigit() and int(size) > 0
               for name, sep, size in pairs):
        raise CfpError(f"--mesh {text!r} is not a mesh: name each axis with its size, "
                       f"e.g. data=2,model=4")
    names = [name for name, _, _ in pairs]
    if len(set(names)) != len(names):
        raise CfpError(f"--mesh {text!r} names an axis twice")
    return _split_axes(tuple(int(size) for _, _, size in pairs), tuple(names), f"--mesh {text!r}")


def _split_axes(shape, names, what: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The axes of more than one device (an axis of one splits nothing)."""
    kept = [(n, a) for n, a in zip(shape, names) if n > 1] or [(1, names[0])]
    if len(kept) > len(AXIS_NAMES):
        raise CfpError(f"{what} splits over {len(kept)} axes; cfp plans for at most "
                       f"{len(AXIS_NAMES)} axes of more than one device")
    return tuple(n for n, _ in kept), tuple(a for _, a in kept)


def mesh_from(mesh) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``(shape, axis names)`` of a user's mesh: a ``jax.sharding.Mesh`` (as ``jax.make_mesh``
    returns it, any axis names and axis types) or ``--mesh`` text. Axes of one device (a
    MaxText mesh's unused ``stage`` or ``expert``) are left out: they split nothing, and a
    plan that names only the others applies to the whole mesh.

    Example:
        >>> mesh_from("data=2,model=4")
        ((2, 4), ('data', 'model'))
    """
    if isinstance(mesh, str):
        return parse_mesh(mesh)
    import jax
    if not isinstance(mesh, jax.sharding.Mesh):
        raise CfpError(f"a mesh is a jax.sharding.Mesh or text such as 2x4 or data=2,"
                       f"model=4, not a {type(mesh).__name__}")
    return _split_axes(tuple(mesh.devices.shape), tuple(map(str, mesh.axis_names)),
                       f"the mesh {dict(mesh.shape)}")


def mesh_text(shape: tuple[int, ...], axis_names: tuple[str, ...] | None = None) -> str:
    """``2x4`` for axes m0, m1, ...; ``data=2,model=4`` for axes named otherwise."""
    if axis_names is None or tuple(axis_names) == AXIS_NAMES[:len(shape)]:
        return "x".join(map(str, shape))
    return ",".join(f"{a}={n}" for a, n in zip(axis_names, shape))


def check_mesh(shape: tuple[int, ...], num_devices: int) -> None:
    if math.prod(shape) != num_devices:
        raise CfpError(f"mesh {mesh_text(shape)} has {math.prod(shape)} devices but "
                       f"{num_devices} are used (--num-devices): make them equal")


def make_mesh(shape: tuple[int, ...], axis_names: tuple[str, ...] | None = None,
              device_ids: tuple[int, ...] | None = None):
    """A ``jax.sharding.Mesh`` over the devices ``device_ids`` in that order (a user's mesh's,
    ``device_order``), or JAX's first devices when None; axes ``axis_names`` (m0, m1, ... when
    None), Auto axis types: cfp measures with its constraints inside the step."""
    import jax
    import numpy as np
    from cfp.jax_compat import auto_axis_types
    devices = jax.devices()
    n = math.prod(shape)
    if len(devices) < n:
        how = ("on CPU, set XLA_FLAGS=--xla_force_host_platform_device_count=N before JAX is "
               "imported (the command line's --num-devices does)"
               if devices[0].platform == "cpu" else "use a smaller mesh")
        raise CfpError(f"mesh {mesh_text(shape)} needs {n} devices but JAX sees {len(devices)} "
                       f"({devices[0].platform}): {how}")
    if device_ids is not None:
        by_id = {d.id: d for d in devices}
        missing = [i for i in device_ids if i not in by_id]
        if missing or len(device_ids) != n:
            raise CfpError(f"the mesh's devices {list(device_ids)} are not {n} of the devices "
                           f"JAX sees here ({sorted(by_id)}): run where the mesh's devices are")
        devices = [by_id[i] for i in device_ids]
    names = AXIS_NAMES[:len(shape)] if axis_names is None else tuple(axis_names)
    return jax.sharding.Mesh(np.array(devices[:n]).reshape(shape), names,
                             **auto_axis_types(len(shape)))


def device_order(mesh) -> tuple[int, ...] | None:
    """The ids of a user's ``jax.sharding.Mesh``'s devices in its order (row-major over its
    axes; axes of one device change nothing), or None where that is JAX's first devices in
    order, which ``make_mesh`` takes anyway. A mesh from ``jax.make_mesh`` on a GPU or TPU,
    or one the user laid out, may order them otherwise, and which devices talk over which
    links then differs.

    Example:
        >>> import jax, numpy as np
        >>> device_order(jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))) is None
        True
    """
    import jax
    ids = tuple(int(d.id) for d in mesh.devices.flat)
    if ids == tuple(d.id for d in jax.devices()[:len(ids)]):
        return None
    return ids


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
                       f"{largest.nbytes / 2**30:.3g} GB) does not fit this host's "
                       f"{host_bytes / 2**30:.3g} GB of memory: choose smaller sizes, or plan "
                       f"without running it (--cost model or --cluster)")


def host_memory_bytes() -> int:
    """This host's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def trace_step(workload):
    """Trace the step a workload plans (``Workload.step_fn``: its full training step, or its
    forward computation) with abstract inputs (nothing allocated)."""
    import jax
    import jax.numpy as jnp
    from cfp.graph import trace_program
    with user_code(workload.model):
        args = (workload.abstract_params(), workload.abstract_opt_state(),
                workload.abstract_batch())
        not_float = [jax.tree_util.keystr(path) for path, x in
                     jax.tree_util.tree_flatten_with_path(args[0])[0]
                     if not jnp.issubdtype(x.dtype, jnp.inexact)]  # bfloat16 is inexact
        if not_float and workload.step == "train":
            raise CfpError(f"the parameters of {workload.model} are differentiated, but "
                           f"{', '.join(not_float[:3])} {'is' if len(not_float) == 1 else 'are'}"
                           f" not floating point: keep integer arrays out of the params")
        loss = jax.eval_shape(workload.loss_fn, args[0], args[2])
        if not isinstance(loss, jax.ShapeDtypeStruct) or loss.shape != ():
            raise CfpError(f"the loss of {workload.model} returns "
                           f"{getattr(loss, 'shape', type(loss).__name__)}, not a scalar")
        return trace_program(workload.step_fn(), *args)


@contextlib.contextmanager
def user_code(model: str):
    """Around code that runs a user's step (``model`` is ``package.module:factory``): an
    exception raised by the user's code becomes one ``CfpError`` naming the factory, its
    frames logged (shown under ``-v``). One raised by cfp itself stays a bug, with its
    traceback. Zoo models are cfp's own code."""
    try:
        yield
    except (CfpError, KeyboardInterrupt):
        raise
    except (Exception, SystemExit) as e:  # user code may call sys.exit
        if ":" not in model or not _raised_outside_cfp(e):
            raise
        raise _user_error(model, e) from None


def _user_error(model: str, e: BaseException, doing: str = "") -> CfpError:
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not (_is_cfp(f.filename) or _is_jax_or_python(f.filename))]
    where = (f'  File "{e.filename}", line {e.lineno}\n' if isinstance(e, SyntaxError)
             else "".join(traceback.format_list(frames)))
    log.info("%s raised%s, in its own code:\n%s", model, f" {doing}" if doing else "",
             where.rstrip())
    what = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return CfpError(f"{model}{': ' + doing if doing else ''} raised {type(e).__name__}"
                    f"{': ' + what if what else ''}")


def _raised_outside_cfp(e: BaseException) -> bool:
    """Whether the innermost frame of ``e``'s traceback that is not JAX's or Python's own is
    outside cfp: in the user's code, or a library it called."""
    inner = [f.filename for f in traceback.extract_tb(e.__traceback__)
             if not _is_jax_or_python(f.filename)]
    return bool(inner) and not _is_cfp(inner[-1])


def _is_cfp(filename: str) -> bool:
    return filename.startswith(_dirs()[0])


def _is_jax_or_python(filename: str) -> bool:
    """A file of JAX, of Python's own library (not of the packages installed beside it, the
    user's among them), or code Python generated."""
    _, jax_dirs, stdlib, installed = _dirs()
    return (filename.startswith(jax_dirs + ("<",))
            or filename.startswith(stdlib) and not filename.startswith(installed))


@functools.cache
def _dirs() -> tuple[tuple[str, ...], tuple[str, ...], str, tuple[str, ...]]:
    """(cfp's directories, JAX's, Python's own library, where packages are installed);
    imported late, so that JAX starts after the command line sets its devices."""
    import importlib.util
    import site
    import sysconfig
    import jax
    import jaxlib
    here = lambda m: os.path.dirname(os.path.abspath(m.__file__)) + os.sep  # noqa: E731
    passes = importlib.util.find_spec("cfp.passes").submodule_search_locations[0]
    paths = sysconfig.get_paths()
    installed = {paths["purelib"], paths["platlib"], *site.getsitepackages()}
    return ((here(sys.modules["cfp"]), os.path.abspath(passes) + os.sep),
            (here(jax), here(jaxlib)), os.path.abspath(paths["stdlib"]) + os.sep,
            tuple(os.path.abspath(d) + os.sep for d in installed))


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
