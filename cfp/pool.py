"""Work that is the same for every mesh, spread over this machine's cores.

The stages pass prices the step on every submesh of a cluster, and ``--mesh auto`` on every
logical mesh: each mesh's analysis, analytic profile and solve depend on that mesh and on the
traced step alone. ``map_meshes`` runs them in spawned processes, one per core and never more
than the meshes, each handed the traced step once (and a step handed to ``cfp.autoshard``,
by value); none runs the caller's ``__main__`` again. The processes ignore SIGINT: Ctrl-C
reaches the parent, which cancels what is left and ends them.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import multiprocessing
import os
import pickle
import signal
import sys
import types
from typing import Callable, Sequence

_SHARED: tuple = ()  # in a pool's process: the arguments every call begins with


def map_meshes(fn: Callable, shared: tuple, items: Sequence, *,
               processes: int | None = None) -> list:
    """``[fn(*shared, item) for item in items]``, in that order, on up to ``processes``
    (default: one per core) spawned processes. ``fn`` is a module-level function; an
    exception it raises is raised here."""
    n = min(processes or os.cpu_count() or 1, len(items))
    if n <= 1:
        return [fn(*shared, item) for item in items]
    from cfp.workloads import handed_steps
    pool = concurrent.futures.ProcessPoolExecutor(
        n, mp_context=multiprocessing.get_context("spawn"), initializer=_start,
        initargs=(pickle.dumps(shared, protocol=pickle.HIGHEST_PROTOCOL), handed_steps()))
    try:
        with main_left_out():  # the processes start as the calls are submitted
            results = pool.map(_call, [fn] * len(items), items)
        out = list(results)
    except BaseException:  # Ctrl-C, or an item's exception: the rest is not waited for
        for proc in list((getattr(pool, "_processes", None) or {}).values()):
            proc.terminate()  # (Python 3.14's ProcessPoolExecutor.terminate_workers)
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    pool.shutdown()
    return out


@contextlib.contextmanager
def main_left_out():
    """Processes spawned inside do not run the caller's ``__main__`` again (Python's spawn
    would, as ``__mp_main__``): the user's script, a notebook's kernel or a script read
    from standard input. What they need of it comes by value (``cfp.workloads.handed_steps``)."""
    main = sys.modules["__main__"]
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        sys.modules["__main__"] = main


def _start(shared: bytes, handed: dict[str, bytes]) -> None:
    global _SHARED
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from cfp.workloads import receive_handed
    receive_handed(handed)
    _SHARED = pickle.loads(shared)


def _call(fn: Callable, item):
    return fn(*_SHARED, item)
