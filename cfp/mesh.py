"""The mesh a run plans for: parsed from the command line's text or taken from the user's
``jax.sharding.Mesh``, checked against the devices, and built over JAX's devices.

Example:
    >>> parse_mesh("data=2,model=4")
    ((2, 4), ('data', 'model'))
    >>> mesh_text((2, 4))
    '2x4'
"""
from __future__ import annotations

import math

from cfp.errors import CfpError

AXIS_NAMES = ("m0", "m1", "m2")


def parse_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """``--mesh`` text as ``(shape, axis names)``: ``"8"`` -> ``((8,), ("m0",))``, ``"2x4"`` ->
    axes m0, m1; ``"data=2,model=4"`` names the axes. A named axis of one device splits
    nothing and is left out, as in ``mesh_from``."""
    if not isinstance(text, str):
        raise CfpError(f"a mesh is text such as 8, 2x4 or data=2,model=4, or a "
                       f"jax.sharding.Mesh, not a {type(text).__name__}")
    if "=" in text:
        return _named_mesh(text)
    parts = text.split("x")
    if not all(_is_size(p) for p in parts):
        raise CfpError(f"--mesh {text!r} is not a mesh shape: write N or NxM (e.g. 8 or 2x4), "
                       f"or name the axes (data=2,model=4)")
    shape = tuple(int(p) for p in parts)
    if len(shape) > 1 and 1 in shape:
        raise CfpError(f"--mesh {text!r} has an axis of one device, which splits nothing: "
                       f"write {mesh_text(tuple(n for n in shape if n > 1) or (1,))}")
    return _split_axes(shape, AXIS_NAMES[:len(shape)] if len(shape) <= len(AXIS_NAMES)
                       else tuple(f"m{k}" for k in range(len(shape))), f"--mesh {text!r}")


def _is_size(text: str) -> bool:
    """An axis size: ASCII digits only (no signs, spaces or other scripts' digits), at least
    one device, and short enough to read as a number."""
    return text.isascii() and text.isdigit() and len(text) <= 9 and int(text) > 0


def _named_mesh(text: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    pairs = [part.partition("=") for part in text.split(",")]
    if not all(name.isascii() and name.isidentifier() and sep and _is_size(size)
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

