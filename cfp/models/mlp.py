"""Plain MLP: a stack of Dense layers with gelu between them, MSE against a random target."""
import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from cfp.models import layers
from cfp.models.common import ModelSpec, check_positive_fields


@dataclasses.dataclass(frozen=True)
class MLPConfig:
    """MLP hyper-parameters; input_size / output_size None mean hidden_size."""

    num_layers: int
    hidden_size: int
    input_size: int | None = None
    output_size: int | None = None

    def __post_init__(self):
        check_positive_fields(self)

    def widths(self) -> list[int]:
        """Layer boundary widths: [in, hidden, ..., hidden, out] (num_layers + 1 entries)."""
        inner = [self.hidden_size] * (self.num_layers - 1)
        return [self.input_size or self.hidden_size, *inner, self.output_size or self.hidden_size]


PRESETS = {
    "tiny": MLPConfig(4, 64),
    "wide": MLPConfig(8, 4096),
}
DEFAULT_BATCH_SIZES = {"tiny": 8, "wide": 1024}


def init_params(config: MLPConfig, key: jax.Array, dtype: Any) -> dict:
    """Parameters: layers[i] = {"w": [in, out], "b": [out]}."""
    widths = config.widths()
    keys = jax.random.split(key, config.num_layers)
    return {"layers": [layers.init_dense(keys[i], widths[i], widths[i + 1], dtype)
                       for i in range(config.num_layers)]}


def forward(params: dict, x: jax.Array) -> jax.Array:
    """Dense, gelu, Dense, ..., Dense (no activation after the last layer)."""
    for i, layer in enumerate(params["layers"]):
        if i:
            x = jax.nn.gelu(x)
        x = layers.dense(layer, x)
    return x


def loss_fn(config: MLPConfig, params: dict, batch: dict) -> jax.Array:
    """Mean squared error in float32."""
    del config
    err = forward(params, batch["x"]).astype(jnp.float32) - batch["y"].astype(jnp.float32)
    return jnp.mean(jnp.square(err))


def make_batch(config: MLPConfig, key: jax.Array, batch_size: int, dtype: Any) -> dict:
    """{"x": [B, in], "y": [B, out]} standard-normal floats in ``dtype``."""
    widths = config.widths()
    k_x, k_y = jax.random.split(key)
    return {"x": jax.random.normal(k_x, (batch_size, widths[0]), jnp.float32).astype(dtype),
            "y": jax.random.normal(k_y, (batch_size, widths[-1]), jnp.float32).astype(dtype)}


def flops_per_step(config: MLPConfig, batch_size: int) -> float:
    """Analytic training FLOPs (3x forward matmul FLOPs)."""
    widths = config.widths()
    return 3.0 * sum(2.0 * batch_size * a * b for a, b in zip(widths[:-1], widths[1:]))


SPEC = ModelSpec("mlp", MLPConfig, PRESETS, DEFAULT_BATCH_SIZES, init_params, make_batch, loss_fn,
                 flops_per_step)
