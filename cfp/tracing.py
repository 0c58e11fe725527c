"""Tracing the step a workload plans, and telling the user's errors from cfp's.

A user's own step (``--model package.module:factory``, or a step handed to ``cfp.autoshard``)
runs inside ``user_code``: what it
raises becomes one ``CfpError`` naming the factory, while an exception raised in cfp's own
frames stays a bug, with its traceback.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
import traceback

from cfp.errors import CfpError

log = logging.getLogger(__name__)


def trace_step(workload):
    """Trace the step a workload plans (``Workload.step_fn``: its full training step, or its
    forward computation) with abstract inputs (nothing allocated). The step is traced once:
    its loss is checked on the traced program, or where the trace fails, on the loss alone
    (a loss that is not a scalar fails JAX's gradient first)."""
    import jax
    import jax.numpy as jnp
    from cfp.program import trace_program
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
        try:
            program = trace_program(workload.step_fn(), *args)
        except CfpError:
            raise
        except Exception:
            loss = jax.eval_shape(workload.loss_fn, args[0], args[2])
            _check_loss(workload.model, getattr(loss, "shape", type(loss).__name__))
            raise
        out = jax.tree_util.tree_unflatten(program.out_tree, program.outputs)  # value ids
        loss = out[2] if workload.step == "train" else out
        _check_loss(workload.model, program.avals[loss][0] if isinstance(loss, int)
                    else type(loss).__name__)
        return program


def _check_loss(model: str, shape) -> None:
    """Refuse a loss whose shape (or, not an array, whose type's name) is not a scalar's, in
    one line."""
    if shape != ():
        raise CfpError(f"the loss of {model} returns {shape}, not a scalar")


def users_step(model: str) -> bool:
    """Whether ``model`` names a user's step (``package.module:factory``, or a step handed to
    ``cfp.autoshard``, ``<name>@<fingerprint>``) rather than a model of cfp's zoo."""
    return ":" in model or "@" in model


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
        if not users_step(model) or not _raised_outside_cfp(e):
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
    model = model.partition("@")[0]  # a step handed in: its name, not its fingerprint
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

