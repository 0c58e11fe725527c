"""Tests for the model zoo (cfp.models): every tiny preset trains; big presets trace abstractly."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cfp.errors import CfpError
from cfp.models import (
    DEFAULT_PRESET,
    MODEL_NAMES,
    PRESETS,
    AdamState,
    adam_init,
    adam_update,
    default_batch_size,
    get_workload,
    param_count,
)
from cfp.models.moe import top2_gating


def _shapes(tree):
    """Tree of (shape, dtype) pairs for structural comparison."""
    return jax.tree.map(lambda x: (tuple(x.shape), jnp.dtype(x.dtype)), tree)


def _here(*models):
    """MODEL_NAMES, those not in ``models`` marked slow (run by scripts/slow_tests.sh): the
    suite keeps the models that exercise the most, to stay under 10 minutes."""
    return [m if m in models else pytest.param(m, marks=pytest.mark.slow) for m in MODEL_NAMES]


@pytest.mark.parametrize("model", _here("gpt"))
def test_tiny_trains(model):
    """The step runs, the loss is a finite float32 scalar and decreases over 5 Adam steps."""
    w = get_workload(model)
    assert w.config_name == DEFAULT_PRESET and w.batch_size == 8 and w.dtype == "float32"
    params = w.init_params(jax.random.key(0))
    batch = w.make_batch(jax.random.key(1))
    assert _shapes(params) == _shapes(w.abstract_params())
    assert _shapes(batch) == _shapes(w.abstract_batch())
    state = adam_init(params)
    assert _shapes(state) == _shapes(w.abstract_opt_state())
    step = jax.jit(w.train_step(lr=1e-2))
    losses = []
    for _ in range(6):
        params, state, loss = step(params, state, batch)
        assert loss.shape == () and loss.dtype == jnp.float32
        losses.append(float(loss))
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0] - 0.05, losses
    assert int(state.count) == 6
    assert w.flops_per_step() > 0


@pytest.mark.parametrize("model", MODEL_NAMES)
def test_grads_match_params(model):
    """grad_fn returns a scalar loss and grads with the params' structure, shapes and dtypes."""
    w = get_workload(model)
    loss, grads = jax.eval_shape(w.grad_fn(), w.abstract_params(), w.abstract_batch())
    assert loss.shape == () and loss.dtype == jnp.float32
    assert _shapes(grads) == _shapes(w.abstract_params())


@pytest.mark.parametrize("model", _here("mlp", "gpt"))
def test_bfloat16_runs(model):
    """The bfloat16 variant keeps params in bf16 and returns a finite float32 loss."""
    w = get_workload(model, dtype="bf16")
    assert w.dtype == "bfloat16"
    params = w.init_params(jax.random.key(0))
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    new_params, _, loss = jax.jit(w.train_step())(params, adam_init(params), w.make_batch(jax.random.key(1)))
    assert loss.dtype == jnp.float32 and math.isfinite(float(loss))
    assert _shapes(new_params) == _shapes(params)


def test_llama_13b_abstract():
    """13B parameters are counted and the full step traced without allocating anything."""
    w = get_workload("llama", "13b")
    abstract = w.abstract_params()
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(abstract))
    assert abs(param_count(abstract) - 13.0e9) / 13.0e9 < 0.03
    assert abstract["layers"][0]["attn"]["wq"].shape == (5120, 40, 128)
    jaxpr = jax.make_jaxpr(w.train_step())(abstract, w.abstract_opt_state(), w.abstract_batch())
    assert len(jaxpr.out_avals) == 3 * len(jax.tree.leaves(abstract)) + 2  # params, count+mu+nu, loss


@pytest.mark.parametrize("model,preset,expected,tol", [
    ("gpt", "1.3b", 1.3e9, 0.05), ("gpt", "125m", 125e6, 0.05), ("llama", "7b", 6.74e9, 0.02),
    ("bert", "base", 110e6, 0.05), ("bert", "large", 335e6, 0.05), ("moe", "380m", 380e6, 0.05),
    ("moe", "7.1b", 7.1e9, 0.05),
])
def test_reference_param_counts(model, preset, expected, tol):
    """Named presets have about the parameter count their name says."""
    count = param_count(get_workload(model, preset).abstract_params())
    assert abs(count - expected) / expected < tol, count


def test_every_preset_builds():
    """Every preset yields a workload with abstract params and batch."""
    for model in MODEL_NAMES:
        for preset in PRESETS[model]:
            w = get_workload(model, preset)
            assert w.batch_size == default_batch_size(model, preset) and w.batch_size % 8 == 0
            assert param_count(w.abstract_params()) > 0 and w.abstract_batch()


def test_overrides():
    """Overrides change the config; None values are ignored."""
    w = get_workload("gpt", "1.3b", num_layers=2, seq_len=None, batch_size=4)
    assert w.config.num_layers == 2 and w.config.seq_len == 1024 and w.batch_size == 4
    assert len(w.abstract_params()["layers"]) == 2
    w = get_workload("moe", num_experts=8, expert_group_size=16)
    assert w.abstract_params()["layers"][1]["moe"]["wi"].shape[0] == 8


@pytest.mark.parametrize("kwargs", [
    dict(model="resnet"),
    dict(model="gpt", config="175b"),
    dict(model="gpt", num_heads=5),
    dict(model="llama", hidden_size=60, num_heads=4),  # odd head_dim 15: no rotary
    dict(model="moe", batch_size=3, expert_group_size=64),
    dict(model="moe", num_experts=1),
    dict(model="gpt", num_experts=4),
    dict(model="gpt", foo=1),
    dict(model="gpt", dtype="float16"),
    dict(model="gpt", batch_size=0),
    dict(model="bert", num_layers=-1),
    dict(model="mlp", seq_len=8),
])
def test_bad_input_raises(kwargs):
    """Bad input is a one-line CfpError."""
    with pytest.raises(CfpError) as info:
        get_workload(**kwargs)
    assert "\n" not in str(info.value)


def test_error_messages_list_choices():
    """Unknown model / preset errors list the valid names."""
    with pytest.raises(CfpError, match="llama"):
        get_workload("resnet")
    with pytest.raises(CfpError, match="13b"):
        get_workload("llama", "70b")
    with pytest.raises(CfpError, match="expert_group_size"):
        get_workload("moe", batch_size=1, expert_group_size=64)


def test_batches_are_valid():
    """Token ids are in range; BERT masks are well-formed."""
    for model in ("gpt", "llama", "moe"):
        w = get_workload(model)
        batch = w.make_batch(jax.random.key(3))
        for ids in (batch["inputs"], batch["targets"]):
            assert ids.dtype == jnp.int32 and ids.shape == (8, w.config.seq_len)
            assert 0 <= int(ids.min()) and int(ids.max()) < w.config.vocab_size
        np.testing.assert_array_equal(batch["inputs"][:, 1:], batch["targets"][:, :-1])
    w = get_workload("bert")
    b = jax.tree.map(np.asarray, w.make_batch(jax.random.key(3)))
    assert set(b) == {"input_ids", "token_type_ids", "attention_mask", "labels", "mlm_mask"}
    assert (b["attention_mask"][:, 0] == 1).all()
    assert (np.diff(b["attention_mask"], axis=1) <= 0).all()  # a prefix of ones
    assert (b["mlm_mask"].sum(1) >= 1).all() and (b["mlm_mask"] <= b["attention_mask"]).all()
    assert b["input_ids"].max() < w.config.vocab_size and b["labels"].max() < w.config.vocab_size


def test_top2_gating_is_well_formed():
    """Each token goes to <= 2 experts, each expert slot holds <= 1 token, combine weights sum to <= 1."""
    gates = jax.nn.softmax(jax.random.normal(jax.random.key(0), (3, 16, 4)), axis=-1)
    combine, dispatch, aux = top2_gating(gates, capacity=8)
    combine, dispatch = np.asarray(combine), np.asarray(dispatch)
    assert combine.shape == dispatch.shape == (3, 16, 4, 8)
    assert set(np.unique(dispatch)) <= {0.0, 1.0}
    assert (dispatch.sum((2, 3)) <= 2).all() and (dispatch.sum(1) <= 1).all()
    assert (combine.sum((2, 3)) <= 1 + 1e-5).all() and ((combine > 0) <= (dispatch > 0)).all()
    assert math.isfinite(float(aux)) and float(aux) > 0
    _, tight, _ = top2_gating(gates, capacity=1)
    assert (np.asarray(tight).sum(1) <= 1).all()


def test_adam_matches_reference():
    """adam_update matches a NumPy Adam step; state is an int32 count plus moments."""
    params = {"a": jnp.array([1.0, -2.0]), "b": [jnp.array(3.0)]}
    grads = {"a": jnp.array([0.5, 0.1]), "b": [jnp.array(-1.0)]}
    state = adam_init(params)
    assert isinstance(state, AdamState) and state.count.dtype == jnp.int32
    new, state = adam_update(grads, state, params, lr=0.1)
    m = 0.1 * np.array([0.5, 0.1])
    v = 0.001 * np.array([0.25, 0.01])
    expected = np.array([1.0, -2.0]) - 0.1 * (m / 0.1) / (np.sqrt(v / 0.001) + 1e-8)
    np.testing.assert_allclose(np.asarray(new["a"]), expected, rtol=1e-5)
    assert int(state.count) == 1 and jax.tree.structure(new) == jax.tree.structure(params)
