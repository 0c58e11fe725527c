"""The training steps people copy from JAX LLM codebases, on cfp's GPT and LLaMA and on a
Flax linen transformer: ``recipe_workload(model, recipe, num_layers)``.

Recipes:
- ``adam``: Optax's Adam, the textbook step;
- ``clip``: ``clip_by_global_norm(1.0)`` then AdamW with a weight-decay mask and a warmup-cosine
  schedule (MaxText's, Levanter's and EasyLM's default);
- ``hand_clip``: the same clip written by hand in a plain ``train_step(params, opt_state,
  batch)`` (a sum of squares over the gradient tree);
- ``multisteps``: ``optax.MultiSteps(adamw, every_k_schedule=2)``;
- ``bf16_cast``: float32 params cast to bfloat16 in the loss (compute in bfloat16);
- ``adafactor``, ``lion``: Optax's;
- ``clip_metrics``: ``clip`` as a plain ``train_step`` returning a dict of metrics (the loss,
  the gradient norm, the learning rate).

``flax_bf16`` is a Flax linen transformer with ``dtype=bfloat16`` and ``param_dtype=float32``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from cfp.models import get_workload, user_workload

RECIPES = ("adam", "clip", "hand_clip", "multisteps", "bf16_cast", "adafactor", "lion",
           "clip_metrics")
VOCAB = 64


def adamw():
    """AdamW with a weight-decay mask (matrices only) and a warmup-cosine schedule."""
    import optax
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-3, 10, 100)
    mask = lambda params: jax.tree.map(lambda x: x.ndim > 1, params)  # noqa: E731
    return optax.adamw(schedule, weight_decay=0.1, mask=mask)


def clipped_adamw(max_norm: float = 1.0):
    import optax
    return optax.chain(optax.clip_by_global_norm(max_norm), adamw())


def optimizer(recipe: str):
    import optax
    return {"adam": lambda: optax.adam(1e-3),
            "bf16_cast": lambda: optax.adam(1e-3),
            "clip": clipped_adamw,
            "clip_metrics": clipped_adamw,
            "hand_clip": adamw,
            "multisteps": lambda: optax.MultiSteps(optax.adamw(1e-3), every_k_schedule=2),
            "adafactor": lambda: optax.adafactor(1e-3, min_dim_size_to_factor=16),
            "lion": lambda: optax.lion(1e-4)}[recipe]()


def parts(model: str, num_layers: int, batch_size: int | None = None,
          seq_len: int | None = None, hidden_size: int | None = None,
          num_heads: int | None = None):
    """(loss_fn, init_params, make_batch) of ``model``: cfp's ``gpt`` or ``llama`` tiny
    preset, or the Flax linen ``flax`` (float32) or ``flax_bf16`` (bfloat16 compute), with
    the sizes given in place of the preset's."""
    if model in ("gpt", "llama"):
        w = get_workload(model, "tiny", num_layers=num_layers, batch_size=batch_size,
                         seq_len=seq_len, hidden_size=hidden_size, num_heads=num_heads)
        return w.loss_fn, w.init_params, w.make_batch
    batch_size, seq_len = batch_size or 8, seq_len or 16
    net = flax_model(hidden_size or 32, num_heads or 4, num_layers,
                     jnp.bfloat16 if model == "flax_bf16" else jnp.float32)

    def init(key):
        return net.init(key, jnp.zeros((batch_size, seq_len), jnp.int32))

    def batch(key):
        toks = jax.random.randint(key, (batch_size, seq_len + 1), 0, VOCAB)
        return {"x": toks[:, :-1], "y": toks[:, 1:]}

    def loss(params, b):
        logp = jax.nn.log_softmax(net.apply(params, b["x"]).astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(b["y"], VOCAB), axis=-1))

    return loss, init, batch


def recipe_workload(model: str, recipe: str, num_layers: int = 2, **sizes):
    """The ``cfp.models.user_workload`` of ``model`` (``parts``' sizes) trained by
    ``recipe``."""
    loss_fn, init, batch = parts(model, num_layers, **sizes)
    name = f"{model}_{recipe}"
    if recipe == "bf16_cast":
        base = loss_fn

        def loss_fn(params, b):  # noqa: F811 - the cast is the recipe
            return base(jax.tree.map(lambda p: p.astype(jnp.bfloat16), params), b)
    if recipe in ("hand_clip", "clip_metrics"):
        tx = optimizer(recipe)
        return user_workload(train_step=plain_step(loss_fn, tx, recipe == "hand_clip"),
                             init_state=lambda key: _state(init(key), tx),
                             make_batch=batch, name=name)
    return user_workload(loss_fn, init, batch, optimizer=optimizer(recipe), name=name)


def _state(params, tx):
    return params, tx.init(params)


def plain_step(loss_fn, tx, clip_by_hand: bool):
    """``train_step(params, opt_state, batch) -> (params, opt_state, metrics)`` as plain-JAX
    code writes it, with the global-norm clip by hand (``clip_by_hand``) or in ``tx``."""
    import optax

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
        if clip_by_hand:
            scale = jnp.minimum(1.0, 1.0 / (norm + 1e-6))
            grads = jax.tree.map(lambda g: g * scale, grads)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state,
                {"loss": loss, "grad_norm": norm})
    return train_step


def flax_model(hidden: int, num_heads: int, num_layers: int, dtype):
    """A Flax linen pre-norm transformer computing in ``dtype`` over float32 parameters."""
    import flax.linen as nn

    def dense(features):
        return nn.Dense(features, dtype=dtype, param_dtype=jnp.float32)

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h):
            b, s, _ = h.shape
            hd = hidden // num_heads
            qkv = dense(3 * hidden)(nn.LayerNorm(dtype=dtype)(h))
            q, k, v = (t.reshape(b, s, num_heads, hd) for t in jnp.split(qkv, 3, axis=-1))
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd).astype(dtype)
            w = nn.softmax(scores.astype(jnp.float32), axis=-1).astype(dtype)
            h = h + dense(hidden)(jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, s, hidden))
            return h + dense(hidden)(nn.gelu(dense(4 * hidden)(nn.LayerNorm(dtype=dtype)(h))))

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Embed(VOCAB, hidden, dtype=dtype, param_dtype=jnp.float32)(x)
            for _ in range(num_layers):
                h = Block()(h)
            return dense(VOCAB)(nn.LayerNorm(dtype=dtype)(h))

    return Model()


def workload(model: str = "gpt", recipe: str = "clip", num_layers: int = 2):
    """``recipe_workload``, as a factory that takes the model and recipe as overrides."""
    return recipe_workload(model, recipe, num_layers)


def _factory(model: str, recipe: str):
    def factory(num_layers: int = 2, batch_size: int | None = None, seq_len: int | None = None,
                hidden_size: int | None = None, num_heads: int | None = None):
        sizes = dict(batch_size=batch_size, seq_len=seq_len, hidden_size=hidden_size,
                     num_heads=num_heads)
        if recipe.startswith("accumulate"):
            return accumulating_state(model, num_layers, 2, recipe.endswith("in_loss"),
                                      **sizes)
        return recipe_workload(model, recipe, num_layers, **sizes)
    factory.__name__ = f"{model}_{recipe}"
    return factory


MODELS = ("gpt", "llama", "flax", "flax_bf16")
ALL = RECIPES + ("accumulate", "accumulate_in_loss")
# ``--model recipes:gpt_clip`` and so on, one factory per model and recipe (with
# ``cfp_test`` on the path), each taking ``num_layers``
for _model in MODELS:
    for _recipe in ALL:
        globals()[f"{_model}_{_recipe}"] = _factory(_model, _recipe)


def accumulating_state(model: str = "gpt", num_layers: int = 2, micro_batches: int = 2,
                       in_loss: bool = False, **sizes):
    """A Flax ``TrainState`` step that accumulates gradients over ``micro_batches`` with
    ``lax.scan``, in the step (forward and backward per micro-batch, as MaxText and
    Levanter do) or, with ``in_loss``, in the loss (the mean of the micro-batches' losses,
    differentiated once)."""
    from flax.training import train_state
    loss_fn, init, batch = parts(model, num_layers, **sizes)

    def split(b):
        return jax.tree.map(lambda x: x.reshape(micro_batches, -1, *x.shape[1:]), b)

    tx = clipped_adamw()

    def init_state(key):
        return train_state.TrainState.create(apply_fn=None, params=init(key), tx=tx)

    def train_step(state, b):
        if in_loss:
            def mean_loss(params):
                losses = jax.lax.scan(lambda c, mb: (c, loss_fn(params, mb)), None, split(b))[1]
                return jnp.mean(losses)
            loss, grads = jax.value_and_grad(mean_loss)(state.params)
        else:
            def one(carry, mb):
                loss, grads = jax.value_and_grad(loss_fn)(state.params, mb)
                return jax.tree.map(jnp.add, carry, (loss, grads)), None
            zeros = (jnp.zeros(()), jax.tree.map(jnp.zeros_like, state.params))
            loss, grads = jax.lax.scan(one, zeros, split(b))[0]
            loss, grads = jax.tree.map(lambda x: x / micro_batches, (loss, grads))
        return state.apply_gradients(grads=grads), {"loss": loss}

    return user_workload(train_step=train_step, init_state=init_state, make_batch=batch,
                         name=f"{model}_accumulate{'_in_loss' if in_loss else ''}")
