"""Validation and dtype helpers shared by the model zoo."""
import dataclasses
import numbers
import typing
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from cfp.errors import CfpError

DTYPE_NAMES = ("float32", "bfloat16")
_DTYPE_ALIASES = (("float32", "float32"), ("fp32", "float32"), ("f32", "float32"),
                  ("bfloat16", "bfloat16"), ("bf16", "bfloat16"))


def canonical_dtype(name: str) -> str:
    """Return the canonical dtype name ("float32" or "bfloat16") for ``name`` or raise CfpError."""
    for alias, canonical in _DTYPE_ALIASES:
        if isinstance(name, str) and name.lower() == alias:
            return canonical
    raise CfpError(f"unknown dtype {name!r}; use one of: {', '.join(DTYPE_NAMES)}")


def jnp_dtype(name: str) -> Any:
    """Map a dtype name to the jnp dtype object."""
    return jnp.bfloat16 if canonical_dtype(name) == "bfloat16" else jnp.float32


def check_positive_fields(config: Any) -> None:
    """Raise CfpError unless every field of the config dataclass is a positive integer.

    Fields whose default is None may be None (meaning "derive from other fields").
    """
    cls = type(config).__name__
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if value is None and field.default is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value <= 0:
            raise CfpError(f"{cls}.{field.name} must be a positive integer, got {value!r}; "
                           f"fix the preset or the override")


def check_heads(config: Any) -> None:
    """Raise CfpError unless num_heads divides hidden_size."""
    if config.hidden_size % config.num_heads:
        raise CfpError(f"num_heads={config.num_heads} does not divide hidden_size={config.hidden_size}; "
                       f"pick a num_heads that divides hidden_size")


def check_batch_size(batch_size: Any) -> int:
    """Return ``batch_size`` as int, or raise CfpError if it is not a positive integer."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, numbers.Integral) or batch_size <= 0:
        raise CfpError(f"batch_size must be a positive integer, got {batch_size!r}")
    return int(batch_size)


def param_count(tree: Any) -> int:
    """Total number of elements over the leaves of a pytree of arrays or ShapeDtypeStructs."""
    return int(sum(int(np.prod(leaf.shape, dtype=np.int64)) for leaf in jax.tree.leaves(tree)))


class ModelSpec(typing.NamedTuple):
    """Everything the registry needs to know about one model family."""

    name: str
    config_cls: type
    presets: Mapping[str, Any]               # preset key -> config
    default_batch_sizes: Mapping[str, int]   # preset key -> batch size
    init_params: Callable[..., Any]          # (config, key, dtype) -> params
    make_batch: Callable[..., Any]           # (config, key, batch_size, dtype) -> batch
    loss_fn: Callable[..., jax.Array]        # (config, params, batch) -> scalar float32
    flops_per_step: Callable[..., float]     # (config, batch_size) -> float
    check_batch_size: Callable[..., None] | None = None  # (config, batch_size) -> None or CfpError


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    """Hyper-parameters shared by the GPT and BERT families; ffn_size None means 4 * hidden."""

    num_layers: int
    hidden_size: int
    num_heads: int
    seq_len: int = 1024
    vocab_size: int = 51200
    ffn_size: int | None = None

    def __post_init__(self):
        check_positive_fields(self)
        check_heads(self)

    @property
    def ffn(self) -> int:
        """Feed-forward width."""
        return self.ffn_size or 4 * self.hidden_size


def is_array(x) -> bool:  # tracers, too: init_params runs under eval_shape and jit
    return isinstance(x, (jax.Array, np.ndarray))


def split_arrays(tree):
    """(the array leaves, the rest) of a pytree, each with ``None`` where the other holds."""
    params = jax.tree_util.tree_map(lambda x: x if is_array(x) else None, tree)
    rest = jax.tree_util.tree_map(lambda x: None if is_array(x) else x, tree)
    return params, rest


def join_arrays(params, rest):
    """The tree ``split_arrays`` split, whole again."""
    return jax.tree_util.tree_map(lambda p, r: r if p is None else p, params, rest,
                                  is_leaf=lambda x: x is None)
