"""plan.json in the user's own jit: Flax, Equinox and plain JAX with Optax (Adam, and
Adafactor's factored state), on meshes 8 and 2x4."""
import dataclasses

import jax
import numpy as np
import pytest

import users_models
from cfp.api import Plan
from cfp.errors import CfpError
from cfp.execute import PlannedStep, check_numerics, example_inputs
from cfp.passes.analysis import run_analysis
from cfp.plan import jit as plan_jit
from cfp.plan import make_plan, shardings
from cfp import dims as dimrules
from cfp.models import adam_init
from helpers import assert_users_loop
from cfp.collectives import collectives
from cfp.mesh import make_mesh
from cfp.tracing import trace_step
from cfp.workloads import WorkloadSpec

MODELS = [("users_models:flax_dropout", "adam"), ("users_models:equinox_attention", "adam"),
          ("users_models:optax_attention", "adam"), ("users_models:optax_attention", "adafactor")]


# One here (Optax's factored Adafactor state, the case most unlike the parameters); the other
# seven run with the slow tests (bash scripts/slow_tests.sh).
FAST = [("users_models:optax_attention", "adafactor", (8,))]
CASES = [pytest.param(model, optimizer, mesh_shape,
                      marks=[] if (model, optimizer, mesh_shape) in FAST else [pytest.mark.slow])
         for model, optimizer in MODELS for mesh_shape in [(8,), (2, 4)]]


@pytest.mark.parametrize("model,optimizer,mesh_shape", CASES)
def test_the_plan_in_the_users_own_jit(model, optimizer, mesh_shape, monkeypatch):
    import optax
    over = (("optimizer", optimizer),) if model.endswith("optax_attention") else ()
    spec = WorkloadSpec(model, None, None, "float32", over).resolved()
    tx = (optax.adafactor(1e-3, min_dim_size_to_factor=16) if optimizer == "adafactor"
          else optax.adam(1e-3))
    if spec.build().opt_update is None:  # trained with Optax by the user; so analysed
        base = spec.build

        def with_optax():
            return dataclasses.replace(base(), opt_init=tx.init,
                                       opt_update=users_models.optax_update(tx))
        monkeypatch.setattr(WorkloadSpec, "build", lambda self: with_optax())
    a = run_analysis(spec, mesh_shape)
    w = spec.build()
    strategies = [len(b.strategies) - 1 for b in a.blocks.blocks]  # the most split
    plan = make_plan(a, strategies)
    assert len(plan["opt_state"]) > len(plan["params"])  # every optimizer-state leaf
    assert any(any(e is not None for e in s) for s in plan["params"].values())
    params, batch = example_inputs(w)
    opt_state = jax.jit(w.opt_init)(params)
    train_step = users_models.optax_train_step(w.loss_fn, tx)
    mesh = make_mesh(mesh_shape)
    new_params = assert_users_loop(train_step, plan, mesh, params, opt_state, batch)
    split = [leaf for leaf in jax.tree_util.tree_leaves(new_params)
             if any(e is not None for e in leaf.sharding.spec)]
    assert split  # the plan splits parameters, and the program keeps them split
    # the same program cfp measured: equal collectives
    theirs = plan_jit(train_step, plan, mesh, params, opt_state, batch).lower(
        params, opt_state, batch).compile().as_text()
    ours = PlannedStep(trace_step(w), a, strategies, mesh)
    ours.compile()
    count = lambda text: sorted((c.kind, c.bytes) for c in collectives(text, mesh_shape))  # noqa
    assert count(theirs) == count(ours.compiled.as_text())


def test_a_plan_is_a_fixed_point_where_a_block_splits_what_enters_replicated():
    """The case that broke a user's loop at its second step: a parameter whose first reader
    takes it replicated while the block computing its update makes it split (llama's norm
    weights on 2x4, under the most split strategies). The plan returns it replicated, as it
    came in, and the loop runs. Control: the layout its producer makes differs, so a plan
    that returned it so could not be fed back."""
    from cfp.execute import plan_specs
    spec = WorkloadSpec("llama", "tiny", None, "float32", (("num_layers", 2),)).resolved()
    a = run_analysis(spec, (2, 4))
    strategies = [len(b.strategies) - 1 for b in a.blocks.blocks]
    g = a.graph
    ins, outs, _ = plan_specs(a, strategies, ("m0", "m1"))
    member = {m.op: m for b in a.blocks.blocks for m in b.members}
    made = {}
    for b in a.blocks.blocks:
        st = b.strategies[strategies[b.index]]
        for m in b.members:
            for v, lab in zip(g.ops[m.op].outputs, m.outs):
                made[v] = dimrules.spec_axes(lab, st.axes, ("m0", "m1"))
    pairs = g.state_pairs()
    assert all(outs[new] == ins[v] for v, new in pairs)
    broken = [(v, new) for v, new in pairs if new in made and made[new] != ins[v]
              and all(e is None for e in ins[v]) and g.values[v].producer is None]
    assert broken and member  # control: the producers' layouts alone would not loop
    w = spec.build()
    plan = make_plan(a, strategies)
    params, batch = example_inputs(w)
    opt_state = jax.jit(w.opt_init or adam_init)(params)
    assert_users_loop(w.train_step(), plan, make_mesh((2, 4)), params, opt_state, batch)


def test_a_plan_for_another_tree_or_step_is_refused():
    """Negative controls: the params wrapped as Flax wraps them, a renamed leaf, a plan from
    another model, and another step under plan.jit."""
    spec = WorkloadSpec("users_models:optax_attention", None, None, "float32", ()).resolved()
    w = spec.build()
    a = run_analysis(spec, (8,))
    plan = make_plan(a, [0] * len(a.blocks.blocks))
    params, batch = example_inputs(w)
    mesh = make_mesh((8,))
    shardings(params, plan, mesh)  # the right tree
    with pytest.raises(CfpError, match="no entry for \\['params'\\]"):
        shardings({"params": params}, plan, mesh)
    renamed = dict(params, embedding=params["embed"])
    del renamed["embed"]
    with pytest.raises(CfpError, match="embedding"):
        shardings(renamed, plan, mesh)
    split = next(k for k, v in plan["params"].items() if v)  # an entry with dims
    with pytest.raises(CfpError, match="dims, the leaf has 0"):  # a Python scalar there
        shardings(jax.tree_util.tree_map_with_path(
            lambda p, x: 0 if jax.tree_util.keystr(p) == split else x, params), plan, mesh)
    other = make_plan(run_analysis(WorkloadSpec("mlp").resolved(), (8,)), [0] * 4)
    with pytest.raises(CfpError):
        shardings(params, other, mesh)
    import optax
    tx = optax.adam(1e-3)
    doubled = users_models.optax_train_step(lambda p, b: 2 * w.loss_fn(p, b), tx)
    with pytest.raises(CfpError, match="not the step the plan was made for"):
        plan_jit(doubled, plan, mesh, params, tx.init(params), batch)


def test_a_forward_plan_in_the_users_own_jit():
    """A plan of the forward step (``--step forward``) used for evaluation in the user's own
    jit: over several batches its loss matches one device's, the parameters it splits stay
    split and are not donated; a training step's arguments are refused."""
    from cfp.plan import step_shardings
    spec = WorkloadSpec("gpt", "tiny", 8, overrides=(("num_layers", 2),), step="forward")
    a = run_analysis(spec, (2, 4))
    w = spec.build()
    strategies = [len(b.strategies) - 1 for b in a.blocks.blocks]  # the most split
    plan = make_plan(a, strategies)
    assert plan["step"]["kind"] == "forward" and "opt_state" not in plan
    assert any(any(e is not None for e in s) for s in plan["params"].values())
    params, _ = example_inputs(w)
    batches = [jax.jit(w.make_batch)(jax.random.key(k)) for k in (1, 2, 3)]
    mesh = make_mesh((2, 4))

    def evaluate(params, batch):  # the user's own inference step
        return w.loss_fn(params, batch)

    want = [jax.jit(evaluate)(params, b) for b in batches]  # one device
    in_sh, out_sh = step_shardings(plan, mesh, params, batches[0])
    assert Plan(plan).shardings(params, batches[0]) == (in_sh, out_sh)  # as autoshard hands it
    assert step_shardings(Plan(plan), mesh, params, batches[0]) == (in_sh, out_sh)
    for step in (plan_jit(evaluate, plan, mesh, params, batches[0]),
                 Plan(plan).jit(evaluate, params, batches[0]),
                 jax.jit(evaluate, in_shardings=in_sh, out_shardings=out_sh)):
        placed = jax.device_put(params, in_sh[0])
        got = [step(placed, jax.device_put(b, in_sh[1])) for b in batches]
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5)
        assert not any(x.is_deleted() for x in jax.tree_util.tree_leaves(placed))
        assert any(any(e is not None for e in x.sharding.spec)
                   for x in jax.tree_util.tree_leaves(placed))
    loss_err, grad_excess = check_numerics(w, a, strategies, mesh)  # the search pass's check
    assert loss_err < 1e-5 and grad_excess == 0
    # controls: the comparison tells other parameters apart; a training step's arguments
    # (with an optimizer state) are refused by a forward plan
    other = jax.tree_util.tree_map(lambda x: x * 1.01, params)
    assert not np.allclose(np.asarray(jax.jit(evaluate)(other, batches[0])), np.asarray(want[0]),
                           rtol=1e-5)
    with pytest.raises(CfpError, match="forward plan has no opt_state"):
        step_shardings(plan, mesh, params, jax.jit(adam_init)(params), batches[0])
    with pytest.raises(CfpError, match="forward plan has no opt_state"):
        Plan(plan).jit(evaluate, params, jax.jit(adam_init)(params), batches[0])


@pytest.mark.parametrize("explicit", [pytest.param(False, marks=pytest.mark.slow), True])
def test_plan_jit_takes_state_wherever_it_lives(explicit):
    """``plan.jit`` built from, and fed, state already placed in the plan's shardings (a
    restored sharded checkpoint), or placed in other shardings (copied into the plan's once),
    runs three donated steps that match one device; on the user's mesh of Auto or Explicit
    axes. Control: the plain jit of the same step refuses state placed otherwise."""
    from jax.sharding import NamedSharding, PartitionSpec
    from cfp.plan import DONATE_ARGNUMS, step_shardings
    from helpers import assert_loop_matches, run_loop
    spec = WorkloadSpec("users_models:optax_attention", None, None, "float32", ()).resolved()
    w = spec.build()
    a = run_analysis(spec, (8,))
    plan = make_plan(a, [len(b.strategies) - 1 for b in a.blocks.blocks])
    params, batch = example_inputs(w)
    opt_state = jax.jit(w.opt_init or adam_init)(params)
    train_step = w.train_step()
    ref = run_loop(jax.jit(train_step), params, opt_state, batch)
    mesh = (jax.make_mesh((8,), ("m0",), axis_types=(jax.sharding.AxisType.Explicit,))
            if explicit else make_mesh((8,)))
    in_sh, out_sh = step_shardings(plan, mesh, params, opt_state, batch)
    host = jax.tree_util.tree_map(np.asarray, (params, opt_state, batch))
    placed = jax.device_put(host, in_sh)
    assert any(any(e is not None for e in x.sharding.spec)
               for x in jax.tree_util.tree_leaves(placed[0]))  # the plan splits some
    step = plan_jit(train_step, plan, mesh, *placed)
    got = run_loop(step, *placed)
    assert_loop_matches(got, ref)
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(placed[0]))  # donated
    replicated = NamedSharding(mesh, PartitionSpec())
    other = jax.device_put(host, jax.tree_util.tree_map(lambda _: replicated, host))
    got = run_loop(step, *other)
    assert_loop_matches(got, ref)
    assert all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(
        jax.tree_util.tree_leaves(got[1:]), jax.tree_util.tree_leaves(in_sh[:2])))
    plain = jax.jit(train_step, in_shardings=in_sh, out_shardings=out_sh,
                    donate_argnums=DONATE_ARGNUMS)
    with pytest.raises(ValueError, match="does not match the sharding"):
        plain(*jax.device_put(host, jax.tree_util.tree_map(lambda _: replicated, host)))


def test_a_module_whole_is_refused_naming_its_fields_that_are_no_arrays():
    """The plan names a module's arrays alone (cfp plans them, the rest set aside): the whole
    module, with a field that is no array (``eqx.nn.Dropout``'s rate), is refused in one
    line that says to pass the arrays; they are taken. Control: a tree of other arrays still
    reads as a plan for another model."""
    import equinox as eqx
    import jax.numpy as jnp

    class Net(eqx.Module):
        w: jax.Array
        rate: float

    plan = {"format": "cfp-plan", "version": 3, "mesh": {"shape": [1], "axes": ["m0"]},
            "params": {".w": ["m0", None]}}
    mesh = jax.sharding.Mesh(jax.devices()[:1], ("m0",))
    net = Net(jnp.ones((2, 2)), 0.1)
    with pytest.raises(CfpError, match=r"are arrays alone, and \.rate is not: pass the arrays"):
        shardings(net, plan, mesh)
    arrays, _ = eqx.partition(net, eqx.is_array)
    assert tuple(shardings(arrays, plan, mesh).w.spec) == ("m0", None)
    with pytest.raises(CfpError, match="a plan for another model"):
        shardings({"v": jnp.ones((2, 2))}, plan, mesh)
