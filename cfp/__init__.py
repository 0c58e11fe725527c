"""cfp: profiling-driven intra-operator auto-sharding for JAX training steps.

    >>> import cfp  # doctest: +SKIP
    >>> plan = cfp.autoshard("gpt", mesh="2x4", memory_budget_gb=2)  # doctest: +SKIP
    >>> print(plan.describe())  # doctest: +SKIP

``autoshard`` runs the three passes (analysis, profile, search) and returns a ``Plan``; ``run``
runs the passes ``Options`` asks for, as ``python -m cfp`` does; a user's mistake raises
``CfpError``. Importing cfp imports neither JAX nor a pass.

The passes live in the top-level ``passes/`` folder of the source tree and are installed as
``cfp.passes`` (setuptools' package-dir mapping), so an install adds no top-level module of
that name. A source checkout run without installing (``PYTHONPATH=.``) gets the same name here.
"""
import importlib.util as _util
import sys as _sys
from pathlib import Path as _Path

from cfp.gpu_compile import quiet_cuda_plugin as _quiet_cuda_plugin

_quiet_cuda_plugin()  # before JAX starts

from cfp.api import Plan, autoshard, run
from cfp.options import Options  # noqa: E402
from cfp.errors import CfpError  # noqa: E402

__all__ = ["CfpError", "Options", "Plan", "autoshard", "run"]

if "cfp.passes" not in _sys.modules and _util.find_spec("cfp.passes") is None:
    _dir = _Path(__file__).resolve().parent.parent / "passes"
    _spec = _util.spec_from_file_location("cfp.passes", _dir / "__init__.py",
                                          submodule_search_locations=[str(_dir)])
    if _spec is not None and (_dir / "__init__.py").exists():
        _module = _util.module_from_spec(_spec)
        _sys.modules["cfp.passes"] = _module
        _spec.loader.exec_module(_module)
        passes = _module
