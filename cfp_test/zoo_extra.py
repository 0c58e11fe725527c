"""Models that exist only in the tests: what the analysis must handle without being told.

- ``convnet``: two NHWC convolutions with ReLU, global mean pooling, a dense classifier.
- ``einsum_net``: a chain of multi-dim einsum contractions (a factorized bilinear layer and a
  tensor-train style contraction), nothing a transformer preset would have.
- ``reshape_attention``: transformer layers whose heads are split off by reshape;
  ``rotary_angles``, ``rotary_cosines``: the same layers reading one rotary table made by an
  einsum (its angles, or its cosines and sines made once).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from cfp.models import Workload


def _ce(logits, labels):
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(labels, logits.shape[-1]), axis=-1))


def convnet(batch_size: int = 8, dtype: str = "float32", **_) -> Workload:
    """A small convolutional classifier (images 8x8x4, 8 then 16 channels, 10 classes)."""
    dt = jnp.dtype(dtype)

    def init(key):
        k1, k2, k3 = jax.random.split(key, 3)
        return {"c1": 0.1 * jax.random.normal(k1, (3, 3, 4, 8), dt),
                "c2": 0.1 * jax.random.normal(k2, (3, 3, 8, 16), dt),
                "fc": 0.1 * jax.random.normal(k3, (16, 10), dt)}

    def batch(key):
        k1, k2 = jax.random.split(key)
        return {"x": jax.random.normal(k1, (batch_size, 8, 8, 4), dt),
                "y": jax.random.randint(k2, (batch_size,), 0, 10)}

    def loss(p, b):
        dn = ("NHWC", "HWIO", "NHWC")
        h = jax.lax.conv_general_dilated(b["x"], p["c1"], (1, 1), "SAME", dimension_numbers=dn)
        h = jax.nn.relu(h)
        h = jax.lax.conv_general_dilated(h, p["c2"], (1, 1), "SAME", dimension_numbers=dn)
        h = jnp.mean(jax.nn.relu(h), axis=(1, 2))
        return _ce(h @ p["fc"], b["y"])

    return Workload("convnet", "test", None, batch_size, dtype, init, batch, loss)


def einsum_net(batch_size: int = 8, dtype: str = "float32", **_) -> Workload:
    """Factorized bilinear and tensor-train contractions over a [B, 4, 8] input."""
    dt = jnp.dtype(dtype)

    def init(key):
        k = jax.random.split(key, 4)
        return {"u": 0.1 * jax.random.normal(k[0], (4, 8, 16), dt),
                "core": 0.1 * jax.random.normal(k[1], (16, 4, 16), dt),
                "v": 0.1 * jax.random.normal(k[2], (16, 8), dt),
                "out": 0.1 * jax.random.normal(k[3], (4, 8, 6), dt)}

    def batch(key):
        k1, k2 = jax.random.split(key)
        return {"x": jax.random.normal(k1, (batch_size, 4, 8), dt),
                "y": jax.random.randint(k2, (batch_size,), 0, 6)}

    def loss(p, b):
        h = jnp.einsum("bij,ijr->br", b["x"], p["u"])
        h = jnp.tanh(jnp.einsum("br,rks->bks", h, p["core"]))
        h = jnp.einsum("bks,sd->bkd", h, p["v"])
        logits = jnp.einsum("bkd,kdc->bc", h, p["out"])
        return _ce(logits, b["y"])

    return Workload("einsum_net", "test", None, batch_size, dtype, init, batch, loss)


def einsum_net_momentum(batch_size: int = 8, dtype: str = "float32", **kw) -> Workload:
    """``einsum_net`` trained with the user's own optimizer (Optax-style init/update pair:
    SGD with momentum), as a user with an Optax optimizer would plug it in."""
    import dataclasses

    def opt_init(params):
        return jax.tree_util.tree_map(jnp.zeros_like, params)

    def opt_update(grads, velocity, params):
        velocity = jax.tree_util.tree_map(lambda v, g: 0.9 * v + g, velocity, grads)
        params = jax.tree_util.tree_map(lambda p, v: p - 0.01 * v, params, velocity)
        return params, velocity

    return dataclasses.replace(einsum_net(batch_size, dtype, **kw), opt_init=opt_init,
                               opt_update=opt_update)


def einsum_net_momentum_step():
    """``einsum_net_momentum`` as its user's own loop holds it: ``(train_step, params,
    velocity, batch)``, the step ``(params, velocity, batch) -> (params, velocity, loss)``."""
    w = einsum_net_momentum()
    params = w.init_params(jax.random.key(0))
    velocity, batch = w.opt_init(params), w.make_batch(jax.random.key(1))

    def train_step(p, v, b):
        loss, grads = jax.value_and_grad(w.loss_fn)(p, b)
        return (*w.opt_update(grads, v, p), loss)
    return train_step, params, velocity, batch


def reshape_attention(batch_size: int = 4, dtype: str = "float32", num_layers: int = 2,
                      seq_len: int = 16, hidden: int = 32, num_heads: int = 4,
                      rotary: str | None = None, **_) -> Workload:
    """Pre-norm transformer layers written the common way: one [H, 3H] projection, heads
    split off by reshape ([B, S, H] -> [B, S, nh, hd]) and merged back; tied embeddings.
    With ``rotary``, every layer rotates its queries and keys by one table of angles, made
    once as the outer product of positions and frequencies (an einsum: a contraction):
    each layer takes its cosines and sines (``"angles"``), or every layer reads the ones
    made once (``"cosines"``)."""
    dt = jnp.dtype(dtype)
    vocab, hd = 64, hidden // num_heads

    def init(key):
        ks = jax.random.split(key, 1 + 3 * num_layers)
        layers = [{"qkv": 0.1 * jax.random.normal(ks[1 + 3 * i], (hidden, 3 * hidden), dt),
                   "proj": 0.1 * jax.random.normal(ks[2 + 3 * i], (hidden, hidden), dt),
                   "up": 0.1 * jax.random.normal(ks[3 + 3 * i], (hidden, 4 * hidden), dt),
                   "down": 0.1 * jax.random.normal(ks[3 + 3 * i], (4 * hidden, hidden), dt)}
                  for i in range(num_layers)]
        return {"embed": 0.1 * jax.random.normal(ks[0], (vocab, hidden), dt), "layers": layers}

    def batch(key):
        toks = jax.random.randint(key, (batch_size, seq_len + 1), 0, vocab)
        return {"x": toks[:, :-1], "y": toks[:, 1:]}

    def norm(h):
        return h * jax.lax.rsqrt(jnp.mean(h * h, axis=-1, keepdims=True) + 1e-6)

    def cosines(angles):  # [S, hd / 2] -> [S, 1, hd / 2] twice
        return jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]

    def rotate(t, table):  # [B, S, nh, hd]
        cos, sin = cosines(table) if rotary == "angles" else table
        t1, t2 = t[..., :hd // 2], t[..., hd // 2:]
        return jnp.concatenate([t1 * cos - t2 * sin, t2 * cos + t1 * sin], axis=-1)

    def attention(p, h, table):
        b, s, _ = h.shape
        q, k, v = jnp.split(norm(h) @ p["qkv"], 3, axis=-1)
        q, k, v = (t.reshape(b, s, num_heads, hd) for t in (q, k, v))
        if table is not None:
            q, k = rotate(q, table), rotate(k, table)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / jnp.sqrt(hd).astype(dt)
        mask = jnp.tril(jnp.ones((s, s), bool))
        w = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
        ctx = jnp.einsum("bhqk,bkhd->bqhd", w, v).reshape(b, s, hidden)
        return h + ctx @ p["proj"]

    def loss(p, b):
        h = p["embed"][b["x"]]
        table = None
        if rotary:
            frequencies = 10000.0 ** (-jnp.arange(hd // 2, dtype=dt) * 2 / hd)
            table = jnp.einsum("s,f->sf", jnp.arange(seq_len, dtype=dt), frequencies)
            table = table if rotary == "angles" else cosines(table)
        for layer in p["layers"]:
            h = attention(layer, h, table)
            h = h + jax.nn.gelu(norm(h) @ layer["up"]) @ layer["down"]
        return _ce(norm(h) @ p["embed"].T, b["y"])

    name = f"rotary_{rotary}" if rotary else "reshape_attention"
    return Workload(name, "test", None, batch_size, dtype, init, batch, loss)


def rotary_angles(batch_size: int = 4, dtype: str = "float32", num_layers: int = 2,
                  **kw) -> Workload:
    """``reshape_attention`` whose layers read one table of rotary angles made by an einsum,
    each taking its cosines and sines."""
    return reshape_attention(batch_size, dtype, num_layers, rotary="angles", **kw)


def rotary_cosines(batch_size: int = 4, dtype: str = "float32", num_layers: int = 2,
                   **kw) -> Workload:
    """``reshape_attention`` whose layers read one rotary table's cosines and sines, made
    once from angles made by an einsum."""
    return reshape_attention(batch_size, dtype, num_layers, rotary="cosines", **kw)


def per_example_loss(batch_size: int = 8, dtype: str = "float32", **_) -> Workload:
    """Bad input: a loss that returns one value per example, not a scalar."""
    import dataclasses
    base = einsum_net(batch_size, dtype)

    def loss(p, b):
        h = jnp.einsum("bij,ijr->br", b["x"], p["u"])
        return jnp.sum(h * h, axis=-1)
    return dataclasses.replace(base, loss_fn=loss)


EFFECT_CALLS: list[float] = []  # what ``effects_step``'s callback saw, in this process


def _seen(loss):
    import numpy as np
    EFFECT_CALLS.append(float(loss))
    return np.float32(loss)


def _effects_loss(p, b):
    return jnp.mean((jax.nn.relu(b["x"] @ p["w1"]) @ p["w2"] - b["y"]) ** 2)


def effects_train_step(params, opt_state, batch):
    """A plain-JAX Adam step that prints its loss (``jax.debug.print``) and hands it to the
    host (``io_callback``): effects, which no output of the step needs."""
    from jax.experimental import io_callback
    import optax
    loss, grads = jax.value_and_grad(_effects_loss)(params, batch)
    jax.debug.print("step loss {}", loss)
    io_callback(_seen, jax.ShapeDtypeStruct((), jnp.float32), loss, ordered=True)
    updates, opt_state = optax.adam(1e-3).update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def effects_step(batch_size: int = 16, dtype: str = "float32", **_) -> Workload:
    import optax
    from cfp.models import user_workload

    def init_state(key):
        k1, k2 = jax.random.split(key)
        params = {"w1": jax.random.normal(k1, (32, 64)) * 0.1,
                  "w2": jax.random.normal(k2, (64, 32)) * 0.1}
        return params, optax.adam(1e-3).init(params)

    def make_batch(key):
        x = jax.random.normal(key, (batch_size, 32))
        return {"x": x, "y": jnp.tanh(x)}
    return user_workload(train_step=effects_train_step, init_state=init_state,
                         make_batch=make_batch, name="effects")
