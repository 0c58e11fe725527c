"""A plan as Flax/MaxText logical-axis rules: ``[("embed", "model"), ("mlp", None), ...]``.

cfp plans per array (a ``PartitionSpec`` per parameter); a Flax or MaxText model names the dims
of its parameters with logical axes (``nn.with_logical_partitioning``), and one ordered rule
list maps every logical name to mesh axes. The plan is expressible that way when each logical
name gets the same mesh axes in every parameter the plan splits, and every dim the plan splits
has a logical name. Then ``logical_rules`` returns rules that, applied through Flax's own
``nn.logical_to_mesh_axes``, give the plan's shardings of the parameters (checked so, with
Flax, before they are returned). Otherwise it says why not: each conflict, one line. The rules
cover the parameters (the optimizer state of a Flax model follows them); the batch keeps the
plan's ``batch`` entries. The logical names come from the user's boxed parameters
(``LogicallyPartitioned``, as ``model.init`` returns them), which the traced step does not see.

Example:
    >>> import jax, jax.numpy as jnp, flax.linen as nn
    >>> boxed = {"w": nn.LogicallyPartitioned(jnp.ones((4, 8)), ("embed", "mlp"))}
    >>> plan = {"mesh": {"shape": [2], "axes": ["model"]}, "params": {"['w']": [None, "model"]}}
    >>> logical_rules(plan, boxed).rules
    (('embed', None), ('mlp', 'model'))
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from cfp.errors import CfpError

RULES_FORMAT, RULES_VERSION = "cfp-logical-rules", 1


@dataclasses.dataclass(frozen=True)
class LogicalRules:
    rules: tuple[tuple[str, str | tuple[str, ...] | None], ...]  # logical name -> mesh axes
    conflicts: tuple[str, ...]  # why the plan is not expressible as rules; empty when it is

    @property
    def expressible(self) -> bool:
        return not self.conflicts


def logical_rules(plan: dict, boxed_params) -> LogicalRules:
    """The rules that give ``plan``'s parameter shardings from the logical names of
    ``boxed_params`` (the user's parameters as Flax boxes them), or the conflicts that
    make the plan inexpressible as rules (``rules`` then empty)."""
    import jax
    from flax.core import meta
    from flax.linen import logical_to_mesh_axes

    def is_box(x):
        return isinstance(x, meta.Partitioned)

    named = []  # (plan key, logical names per dim, the plan's spec)
    for path, leaf in jax.tree_util.tree_flatten_with_path(boxed_params, is_leaf=is_box)[0]:
        key = _plan_key(plan, jax.tree_util.keystr(path), is_box(leaf))
        names = tuple(leaf.names) if is_box(leaf) else (None,) * len(leaf.shape)
        named.append((key, names, tuple(_axes(e) for e in plan["params"][key])))
    assigned: dict[str, tuple] = {}  # logical name -> (mesh axes, where first seen)
    conflicts = []
    for key, names, spec in named:
        for dim, (name, axes) in enumerate(zip(names, spec)):
            if name is None:
                if axes is not None:
                    conflicts.append(f"{key} dim {dim} is split over {_words(axes)} but has "
                                     f"no logical name")
                continue
            first = assigned.setdefault(name, (axes, f"{key} dim {dim}"))
            if first[0] != axes:
                conflicts.append(f"logical axis {name!r} is split over {_words(first[0])} in "
                                 f"{first[1]} but over {_words(axes)} in {key} dim {dim}")
    rules = tuple((name, axes) for name, (axes, _) in assigned.items())
    if not conflicts:  # Flax's own reading of the rules must give the plan back
        for key, names, spec in named:
            got = tuple(logical_to_mesh_axes(names, rules))
            if tuple(_axes(e) for e in got) != spec:
                conflicts.append(f"{key}: the rules give {got}, the plan {spec}")
    return LogicalRules(() if conflicts else rules, tuple(conflicts))


def workload_rules(plan: dict, workload) -> LogicalRules | None:
    """``logical_rules`` of a workload whose params are boxed with logical names (None when
    none is, or Flax is not installed)."""
    try:
        from flax.core import meta
    except ImportError:
        return None
    import jax
    params = workload.abstract_params()
    boxes = [x for x in jax.tree_util.tree_leaves(
        params, is_leaf=lambda x: isinstance(x, meta.Partitioned))
        if isinstance(x, meta.Partitioned)]
    return logical_rules(plan, params) if boxes else None


def _plan_key(plan: dict, key: str, boxed: bool) -> str:
    """The plan's entry of a parameter: made from unboxed parameters (the path to the box)
    or from boxed ones (the path to its value)."""
    for candidate in (key, key + ".value") if boxed else (key,):
        if candidate in plan["params"]:
            return candidate
    raise CfpError(f"the plan has no parameter {key}: these params are not the ones the plan "
                   f"was made for")


def _axes(entry):
    """A spec entry as one value: None, an axis name, or a tuple of two or more."""
    if isinstance(entry, (list, tuple)):
        entry = tuple(entry)
        return None if not entry else entry[0] if len(entry) == 1 else entry
    return entry


def _words(axes) -> str:
    return "nothing (replicated)" if axes is None else repr(axes)


def write_logical_rules(path, plan: dict, rules: LogicalRules) -> None:
    """``logical_rules.json``: the rules (a list of ``[logical name, mesh axes]`` pairs, the
    form ``nn.logical_axis_rules`` and MaxText's ``logical_axis_rules`` take) when the plan
    is expressible, else the conflicts."""
    Path(path).write_text(json.dumps({
        "format": RULES_FORMAT, "version": RULES_VERSION, "mesh": plan["mesh"],
        "expressible": rules.expressible,
        "rules": [[name, list(a) if isinstance(a, tuple) else a] for name, a in rules.rules],
        "conflicts": list(rules.conflicts)}, indent=1))
