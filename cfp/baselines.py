"""The plans people use, written as data and run through the same path as cfp's plans.

A rule file ``cfp/baseline_rules/<name>.json`` maps *roles* of a contraction's loop dims to mesh
axes. ``axes`` holds, per mesh axis (the last entry repeats for further axes), the roles to try in
order; the first that the contraction has, and whose dim the axis divides, takes the axis, and
an axis no role takes is left replicated. Roles are found in the graph, for any model:

- ``data``: a dim that descends from a batch input's leading dim (followed forward through every
  operator with ``cfp.dims`` rules, contractions included);
- ``expert``: a batch dim of the contraction that a parameter operand holds (per-expert weights);
- ``weight_out``: a free dim of a parameter operand (a column-parallel split);
- ``weight_in``: a contracting dim of a parameter operand (a row-parallel split);
- ``follow``: the dim the incoming activation already is split on along this axis, under the
  plans of the blocks upstream (blocks are decided in program order). Megatron's column/row
  alternation and its head split come out of ``["follow", "weight_out"]``.

A parameter operand is a step input among the parameters, reached through layout operators.
``storage`` says where parameters and optimizer state live between steps
(``cfp.execute.Storage``): ``plan``, in the layout their first reader's strategy wants (as
cfp's own plans keep them); ``zero1``, the optimizer state split further over the mesh axes
that layout leaves replicated, the update on shards; ``fsdp``, the parameters too. ``axes:
null`` puts no constraint inside the step at all; only the batch is split (XLA propagates the
rest).

Example:
    >>> sorted(load_rules())
    ['batch_only', 'dp', 'dp_tp', 'expert', 'fsdp', 'fsdp_tp', 'megatron', 'zero1']
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from cfp import dims as dimrules
from cfp.errors import CfpError
from cfp.mesh import AXIS_NAMES
from cfp.strategies import Strategy, op_loop_dims, strategy_name

RULES_DIR = Path(__file__).parent / "baseline_rules"
ROLES = ("data", "expert", "weight_out", "weight_in", "follow")


@dataclasses.dataclass(frozen=True)
class Rule:
    name: str
    title: str
    about: str
    axes: tuple[tuple[str, ...], ...] | None
    storage: str  # one of cfp.execute.STATE_LAYOUTS
    mesh_dims: int | None = None  # only for meshes of this rank
    needs_role: str | None = None  # only when some contraction has this role


def load_rules(directory: Path = RULES_DIR) -> dict[str, Rule]:
    rules = {}
    for path in sorted(Path(directory).glob("*.json")):
        try:
            d = json.loads(path.read_text())
            axes = None if d["axes"] is None else tuple(tuple(a) for a in d["axes"])
            rule = Rule(path.stem, d["title"], d.get("about", ""), axes, d["storage"],
                        d.get("mesh_dims"), d.get("needs_role"))
        except (ValueError, KeyError, TypeError) as e:
            raise CfpError(f"{path} is not a baseline rule file ({e})") from None
        for role in {r for a in (rule.axes or ()) for r in a} | {rule.needs_role} - {None}:
            if role not in ROLES:
                raise CfpError(f"{path}: unknown role {role!r} (known: {', '.join(ROLES)})")
        from cfp.execute import STATE_LAYOUTS
        if rule.storage not in STATE_LAYOUTS:
            raise CfpError(f"{path}: storage must be one of {', '.join(STATE_LAYOUTS)}")
        rules[rule.name] = rule
    return rules


@dataclasses.dataclass(frozen=True)
class BaselinePlan:
    """A manual plan: per block a ``Strategy`` (``None``: no constraints inside the step) and
    where it keeps the state (``cfp.execute.Storage``)."""

    name: str
    strategies: tuple[Strategy, ...] | None
    storage: "Storage"


def input_kinds(analysis) -> list[str]:
    """'param', 'opt' or 'batch' for every step input, in order (the workload's abstract
    parameters traced once per analysis, not once per hand plan)."""
    from cfp.graph import memo

    def make():
        import jax
        w = analysis.spec.build()
        n_p = len(jax.tree_util.tree_leaves(w.abstract_params()))
        n_b = len(jax.tree_util.tree_leaves(w.abstract_batch()))
        n = len(analysis.graph.inputs)
        return ["param"] * n_p + ["opt"] * (n - n_p - n_b) + ["batch"] * n_b
    return list(memo(analysis, "input_kinds", make))


def params_and_data(analysis) -> tuple[set[int], dict[int, tuple]]:
    """``_params`` and ``_data_labels`` of the analysis's graph, computed once per analysis
    (every hand plan reads them); not to be changed."""
    from cfp.graph import memo

    def make():
        kinds = input_kinds(analysis)
        return _params(analysis.graph, kinds), _data_labels(analysis.graph, kinds)
    return memo(analysis, "params_and_data", make)


def _params(graph, kinds) -> set[int]:
    """Values that are parameters, reached from a parameter input through layout operators,
    slices (one layer of stacked weights) and remat's barriers."""
    from cfp.blocks import LAYOUT_OPS
    out = {v for v, k in zip(graph.inputs, kinds) if k == "param"}
    for op in graph.ops:
        if (op.primitive in LAYOUT_OPS + ("slice", "optimization_barrier") and op.inputs
                and op.inputs[0] in out):
            out.update(op.outputs)
    return out


def _data_labels(graph, kinds) -> dict[int, tuple]:
    """Per value, label 0 on the dims that descend from a batch input's leading dim."""
    shape = lambda v: graph.values[v].shape  # noqa: E731
    labels = {}
    for v, k in zip(graph.inputs, kinds):
        n = len(shape(v))
        labels[v] = ((0,) + (None,) * (n - 1)) if k == "batch" and n else (None,) * n
    for op in graph.ops:
        ins = [labels.get(v) for v in op.inputs]
        if op.is_contraction:
            out = [None] * len(shape(op.outputs[0]))
            for ld in op_loop_dims(op, graph.values):
                if ld.out is None:
                    continue
                got = [lab[pos] for lab, pos in ((ins[0], ld.lhs), (ins[1], ld.rhs))
                       if lab is not None and pos is not None]
                out[ld.out] = next((g for g in got if g is not None), None)
            outs = (tuple(out),)
        else:
            outs = dimrules.forward(op.primitive, dict(op.attrs), [shape(v) for v in op.inputs],
                                    [shape(v) for v in op.outputs], ins).outs
        for v, lab in zip(op.outputs, outs):
            labels[v] = lab
    return labels


def static_roles(block, graph, params: set, data: dict) -> dict[str, list[int]]:
    """Loop dims of the block's seed that play each role (all but ``follow``)."""
    op = graph.ops[block.seed]
    lhs, rhs = op.inputs[:2]
    roles = {r: [] for r in ROLES}
    for i, ld in enumerate(block.loop_dims):
        held = [(v, pos) for v, pos in ((lhs, ld.lhs), (rhs, ld.rhs)) if pos is not None]
        if ld.kind != "contract" and any(data.get(v, ())[pos:pos + 1] == (0,) for v, pos in held):
            roles["data"].append(i)
        by_param = any(v in params for v, _ in held)
        if ld.kind == "batch" and by_param:
            roles["expert"].append(i)
        if ld.kind in ("lhs", "rhs") and by_param:
            roles["weight_out"].append(i)
        if ld.kind == "contract" and by_param:
            roles["weight_in"].append(i)
    return roles


def _incoming(block, graph, ba, chosen: dict, params: set) -> dict[int, int]:
    """Mesh axis -> loop dim of this block that the incoming activations are split on, under
    the strategies ``chosen`` for the blocks upstream (the largest activation first)."""
    seen = []
    for m in block.members:
        if m.op > block.seed:
            continue
        for v, lab in zip(graph.ops[m.op].inputs, m.ins):
            prod = graph.values[v].producer
            up = ba.owner.get(prod) if prod is not None else None
            if v in params or up is None or up not in chosen or up == block.index:
                continue
            up_lab = ba.value_labels[up].get(v)
            if up_lab is None:
                continue
            split = {}
            for lu, lc in zip(up_lab, lab):
                for a, loop in enumerate(chosen[up].axes):
                    if lu is not None and lc is not None and loop == lu:
                        split[a] = lc
            seen.append((graph.values[v].nbytes, split))
    out: dict[int, int] = {}
    for _, split in sorted(seen, key=lambda s: -s[0]):
        for a, loop in split.items():
            out.setdefault(a, loop)
    return out


def _divides(block, graph) -> list[tuple]:
    """(label, size) of every labelled dim of the block's contractions."""
    out = []
    for m in block.contractions:
        op = graph.ops[m.op]
        for v, lab in list(zip(op.inputs, m.ins)) + list(zip(op.outputs, m.outs)):
            out += [(l, s) for l, s in zip(lab, graph.values[v].shape) if l is not None]
    return out


def _fits(axes, block, divides, mesh_shape) -> bool:
    for loop in {d for d in axes if d is not None}:
        used = [i for i, d in enumerate(axes) if d == loop]
        if used != list(range(used[0], used[0] + len(used))):
            return False
        if block.loop_dims[loop].size % math.prod(mesh_shape[i] for i in used):
            return False
    return dimrules.satisfied(divides, axes, mesh_shape)


def block_strategy(rule: Rule, block, graph, roles, incoming, mesh_shape) -> Strategy:
    divides = _divides(block, graph)
    axes: list = [None] * len(mesh_shape)
    for a in range(len(mesh_shape)):
        if mesh_shape[a] == 1:
            continue
        for role in rule.axes[min(a, len(rule.axes) - 1)]:
            cands = [incoming[a]] if role == "follow" and a in incoming else roles.get(role, [])
            pick = next((c for c in cands if _fits(axes[:a] + [c] + axes[a + 1:], block,
                                                    divides, mesh_shape)), None)
            if pick is not None:
                axes[a] = pick
                break
    axes = tuple(axes)
    for s in block.strategies:
        if s.axes == axes:
            return s
    op = graph.ops[block.seed]
    nd = tuple(len(graph.values[v].shape) for v in (op.outputs[0], op.inputs[0], op.inputs[1]))
    return Strategy(axes, strategy_name(axes, block.loop_dims, nd))


def applies(rule: Rule, analysis) -> bool:
    if rule.mesh_dims is not None and sum(s > 1 for s in analysis.mesh_shape) != rule.mesh_dims:
        return False
    if rule.needs_role is None:
        return True
    g = analysis.graph
    params, data = params_and_data(analysis)
    return any(static_roles(b, g, params, data)[rule.needs_role]
               for b in analysis.blocks.blocks)


def baseline_plan(rule: Rule, analysis) -> BaselinePlan:
    from cfp.execute import Storage
    g, ba, mesh_shape = analysis.graph, analysis.blocks, tuple(analysis.mesh_shape)
    names = AXIS_NAMES[:len(mesh_shape)]
    kinds = input_kinds(analysis)
    if rule.axes is None:
        split = names if len(names) > 1 else names[0]
        batch = tuple((i, (split,) + (None,) * (len(g.values[v].shape) - 1))
                      for i, (v, k) in enumerate(zip(g.inputs, kinds))
                      if k == "batch" and g.values[v].shape
                      and g.values[v].shape[0] % math.prod(mesh_shape) == 0)
        return BaselinePlan(rule.name, None, Storage(rule.storage, batch))
    params, data = params_and_data(analysis)
    chosen: dict[int, Strategy] = {}
    for b in ba.blocks:
        roles = static_roles(b, g, params, data)
        chosen[b.index] = block_strategy(rule, b, g, roles, _incoming(b, g, ba, chosen, params),
                                         mesh_shape)
    return BaselinePlan(rule.name, tuple(chosen[b.index] for b in ba.blocks),
                        Storage(rule.storage))


def baseline_strategy_indices(analysis, *, storage: bool = False
                              ) -> dict[str, tuple[int | None, ...]]:
    """Per rule-file baseline that applies and fixes every block's strategy, the index of
    each block's strategy in its block's list (``None`` where the analysis kept no such
    strategy): those that keep the state as their blocks compute, or (``storage``) every
    one, mapped to (indices, its state layout)."""
    out = {}
    for name, rule in load_rules().items():
        if rule.axes is None or not (storage or rule.storage == "plan") \
                or not applies(rule, analysis):
            continue
        bp = baseline_plan(rule, analysis)
        idx = tuple(next((i for i, t in enumerate(b.strategies) if t.axes == st.axes), None)
                    for b, st in zip(analysis.blocks.blocks, bp.strategies))
        out[name] = (idx, rule.storage) if storage else idx
    return out
