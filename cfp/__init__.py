"""cfp: profiling-driven intra-operator auto-sharding for JAX training steps.

The passes live in the top-level ``passes/`` folder of the source tree and are installed as
``cfp.passes`` (setuptools' package-dir mapping), so an install adds no top-level module of
that name. A source checkout run without installing (``PYTHONPATH=.``) gets the same name here.
"""
import importlib.util as _util
import sys as _sys
from pathlib import Path as _Path

if "cfp.passes" not in _sys.modules and _util.find_spec("cfp.passes") is None:
    _dir = _Path(__file__).resolve().parent.parent / "passes"
    _spec = _util.spec_from_file_location("cfp.passes", _dir / "__init__.py",
                                          submodule_search_locations=[str(_dir)])
    if _spec is not None and (_dir / "__init__.py").exists():
        _module = _util.module_from_spec(_spec)
        _sys.modules["cfp.passes"] = _module
        _spec.loader.exec_module(_module)
        passes = _module
