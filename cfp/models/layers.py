"""Shared building blocks: initializers, norms, attention, rotary embeddings, losses.

Parameters are plain dicts of arrays; every function here is pure and unrolled (no scan, no remat).
one_hot / select / log_softmax / silu are written with lax primitives so the traced step has no
nested jit calls (jnp.where, jax.nn.one_hot etc. trace as inner jit equations).
"""
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax import lax

INIT_STD = 0.02
NEG_INF = -1e9  # additive mask value; scores are float32 so this is safe

Params = dict[str, Any]


def normal(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """N(0, 0.02^2) weights, drawn in float32 and cast to ``dtype``."""
    return (INIT_STD * jax.random.normal(key, shape, jnp.float32)).astype(dtype)


def one_hot(ids: jax.Array, num_classes: int, dtype: Any) -> jax.Array:
    """One-hot encoding of integer ids along a new last axis, via an iota comparison."""
    classes = lax.broadcasted_iota(ids.dtype, (*ids.shape, num_classes), ids.ndim)
    return (ids[..., None] == classes).astype(dtype)


def select(mask: jax.Array, x: jax.Array, fill: float) -> jax.Array:
    """x where mask (broadcast to x's shape) is true, else ``fill``."""
    return lax.select(jnp.broadcast_to(mask, x.shape), x, lax.full_like(x, fill))


def log_softmax(x: jax.Array) -> jax.Array:
    """Numerically stable log-softmax over the last axis."""
    shifted = x - lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    return shifted - jnp.log(jnp.sum(jnp.exp(shifted), axis=-1, keepdims=True))


def silu(x: jax.Array) -> jax.Array:
    """x * sigmoid(x)."""
    return x * jax.nn.sigmoid(x)


def init_norm(hidden: int, dtype: Any, *, bias: bool = True) -> Params:
    """Norm parameters: scale ones (and bias zeros when ``bias``)."""
    p = {"scale": jnp.ones((hidden,), dtype)}
    if bias:
        p["bias"] = jnp.zeros((hidden,), dtype)
    return p


def layer_norm(p: Params, x: jax.Array, eps: float = 1e-5) -> jax.Array:
    """LayerNorm over the last axis; statistics in float32, output in x's dtype."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = ((x32 - mean) * lax.rsqrt(var + eps)).astype(x.dtype)
    return y * p["scale"] + p["bias"]


def rms_norm(p: Params, x: jax.Array, eps: float = 1e-5) -> jax.Array:
    """RMSNorm over the last axis; statistics in float32, output in x's dtype."""
    x32 = x.astype(jnp.float32)
    y = x32 * lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return y.astype(x.dtype) * p["scale"]


def init_dense(key: jax.Array, d_in: int, d_out: int, dtype: Any, *, bias: bool = True) -> Params:
    """Dense layer parameters: weight [d_in, d_out] (and bias [d_out])."""
    p = {"w": normal(key, (d_in, d_out), dtype)}
    if bias:
        p["b"] = jnp.zeros((d_out,), dtype)
    return p


def dense(p: Params, x: jax.Array) -> jax.Array:
    """x @ w (+ b)."""
    y = x @ p["w"]
    return y + p["b"] if "b" in p else y


def init_ffn(key: jax.Array, hidden: int, ffn: int, dtype: Any) -> Params:
    """Two-layer feed-forward block parameters (fc_in [hidden, ffn], fc_out [ffn, hidden], biases)."""
    k_in, k_out = jax.random.split(key)
    return {"fc_in": init_dense(k_in, hidden, ffn, dtype), "fc_out": init_dense(k_out, ffn, hidden, dtype)}


def ffn(p: Params, x: jax.Array, *, approximate: bool = True) -> jax.Array:
    """fc_out(gelu(fc_in(x)))."""
    return dense(p["fc_out"], jax.nn.gelu(dense(p["fc_in"], x), approximate=approximate))


def init_attention(key: jax.Array, hidden: int, heads: int, dtype: Any, *, bias: bool) -> Params:
    """Attention parameters: wq/wk/wv [hidden, heads, head_dim], wo [heads, head_dim, hidden]."""
    head_dim = hidden // heads
    kq, kk, kv, ko = jax.random.split(key, 4)
    p = {
        "wq": normal(kq, (hidden, heads, head_dim), dtype),
        "wk": normal(kk, (hidden, heads, head_dim), dtype),
        "wv": normal(kv, (hidden, heads, head_dim), dtype),
        "wo": normal(ko, (heads, head_dim, hidden), dtype),
    }
    if bias:
        for name in ("bq", "bk", "bv"):
            p[name] = jnp.zeros((heads, head_dim), dtype)
        p["bo"] = jnp.zeros((hidden,), dtype)
    return p


def _project(p: Params, x: jax.Array, name: str) -> jax.Array:
    """Project x [B,S,H] to [B,S,N,D] with weight w<name> (and bias b<name> if present)."""
    y = jnp.einsum("bsh,hnd->bsnd", x, p["w" + name])
    return y + p["b" + name] if "b" + name in p else y


def attention(p: Params, x: jax.Array, mask: jax.Array,
              rope: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """Multi-head self-attention; ``mask`` is a bool array broadcastable to [B, N, Q, K]."""
    q, k, v = _project(p, x, "q"), _project(p, x, "k"), _project(p, x, "v")
    if rope is not None:
        q, k = rope(q), rope(k)
    q = q * (q.shape[-1] ** -0.5)
    scores = jnp.einsum("bqnd,bknd->bnqk", q, k).astype(jnp.float32)
    scores = select(mask, scores, NEG_INF)
    probs = jax.nn.softmax(scores, axis=-1).astype(x.dtype)
    ctx = jnp.einsum("bnqk,bknd->bqnd", probs, v)
    out = jnp.einsum("bsnd,ndh->bsh", ctx, p["wo"])
    return out + p["bo"] if "bo" in p else out


def causal_mask(seq_len: int) -> jax.Array:
    """Bool [1, 1, S, S] lower-triangular mask, built from iota inside the step."""
    row = lax.broadcasted_iota(jnp.int32, (seq_len, seq_len), 0)
    col = lax.broadcasted_iota(jnp.int32, (seq_len, seq_len), 1)
    return (row >= col)[None, None]


def padding_mask(attention_mask: jax.Array) -> jax.Array:
    """Bool [B, 1, 1, S] key mask from a [B, S] 0/1 attention mask."""
    return (attention_mask > 0)[:, None, None, :]


def rotary(x: jax.Array, base: float = 10000.0) -> jax.Array:
    """Rotary position embedding on [B, S, N, D] (split-halves convention), computed in float32."""
    seq_len, head_dim = x.shape[1], x.shape[3]
    half = head_dim // 2
    pos = lax.broadcasted_iota(jnp.float32, (seq_len, half), 0)
    idx = lax.broadcasted_iota(jnp.float32, (seq_len, half), 1)
    angles = pos * jnp.power(base, -2.0 * idx / head_dim)
    cos, sin = jnp.cos(angles)[None, :, None, :], jnp.sin(angles)[None, :, None, :]
    x32 = x.astype(jnp.float32)
    x1, x2 = x32[..., :half], x32[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Per-position cross-entropy in float32 (one-hot formulation, no gather)."""
    logp = log_softmax(logits.astype(jnp.float32))
    onehot = one_hot(targets, logits.shape[-1], jnp.float32)
    return -jnp.sum(onehot * logp, axis=-1)


def token_batch(key: jax.Array, batch_size: int, seq_len: int, vocab_size: int) -> dict[str, jax.Array]:
    """Next-token batch {"inputs", "targets"}: int32 [B, S], targets = inputs shifted by one."""
    tokens = jax.random.randint(key, (batch_size, seq_len + 1), 0, vocab_size, dtype=jnp.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def transformer_flops(tokens: int, batch_size: int, seq_len: int, hidden: int, ffn_matmul_params: int) -> float:
    """Forward FLOPs of one transformer layer: projections, attention scores/context, FFN matmuls."""
    proj = 2 * tokens * 4 * hidden * hidden
    attn = 2 * 2 * batch_size * seq_len * seq_len * hidden
    return float(proj + attn + 2 * tokens * ffn_matmul_params)
