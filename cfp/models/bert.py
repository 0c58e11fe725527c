"""BERT encoder: post-LayerNorm blocks, padding-masked bidirectional attention, masked-LM head."""
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from cfp.models import layers
from cfp.models.common import ModelSpec, TransformerConfig

LN_EPS = 1e-12
TYPE_VOCAB_SIZE = 2
MASK_TOKEN_ID = 103  # BERT's [MASK]; clipped to vocab_size - 1 for small vocabularies
MLM_PROBABILITY = 0.15


@dataclasses.dataclass(frozen=True)
class BertConfig(TransformerConfig):
    """BERT hyper-parameters; ffn_size None means 4 * hidden_size."""

    seq_len: int = 512
    vocab_size: int = 30522


# Devlin et al. 2019 (BERT-base / BERT-large).
PRESETS = {
    "tiny": BertConfig(2, 64, 4, seq_len=32, vocab_size=256),
    "base": BertConfig(12, 768, 12),
    "large": BertConfig(24, 1024, 16),
}
DEFAULT_BATCH_SIZES = {"tiny": 8, "base": 32, "large": 32}


def _init_layer(config: BertConfig, key: jax.Array, dtype: Any) -> dict:
    """One post-LN block: attn, attn_ln, mlp, mlp_ln."""
    k_attn, k_mlp = jax.random.split(key)
    h = config.hidden_size
    return {"attn": layers.init_attention(k_attn, h, config.num_heads, dtype, bias=True),
            "attn_ln": layers.init_norm(h, dtype),
            "mlp": layers.init_ffn(k_mlp, h, config.ffn, dtype),
            "mlp_ln": layers.init_norm(h, dtype)}


def init_params(config: BertConfig, key: jax.Array, dtype: Any) -> dict:
    """Parameters: embeddings {word, position, token_type, ln}, layers[i], mlm {dense, ln, bias}."""
    k_word, k_pos, k_type, k_layers, k_mlm = jax.random.split(key, 5)
    h = config.hidden_size
    return {
        "embeddings": {"word": layers.normal(k_word, (config.vocab_size, h), dtype),
                       "position": layers.normal(k_pos, (config.seq_len, h), dtype),
                       "token_type": layers.normal(k_type, (TYPE_VOCAB_SIZE, h), dtype),
                       "ln": layers.init_norm(h, dtype)},
        "layers": [_init_layer(config, k, dtype) for k in jax.random.split(k_layers, config.num_layers)],
        "mlm": {"dense": layers.init_dense(k_mlm, h, h, dtype),
                "ln": layers.init_norm(h, dtype),
                "bias": jnp.zeros((config.vocab_size,), dtype)},
    }


def encode(config: BertConfig, params: dict, batch: dict) -> jax.Array:
    """Batch -> final hidden states [B,S,H]."""
    emb = params["embeddings"]
    seq_len = batch["input_ids"].shape[1]
    x = (emb["word"][batch["input_ids"]] + emb["position"][None, :seq_len]
         + emb["token_type"][batch["token_type_ids"]])
    x = layers.layer_norm(emb["ln"], x, LN_EPS)
    mask = layers.padding_mask(batch["attention_mask"])
    for layer in params["layers"]:
        x = layers.layer_norm(layer["attn_ln"], x + layers.attention(layer["attn"], x, mask), LN_EPS)
        x = layers.layer_norm(layer["mlp_ln"], x + layers.ffn(layer["mlp"], x, approximate=False), LN_EPS)
    return x


def mlm_logits(params: dict, x: jax.Array) -> jax.Array:
    """MLM head: dense + gelu + LayerNorm + tied decoder + bias -> logits [B,S,V]."""
    head = params["mlm"]
    y = jax.nn.gelu(layers.dense(head["dense"], x), approximate=False)
    y = layers.layer_norm(head["ln"], y, LN_EPS)
    return jnp.einsum("bsh,vh->bsv", y, params["embeddings"]["word"]) + head["bias"]


def loss_fn(config: BertConfig, params: dict, batch: dict) -> jax.Array:
    """Masked-LM cross-entropy averaged over positions where mlm_mask is set (float32 scalar)."""
    logits = mlm_logits(params, encode(config, params, batch))
    weights = batch["mlm_mask"].astype(jnp.float32)
    per_token = layers.cross_entropy(logits, batch["labels"])
    return jnp.sum(per_token * weights) / jnp.maximum(jnp.sum(weights), 1.0)


def make_batch(config: BertConfig, key: jax.Array, batch_size: int, dtype: Any) -> dict:
    """Valid MLM batch: input_ids, token_type_ids, attention_mask (int32), labels (int32), mlm_mask (float32).

    Each row has a random length >= 1 (attention_mask is a prefix of ones), two segments, and at
    least one MLM position (position 0 always, plus ~15% of the other real tokens).
    """
    del dtype
    k_tok, k_len, k_mlm = jax.random.split(key, 3)
    shape = (batch_size, config.seq_len)
    labels = jax.random.randint(k_tok, shape, 0, config.vocab_size, dtype=jnp.int32)
    lengths = jax.random.randint(k_len, (batch_size, 1), 1, config.seq_len + 1, dtype=jnp.int32)
    pos = jax.lax.broadcasted_iota(jnp.int32, shape, 1)
    real = pos < lengths
    mlm = ((jax.random.uniform(k_mlm, shape) < MLM_PROBABILITY) & real) | (pos == 0)
    mask_id = min(MASK_TOKEN_ID, config.vocab_size - 1)
    input_ids = jnp.where(mlm, mask_id, jnp.where(real, labels, 0)).astype(jnp.int32)
    return {"input_ids": input_ids,
            "token_type_ids": ((pos >= lengths // 2) & real).astype(jnp.int32),
            "attention_mask": real.astype(jnp.int32),
            "labels": labels,
            "mlm_mask": mlm.astype(jnp.float32)}


def flops_per_step(config: BertConfig, batch_size: int) -> float:
    """Analytic training FLOPs (3x forward matmul FLOPs, attention and MLM head included)."""
    tokens = batch_size * config.seq_len
    h = config.hidden_size
    per_layer = layers.transformer_flops(tokens, batch_size, config.seq_len, h, 2 * h * config.ffn)
    head = 2 * tokens * h * (h + config.vocab_size)
    return 3.0 * (config.num_layers * per_layer + head)


SPEC = ModelSpec("bert", BertConfig, PRESETS, DEFAULT_BATCH_SIZES, init_params, make_batch, loss_fn,
                 flops_per_step)
