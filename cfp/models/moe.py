"""GShard mixture-of-experts decoder: dense FFN on even layers, top-2 gated MoE FFN on odd layers.

The MoE block follows the GShard paper (Lepikhin et al. 2020) and Alpa's ``moe_layer``: tokens are
cut into groups of ``expert_group_size``, routed with top-2 gating and a per-expert capacity
``2 * S_g // E`` through one-hot dispatch/combine tensors [G, S_g, E, C]. The GShard auxiliary
load-balancing loss (weight 0.01) is added to the LM loss. The LM head is tied to the embedding,
as in Alpa's MoE benchmark.
"""
import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from cfp.errors import CfpError
from cfp.models import layers
from cfp.models.common import ModelSpec, check_heads, check_positive_fields

AUX_LOSS_WEIGHT = 0.01


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """MoE hyper-parameters; first seven fields in the order of Alpa's ``MoEModelConfig``.

    ffn_size None means ``ffn_multiplier * hidden_size`` (Alpa's benchmark uses 8).
    """

    seq_len: int
    hidden_size: int
    num_layers: int
    num_heads: int
    vocab_size: int
    num_experts: int
    expert_group_size: int
    ffn_size: int | None = None
    ffn_multiplier: int = 4

    def __post_init__(self):
        check_positive_fields(self)
        check_heads(self)
        if self.num_experts < 2:
            raise CfpError(f"moe needs num_experts >= 2 for top-2 gating, got {self.num_experts}")

    @property
    def ffn(self) -> int:
        """Feed-forward width of the dense blocks and of every expert."""
        return self.ffn_size or self.ffn_multiplier * self.hidden_size

    @property
    def capacity(self) -> int:
        """Per-expert, per-group capacity: 2 * S_g // E, at least 1."""
        return max(1, 2 * self.expert_group_size // self.num_experts)


def _alpa(*fields: int) -> MoEConfig:
    """Config from Alpa's MoEModelConfig tuple, with Alpa's 8x FFN width."""
    return MoEConfig(*fields, ffn_multiplier=8)


# Alpa's MoE benchmark suite (benchmark/alpa/suite_auto_moe.py); "cfp" is the CFP artifact's config.
PRESETS = {
    "tiny": MoEConfig(32, 64, 4, 4, 256, 4, 32),
    "380m": _alpa(1024, 768, 8, 16, 32000, 8, 2048),
    "690m": _alpa(1024, 768, 8, 16, 32000, 16, 2048),
    "1.3b": _alpa(1024, 768, 16, 16, 32000, 16, 2048),
    "2.4b": _alpa(1024, 1024, 16, 16, 32000, 16, 2048),
    "7.1b": _alpa(1024, 1280, 16, 16, 32000, 32, 2048),
    "cfp": _alpa(1024, 1280, 16, 4, 32000, 32, 2048),
}
DEFAULT_BATCH_SIZES = {name: (8 if name == "tiny" else 32) for name in PRESETS}


def is_moe_layer(index: int) -> bool:
    """Odd layers carry the MoE FFN, even layers a dense FFN."""
    return index % 2 == 1


def _init_moe_ffn(config: MoEConfig, key: jax.Array, dtype: Any) -> dict:
    """Gate wg [M,E], experts wi [E,M,H] and wo [E,H,M]."""
    k_g, k_i, k_o = jax.random.split(key, 3)
    e, m, h = config.num_experts, config.hidden_size, config.ffn
    return {"wg": layers.normal(k_g, (m, e), dtype),
            "wi": layers.normal(k_i, (e, m, h), dtype),
            "wo": layers.normal(k_o, (e, h, m), dtype)}


def _init_layer(config: MoEConfig, index: int, key: jax.Array, dtype: Any) -> dict:
    """One pre-LN block: ln1, attn, ln2, and either "mlp" (dense) or "moe"."""
    k_attn, k_ffn = jax.random.split(key)
    h = config.hidden_size
    layer = {"ln1": layers.init_norm(h, dtype),
             "attn": layers.init_attention(k_attn, h, config.num_heads, dtype, bias=True),
             "ln2": layers.init_norm(h, dtype)}
    if is_moe_layer(index):
        layer["moe"] = _init_moe_ffn(config, k_ffn, dtype)
    else:
        layer["mlp"] = layers.init_ffn(k_ffn, h, config.ffn, dtype)
    return layer


def init_params(config: MoEConfig, key: jax.Array, dtype: Any) -> dict:
    """Parameters: wte [V,H], wpe [S,H], layers[i], ln_f."""
    k_wte, k_wpe, k_layers = jax.random.split(key, 3)
    keys = jax.random.split(k_layers, config.num_layers)
    return {
        "wte": layers.normal(k_wte, (config.vocab_size, config.hidden_size), dtype),
        "wpe": layers.normal(k_wpe, (config.seq_len, config.hidden_size), dtype),
        "layers": [_init_layer(config, i, keys[i], dtype) for i in range(config.num_layers)],
        "ln_f": layers.init_norm(config.hidden_size, dtype),
    }


def top2_gating(gates: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GShard top-2 gating on float32 gates [G,S,E] -> (combine [G,S,E,C], dispatch [G,S,E,C], aux)."""
    num_experts = gates.shape[-1]
    index_1 = jnp.argmax(gates, axis=-1)
    mask_1 = layers.one_hot(index_1, num_experts, jnp.int32)
    gates_rest = gates * (1 - mask_1)
    index_2 = jnp.argmax(gates_rest, axis=-1)
    mask_2 = layers.one_hot(index_2, num_experts, jnp.int32)
    gate_1 = jnp.sum(gates * mask_1, axis=-1)
    gate_2 = jnp.sum(gates_rest * mask_2, axis=-1)

    density = jnp.mean(mask_1.astype(jnp.float32), axis=1)
    density_proxy = jnp.mean(gates, axis=1)
    aux = jnp.mean(density * density_proxy) * float(num_experts * num_experts)

    pos_1 = lax.cumsum(mask_1, axis=1) - mask_1
    mask_1 = mask_1 * (pos_1 < capacity)
    pos_2 = lax.cumsum(mask_2, axis=1) - mask_2 + jnp.sum(mask_1, axis=1, keepdims=True)
    mask_2 = mask_2 * (pos_2 < capacity)
    pos_1, pos_2 = jnp.sum(pos_1 * mask_1, axis=-1), jnp.sum(pos_2 * mask_2, axis=-1)

    gate_1 = gate_1 * jnp.sum(mask_1, axis=-1)
    gate_2 = gate_2 * jnp.sum(mask_2, axis=-1)
    denom = gate_1 + gate_2
    denom = lax.select(denom > 0, denom, jnp.ones_like(denom))
    gate_1, gate_2 = gate_1 / denom, gate_2 / denom

    slot_1 = jnp.einsum("gse,gsc->gsec", mask_1.astype(jnp.float32),
                        layers.one_hot(pos_1, capacity, jnp.float32))
    slot_2 = jnp.einsum("gse,gsc->gsec", mask_2.astype(jnp.float32),
                        layers.one_hot(pos_2, capacity, jnp.float32))
    combine = gate_1[..., None, None] * slot_1 + gate_2[..., None, None] * slot_2
    return combine, slot_1 + slot_2, aux


def moe_ffn(config: MoEConfig, p: dict, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Top-2 routed expert FFN on x [B,S,M]; returns (output [B,S,M], aux loss)."""
    batch, seq_len, hidden = x.shape
    xg = x.reshape(-1, config.expert_group_size, hidden)
    logits = jnp.einsum("gsm,me->gse", xg, p["wg"])
    gates = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    combine, dispatch, aux = top2_gating(gates, config.capacity)
    expert_in = jnp.einsum("gsec,gsm->egcm", dispatch.astype(x.dtype), xg)
    h = jax.nn.gelu(jnp.einsum("egcm,emh->egch", expert_in, p["wi"]))
    expert_out = jnp.einsum("egch,ehm->egcm", h, p["wo"])
    out = jnp.einsum("gsec,egcm->gsm", combine.astype(x.dtype), expert_out)
    return out.reshape(batch, seq_len, hidden), aux


def forward(config: MoEConfig, params: dict, inputs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Token ids [B,S] -> (logits [B,S,V], summed auxiliary loss)."""
    seq_len = inputs.shape[1]
    x = params["wte"][inputs] + params["wpe"][None, :seq_len]
    mask = layers.causal_mask(seq_len)
    aux_total = jnp.zeros((), jnp.float32)
    for layer in params["layers"]:
        x = x + layers.attention(layer["attn"], layers.layer_norm(layer["ln1"], x), mask)
        y = layers.layer_norm(layer["ln2"], x)
        if "moe" in layer:
            y, aux = moe_ffn(config, layer["moe"], y)
            aux_total = aux_total + aux
        else:
            y = layers.ffn(layer["mlp"], y)
        x = x + y
    x = layers.layer_norm(params["ln_f"], x)
    return jnp.einsum("bsh,vh->bsv", x, params["wte"]), aux_total


def loss_fn(config: MoEConfig, params: dict, batch: dict) -> jax.Array:
    """Mean next-token cross-entropy + 0.01 * GShard auxiliary loss (float32 scalar)."""
    logits, aux = forward(config, params, batch["inputs"])
    return jnp.mean(layers.cross_entropy(logits, batch["targets"])) + AUX_LOSS_WEIGHT * aux


def make_batch(config: MoEConfig, key: jax.Array, batch_size: int, dtype: Any) -> dict:
    """{"inputs", "targets"}: int32 [B, S] token ids in [0, vocab)."""
    del dtype
    return layers.token_batch(key, batch_size, config.seq_len, config.vocab_size)


def check_batch_size(config: MoEConfig, batch_size: int) -> None:
    """Raise CfpError unless batch_size * seq_len is a multiple of expert_group_size."""
    tokens = batch_size * config.seq_len
    if tokens % config.expert_group_size:
        step = config.expert_group_size // math.gcd(config.expert_group_size, config.seq_len)
        raise CfpError(f"moe: batch_size*seq_len = {batch_size}*{config.seq_len} = {tokens} is not divisible "
                       f"by expert_group_size={config.expert_group_size}; use a batch_size that is a "
                       f"multiple of {step} or a smaller expert_group_size")


def flops_per_step(config: MoEConfig, batch_size: int) -> float:
    """Analytic training FLOPs: attention, dense FFNs, gating, dispatch/combine, experts, LM head."""
    tokens = batch_size * config.seq_len
    m, h, e, c = config.hidden_size, config.ffn, config.num_experts, config.capacity
    groups = tokens // config.expert_group_size
    dense = layers.transformer_flops(tokens, batch_size, config.seq_len, m, 2 * m * h)
    attn_only = layers.transformer_flops(tokens, batch_size, config.seq_len, m, 0)
    moe = attn_only + 2 * tokens * m * e + 2 * 2 * tokens * e * c * m + 2 * 2 * e * groups * c * m * h
    num_moe = config.num_layers // 2
    head = 2 * tokens * m * config.vocab_size
    return 3.0 * ((config.num_layers - num_moe) * dense + num_moe * moe + head)


SPEC = ModelSpec("moe", MoEConfig, PRESETS, DEFAULT_BATCH_SIZES, init_params, make_batch, loss_fn,
                 flops_per_step, check_batch_size)
