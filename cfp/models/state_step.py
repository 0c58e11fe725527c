"""The training step as users write it, mapped onto the step cfp plans.

cfp plans ``step(params, opt_state, batch) -> (params, opt_state, loss)``. Code written today
more often carries one state:

- a Flax ``TrainState`` (or any pytree record with a ``params`` field and a ``replace``
  method): ``train_step(state, batch) -> (state, metrics)``;
- an NNX ``(model, optimizer)``: ``train_step(model, optimizer, batch)`` updates both in place
  and returns the loss or metrics;
- plain JAX with Optax: ``init(key) -> (params, opt_state)`` and ``train_step(params,
  opt_state, batch) -> (params, opt_state, metrics)``, metrics beside the loss (the gradient
  norm, the learning rate).

``StateLayout`` splits such a state into cfp's two parts and back: ``params`` are the state's
parameters (the record's ``params``; NNX's ``nnx.Param`` variables), ``opt_state`` is every
other array of it (the step counter, a Python number made an array, the optimizer's moments,
batch statistics). What is not
an array (``apply_fn``, ``tx``, the NNX graph) is kept aside and put back. ``metrics`` is the
loss, or a mapping holding it under ``loss``.

Example:
    >>> import jax.numpy as jnp
    >>> from flax.training import train_state
    >>> import optax
    >>> state = train_state.TrainState.create(apply_fn=None, params={"w": jnp.ones(2)},
    ...                                       tx=optax.sgd(0.1))
    >>> layout = StateLayout.of(state)
    >>> params, rest = layout.split(state)
    >>> sorted(params), layout.merge(params, rest).step
    (['w'], Array(0, dtype=int32, weak_type=True))
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax

from cfp.errors import CfpError
from cfp.models.common import is_array, join_arrays, split_arrays


def _is_nnx(state) -> bool:
    try:
        from flax import nnx
    except ImportError:
        return False
    return any(isinstance(x, (nnx.Module, nnx.Optimizer))
               for x in (state if isinstance(state, tuple) else (state,)))


@dataclasses.dataclass(frozen=True)
class StateLayout:
    """How one user state splits into ``(params, opt_state)`` and is put back together."""

    nnx_graph: Any = None  # the NNX graphdef; None: a pytree record with ``params``
    rest_def: Any = None  # a record without its params (or a plain opt_state): its structure
    rest_static: tuple = ()  # and per leaf, None for an array, else the leaf kept aside
    plain: bool = False  # a plain (params, opt_state) pair
    # of a plain pair's params (an Equinox module, say), what is not an array: kept aside
    params_static: Any = None

    @classmethod
    def of(cls, state) -> "StateLayout":
        """The layout of ``state`` (a ``TrainState``-like record or an NNX tuple)."""
        if _is_nnx(state):
            from flax import nnx
            return cls(nnx_graph=nnx.split(state, nnx.Param, ...)[0])
        plain = isinstance(state, tuple) and len(state) == 2
        if not plain and not (hasattr(state, "params") and hasattr(state, "replace")):
            raise CfpError(f"init_state returned a {type(state).__name__}: give a Flax "
                           f"TrainState (a record with params and replace), an NNX "
                           f"(model, optimizer) or a plain (params, opt_state)")
        if plain:
            leaves, rest_def = jax.tree_util.tree_flatten(state[1])
            return cls(rest_def=rest_def, plain=True, params_static=split_arrays(state[0])[1],
                       rest_static=tuple(None if is_array(x) else x for x in leaves))
        leaves, rest_def = jax.tree_util.tree_flatten(_rest(state))
        return cls(rest_def=rest_def,
                   rest_static=tuple(None if is_array(x) else x for x in leaves))

    def split(self, state) -> tuple[Any, Any]:
        """``(params, opt_state)``: the state's parameters and its other arrays (the record
        without its params, ``None`` in place of what is not an array)."""
        if self.nnx_graph is not None:
            from flax import nnx
            _, params, rest = nnx.split(state, nnx.Param, ...)
            return params, rest
        if self.plain:
            return split_arrays(state[0])[0], split_arrays(state[1])[0]
        return state.params, split_arrays(_rest(state))[0]

    def merge(self, params, opt_state):
        """The user's state from its two parts (the leaves of ``opt_state`` are its arrays,
        or anything in their place, such as shardings)."""
        if self.nnx_graph is not None:
            from flax import nnx
            return nnx.merge(self.nnx_graph, params, opt_state)
        arrays = iter(jax.tree_util.tree_leaves(opt_state))
        leaves = [next(arrays) if x is None else x for x in self.rest_static]
        rest = jax.tree_util.tree_unflatten(self.rest_def, leaves)
        if self.plain:
            return join_arrays(params, self.params_static), rest
        return rest.replace(params=params)


def _rest(state):
    """A record without its params, its Python numbers (``TrainState.create``'s step
    counter, 0) made arrays: the state a step returns holds them as arrays."""
    import jax.numpy as jnp
    return jax.tree_util.tree_map(
        lambda x: jnp.asarray(x) if type(x) in (int, float) else x, state.replace(params=None))


def loss_of(metrics, where: str) -> jax.Array:
    """The loss in a step's ``metrics``: the scalar itself, or ``metrics["loss"]``."""
    if isinstance(metrics, dict) and "loss" in metrics:
        return metrics["loss"]
    if hasattr(metrics, "shape") and metrics.shape == ():
        return metrics
    raise CfpError(f"{where} returns {type(metrics).__name__} metrics: return the loss, or "
                   f"a dict holding it under 'loss'")


def _what(out) -> str:
    """What a step returned, in words: an array's shape, else its type."""
    if hasattr(out, "shape") and hasattr(out, "dtype"):
        return f"one array ({out.dtype}{list(out.shape)})"
    return f"a {type(out).__name__}" + (f" of {len(out)}" if isinstance(out, tuple) else "")


def adapt(train_step: Callable, layout_of: Callable[[], StateLayout]) -> Callable:
    """``train_step`` on the user's state as ``step(params, opt_state, batch) -> (params,
    opt_state, loss)``; ``layout_of()`` gives the state's layout once it is known."""
    name = getattr(train_step, "__name__", "train_step")

    def step(params, opt_state, batch):
        layout = layout_of()
        state = layout.merge(params, opt_state)
        if layout.nnx_graph is not None:  # updated in place
            metrics = train_step(*state, batch)
            new_state = state
        elif layout.plain:
            out = train_step(*state, batch)
            if not (isinstance(out, tuple) and len(out) == 3):
                raise CfpError(f"{name}(params, opt_state, batch) returns "
                               f"{_what(out)}, not (params, opt_state, metrics); a step "
                               f"that returns only the loss is planned with step='forward', "
                               f"as loss(params, batch)")
            new_state, metrics = out[:2], out[2]
        else:
            out = train_step(state, batch)
            if not (isinstance(out, tuple) and len(out) == 2):
                raise CfpError(f"{name}(state, batch) returns {_what(out)}, not "
                               f"(state, metrics)")
            new_state, metrics = out
        new_params, new_opt_state = layout.split(new_state)
        return new_params, new_opt_state, loss_of(metrics, name)

    step.layout_of = layout_of  # what the state is (the usage line after search asks)
    return step


def state_shardings(state, plan: dict, mesh):
    """A pytree like ``state`` (a ``TrainState``-like record) of ``NamedSharding``s, from the
    plan of the workload made from it: for ``jax.jit(train_step, in_shardings=(state_sh,
    batch_sh), out_shardings=(state_sh, None), donate_argnums=0)``; the new state comes out
    as it went in, so a loop passes each step's state to the next."""
    from cfp.plan import shardings
    layout = StateLayout.of(state)
    params, rest = layout.split(state)
    return layout.merge(shardings(params, plan, mesh, "params"),
                        shardings(rest, plan, mesh, "opt_state"))
