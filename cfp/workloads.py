"""What a run is about: the workload spec, and the fingerprint of a run's files.

``WorkloadSpec`` names a workload as plain data (so it can live in a record): a model of the
zoo (``gpt``, ``llama``, ...) or a user's own step given as ``package.module:factory``, where
``factory(batch_size=..., dtype=..., **overrides)`` returns a ``cfp.models.Workload``.

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
from cfp.tracing import _user_error, user_code

log = logging.getLogger(__name__)

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
        """The ``cfp.models.Workload`` this spec names: built once per process (per factory,
        for a user's step), so its abstract trees are traced once for every pass."""
        from cfp.models.workload import STEPS
        if self.step not in STEPS:
            raise CfpError(f"--step {self.step!r} is not one of {', '.join(STEPS)}")
        factory = _user_factory(self.model) if ":" in self.model else None
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
        ``gpt-tiny-L4``; a user's ``pkg.module:make`` is ``pkg_module_make``."""
        short = {"num_layers": "L", "seq_len": "S", "hidden_size": "H", "num_heads": "A",
                 "vocab_size": "V", "num_experts": "E", "compute_dtype": "C"}
        # a user's factory by its module too: two modules' ``make`` are two runs
        name = self.model.replace(":", "_").replace(".", "_")
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
    """The factory that ``package.module:factory`` names."""
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
