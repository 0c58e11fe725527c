"""GPT-2 style decoder: learned positions, pre-LayerNorm blocks, causal attention, tied LM head."""
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from cfp.models import layers
from cfp.models.common import ModelSpec, TransformerConfig


@dataclasses.dataclass(frozen=True)
class GPTConfig(TransformerConfig):
    """GPT hyper-parameters; ffn_size None means 4 * hidden_size."""

    seq_len: int = 1024
    vocab_size: int = 51200


# Alpa's GPT benchmark suite / GPT-3 paper table 2.1 (seq 1024, vocab 51200).
PRESETS = {
    "tiny": GPTConfig(2, 64, 4, seq_len=32, vocab_size=256),
    "125m": GPTConfig(12, 768, 12),
    "350m": GPTConfig(24, 1024, 16),
    "760m": GPTConfig(24, 1536, 16),
    "1.3b": GPTConfig(24, 2048, 32),
    "2.6b": GPTConfig(32, 2560, 32),
    "6.7b": GPTConfig(32, 4096, 32),
    "39b": GPTConfig(48, 8192, 64),  # Alpa's largest GPT benchmark (its 64-GPU case)
}
DEFAULT_BATCH_SIZES = {name: (8 if name == "tiny" else 32) for name in PRESETS}


def _init_layer(config: GPTConfig, key: jax.Array, dtype: Any) -> dict:
    """One pre-LN transformer block."""
    k_attn, k_mlp = jax.random.split(key)
    h = config.hidden_size
    return {
        "ln1": layers.init_norm(h, dtype),
        "attn": layers.init_attention(k_attn, h, config.num_heads, dtype, bias=True),
        "ln2": layers.init_norm(h, dtype),
        "mlp": layers.init_ffn(k_mlp, h, config.ffn, dtype),
    }


def init_params(config: GPTConfig, key: jax.Array, dtype: Any) -> dict:
    """Parameters: wte [V,H], wpe [S,H], layers[i] {ln1, attn, ln2, mlp}, ln_f."""
    k_wte, k_wpe, k_layers = jax.random.split(key, 3)
    return {
        "wte": layers.normal(k_wte, (config.vocab_size, config.hidden_size), dtype),
        "wpe": layers.normal(k_wpe, (config.seq_len, config.hidden_size), dtype),
        "layers": [_init_layer(config, k, dtype) for k in jax.random.split(k_layers, config.num_layers)],
        "ln_f": layers.init_norm(config.hidden_size, dtype),
    }


def forward(config: GPTConfig, params: dict, inputs: jax.Array) -> jax.Array:
    """Token ids [B,S] -> logits [B,S,V] (in the params' dtype)."""
    seq_len = inputs.shape[1]
    x = params["wte"][inputs] + params["wpe"][None, :seq_len]
    mask = layers.causal_mask(seq_len)
    for layer in params["layers"]:
        x = x + layers.attention(layer["attn"], layers.layer_norm(layer["ln1"], x), mask)
        x = x + layers.ffn(layer["mlp"], layers.layer_norm(layer["ln2"], x))
    x = layers.layer_norm(params["ln_f"], x)
    return jnp.einsum("bsh,vh->bsv", x, params["wte"])


def loss_fn(config: GPTConfig, params: dict, batch: dict) -> jax.Array:
    """Mean next-token cross-entropy (float32 scalar)."""
    logits = forward(config, params, batch["inputs"])
    return jnp.mean(layers.cross_entropy(logits, batch["targets"]))


def make_batch(config: GPTConfig, key: jax.Array, batch_size: int, dtype: Any) -> dict:
    """{"inputs", "targets"}: int32 [B, S] token ids in [0, vocab)."""
    del dtype
    return layers.token_batch(key, batch_size, config.seq_len, config.vocab_size)


def flops_per_step(config: GPTConfig, batch_size: int) -> float:
    """Analytic training FLOPs (3x forward matmul FLOPs, attention included)."""
    tokens = batch_size * config.seq_len
    per_layer = layers.transformer_flops(tokens, batch_size, config.seq_len, config.hidden_size,
                                         2 * config.hidden_size * config.ffn)
    head = 2 * tokens * config.hidden_size * config.vocab_size
    return 3.0 * (config.num_layers * per_layer + head)


SPEC = ModelSpec("gpt", GPTConfig, PRESETS, DEFAULT_BATCH_SIZES, init_params, make_batch, loss_fn,
                 flops_per_step)
