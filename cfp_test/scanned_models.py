"""Transformer stacks written with ``scan`` over layers and with remat, as large JAX models
are (MaxText's defaults), each next to its unrolled twin.

- ``flax_stack(layers="scan"|"remat"|"scan_remat"|"unrolled")``: a Flax linen pre-norm
  transformer whose layers are ``nn.scan``-ned, ``nn.remat``-ed, both
  (``nn.scan(nn.remat(Layer))``), or a Python loop.
- ``jax_stack(layers="scan"|"checkpoint"|"unrolled")``: plain JAX with the layers' weights
  stacked on a leading layer axis, applied by ``lax.scan``, by a loop of ``jax.checkpoint``-ed
  layers, or by a plain loop.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from cfp.models import Workload
from users_models import VOCAB, _ce, flax_block
from users_models import _tokens as _token_pair


def _tokens(key, batch_size, seq_len):
    x, y = _token_pair(key, batch_size, seq_len)
    return {"x": x, "y": y}


def _flax_model(hidden, num_heads, num_layers, layers):
    import flax.linen as nn

    Block = flax_block(hidden, num_heads, rate=0.0)

    class Layer(nn.Module):  # the shape nn.scan wants: (carry, x) -> (carry, y)
        @nn.compact
        def __call__(self, h, _):
            return Block()(h, False), None

    class Model(nn.Module):
        @nn.compact
        def __call__(self, x):
            h = nn.Embed(VOCAB, hidden)(x)
            layer = nn.remat(Layer) if "remat" in layers else Layer
            if "scan" in layers:
                h, _ = nn.scan(layer, variable_axes={"params": 0}, split_rngs={"params": True},
                               length=num_layers)()(h, None)
            else:
                for _ in range(num_layers):
                    h, _ = layer()(h, None)
            return nn.Dense(VOCAB)(nn.LayerNorm()(h))

    return Model()


def flax_stack(batch_size: int = 4, dtype: str = "float32", num_layers: int = 2,
               seq_len: int = 16, hidden: int = 32, num_heads: int = 4,
               layers: str = "scan") -> Workload:
    model = _flax_model(hidden, num_heads, num_layers, layers)

    def init(key):
        return model.init(key, jnp.zeros((batch_size, seq_len), jnp.int32))

    def loss(params, b):
        return _ce(model.apply(params, b["x"]), b["y"])

    return Workload(f"flax_{layers}", "test", None, batch_size, dtype, init,
                    lambda key: _tokens(key, batch_size, seq_len), loss)


def jax_stack(batch_size: int = 4, dtype: str = "float32", num_layers: int = 2,
              seq_len: int = 16, hidden: int = 32, layers: str = "scan") -> Workload:
    """A residual MLP stack, per layer ``h + gelu(h @ w_up) @ w_down``: weights stacked on a
    leading layer axis for ``scan``, a list of layers otherwise."""

    def init(key):
        k = jax.random.split(key, 4)
        stack = {"w_up": jax.random.normal(k[1], (num_layers, hidden, 4 * hidden)) * 0.02,
                 "w_down": jax.random.normal(k[2], (num_layers, 4 * hidden, hidden)) * 0.02}
        if layers != "scan":  # a list of layers, as a loop over them is written
            stack = [{n: w[i] for n, w in stack.items()} for i in range(num_layers)]
        return {"embed": jax.random.normal(k[0], (VOCAB, hidden)) * 0.02, "layers": stack,
                "head": jax.random.normal(k[3], (hidden, VOCAB)) * 0.02}

    def layer(h, w):
        return h + jax.nn.gelu(h @ w["w_up"]) @ w["w_down"]

    def loss(params, b):
        h = params["embed"][b["x"]]
        if layers == "scan":
            h, _ = jax.lax.scan(lambda c, w: (layer(c, w), None), h, params["layers"])
        else:
            fn = jax.checkpoint(layer) if layers == "checkpoint" else layer
            for w in params["layers"]:
                h = fn(h, w)
        return _ce(h @ params["head"], b["y"])

    return Workload(f"jax_{layers}", "test", None, batch_size, dtype, init,
                    lambda key: _tokens(key, batch_size, seq_len), loss)


flax_scan = functools.partial(flax_stack, layers="scan")
flax_remat = functools.partial(flax_stack, layers="remat")
flax_scan_remat = functools.partial(flax_stack, layers="scan_remat")
flax_unrolled = functools.partial(flax_stack, layers="unrolled")
jax_scan = functools.partial(jax_stack, layers="scan")
jax_checkpoint = functools.partial(jax_stack, layers="checkpoint")
jax_unrolled = functools.partial(jax_stack, layers="unrolled")
