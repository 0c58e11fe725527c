"""``plan.json``: a plan in the form a user's own training step takes.

The step is ``train_step(params, opt_state, batch) -> (params, opt_state, loss)``, the one cfp
analysed (for a loss that takes a key, the batch is ``(batch, key)``). The file holds, keyed by
``jax.tree_util.keystr`` paths *inside* each argument as the user passes it:

- ``params``, ``opt_state``, ``batch``: the layout of every leaf the step reads (each entry a
  list with, per dim, ``null`` (replicated), an axis name, or a list of axis names);
- ``outputs``: the layouts of the new ``params`` and ``opt_state``, the same as they came in
  (a plan is a fixed point, so a loop feeds them back; the loss is replicated);
- ``blocks`` and ``constraints``: each block's strategy, and the sharding constraints it puts
  on its members (every contraction's operands and result, every other member's labelled
  results; operator index -> operand and result specs);
- ``step``: the fingerprint of the traced step, so ``jit`` can check it is the analysed one;
- ``mesh`` (shape and axis names: the user's, ``m0``, ``m1``, ... when none were given; and
  ``devices``, the ids of the user's mesh's devices in its order, which cfp measured on,
  where they were not JAX's first devices in order) and the format and its version.

A plan of a forward step (``--step forward``: ``forward(params, batch) -> loss``, for
inference or evaluation) has ``step.kind`` ``forward``, no ``opt_state`` and no ``outputs``:
nothing comes back to feed a next step, and nothing is donated.

Two ways to use it: ``step_shardings`` gives ``in_shardings``/``out_shardings`` for
``jax.jit(train_step, ..., donate_argnums=DONATE_ARGNUMS)`` (the interior left to XLA's
sharding propagation); ``jit`` also puts the block constraints inside, so the program is the
plan cfp measured. Either takes the user's mesh as it is, Auto or Explicit axes, with the
plan's axis names and sizes (and any other axes of one device), on its devices in any order
(a mesh that orders them otherwise than cfp measured runs the same numbers; a log line says
that its measured times were for the other order); on Explicit axes ``jit`` runs
the body with them Auto (``jax.sharding.auto_axes``), so the constraints and XLA place the
interior as cfp measured it, and the outputs come back typed on the user's mesh. A user's
own ``jax.jit`` on Explicit axes traces the step with sharded types: a step whose
contractions JAX cannot type from them alone (``ShardingTypeError``) is wrapped in
``jax.sharding.auto_axes(train_step, out_sharding=out_shardings)``. Both donate ``params`` and ``opt_state``, as cfp measured them: the new
state takes their place, so pass each step the state the last one returned.

Example:
    >>> import jax, jax.numpy as jnp
    >>> plan = {"format": "cfp-plan", "version": 3, "mesh": {"shape": [1], "axes": ["m0"]},
    ...         "params": {"['w']": ["m0", None]}}
    >>> mesh = jax.sharding.Mesh(jax.devices()[:1], ("m0",))
    >>> tuple(shardings({"w": jnp.ones((2, 2))}, plan, mesh)["w"].spec)
    ('m0', None)
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any, Callable

from cfp.errors import CfpError

log = logging.getLogger(__name__)

PLAN_FORMAT, PLAN_VERSION = "cfp-plan", 3
PARTS = ("params", "opt_state", "batch")
DONATE_ARGNUMS = (0, 1)  # train_step(params, opt_state, batch): the state a loop feeds back


def plan_data(plan) -> dict:
    """``plan.json``'s content: ``plan`` itself (a dict, as ``load_plan`` reads it), or the
    ``data`` of the ``cfp.Plan`` that ``cfp.autoshard`` returns: ``shardings``,
    ``step_shardings`` and ``jit`` take either."""
    return getattr(plan, "data", plan)


def step_parts(plan: dict) -> tuple[str, ...]:
    """The arguments of the plan's step: ``PARTS``, or ``(params, batch)`` for a forward
    step (plans written before steps had kinds are training steps)."""
    return ("params", "batch") if plan["step"].get("kind") == "forward" else PARTS


def _to_json(spec) -> list:
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def _from_json(entries) -> tuple:
    return tuple(tuple(e) if isinstance(e, list) else e for e in entries)


def _renamed(spec, names: dict):
    """A spec (None, or per dim None, an axis, or a tuple of axes) with its axes renamed."""
    if spec is None:
        return None
    return tuple(e if e is None else tuple(names[a] for a in e) if isinstance(e, tuple)
                 else names[e] for e in spec)


def make_plan(analysis, strategies, *, in_specs=None, out_specs=None, source: str = "",
              storage=None, recompute: dict | None = None) -> dict:
    """The plan of ``strategies`` (a strategy index per block) for the analysed step.
    ``in_specs``/``out_specs`` (per step input and output, in order) default to the layouts
    the strategies give; a search record passes its own (a baseline may store parameters
    its own way); ``storage`` (``cfp.execute.Storage``) is where it keeps the state, whose
    update it constrains to the split layout it names; ``recompute``
    (``cfp.recompute.Recompute.to_json``), what it recomputes."""
    import jax
    from cfp.execute import plan_specs
    from cfp.mesh import AXIS_NAMES
    g, blocks = analysis.graph, analysis.blocks.blocks
    ours = AXIS_NAMES[:len(analysis.mesh_shape)]  # the axes cfp measured on, m0, m1, ...
    ins, outs, op_constraints = plan_specs(analysis, strategies, ours, storage)
    in_specs = list(in_specs) if in_specs is not None else [ins[v] for v in g.inputs]
    out_specs = list(out_specs) if out_specs is not None else [outs[v] for v in g.outputs]
    axis_names = analysis.mesh_axes  # the user's: the plan speaks them
    users = dict(zip(ours, axis_names))
    in_specs, out_specs = ([_renamed(s, users) for s in specs] for specs in (in_specs, out_specs))
    op_constraints = {op: ([_renamed(s, users) for s in operands],
                           [_renamed(s, users) for s in results])
                      for op, (operands, results) in op_constraints.items()}
    workload = analysis.spec.build()
    trees = {"params": workload.abstract_params(), "opt_state": workload.abstract_opt_state(),
             "batch": workload.abstract_batch()}
    mesh = {"shape": list(analysis.mesh_shape), "axes": list(axis_names)}
    if analysis.device_ids is not None:
        mesh["devices"] = list(analysis.device_ids)
    plan: dict[str, Any] = {"format": PLAN_FORMAT, "version": PLAN_VERSION, "mesh": mesh,
                            "source": source,
                            "step": {"fingerprint": g.fingerprint(), "kind": workload.step,
                                     "loss_takes_key": workload.loss_takes_key}}
    start, outputs = 0, {}
    for part in step_parts(plan):
        leaves = jax.tree_util.tree_flatten_with_path(trees[part])[0]
        specs = in_specs[start:start + len(leaves)]
        plan[part] = {jax.tree_util.keystr(p): _to_json(s) for (p, _), s in zip(leaves, specs)}
        if part != "batch" and workload.step == "train":  # new params and opt_state, in order
            outputs[part] = {jax.tree_util.keystr(p): _to_json(s) for (p, _), s in
                             zip(leaves, out_specs[start:start + len(leaves)])}
        start += len(leaves)
    if outputs:
        plan["outputs"] = outputs
    plan["blocks"] = [{"block": b.index, "strategy_index": int(strategies[b.index]),
                       "strategy": b.strategies[strategies[b.index]].name,
                       "seed": g.ops[b.seed].hlo} for b in blocks]
    plan["constraints"] = {str(op): [[None if s is None else _to_json(s) for s in operands],
                                     [None if s is None else _to_json(s) for s in results]]
                           for op, (operands, results) in sorted(op_constraints.items())}
    if recompute:
        plan["recompute"] = recompute
    return plan


def write_plan(path: Path, plan: dict) -> None:
    """Write ``plan.json`` atomically: a plan is whole or absent, never half written."""
    tmp = Path(path).with_suffix(".json.tmp")
    try:
        tmp.write_text(json.dumps(plan, indent=1))
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def load_plan(path) -> dict:
    try:
        plan = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise CfpError(f"cannot read the plan {path} ({e}): run python -m cfp --mode search "
                       f"first") from None
    if not isinstance(plan, dict) or plan.get("format") != PLAN_FORMAT:
        raise CfpError(f"{path} is not a cfp plan.json")
    if plan.get("version") != PLAN_VERSION:
        raise CfpError(f"{path} is a version {plan.get('version')} plan, this cfp reads version "
                       f"{PLAN_VERSION}: run python -m cfp --mode search again")
    wrong = _malformed(plan)
    if wrong:
        raise CfpError(f"{path} is not a plan cfp wrote: {wrong}")
    return plan


def _malformed(plan: dict) -> str | None:
    """What in ``plan`` (a ``plan.json`` of this format and version) is not of the type and
    shape cfp writes, or None: every field a plan is used by is checked before it is."""
    mesh = plan.get("mesh")
    if not isinstance(mesh, dict):
        return "its mesh is not an object"
    shape, axes, devices = mesh.get("shape"), mesh.get("axes"), mesh.get("devices")
    if not (_ints(shape, 1) and shape):
        return f"its mesh shape {shape!r} is not a list of positive whole numbers"
    if not (isinstance(axes, list) and len(axes) == len(shape) and len(set(axes)) == len(axes)
            and all(isinstance(a, str) and a.isidentifier() for a in axes)):
        return f"its mesh axes {axes!r} are not one distinct name per dimension"
    if devices is not None and not (_ints(devices, 0) and len(devices) == math.prod(shape)
                                    and len(set(devices)) == len(devices)):
        return f"its mesh devices are not {math.prod(shape)} distinct device ids"
    step = plan.get("step")
    if not (isinstance(step, dict) and isinstance(step.get("fingerprint"), str)
            and step.get("kind", "train") in ("train", "forward")
            and isinstance(step.get("loss_takes_key", False), bool)):
        return "its step is not a fingerprint, a kind (train or forward) and loss_takes_key"
    names = set(axes)
    parts = {part: plan.get(part) for part in step_parts(plan)}
    if step.get("kind", "train") == "train":
        outputs = plan.get("outputs")
        if not isinstance(outputs, dict):
            return "its outputs are not an object"
        parts.update({f"outputs {k}": outputs.get(k) for k in ("params", "opt_state")})
    for part, specs in parts.items():
        if not (isinstance(specs, dict) and all(isinstance(k, str) and _spec(v, names)
                                                for k, v in specs.items())):
            return (f"its {part} is not an object of leaf paths and specs (per dim null, an "
                    f"axis of {sorted(names)}, or a list of them)")
    blocks = plan.get("blocks")
    if not (isinstance(blocks, list) and all(
            isinstance(b, dict) and _ints([b.get("block"), b.get("strategy_index")], 0)
            and isinstance(b.get("strategy"), str) for b in blocks)):
        return "its blocks are not a list of block, strategy_index and strategy"
    constraints = plan.get("constraints")
    if not (isinstance(constraints, dict) and all(
            isinstance(op, str) and op.isascii() and op.isdigit() and isinstance(c, list)
            and len(c) == 2 and all(isinstance(side, list) and all(
                spec is None or _spec(spec, names) for spec in side) for side in c)
            for op, c in constraints.items())):
        return "its constraints are not an object of operator index -> [operand, result specs]"
    recompute = plan.get("recompute")
    if recompute is not None and not _recompute_ok(recompute):
        return ("its recompute is not a backward_from operator and a list of layers, each a "
                "policy of jax.checkpoint_policies and [start, end) runs of operators")
    description = plan.get("description", [])
    if not (isinstance(description, list) and all(isinstance(d, str) for d in description)):
        return "its description is not a list of lines"
    return None


def _recompute_ok(recompute) -> bool:
    from cfp.recompute import POLICIES
    return (isinstance(recompute, dict) and _ints([recompute.get("backward_from")], 0)
            and isinstance(recompute.get("layers"), list) and all(
                isinstance(layer, dict) and layer.get("policy") in POLICIES
                and type(layer.get("segment", 0)) is int
                and isinstance(layer.get("ops"), list)
                and all(_ints(run, 0) and len(run) == 2 and run[0] < run[1]
                        for run in layer["ops"])
                for layer in recompute["layers"]))


def _ints(values, low: int) -> bool:
    return isinstance(values, list) and all(
        type(v) is int and low <= v < 2**31 for v in values)


def _spec(spec, axes: set) -> bool:
    """A spec as ``plan.json`` holds it: per dim None, an axis name, or a list of them."""
    return isinstance(spec, list) and all(
        e is None or (isinstance(e, str) and e in axes)
        or (isinstance(e, list) and all(isinstance(a, str) and a in axes for a in e))
        for e in spec)


def mesh_of(plan: dict):
    """The plan's mesh over the devices it was measured on in that order (JAX's first devices
    when it names none), with its axis names (Auto axis types)."""
    from cfp.mesh import make_mesh
    devices = plan["mesh"].get("devices")
    return make_mesh(tuple(plan["mesh"]["shape"]), tuple(plan["mesh"]["axes"]),
                     None if devices is None else tuple(devices))


def _measured_devices(plan: dict) -> tuple[int, ...]:
    """The ids of the devices the plan was measured on, in the order of its mesh."""
    import jax
    devices = plan["mesh"].get("devices")
    if devices is not None:
        return tuple(devices)
    return tuple(d.id for d in jax.devices()[:math.prod(plan["mesh"]["shape"])])


def _mesh_devices(plan: dict, mesh) -> tuple[int, ...]:
    """The ids of ``mesh``'s devices in the order of the plan's mesh: its axes put in the
    plan's order (the mesh may order its axes otherwise, or hold further axes of one)."""
    import numpy as np
    names = list(mesh.axis_names)
    ours = [names.index(a) for a in plan["mesh"]["axes"] if a in names]
    order = ours + [i for i in range(len(names)) if i not in ours]
    return tuple(int(d.id) for d in np.transpose(mesh.devices, order).flat)


def _note_device_order(plan: dict, mesh) -> None:
    """Log one line where ``mesh`` places the plan's axes on other devices, or in another
    order, than cfp measured it on: the plan applies and computes the same numbers (its
    shardings name axes, not devices), but its measured times were for the other order."""
    measured, here = _measured_devices(plan), _mesh_devices(plan, mesh)
    if measured != here:
        log.warning("this mesh lays the plan's axes over devices %s; the plan was measured "
                    "on %s: it applies, but its times were measured for the other order "
                    "(give autoshard this mesh to measure on it)", list(here), list(measured))


def check_mesh(plan: dict, mesh) -> None:
    """Refuse a mesh the plan was not made for: each of the plan's axes must be one of the
    mesh's, of the same size; the mesh's other axes must be of one device."""
    sizes = dict(mesh.shape)
    want = dict(zip(plan["mesh"]["axes"], plan["mesh"]["shape"]))
    wrong = [f"{a}={n}" for a, n in want.items() if sizes.get(a) != n and n > 1]
    extra = [f"{a}={n}" for a, n in sizes.items() if a not in want and n > 1]
    if wrong or extra:
        raise CfpError(f"the plan is for the mesh {_mesh_words(want)}, not "
                       f"{_mesh_words(sizes)}: plan again for this mesh (cfp --mesh "
                       f"{','.join(f'{a}={n}' for a, n in sizes.items() if n > 1)})")


def _mesh_words(sizes: dict) -> str:
    return ",".join(f"{a}={n}" for a, n in sizes.items())


def shardings(tree, plan: dict, mesh, part: str = "params", *, specs: dict | None = None):
    """A pytree like ``tree`` of ``NamedSharding``s from the plan's ``part`` (``params``,
    ``opt_state`` or ``batch``). Every leaf must be named by the plan and every entry must
    name a leaf: a plan applied to a tree it was not made for (another model, or the same
    params wrapped or renamed) is refused, naming the first paths that do not match."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding, PartitionSpec
    plan = plan_data(plan)
    check_mesh(plan, mesh)
    specs = plan[part] if specs is None else specs
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    paths = [jax.tree_util.keystr(p) for p, _ in leaves]
    unmatched = [p for p in paths if p not in specs]
    unused = [p for p in specs if p not in set(paths)]
    fields = [p for p, (_, leaf) in zip(paths, leaves) if p not in specs and not isinstance(
        leaf, (jax.Array, np.ndarray, jax.ShapeDtypeStruct))] if unmatched else []
    if fields and len(fields) == len(unmatched) and not unused:  # a module's other fields
        raise CfpError(
            f"the plan's {part} are arrays alone, and {', '.join(fields[:3])}"
            f"{f' and {len(fields) - 3} more' if len(fields) > 3 else ''} "
            f"{'is' if len(fields) == 1 else 'are'} not: pass the arrays, as cfp planned them "
            f"(of an Equinox module, eqx.partition(model, eqx.is_array)), and join the rest "
            f"inside the step (eqx.combine)")
    if unmatched or unused:
        raise CfpError(
            f"the plan's {part} do not match this tree: "
            + (f"no entry for {', '.join(unmatched[:3])}" if unmatched else "")
            + ("; " if unmatched and unused else "")
            + (f"no leaf at {', '.join(unused[:3])}" if unused else "")
            + " (a plan for another model, or a tree wrapped or renamed since)")

    def one(path, leaf):
        key = jax.tree_util.keystr(path)
        spec = _from_json(specs[key])
        dims = len(getattr(leaf, "shape", ()))  # a Python scalar has none
        if len(spec) != dims:
            raise CfpError(f"the plan's {part} entry {key} has {len(spec)} dims, the leaf has "
                           f"{dims}: a plan for another model")
        return NamedSharding(mesh, PartitionSpec(*spec))

    return jax.tree_util.tree_map_with_path(one, tree)


def step_shardings(plan: dict, mesh, *args) -> tuple[tuple, Any]:
    """``(in_shardings, out_shardings)`` for ``jax.jit(train_step, in_shardings,
    out_shardings, donate_argnums=DONATE_ARGNUMS)`` with ``train_step(params, opt_state,
    batch) -> (params, opt_state, loss)``; ``args`` are its ``(params, opt_state, batch)``. The
    new state comes out as it went in, so a loop passes each step's ``(params, opt_state)`` to
    the next. For a forward plan ``args`` are ``(params, batch)`` and the out sharding is the
    loss's (replicated); a forward step that returns something else (logits) may leave its
    out shardings to XLA."""
    from jax.sharding import NamedSharding, PartitionSpec
    plan = plan_data(plan)
    parts = step_parts(plan)
    if len(args) != len(parts):
        raise CfpError(f"the plan's step takes ({', '.join(parts)}), {len(parts)} arguments; "
                       f"got {len(args)}"
                       + (": a forward plan has no opt_state" if len(parts) == 2 else ""))
    ins = tuple(shardings(a, plan, mesh, part) for a, part in zip(args, parts))
    _note_device_order(plan, mesh)  # the mesh is the plan's (``shardings`` checked it)
    loss = NamedSharding(mesh, PartitionSpec())
    if "opt_state" not in parts:
        return ins, loss
    params, opt_state, _ = args
    return ins, (shardings(params, plan, mesh, "params", specs=plan["outputs"]["params"]),
                 shardings(opt_state, plan, mesh, "opt_state",
                           specs=plan["outputs"]["opt_state"]), loss)


def jit(train_step: Callable, plan: dict, mesh, *args) -> Callable:
    """``train_step`` jitted with the plan: its layouts at the edges and each block's
    constraints inside, so it compiles to the program cfp measured; ``params`` and
    ``opt_state`` are donated (``DONATE_ARGNUMS``). ``args``, ``(params, opt_state, batch)``
    (arrays or ``jax.ShapeDtypeStruct``s), fix the shapes; the step traced with them must be
    the analysed one (same fingerprint). A forward plan's step is ``forward(params, batch)``,
    ``args`` are ``(params, batch)``, and nothing is donated."""
    import jax
    from cfp.program import trace_program
    from cfp.jax_compat import auto_inside, constraint_mesh
    from cfp.recompute import Recompute
    from cfp.sharding import step_function
    plan = plan_data(plan)
    check_mesh(plan, mesh)
    in_shardings, out_shardings = step_shardings(plan, mesh, *args)  # checks the arguments
    # Traced from shapes and dtypes alone: arrays placed on a mesh of Explicit axes carry
    # their sharding in their types, and the analysed step was traced without.
    program = trace_program(train_step, *jax.tree_util.tree_map(_abstract, args))
    index = _analysed_ops(program, plan["step"]["fingerprint"])
    if index is None:
        raise CfpError("this train_step is not the step the plan was made for (its traced "
                       "program differs): analyse and search this step")
    constraints = {index[int(op)]: ([None if s is None else _from_json(s) for s in operands],
                                    [None if s is None else _from_json(s) for s in results])
                   for op, (operands, results) in plan["constraints"].items()}
    recompute = None
    if plan.get("recompute"):
        try:
            recompute = Recompute.from_json(plan["recompute"], index)
        except IndexError:
            raise CfpError("the plan's recompute names operators this train_step does not "
                           "have") from None
    flat_step, _ = step_function(program, constraints=constraints,
                                 mesh=constraint_mesh(mesh), recompute=recompute)

    def step(*step_args):
        outs = flat_step(*jax.tree_util.tree_leaves(step_args))
        return jax.tree_util.tree_unflatten(program.out_tree, outs)

    step = auto_inside(step, mesh, out_shardings)
    return PlacingStep(jax.jit(step, in_shardings=in_shardings, out_shardings=out_shardings,
                               donate_argnums=DONATE_ARGNUMS if len(args) == len(PARTS) else ()),
                       in_shardings)


def _analysed_ops(program, fingerprint: str) -> list[int] | None:
    """Per operator of the analysed step, its index in ``program``, the user's step as
    traced; None when it is another step. A step that returns metrics beside the loss (a
    dict holding it under ``loss``, with the gradient norm, the learning rate) was analysed
    as the program of its state and loss alone: the same operators, less those only the
    other metrics need."""
    import jax
    if program.graph().fingerprint() == fingerprint:
        return list(range(len(program.eqns)))
    out = jax.tree_util.tree_unflatten(program.out_tree, program.outputs)
    if not (isinstance(out, tuple) and len(out) == 3 and isinstance(out[2], dict)
            and "loss" in out[2]):
        return None
    analysed, kept = program.restricted(jax.tree_util.tree_leaves(out[:2]) + [out[2]["loss"]])
    return kept if analysed.graph().fingerprint() == fingerprint else None


def _abstract(x):
    """``x``'s shape and dtype, without its placement."""
    import jax
    return (jax.ShapeDtypeStruct(x.shape, x.dtype, weak_type=getattr(x, "weak_type", False))
            if hasattr(x, "dtype") else x)


class PlacingStep:
    """A jitted planned step that takes its arguments wherever they live: an array placed in
    other shardings than the plan's (a checkpoint restored in another layout) is copied into
    the plan's before the call, once, since the step returns the state in the plan's layout;
    arrays in the plan's layout, uncommitted ones and host arrays go in as they are. Anything
    else (``lower``, ``trace``) is the jitted function's."""

    def __init__(self, jitted, in_shardings):
        self.jitted, self.in_shardings = jitted, in_shardings

    def __call__(self, *args):
        import jax
        leaves, tree = jax.tree_util.tree_flatten(args)
        shardings = jax.tree_util.tree_leaves(
            self.in_shardings[:len(args)], is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
        if len(shardings) == len(leaves):  # else jit says what does not match
            args = jax.tree_util.tree_unflatten(tree, map(_placed, leaves, shardings))
        return self.jitted(*args)

    def __getattr__(self, name):
        return getattr(self.jitted, name)


def _placed(x, sharding):
    """``x`` in ``sharding`` when it is an array committed to another layout, else ``x``."""
    import jax
    if (isinstance(x, jax.Array) and x.committed and x.is_fully_addressable
            and not x.sharding.is_equivalent_to(sharding, x.ndim)):
        log.info("an argument in %s is copied into the plan's %s", x.sharding, sharding)
        return jax.device_put(x, sharding)
    return x
