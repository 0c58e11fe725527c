"""Transformers written outside cfp's zoo (``users_models``, ``zoo_extra``): heads split by
reshape, keys in the batch or as the loss's third argument, Flax, Equinox and Optax."""
import collections

import jax
import pytest

import users_models
import zoo_extra
from cfp.cli import main
from cfp.execute import check_numerics, example_inputs
from cfp.models import adam_init
from cfp.passes.analysis import run_analysis
from cfp.plan import load_plan
from cfp.mesh import make_mesh, parse_mesh
from cfp.workloads import WorkloadSpec
from helpers import assert_users_loop

RESHAPED = ["users_models:equinox_attention", "zoo_extra:reshape_attention",
            "users_models:flax_dropout"]


def _analysis(model, mesh_shape, **over):
    return run_analysis(WorkloadSpec(model, None, None, "float32",
                                     tuple(over.items())).resolved(), mesh_shape)


def _activation_contractions(a):
    """Blocks seeded by a contraction of two computed tensors (attention scores, context)."""
    g = a.graph
    weights = set(g.inputs)

    def computed(v):
        while v not in weights and g.values[v].producer is not None:
            op = g.ops[g.values[v].producer]
            if op.primitive not in ("reshape", "transpose", "convert_element_type", "copy"):
                return True
            v = op.inputs[0]
        return False
    return [b for b in a.blocks.blocks if all(computed(v) for v in g.ops[b.seed].inputs)]


@pytest.mark.parametrize("model", RESHAPED)
def test_reshaped_heads_make_repeated_layers(model):
    """Heads split by reshape (4 heads, sequence 16, head size 8): each attention block holds
    its seed and both backward contractions, and layers repeat at every depth."""
    types = {}
    for layers in (2, 4, 8):
        a = _analysis(model, (4,), num_layers=layers)
        attention = _activation_contractions(a)
        assert len(attention) == 2 * layers
        assert all(len(b.contractions) == 3 for b in attention)
        assert len(a.blocks.unclaimed) == 0 or all(
            "key" in a.graph.values[a.graph.ops[i].outputs[0]].dtype for i in a.blocks.unclaimed)
        types[layers] = a.segments.num_types
        if layers == 4:
            counts = collections.Counter(s.type for s in a.segments.instances)
            assert max(counts.values()) >= 4
    assert types[2] == types[4] == types[8]


def test_a_layout_the_reshape_makes_indivisible_is_pruned():
    """4 heads on 8 devices: no strategy splits the heads dim 8 ways, for any member."""
    from cfp.strategies import enumerate_strategies
    a = _analysis("zoo_extra:reshape_attention", (8,))
    g = a.graph

    def indivisible(b, s):
        return [m.op for m in b.members for v, lab in
                list(zip(g.ops[m.op].inputs, m.ins)) + list(zip(g.ops[m.op].outputs, m.outs))
                for d, label in zip(g.values[v].shape, lab)
                if label is not None and label in s.axes and d % 8]
    assert all(not indivisible(b, s) for b in a.blocks.blocks for s in b.strategies)
    # negative control: among all strategies of the seeds, some split the heads dim 8 ways
    assert any(indivisible(b, s) for b in a.blocks.blocks
               for s in enumerate_strategies(b.loop_dims, (8,))[0])


@pytest.mark.slow
@pytest.mark.parametrize("mesh", ["8", "2x4"])
def test_reshaped_heads_through_three_passes(tmp_path, capsys, mesh):
    """4 heads on 8 devices: every combination compiles to the layouts it names (25 s on mesh
    8; the 2x4 mesh, 120 combinations, about 5 minutes: pytest -m slow). The quick suite
    runs reshaped heads through split-state plans in a loop
    (``test_users_models_with_split_state_in_a_loop``)."""
    args = ["--model", "zoo_extra:reshape_attention", "--mesh", mesh, "--workdir", str(tmp_path),
            "--max-combinations", "8", "--memory-budget", "1", "--validate-top", "1",
            "--no-validate-baselines", "--iters", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "gradients match" in out
    csv = (next(tmp_path.rglob("profile.csv"))).read_text()
    assert "compile_error" not in csv and "mismatch" not in csv
    w = zoo_extra.reshape_attention()
    params, batch = example_inputs(w)
    assert_users_loop(w.train_step(), load_plan(tmp_path / "plan.json"),
                      make_mesh(*parse_mesh(mesh)), params, jax.jit(w.opt_init or adam_init)(params),
                      batch)


# Dropout keys as step data are checked in the suite by test_dropout_keys_are_step_data.
@pytest.mark.parametrize("model", ["zoo_extra:reshape_attention",
                                   pytest.param("users_models:flax_dropout_rng",
                                                marks=pytest.mark.slow),
                                   pytest.param("zoo_extra:rotary_cosines",
                                                marks=pytest.mark.slow)])
def test_users_models_sharded_step_matches_single_device_on_2x4(model):
    spec = WorkloadSpec(model, None, None, "float32", ()).resolved()
    a = run_analysis(spec, (2, 4))
    for plan in ([len(b.strategies) - 1 for b in a.blocks.blocks],):
        loss_err, grad_excess = check_numerics(spec.build(), a, plan, make_mesh((2, 4)))
        assert loss_err < 1e-5 and grad_excess == 0.0


@pytest.mark.parametrize("model", ["users_models:flax_dropout", "users_models:flax_dropout_rng",
                                   "users_models:flax_dropout_raw_key"])
def test_dropout_keys_are_step_data(model):
    """Typed keys and raw uint32 keys in the batch, or a key as the loss's third argument:
    dropout is active (another key, another loss) and the keys are never split."""
    w = WorkloadSpec(model, None, None, "float32", ()).resolved().build()
    params, batch = example_inputs(w)
    loss = jax.jit(w.loss_fn)(params, batch)
    other = jax.jit(w.loss_fn)(params, w.make_batch(jax.random.key(7)))
    assert float(loss) != float(other)
    a = _analysis(model, (4,))
    g = a.graph
    keys = {v for v in g.values if g.values[v].dtype.startswith("key<")}
    keys |= {v for v in g.inputs if g.values[v].dtype == "uint32"}  # a raw key
    assert keys
    for b in a.blocks.blocks:
        for m in b.members:
            op = g.ops[m.op]
            for v, lab in list(zip(op.inputs, m.ins)) + list(zip(op.outputs, m.outs)):
                if v in keys:
                    assert all(label is None for label in lab), (m.op, op.primitive)


# With the slow tests: each kind runs in a loop in the user's own jit among the fast ones.
STATE_STEPS = [pytest.param(m, marks=pytest.mark.slow)
               for m in ("users_models:flax_train_state", "users_models:nnx_optimizer")]


@pytest.mark.parametrize("model", STATE_STEPS)
def test_the_step_as_users_write_it_plans_and_matches_one_device(model):
    """A Flax TrainState step and an NNX (model, optimizer) step, through user_workload: the
    state's parameters are cfp's params, its other arrays (the step counter, Adam's moments)
    the optimizer state; under the most split plan, three steps in a loop, the state donated
    and fed back, match three on one device."""
    from cfp.execute import PlannedStep
    from cfp.tracing import trace_step
    from helpers import assert_loop_matches, planned_loop
    spec = WorkloadSpec(model).resolved()
    a = run_analysis(spec, (2, 4))
    w = spec.build()
    assert len(jax.tree_util.tree_leaves(w.abstract_opt_state())) > 2 * len(
        jax.tree_util.tree_leaves(w.abstract_params()))  # both moments and the counters
    strategies = [len(b.strategies) - 1 for b in a.blocks.blocks]  # the most split
    ps = PlannedStep(trace_step(w), a, strategies, make_mesh((2, 4)))
    ps.compile()
    assert ps.state_count == len(a.graph.inputs) - len(jax.tree_util.tree_leaves(
        w.abstract_batch()))  # the whole state is donated
    got, want = planned_loop(ps, w)
    assert_loop_matches(got, want)
    counters = [int(x) for x in jax.tree_util.tree_leaves(got[2]) if x.ndim == 0]
    assert 3 in counters  # the step counter went round the loop
    with pytest.raises(AssertionError):  # the control: a state off by one update
        assert_loop_matches((got[0], *jax.tree_util.tree_map(lambda x: x + 1e-3, got[1:2]),
                             got[2]), want)


def test_a_train_state_step_in_the_users_own_jit():
    """The plan of a TrainState step mapped back onto the user's TrainState
    (``state_shardings``): ``jax.jit(train_step, in_shardings=(state, batch))``, the state
    donated, runs three steps that match one device, the state coming out as it went in."""
    import numpy as np
    import users_models
    from cfp.api import Plan
    from cfp.models.state_step import state_shardings
    from cfp.plan import make_plan, shardings
    spec = WorkloadSpec("users_models:flax_train_state").resolved()
    a = run_analysis(spec, (2, 4))
    plan = make_plan(a, [len(b.strategies) - 1 for b in a.blocks.blocks])
    init_state, make_batch = users_models.train_state_parts()
    state, batch = jax.jit(init_state)(jax.random.key(0)), make_batch(jax.random.key(1))
    mesh = make_mesh((2, 4))
    state_sh, batch_sh = state_shardings(state, plan, mesh), shardings(batch, plan, mesh, "batch")
    assert state_shardings(state, Plan(plan), mesh) == state_sh  # the plan autoshard returns
    assert any(any(e is not None for e in s.spec) for s in jax.tree_util.tree_leaves(
        state_sh.params))

    def loop(step, state):
        losses = []
        for _ in range(3):
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        return losses, state

    want = loop(jax.jit(users_models.train_state_step), state)
    placed = jax.device_put(state, state_sh)
    got = loop(jax.jit(users_models.train_state_step, in_shardings=(state_sh, batch_sh),
                       out_shardings=(state_sh, None), donate_argnums=0), placed)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-4)
    for x, y in zip(jax.tree_util.tree_leaves(got[1]), jax.tree_util.tree_leaves(want[1])):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-4, atol=1e-4)
    assert int(got[1].step) == 3
    assert all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(
        jax.tree_util.tree_leaves(got[1]), jax.tree_util.tree_leaves(state_sh)))
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(placed.params))


def test_an_nnx_step_in_the_users_own_jit():
    """The plan of an NNX (model, optimizer) step in the user's own jit: the state split as
    ``nnx.split(..., nnx.Param, ...)`` splits it is the plan's (params, opt_state), so
    ``step_shardings`` and ``plan.jit`` take it; three steps, donated and fed back, match one
    device (``assert_users_loop``)."""
    import optax
    import users_models
    from flax import nnx
    from cfp.plan import make_plan
    spec = WorkloadSpec("users_models:nnx_optimizer").resolved()
    a = run_analysis(spec, (2, 4))
    plan = make_plan(a, [len(b.strategies) - 1 for b in a.blocks.blocks])
    model = users_models._nnx_model(32, 4, 2, nnx.Rngs(jax.random.key(0)))
    graphdef, params, rest = nnx.split(
        (model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)), nnx.Param, ...)
    batch = spec.build().make_batch(jax.random.key(1))

    def train_step(params, rest, batch):  # the user's: merge, step in place, split
        model, optimizer = nnx.merge(graphdef, params, rest)
        loss = users_models.nnx_step(model, optimizer, batch)
        _, params, rest = nnx.split((model, optimizer), nnx.Param, ...)
        return params, rest, loss

    new_params = assert_users_loop(train_step, plan, make_mesh((2, 4)), params, rest, batch)
    assert any(any(e is not None for e in x.sharding.spec)
               for x in jax.tree_util.tree_leaves(new_params))


def test_a_state_step_given_wrong_is_one_clear_error():
    """A state that is neither a TrainState-like record nor an NNX (model, optimizer), metrics
    without the loss, or loss_fn next to train_step: each a CfpError saying what to give."""
    import jax.numpy as jnp
    import users_models
    from cfp.errors import CfpError
    from cfp.models import user_workload
    from cfp.tracing import trace_step
    init_state, make_batch = users_models.train_state_parts()
    bad = user_workload(train_step=users_models.train_state_step,
                        init_state=lambda key: {"w": jnp.ones(2)}, make_batch=make_batch)
    with pytest.raises(CfpError, match="give a Flax TrainState"):
        bad.abstract_params()

    def metrics_without_loss(state, batch):
        new, metrics = users_models.train_state_step(state, batch)
        return new, {"ce": metrics["loss"]}

    with pytest.raises(CfpError, match="under 'loss'"):
        trace_step(user_workload(train_step=metrics_without_loss, init_state=init_state,
                                 make_batch=make_batch))
    with pytest.raises(CfpError, match="instead of loss_fn"):
        user_workload(lambda p, b: 0.0, train_step=users_models.train_state_step,
                      init_state=init_state, make_batch=make_batch)
    good = user_workload(train_step=users_models.train_state_step, init_state=init_state,
                         make_batch=make_batch)  # the control
    assert trace_step(good).graph().state_pairs()


# Flax linen runs in a loop in the suite: test_a_train_state_step_in_the_users_own_jit; the
# plain-JAX reshaped heads: test_plan_jit_takes_state_wherever_it_lives.
@pytest.mark.parametrize("model", ["users_models:equinox_attention",
                                   pytest.param("users_models:flax_dropout",
                                                marks=pytest.mark.slow),
                                   pytest.param("zoo_extra:reshape_attention",
                                                marks=pytest.mark.slow)])
def test_users_models_with_split_state_in_a_loop(model):
    """Flax, Equinox and plain-JAX models with reshaped heads under a plan that stores the
    state split: every window holding state on its fsdp layout (the parameters and optimizer
    state split over the axes its blocks leave replicated), the blocks on their first
    strategy. Three donated steps in a loop match one device, and the stored state is split
    (the control: under the plan layout the same leaves are whole)."""
    import math
    from cfp.execute import PlannedStep, Storage
    from cfp.windows import held_state, split_windows
    from helpers import assert_loop_matches, planned_loop
    from cfp.tracing import trace_step
    spec = WorkloadSpec(model, None, None, "float32", ()).resolved()
    a = run_analysis(spec, (8,))
    windows, _ = split_windows(a, 32)
    held = sorted(k for w in windows for k in held_state(a, w))
    assert held
    strategies = [0] * len(a.blocks.blocks)
    program, mesh = trace_step(spec.build()), make_mesh((8,))

    def stored_elements(storage):  # of the leaves the windows hold
        step = PlannedStep(program, a, strategies, mesh, storage)
        g = a.graph
        return step, sum(math.prod(step.in_shardings[k].shard_shape(
            g.values[g.inputs[k]].shape)) for k in held)

    split, split_n = stored_elements(Storage(leaves=tuple((k, "fsdp") for k in held)))
    _, plain_n = stored_elements(Storage())
    assert split_n < plain_n  # some leaves have no dim the mesh divides further
    split.compile()
    assert_loop_matches(*planned_loop(split, spec.build()))


# Both with the slow tests: the segments and their pricing are pinned in test_segments.py.
@pytest.mark.parametrize("mesh", [pytest.param("4", marks=pytest.mark.slow),
                                  pytest.param("2x4", marks=pytest.mark.slow)])
def test_shared_values_through_three_passes(tmp_path, capsys, mesh):
    """The encoder-decoder whose layers read shared values (``users_models.t5_shared``),
    one window per segment: its plan trains in the user's loop as on one device (the 2x4
    mesh times about 1,200 reshardings, some 10 minutes: pytest -m slow)."""
    args = ["--model", "users_models:t5_shared", "--mesh", mesh, "--workdir", str(tmp_path),
            "--whole-segments", "--max-combinations", "1", "--memory-budget", "1",
            "--validate-top", "1", "--no-validate-baselines", "--iters", "1"]
    assert main(args) == 0
    assert "gradients match" in capsys.readouterr().out
    plan = load_plan(tmp_path / "plan.json")
    w = users_models.t5_shared()
    params, batch = example_inputs(w)
    assert_users_loop(w.train_step(), plan, make_mesh(*parse_mesh(mesh)), params,
                      jax.jit(adam_init)(params), batch)
