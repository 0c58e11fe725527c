"""Models that exist only in the tests: what the analysis must handle without being told.

- ``convnet``: two NHWC convolutions with ReLU, global mean pooling, a dense classifier.
- ``einsum_net``: a chain of multi-dim einsum contractions (a factorized bilinear layer and a
  tensor-train style contraction), nothing a transformer preset would have.
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
