"""The JAX calls whose spelling depends on the JAX version, in one place.

cfp is tested on JAX 0.10.x (CPU) and 0.11.x (GPU); everything else it calls is public API
that both spell alike.
"""
from __future__ import annotations

import logging

import jax

log = logging.getLogger(__name__)

# What JAX raises when XLA fails to compile or run a program (out of memory, an unsupported
# layout): the failure of the item measured, not of cfp. 0.10 and 0.11 name it alike.
JAX_ERRORS = (jax.errors.JaxRuntimeError,)


def enable_compilation_cache(directory: str | None) -> None:
    """Keep every compiled program in JAX's persistent compilation cache at ``directory``
    (no size or compile-time threshold), so a rerun or a resumed profile loads what it
    compiled before instead of compiling it again. ``None`` leaves JAX's setting alone."""
    if not directory:
        return
    jax.config.update("jax_compilation_cache_dir", str(directory))
    for name, value in (("jax_persistent_cache_min_compile_time_secs", 0.0),
                        ("jax_persistent_cache_min_entry_size_bytes", 0)):
        try:
            jax.config.update(name, value)
        except AttributeError:  # an option this JAX does not have: its default applies
            log.info("JAX has no option %s", name)
