"""An Equinox model at the top level of an importable module, as a step handed to
``cfp.autoshard`` needs its classes to be (``test_handed_step``): a two-layer MLP whose
activation function is a field that is not an array."""
from typing import Callable

import equinox as eqx
import jax


class Mlp(eqx.Module):
    up: eqx.nn.Linear
    down: eqx.nn.Linear
    activation: Callable = eqx.field(static=False, default=jax.nn.gelu)

    def __init__(self, width: int, hidden: int, key):
        k1, k2 = jax.random.split(key)
        self.up = eqx.nn.Linear(width, hidden, key=k1)
        self.down = eqx.nn.Linear(hidden, width, key=k2)
        self.activation = jax.nn.gelu

    def __call__(self, x):
        return self.down(self.activation(self.up(x)))
