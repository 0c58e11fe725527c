"""Transformers written the way users of Flax, Equinox and plain JAX write them, outside
cfp's zoo: heads split off by reshape, dropout driven by keys.

- ``flax_dropout``: a Flax linen pre-norm transformer with dropout; the dropout key travels in
  the batch (``batch["dropout"]``, a typed key).
- ``flax_dropout_rng``: the same model taking the key as the loss's third argument
  (``loss_fn(params, batch, rng)``), trained with Optax's AdamW.
- ``equinox_attention``: an Equinox transformer whose attention splits 4 heads by reshape.
- ``flax_train_state``: the Flax linen transformer in a ``TrainState``, stepped by
  ``train_step(state, batch) -> (state, metrics)``.
- ``nnx_optimizer``: an NNX transformer with ``nnx.Optimizer``, stepped in place by
  ``train_step(model, optimizer, batch) -> loss``.


- ``t5_shared``: a Flax encoder-decoder laid out as T5 is, whose layers read values no layer
  owns (each stack's position bias, made in its first layer; the encoder's output).
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from cfp.models import Workload

VOCAB = 64


def _ce(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(labels, logits.shape[-1]), axis=-1))


def _tokens(key, batch_size, seq_len):
    toks = jax.random.randint(key, (batch_size, seq_len + 1), 0, VOCAB)
    return toks[:, :-1], toks[:, 1:]


def flax_block(hidden, num_heads, rate):
    """The Flax pre-norm transformer layer ``Block()(h, train)`` (dropout off unless train)."""
    import flax.linen as nn

    class Block(nn.Module):
        @nn.compact
        def __call__(self, h, train):
            b, s, _ = h.shape
            hd = hidden // num_heads
            qkv = nn.Dense(3 * hidden, use_bias=False)(nn.LayerNorm()(h))
            q, k, v = (t.reshape(b, s, num_heads, hd) for t in jnp.split(qkv, 3, axis=-1))
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd)
            w = nn.Dropout(rate)(nn.softmax(scores, axis=-1), deterministic=not train)
            ctx = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, s, hidden)
            h = h + nn.Dropout(rate)(nn.Dense(hidden)(ctx), deterministic=not train)
            up = nn.gelu(nn.Dense(4 * hidden)(nn.LayerNorm()(h)))
            return h + nn.Dropout(rate)(nn.Dense(hidden)(up), deterministic=not train)

    return Block


def _flax_model(hidden, num_heads, num_layers, rate):
    import flax.linen as nn
    Block = flax_block(hidden, num_heads, rate)

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x, train=True):
            h = nn.Embed(VOCAB, hidden)(x)
            for _ in range(num_layers):
                h = Block()(h, train)
            return nn.Dense(VOCAB)(nn.LayerNorm()(h))

    return Model()


def flax_dropout(batch_size: int = 4, dtype: str = "float32", num_layers: int = 2,
                 seq_len: int = 16, hidden: int = 32, num_heads: int = 4, rate: float = 0.1,
                 **_) -> Workload:
    model = _flax_model(hidden, num_heads, num_layers, rate)

    def init(key):
        return model.init(key, jnp.zeros((batch_size, seq_len), jnp.int32), train=False)

    def batch(key):
        k1, k2 = jax.random.split(key)
        x, y = _tokens(k1, batch_size, seq_len)
        return {"x": x, "y": y, "dropout": k2}

    def loss(params, b):
        logits = model.apply(params, b["x"], rngs={"dropout": b["dropout"]})
        return _ce(logits, b["y"])

    return Workload("flax_dropout", "test", None, batch_size, dtype, init, batch, loss)


def flax_dropout_rng(batch_size: int = 4, dtype: str = "float32", **kw) -> Workload:
    import optax
    base = flax_dropout(batch_size, dtype, **kw)
    model = _flax_model(kw.get("hidden", 32), kw.get("num_heads", 4), kw.get("num_layers", 2),
                        kw.get("rate", 0.1))
    opt = optax.adamw(1e-3)

    def batch(key):
        b = base.make_batch(key)
        return {"x": b["x"], "y": b["y"]}

    def loss(params, b, rng):
        return _ce(model.apply(params, b["x"], rngs={"dropout": rng}), b["y"])

    def opt_update(grads, state, params):
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    return dataclasses.replace(base, model="flax_dropout_rng", make_batch=batch, loss_fn=loss,
                               opt_init=opt.init, opt_update=opt_update)


def _equinox_model(num_layers: int, hidden: int, num_heads: int):
    """An Equinox transformer class: ``eqx.Module`` layers applied per token with
    ``jax.vmap``, attention that splits heads by reshape."""
    import equinox as eqx

    hd = hidden // num_heads

    class Layer(eqx.Module):
        qkv: eqx.nn.Linear
        out: eqx.nn.Linear
        up: eqx.nn.Linear
        down: eqx.nn.Linear
        norm1: eqx.nn.LayerNorm
        norm2: eqx.nn.LayerNorm

        def __init__(self, key):
            k = jax.random.split(key, 4)
            self.qkv = eqx.nn.Linear(hidden, 3 * hidden, use_bias=False, key=k[0])
            self.out = eqx.nn.Linear(hidden, hidden, key=k[1])
            self.up = eqx.nn.Linear(hidden, 4 * hidden, key=k[2])
            self.down = eqx.nn.Linear(4 * hidden, hidden, key=k[3])
            self.norm1, self.norm2 = eqx.nn.LayerNorm(hidden), eqx.nn.LayerNorm(hidden)

        def __call__(self, h):  # h: [S, H], one sequence
            s = h.shape[0]
            qkv = jax.vmap(self.qkv)(jax.vmap(self.norm1)(h))
            q, k, v = (t.reshape(s, num_heads, hd) for t in jnp.split(qkv, 3, axis=-1))
            w = jax.nn.softmax(jnp.einsum("qhd,khd->hqk", q, k) / jnp.sqrt(hd), axis=-1)
            h = h + jax.vmap(self.out)(jnp.einsum("hqk,khd->qhd", w, v).reshape(s, hidden))
            up = jax.nn.gelu(jax.vmap(self.up)(jax.vmap(self.norm2)(h)))
            return h + jax.vmap(self.down)(up)

    class Model(eqx.Module):
        embed: eqx.nn.Embedding
        layers: list
        head: eqx.nn.Linear

        def __init__(self, key):
            k = jax.random.split(key, num_layers + 2)
            self.embed = eqx.nn.Embedding(VOCAB, hidden, key=k[0])
            self.layers = [Layer(k[i + 1]) for i in range(num_layers)]
            self.head = eqx.nn.Linear(hidden, VOCAB, key=k[-1])

        def __call__(self, x):
            h = jax.vmap(self.embed)(x)
            for layer in self.layers:
                h = layer(h)
            return jax.vmap(self.head)(h)

    return Model


def equinox_attention(batch_size: int = 4, dtype: str = "float32", num_layers: int = 2,
                      seq_len: int = 16, hidden: int = 32, num_heads: int = 4,
                      **_) -> Workload:
    """The Equinox transformer, split by hand with ``eqx.partition`` into trainable arrays
    (the params cfp sees) and the rest."""
    import equinox as eqx
    Model = _equinox_model(num_layers, hidden, num_heads)
    static = eqx.partition(Model(jax.random.key(0)), eqx.is_array)[1]

    def init(key):
        return eqx.partition(Model(key), eqx.is_array)[0]

    def batch(key):
        x, y = _tokens(key, batch_size, seq_len)
        return {"x": x, "y": y}

    def loss(params, b):
        model = eqx.combine(params, static)
        return _ce(jax.vmap(model)(b["x"]), b["y"])

    return Workload("equinox_attention", "test", None, batch_size, dtype, init, batch, loss)


def flax_dropout_raw_key(batch_size: int = 4, dtype: str = "float32", **kw) -> Workload:
    """``flax_dropout`` with the old-style raw key (``uint32[2]``) in the batch."""
    base = flax_dropout(batch_size, dtype, **kw)

    def batch(key):
        b = base.make_batch(key)
        return dict(b, dropout=jax.random.key_data(b["dropout"]))

    return dataclasses.replace(base, model="flax_dropout_raw_key", make_batch=batch)


def optax_attention(batch_size: int = 4, dtype: str = "float32", optimizer: str = "adam",
                    **kw) -> Workload:
    """The plain-JAX transformer of ``zoo_extra.reshape_attention`` trained with an Optax
    optimizer: ``adam`` (a state that mirrors the params) or ``adafactor`` (factored second
    moments: a row and a column vector per matrix)."""
    import optax
    import zoo_extra
    base = zoo_extra.reshape_attention(batch_size, dtype, **kw)
    tx = {"adam": lambda: optax.adam(1e-3),
          "adafactor": lambda: optax.adafactor(1e-3, min_dim_size_to_factor=16)}[optimizer]()
    return dataclasses.replace(base, model=f"optax_attention_{optimizer}", opt_init=tx.init,
                               opt_update=optax_update(tx))


def optax_update(tx):
    """``opt_update`` for an Optax ``GradientTransformation``, as a user writes the step."""
    import optax

    def update(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state
    return update


def optax_train_step(loss_fn, tx):
    """The user's own training step, written without cfp."""
    import optax

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return train_step


def equinox_module(num_layers: int = 2):
    """The Equinox transformer handed over whole: ``init_params`` returns the module, the loss
    takes it, Optax's Adam trains it (``cfp.models.user_workload`` does the partitioning).
    Declares one keyword only: cfp passes no other."""
    import optax
    from cfp.models import user_workload
    Model = _equinox_model(num_layers, hidden=32, num_heads=4)

    def batch(key):
        x, y = _tokens(key, 4, 16)
        return {"x": x, "y": y}

    def loss(model, b):
        return _ce(jax.vmap(model)(b["x"]), b["y"])

    return user_workload(loss, Model, batch, optimizer=optax.adam(1e-3), name="equinox_module")


def train_state_parts(batch_size: int = 4, num_layers: int = 2, seq_len: int = 16,
                      hidden: int = 32, num_heads: int = 4):
    """(init_state, make_batch) of a Flax linen transformer in a ``TrainState`` with Adam."""
    import optax
    from flax.training import train_state
    model = _flax_model(hidden, num_heads, num_layers, 0.0)

    def init_state(key):
        params = model.init(key, jnp.zeros((batch_size, seq_len), jnp.int32), train=False)
        return train_state.TrainState.create(apply_fn=model.apply, params=params,
                                             tx=optax.adam(1e-3))

    def make_batch(key):
        x, y = _tokens(key, batch_size, seq_len)
        return {"x": x, "y": y}

    return init_state, make_batch


def train_state_step(state, batch):
    """``train_step(state, batch) -> (state, metrics)`` as Flax's examples write it."""
    def loss(params):
        return _ce(state.apply_fn(params, batch["x"], train=False), batch["y"])

    value, grads = jax.value_and_grad(loss)(state.params)
    return state.apply_gradients(grads=grads), {"loss": value}


def flax_train_state(batch_size: int = 4, dtype: str = "float32", **kw) -> Workload:
    from cfp.models import user_workload
    init_state, make_batch = train_state_parts(batch_size, **kw)
    return user_workload(train_step=train_state_step, init_state=init_state,
                         make_batch=make_batch, dtype=dtype)


def _nnx_model(hidden: int, num_heads: int, num_layers: int, rngs):
    """An NNX pre-norm transformer (heads split by reshape)."""
    from flax import nnx

    class Layer(nnx.Module):
        def __init__(self):
            self.norm1, self.norm2 = nnx.LayerNorm(hidden, rngs=rngs), nnx.LayerNorm(hidden,
                                                                                 rngs=rngs)
            self.qkv = nnx.Linear(hidden, 3 * hidden, use_bias=False, rngs=rngs)
            self.out = nnx.Linear(hidden, hidden, rngs=rngs)
            self.up = nnx.Linear(hidden, 4 * hidden, rngs=rngs)
            self.down = nnx.Linear(4 * hidden, hidden, rngs=rngs)

        def __call__(self, h):
            b, s, _ = h.shape
            hd = hidden // num_heads
            q, k, v = (t.reshape(b, s, num_heads, hd)
                       for t in jnp.split(self.qkv(self.norm1(h)), 3, axis=-1))
            w = jax.nn.softmax(jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd), axis=-1)
            h = h + self.out(jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, s, hidden))
            return h + self.down(jax.nn.gelu(self.up(self.norm2(h))))

    class Model(nnx.Module):
        def __init__(self):
            self.embed = nnx.Embed(VOCAB, hidden, rngs=rngs)
            self.layers = nnx.List([Layer() for _ in range(num_layers)])
            self.norm = nnx.LayerNorm(hidden, rngs=rngs)
            self.head = nnx.Linear(hidden, VOCAB, rngs=rngs)

        def __call__(self, x):
            h = self.embed(x)
            for layer in self.layers:
                h = layer(h)
            return self.head(self.norm(h))

    return Model()


def _t5_model(hidden: int, num_heads: int, num_layers: int, buckets: int = 8):
    """An encoder-decoder in Flax linen, laid out as T5 is: RMS norms, no biases, one learned
    relative-position bias per stack computed in its first layer and handed to every layer
    after it, a causal mask built once, and decoder layers that cross-attend to the
    encoder's output."""
    import flax.linen as nn

    hd = hidden // num_heads

    def buckets_of(q_len, k_len, bidirectional):
        rel = jnp.arange(k_len)[None, :] - jnp.arange(q_len)[:, None]
        if bidirectional:
            half = buckets // 2
            return jnp.where(rel > 0, half, 0) + jnp.minimum(jnp.abs(rel), half - 1)
        return jnp.minimum(jnp.maximum(-rel, 0), buckets - 1)

    class Attention(nn.Module):
        bias_table: bool = False  # this layer makes the position bias (the first one)
        bidirectional: bool = True

        @nn.compact
        def __call__(self, x, kv, bias):
            b, q_len, _ = x.shape
            k_len = kv.shape[1]
            heads = lambda t, n: t.reshape(b, n, num_heads, hd)  # noqa: E731
            q = heads(nn.Dense(hidden, use_bias=False)(x), q_len)
            k = heads(nn.Dense(hidden, use_bias=False)(kv), k_len)
            v = heads(nn.Dense(hidden, use_bias=False)(kv), k_len)
            if self.bias_table:
                table = nn.Embed(buckets, num_heads)(buckets_of(q_len, k_len,
                                                                 self.bidirectional))
                bias = bias + table.transpose(2, 0, 1)[None]
            scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) + bias
            ctx = jnp.einsum("bhqk,bkhd->bqhd", nn.softmax(scores, axis=-1), v)
            return nn.Dense(hidden, use_bias=False)(ctx.reshape(b, q_len, hidden)), bias

    class Feedforward(nn.Module):
        @nn.compact
        def __call__(self, x):
            up = nn.relu(nn.Dense(4 * hidden, use_bias=False)(nn.RMSNorm()(x)))
            return x + nn.Dense(hidden, use_bias=False)(up)

    class EncoderLayer(nn.Module):
        first: bool = False

        @nn.compact
        def __call__(self, h, bias):
            x = nn.RMSNorm()(h)
            out, bias = Attention(bias_table=self.first)(x, x, bias)
            return Feedforward()(h + out), bias

    class DecoderLayer(nn.Module):
        first: bool = False

        @nn.compact
        def __call__(self, h, enc, bias):
            x = nn.RMSNorm()(h)
            out, bias = Attention(bias_table=self.first, bidirectional=False)(x, x, bias)
            h = h + out
            out, _ = Attention()(nn.RMSNorm()(h), enc, 0.0)
            return Feedforward()(h + out), bias

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x, y_in):
            embed = nn.Embed(VOCAB, hidden)
            h, bias = embed(x), jnp.zeros((), jnp.float32)
            for i in range(num_layers):
                h, bias = EncoderLayer(first=i == 0)(h, bias)
            enc = nn.RMSNorm()(h)
            s = y_in.shape[1]
            causal = jnp.where(jnp.tril(jnp.ones((s, s), bool)), 0.0, -1e9)
            h, bias = embed(y_in), causal[None, None]
            for i in range(num_layers):
                h, bias = DecoderLayer(first=i == 0)(h, enc, bias)
            return embed.attend(nn.RMSNorm()(h))

    return Model()


def nnx_step(model, optimizer, batch):
    """``train_step(model, optimizer, batch) -> loss`` as NNX's examples write it."""
    from flax import nnx

    def loss(model):
        return _ce(model(batch["x"]), batch["y"])

    value, grads = nnx.value_and_grad(loss)(model)
    optimizer.update(model, grads)
    return value


def nnx_optimizer(batch_size: int = 4, dtype: str = "float32", num_layers: int = 2,
                  seq_len: int = 16, hidden: int = 32, num_heads: int = 4, **_) -> Workload:
    """An NNX model with ``nnx.Optimizer`` (Adam), through ``user_workload``."""
    import optax
    from flax import nnx
    from cfp.models import user_workload

    def init_state(key):
        model = _nnx_model(hidden, num_heads, num_layers, nnx.Rngs(key))
        return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

    def make_batch(key):
        x, y = _tokens(key, batch_size, seq_len)
        return {"x": x, "y": y}

    return user_workload(train_step=nnx_step, init_state=init_state, make_batch=make_batch,
                         dtype=dtype)


def flax_logical_model(hidden: int = 16, mlp: int = 64):
    """A Flax MLP whose kernels name their dims with logical axes (``embed``, ``mlp``,
    ``vocab``), as Flax and MaxText models do: ``model.init`` returns them boxed."""
    import flax.linen as nn

    def dense(features, names, name):
        return nn.Dense(features, name=name, kernel_init=nn.with_logical_partitioning(
            nn.initializers.normal(0.1), names), use_bias=False)

    class Mlp(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = dense(hidden, ("vocab", "embed"), "embed")(x)
            h = nn.relu(dense(mlp, ("embed", "mlp"), "up")(h))
            return dense(VOCAB, ("mlp", "vocab"), "out")(h)
    return Mlp()


def flax_logical(batch_size: int = 16, dtype: str = "float32") -> Workload:
    """``flax_logical_model`` trained on one-hot inputs, its params unboxed (``nn.unbox``)."""
    import flax.linen as nn
    model = flax_logical_model()

    def init(key):
        return nn.unbox(model.init(key, jnp.zeros((1, VOCAB)))["params"])

    def batch(key):
        labels = jax.random.randint(key, (batch_size,), 0, VOCAB)
        return {"x": jax.nn.one_hot(labels, VOCAB, dtype=dtype), "y": labels}

    def loss(params, b):
        return _ce(model.apply({"params": params}, b["x"]), b["y"])
    return Workload("flax_logical", "test", None, batch_size, dtype, init, batch, loss)


def flax_logical_boxed(batch_size: int = 16, dtype: str = "float32") -> Workload:
    """``flax_logical`` with its params as ``model.init`` returns them: boxed with their
    logical names."""
    base = flax_logical(batch_size, dtype)
    model = flax_logical_model()
    return dataclasses.replace(base, model="flax_logical_boxed", init_params=lambda key: model.init(
        key, jnp.zeros((1, VOCAB)))["params"])


def t5_shared(batch_size: int = 4, dtype: str = "float32", num_layers: int = 2,
              seq_len: int = 16, target_len: int = 8, hidden: int = 32, num_heads: int = 4,
              **_) -> Workload:
    """The encoder-decoder of ``_t5_model`` on ``seq_len`` source and ``target_len`` target
    tokens: every layer reads values no layer owns (its stack's position bias and, in the
    decoder, the encoder's output)."""
    model = _t5_model(hidden, num_heads, num_layers)

    def init(key):
        return model.init(key, jnp.zeros((batch_size, seq_len), jnp.int32),
                          jnp.zeros((batch_size, target_len), jnp.int32))

    def batch(key):
        k1, k2 = jax.random.split(key)
        x, _ = _tokens(k1, batch_size, seq_len)
        y_in, y = _tokens(k2, batch_size, target_len)
        return {"x": x, "y_in": y_in, "y": y}

    def loss(params, b):
        return _ce(model.apply(params, b["x"], b["y_in"]), b["y"])

    return Workload("t5_shared", "test", None, batch_size, dtype, init, batch, loss)
