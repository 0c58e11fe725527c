"""Model presets and ``get_workload``: turn (model, preset, overrides) into a Workload."""
import dataclasses
import functools
from typing import Any

import jax

from cfp.errors import CfpError
from cfp.models import bert, gpt, llama, mlp, moe
from cfp.models.common import ModelSpec, canonical_dtype, check_batch_size, jnp_dtype
from cfp.models.workload import Workload

MODEL_NAMES = ("mlp", "gpt", "llama", "moe", "bert")
DEFAULT_PRESET = "tiny"
OVERRIDE_NAMES = ("num_layers", "seq_len", "hidden_size", "num_heads", "vocab_size", "num_experts",
                  "ffn_size", "expert_group_size")
PRESETS: dict[str, dict[str, Any]] = {
    spec.name: dict(spec.presets) for spec in (mlp.SPEC, gpt.SPEC, llama.SPEC, moe.SPEC, bert.SPEC)
}


def model_spec(model: str) -> ModelSpec:
    """The ModelSpec for ``model``, or CfpError listing the valid names."""
    specs = {"mlp": mlp.SPEC, "gpt": gpt.SPEC, "llama": llama.SPEC, "moe": moe.SPEC, "bert": bert.SPEC}
    key = model.lower() if isinstance(model, str) else model
    if key not in specs:
        raise CfpError(f"unknown model {model!r}; choose one of: {', '.join(MODEL_NAMES)}")
    return specs[key]


def _preset_key(spec: ModelSpec, config: str | None) -> str:
    """Canonical preset key (case-insensitive), or CfpError listing the valid presets."""
    name = DEFAULT_PRESET if config is None else config
    key = name.lower() if isinstance(name, str) else name
    if key not in spec.presets:
        raise CfpError(f"unknown preset {name!r} for model {spec.name!r}; "
                       f"choose one of: {', '.join(spec.presets)}")
    return key


def default_batch_size(model: str, config: str | None = None) -> int:
    """Default batch size of a preset (8 for every ``tiny``)."""
    spec = model_spec(model)
    return spec.default_batch_sizes[_preset_key(spec, config)]


def apply_overrides(model: str, config: Any, **overrides: Any) -> Any:
    """Return ``config`` with the non-None overrides applied (validated by the config class)."""
    changes = {k: v for k, v in overrides.items() if v is not None}
    fields = {f.name for f in dataclasses.fields(config)}
    for name in changes:
        if name not in OVERRIDE_NAMES:
            raise CfpError(f"unknown override {name!r}; valid overrides: {', '.join(OVERRIDE_NAMES)}")
        if name not in fields:
            valid = ", ".join(n for n in OVERRIDE_NAMES if n in fields)
            raise CfpError(f"model {model!r} has no {name!r}; its overrides are: {valid}")
    return dataclasses.replace(config, **changes) if changes else config


def make_workload(model: str, config: Any, *, batch_size: int, dtype: str = "float32",
                  config_name: str = "custom") -> Workload:
    """Build a Workload from an explicit config object of the model's config class."""
    spec = model_spec(model)
    if not isinstance(config, spec.config_cls):
        raise CfpError(f"model {spec.name!r} needs a {spec.config_cls.__name__}, got {type(config).__name__}")
    batch_size = check_batch_size(batch_size)
    if spec.check_batch_size is not None:
        spec.check_batch_size(config, batch_size)
    dtype = canonical_dtype(dtype)
    jdtype = jnp_dtype(dtype)
    return Workload(
        model=spec.name,
        config_name=config_name,
        config=config,
        batch_size=batch_size,
        dtype=dtype,
        init_params=functools.partial(_init, spec.init_params, config, jdtype),
        make_batch=functools.partial(_batch, spec.make_batch, config, batch_size, jdtype),
        loss_fn=functools.partial(spec.loss_fn, config),
        flops_per_step=functools.partial(spec.flops_per_step, config, batch_size),
    )


def _init(init_params, config, dtype, key: jax.Array) -> Any:
    """Adapter: key -> params."""
    return init_params(config, key, dtype)


def _batch(make_batch, config, batch_size, dtype, key: jax.Array) -> Any:
    """Adapter: key -> batch."""
    return make_batch(config, key, batch_size, dtype)


def get_workload(model: str, config: str | None = None, *, batch_size: int | None = None,
                 dtype: str = "float32", **overrides: Any) -> Workload:
    """Workload for a preset (default "tiny") with optional size overrides.

    Overrides: num_layers, seq_len, hidden_size, num_heads, vocab_size, num_experts, ffn_size,
    expert_group_size (None values are ignored). Bad input raises CfpError.
    """
    spec = model_spec(model)
    key = _preset_key(spec, config)
    cfg = apply_overrides(spec.name, spec.presets[key], **overrides)
    if batch_size is None:
        batch_size = spec.default_batch_sizes[key]
    return make_workload(spec.name, cfg, batch_size=batch_size, dtype=dtype, config_name=key)
