"""``plan.json``: a searched plan in a form a user's own ``jax.jit`` can take.

It holds the chosen strategy of every block and a ``PartitionSpec`` per parameter leaf, keyed
by its ``jax.tree_util.keystr`` path; each entry is ``null`` (replicated), an axis name, or a
list of axis names.

Example:
    >>> import jax, jax.numpy as jnp
    >>> plan = {"mesh": {"shape": [1], "axes": ["m0"]}, "params": {"['w']": ["m0", None]}}
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("m0",))
    >>> shardings({"w": jnp.ones((2, 2))}, plan, mesh)["w"].spec
    PartitionSpec('m0', None)
"""
from __future__ import annotations

import json
from pathlib import Path

from cfp.errors import CfpError


def spec_to_json(spec) -> list:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def write_plan(path: Path, *, mesh_shape, axis_names, blocks: list[dict], params: dict,
               extra: dict | None = None) -> None:
    data = {"mesh": {"shape": list(mesh_shape), "axes": list(axis_names)},
            "blocks": blocks, "params": {k: spec_to_json(v) for k, v in params.items()}}
    data.update(extra or {})
    tmp = Path(path).with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    tmp.replace(path)


def load_plan(path) -> dict:
    try:
        plan = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CfpError(f"cannot read the plan {path} ({e}): run python -m cfp --mode search "
                       f"first") from None
    if "params" not in plan or "mesh" not in plan:
        raise CfpError(f"{path} is not a cfp plan.json (no 'params'/'mesh')")
    return plan


def shardings(params, plan: dict, mesh):
    """A pytree like ``params`` of ``NamedSharding``s from ``plan`` (leaves the plan does not
    name are replicated)."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    def one(path, leaf):
        entries = plan["params"].get(jax.tree_util.keystr(path))
        if entries is None:
            return NamedSharding(mesh, PartitionSpec())
        spec = [tuple(e) if isinstance(e, list) else e for e in entries]
        if len(spec) != len(getattr(leaf, "shape", ())):
            raise CfpError(f"plan entry {jax.tree_util.keystr(path)} has {len(spec)} dims, "
                           f"the parameter has {len(leaf.shape)}: the plan is for another model")
        return NamedSharding(mesh, PartitionSpec(*spec))

    return jax.tree_util.tree_map_with_path(one, params)
