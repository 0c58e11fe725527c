"""A Hugging Face ``FlaxLlamaForCausalLM`` (transformers 4.57) as its users train it: bfloat16
compute over float32 parameters, 2 layers, hidden 128, 8 heads over 2 key-value heads, a
clipped AdamW step returning a dict of metrics, handed to ``cfp.autoshard`` with its arrays.
Its float32 gradients are summed from bfloat16 activations, so the numerical check holds
them to bfloat16's tolerance (``cfp.execute.lowest_precision``): the step plans on meshes 8
and 2x4 and runs three steps in the user's loop. Slow: each mesh profiles about 160
combinations."""
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import cfp

transformers = pytest.importorskip("transformers")


def _llama():
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.FlaxLlamaForCausalLM(config, dtype=jnp.bfloat16, seed=0)
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))

    def loss_fn(params, batch):
        x = batch["x"]
        positions = jnp.broadcast_to(jnp.arange(x.shape[1]), x.shape)
        logits = model.module.apply({"params": params}, x, jnp.ones_like(x),
                                    positions).logits.astype(jnp.float32)
        logp = jax.nn.log_softmax(logits)
        return -jnp.mean(jnp.take_along_axis(logp, batch["y"][..., None], -1))

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state,
                {"loss": loss, "grad_norm": optax.tree.norm(grads)})

    ids = jax.random.randint(jax.random.key(1), (8, 33), 0, 256)
    params = model.params
    return train_step, (params, tx.init(params), {"x": ids[:, :-1], "y": ids[:, 1:]})


@pytest.mark.slow
@pytest.mark.parametrize("mesh, recompute", [("8", "none"), ("2x4", "none"),
                                             ("2x4", "nothing_saveable")])
def test_a_bfloat16_flax_llama_plans_and_runs_in_the_users_loop(tmp_path, mesh, recompute):
    """Planned without a false alarm from the check against one device; three steps of
    ``plan.jit``, donated and fed back, within bfloat16's reach of one device's loop (2e-3
    relative), recomputing every layer too where ``recompute`` says (and saying so).
    Control: the losses move from step to step."""
    train_step, args = _llama()
    plan = cfp.autoshard(train_step, *args, mesh=mesh, memory_budget_gb=2,
                         workdir=tmp_path / "wd", validate_top=1, validate_baselines=False,
                         recompute=recompute)
    assert (f"recompute {recompute}" in plan.describe()) == (recompute != "none")
    host = jax.tree_util.tree_map(np.asarray, args)

    def losses(step):
        params, opt_state, out = *jax.tree_util.tree_map(np.asarray, host[:2]), []
        for _ in range(3):
            params, opt_state, metrics = step(params, opt_state, host[2])
            out.append(float(metrics["loss"]))
        return out

    want = losses(jax.jit(train_step))
    got = losses(plan.jit(train_step, *host))
    np.testing.assert_allclose(got, want, rtol=2e-3)
    assert abs(got[2] - got[0]) > 1e-2 * abs(got[0])
