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
from cfp.workloads import WorkloadSpec, make_mesh, parse_mesh
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


@pytest.mark.parametrize("mesh", ["8", pytest.param("2x4", marks=pytest.mark.slow)])
def test_reshaped_heads_through_three_passes(tmp_path, capsys, mesh):
    """4 heads on 8 devices: every combination compiles to the layouts it names (the 2x4
    mesh, 120 combinations, takes about 5 minutes: pytest -m slow)."""
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
                      make_mesh(parse_mesh(mesh)), params, jax.jit(w.opt_init or adam_init)(params),
                      batch)


@pytest.mark.parametrize("model", ["zoo_extra:reshape_attention",
                                   "users_models:flax_dropout_rng"])
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


@pytest.mark.parametrize("mesh", ["4", pytest.param("2x4", marks=pytest.mark.slow)])
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
    assert_users_loop(w.train_step(), plan, make_mesh(parse_mesh(mesh)), params,
                      jax.jit(adam_init)(params), batch)
