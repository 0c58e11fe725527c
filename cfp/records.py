"""Records that cross pass boundaries, and their files.

Every file cfp writes is a pickle of a ``FileHeader`` followed by one record. The header carries
the format name, the schema version and the fingerprint of the run that made it (model, config,
dtype, batch, mesh, JAX version, graph hash); a later pass checks all three before it trusts
anything. Files are read with a restricted unpickler that admits only cfp's own record types and
plain data (numbers, strings, tuples, lists, dicts, sets, numpy arrays), so a crafted file in a
work dir cannot run code. Nor can it choose code that cfp runs later: no value read may be a
class or another callable, and the one field that names code, a ``WorkloadSpec``'s model (a
user's ``package.module:factory``), must be the reading run's own (its fingerprint names it);
with no run to compare against, only the zoo's models are read. Writes are atomic (a temporary
file renamed into place).
"""
from __future__ import annotations

import dataclasses
import io
import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

from cfp.errors import CfpError

SCHEMA_VERSION = 6


@dataclasses.dataclass(frozen=True)
class FileHeader:
    format: str  # "cfp-analysis", "cfp-segment-profile", ...
    version: int
    fingerprint: tuple  # tuple of (key, value) pairs identifying the run


_ALLOWED_BUILTINS = {"tuple", "list", "dict", "set", "frozenset", "int", "float", "str",
                     "bytes", "bool", "complex", "slice", "NoneType"}
_ALLOWED_NUMPY = {("numpy", "ndarray"), ("numpy", "dtype"), ("numpy.core.multiarray", "_reconstruct"),
                  ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
                  ("numpy._core.multiarray", "scalar"), ("numpy", "float64"), ("numpy", "float32"),
                  ("numpy", "int64"), ("numpy", "int32")}
_ALLOWED_CFP_MODULES = {"cfp.records", "cfp.graph", "cfp.strategies", "cfp.blocks",
                        "cfp.segments", "cfp.workloads", "cfp.measure", "cfp.windows", "cfp.execute",
                        "cfp.cost_model", "cfp.window_memory",
                        "cfp.passes.analysis", "cfp.passes.profile",
                        "cfp.passes.search"}


class _RestrictedUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if module == "builtins" and name in _ALLOWED_BUILTINS:
            return super().find_class(module, name)
        if (module, name) in _ALLOWED_NUMPY:
            return super().find_class(module, name)
        if module in _ALLOWED_CFP_MODULES:
            obj = super().find_class(module, name)
            if isinstance(obj, type) and dataclasses.is_dataclass(obj):
                return obj
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}")


def write_record(path: Path, fmt: str, fingerprint: tuple, record: Any) -> None:
    """Atomically write ``record`` with a header to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    header = FileHeader(fmt, SCHEMA_VERSION, fingerprint)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            pickle.dump(header, f, protocol=pickle.HIGHEST_PROTOCOL)
            pickle.dump(record, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:  # say which file (a full disk)
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


def read_fingerprint(path: Path) -> dict:
    """The fingerprint a record file's header carries, as a dict; empty for a file that is
    missing or not cfp's."""
    try:
        header = _RestrictedUnpickler(io.BytesIO(Path(path).read_bytes())).load()
    except Exception:  # noqa: BLE001 - missing, truncated or foreign: it names no run
        return {}
    return dict(p for p in header.fingerprint if isinstance(p, tuple) and len(p) == 2) \
        if isinstance(header, FileHeader) and isinstance(header.fingerprint, tuple) else {}


def read_record(path: Path, fmt: str, fingerprint: tuple | None, *, hint: str) -> Any:
    """Read a record written by ``write_record``, checking format, version and fingerprint.

    ``hint`` says how to make the file afresh; it ends every error message.
    """
    path = Path(path)
    if not path.exists():
        raise CfpError(f"{path} does not exist: {hint}")
    if not path.is_file():  # a directory, or a link to a device such as /dev/zero
        raise CfpError(f"{path} is not a regular file: {hint}")
    try:
        stream = io.BytesIO(path.read_bytes())
        header = _RestrictedUnpickler(stream).load()
        if not isinstance(header, FileHeader):
            raise pickle.UnpicklingError("no cfp header")
        if header.format != fmt:
            raise CfpError(f"{path} is a {header.format} file, not {fmt}: {hint}")
        if header.version != SCHEMA_VERSION:
            raise CfpError(f"{path} has schema version {header.version}, this cfp reads "
                           f"{SCHEMA_VERSION}: {hint}")
        if fingerprint is not None and header.fingerprint != fingerprint:
            mine, theirs = dict(fingerprint), dict(header.fingerprint)
            handed = str(theirs.get("model", ""))
            if "@" in handed and mine.get("model") != handed:
                raise CfpError(f"{path} was made by cfp.autoshard for the step "
                               f"{handed.partition('@')[0]!r} handed to it in its process; a "
                               f"work dir keeps that step's fingerprint, not the step: call "
                               f"cfp.autoshard with it again")
            diff = [k for k in dict.fromkeys([*mine, *theirs]) if mine.get(k) != theirs.get(k)]
            raise CfpError(f"{path} was made for another run ({', '.join(diff)} differ: "
                           f"{', '.join(f'{k}={theirs.get(k)}' for k in diff)}): {hint}")
        record = _RestrictedUnpickler(stream).load()
    except CfpError:
        raise
    except Exception as e:  # truncated, foreign, or crafted
        raise CfpError(f"{path} is not a readable cfp {fmt} file ({type(e).__name__}: "
                       f"{str(e)[:80]}): {hint}") from None
    _check_names_no_code(record, fingerprint, path, hint)
    return record


def _check_names_no_code(record: Any, fingerprint: tuple | None, path: Path, hint: str) -> None:
    """Refuse a record holding a callable, or a workload spec the reading run did not name."""
    import numpy as np
    from cfp.workloads import WorkloadSpec, spec_fingerprint
    run = dict(p for p in fingerprint or () if isinstance(p, tuple) and len(p) == 2)
    named = tuple((k, run.get(k)) for k, _ in spec_fingerprint(WorkloadSpec("")))
    stack, seen = [record], set()
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, (int, float, complex, str, bytes, type(None))):
            continue
        seen.add(id(obj))
        if isinstance(obj, type) or callable(obj):
            raise CfpError(f"{path} holds a callable ({getattr(obj, '__name__', obj)!r}), "
                           f"which no cfp record does: {hint}")
        if isinstance(obj, WorkloadSpec) and (
                spec_fingerprint(obj) != named if "model" in run else ":" in obj.model):
            raise CfpError(f"{path} names the workload {obj.model!r}, not this run's "
                           f"{run.get('model', 'zoo model')!r}; a work dir's file never "
                           f"chooses what runs: {hint}")
        if isinstance(obj, dict):
            stack.extend(obj.keys())
            stack.extend(obj.values())
        elif isinstance(obj, (tuple, list, set, frozenset)):
            stack.extend(obj)
        elif isinstance(obj, np.ndarray):
            if obj.dtype == object:
                stack.extend(obj.ravel().tolist())
        elif dataclasses.is_dataclass(obj):
            stack.extend(vars(obj).values())
