"""Adam, written by hand on pytrees (no optax)."""
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp


class AdamState(NamedTuple):
    """Adam optimizer state: step count (int32 scalar) and first/second moments (params-shaped)."""

    count: jax.Array
    mu: Any
    nu: Any


def adam_init(params: Any) -> AdamState:
    """Zero Adam state for ``params``; moments take each parameter's shape and dtype."""
    zeros = lambda p: jnp.zeros(p.shape, p.dtype)  # noqa: E731 - works on ShapeDtypeStructs too
    return AdamState(count=jnp.zeros((), jnp.int32),
                     mu=jax.tree.map(zeros, params),
                     nu=jax.tree.map(zeros, params))


def _adam_leaf(g, m, v, p, *, lr, b1, b2, eps, c1, c2):
    """One parameter's Adam update, computed in float32 and cast back to the stored dtypes."""
    g32 = g.astype(jnp.float32)
    m32 = b1 * m.astype(jnp.float32) + (1.0 - b1) * g32
    v32 = b2 * v.astype(jnp.float32) + (1.0 - b2) * jnp.square(g32)
    p32 = p.astype(jnp.float32) - lr * (m32 / c1) / (jnp.sqrt(v32 / c2) + eps)
    return p32.astype(p.dtype), m32.astype(m.dtype), v32.astype(v.dtype)


def adam_update(grads: Any, state: AdamState, params: Any, *, lr: float = 1e-3, b1: float = 0.9,
                b2: float = 0.999, eps: float = 1e-8) -> tuple[Any, AdamState]:
    """One bias-corrected Adam step; returns (new_params, new_state)."""
    count = state.count + 1
    t = count.astype(jnp.float32)
    c1, c2 = 1.0 - b1 ** t, 1.0 - b2 ** t
    p_leaves, treedef = jax.tree.flatten(params)
    g_leaves = treedef.flatten_up_to(grads)
    m_leaves = treedef.flatten_up_to(state.mu)
    v_leaves = treedef.flatten_up_to(state.nu)
    out = [_adam_leaf(g, m, v, p, lr=lr, b1=b1, b2=b2, eps=eps, c1=c1, c2=c2)
           for g, m, v, p in zip(g_leaves, m_leaves, v_leaves, p_leaves)]
    new_params, new_mu, new_nu = (jax.tree.unflatten(treedef, [o[i] for o in out]) for i in range(3))
    return new_params, AdamState(count=count, mu=new_mu, nu=new_nu)
