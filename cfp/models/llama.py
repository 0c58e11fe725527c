"""LLaMA-2 style decoder: RMSNorm, rotary embeddings, SwiGLU MLP, no biases, untied LM head."""
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from cfp.errors import CfpError
from cfp.models import layers
from cfp.models.common import ModelSpec, check_heads, check_positive_fields


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """LLaMA hyper-parameters (ffn_size is the SwiGLU inner width)."""

    num_layers: int
    hidden_size: int
    num_heads: int
    ffn_size: int
    seq_len: int = 4096
    vocab_size: int = 32000

    def __post_init__(self):
        check_positive_fields(self)
        check_heads(self)
        if (self.hidden_size // self.num_heads) % 2:
            raise CfpError(f"llama head_dim={self.hidden_size // self.num_heads} must be even for rotary "
                           f"embeddings; change hidden_size or num_heads")


# LLaMA-2 paper / Meta's released configs.
PRESETS = {
    "tiny": LlamaConfig(2, 64, 4, ffn_size=176, seq_len=32, vocab_size=256),
    "7b": LlamaConfig(32, 4096, 32, ffn_size=11008),
    "13b": LlamaConfig(40, 5120, 40, ffn_size=13824),
}
DEFAULT_BATCH_SIZES = {"tiny": 8, "7b": 8, "13b": 8}


def _init_layer(config: LlamaConfig, key: jax.Array, dtype: Any) -> dict:
    """One decoder block: attn_norm, attn, mlp_norm, mlp {w1 gate, w3 up, w2 down}."""
    k_attn, k1, k2, k3 = jax.random.split(key, 4)
    h, f = config.hidden_size, config.ffn_size
    return {
        "attn_norm": layers.init_norm(h, dtype, bias=False),
        "attn": layers.init_attention(k_attn, h, config.num_heads, dtype, bias=False),
        "mlp_norm": layers.init_norm(h, dtype, bias=False),
        "mlp": {"w1": layers.normal(k1, (h, f), dtype),
                "w3": layers.normal(k3, (h, f), dtype),
                "w2": layers.normal(k2, (f, h), dtype)},
    }


def init_params(config: LlamaConfig, key: jax.Array, dtype: Any) -> dict:
    """Parameters: embed [V,H], layers[i], norm, lm_head [H,V]."""
    k_emb, k_head, k_layers = jax.random.split(key, 3)
    return {
        "embed": layers.normal(k_emb, (config.vocab_size, config.hidden_size), dtype),
        "layers": [_init_layer(config, k, dtype) for k in jax.random.split(k_layers, config.num_layers)],
        "norm": layers.init_norm(config.hidden_size, dtype, bias=False),
        "lm_head": layers.normal(k_head, (config.hidden_size, config.vocab_size), dtype),
    }


def swiglu(p: dict, x: jax.Array) -> jax.Array:
    """w2(silu(x @ w1) * (x @ w3))."""
    return (layers.silu(x @ p["w1"]) * (x @ p["w3"])) @ p["w2"]


def forward(config: LlamaConfig, params: dict, inputs: jax.Array) -> jax.Array:
    """Token ids [B,S] -> logits [B,S,V] (in the params' dtype)."""
    x = params["embed"][inputs]
    mask = layers.causal_mask(inputs.shape[1])
    for layer in params["layers"]:
        x = x + layers.attention(layer["attn"], layers.rms_norm(layer["attn_norm"], x), mask,
                                 rope=layers.rotary)
        x = x + swiglu(layer["mlp"], layers.rms_norm(layer["mlp_norm"], x))
    return layers.rms_norm(params["norm"], x) @ params["lm_head"]


def loss_fn(config: LlamaConfig, params: dict, batch: dict) -> jax.Array:
    """Mean next-token cross-entropy (float32 scalar)."""
    logits = forward(config, params, batch["inputs"])
    return jnp.mean(layers.cross_entropy(logits, batch["targets"]))


def make_batch(config: LlamaConfig, key: jax.Array, batch_size: int, dtype: Any) -> dict:
    """{"inputs", "targets"}: int32 [B, S] token ids in [0, vocab)."""
    del dtype
    return layers.token_batch(key, batch_size, config.seq_len, config.vocab_size)


def flops_per_step(config: LlamaConfig, batch_size: int) -> float:
    """Analytic training FLOPs (3x forward matmul FLOPs, attention included)."""
    tokens = batch_size * config.seq_len
    per_layer = layers.transformer_flops(tokens, batch_size, config.seq_len, config.hidden_size,
                                         3 * config.hidden_size * config.ffn_size)
    head = 2 * tokens * config.hidden_size * config.vocab_size
    return 3.0 * (config.num_layers * per_layer + head)


SPEC = ModelSpec("llama", LlamaConfig, PRESETS, DEFAULT_BATCH_SIZES, init_params, make_batch, loss_fn,
                 flops_per_step)
