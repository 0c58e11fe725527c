"""Hugging Face's Flax T5 (a small configuration) through cfp's analysis on a 2x4 mesh:
segments, window types, the combinations and reshardings the profile would time, at 2, 4 and
8 layers per stack; with ``--profile L``, the measured profile of L layers per stack, timed.

T5 hands every layer of a stack the relative-position bias its first layer computed, and every
decoder layer the encoder's output: values no layer owns (``cfp.segments.common_values``).
Needs ``transformers<4.50`` (its Flax T5), which is not a dependency of cfp; under JAX 0.10
its ``jnp.clip(a_min=..., a_max=...)`` calls are mapped onto ``jnp.clip(min=..., max=...)``.

Usage:
    PYTHONPATH=scripts python scripts/t5_segments.py > scripts/results/<date>-t5-segments-cpu.txt
    PYTHONPATH=scripts python scripts/t5_segments.py --profile 2 \
        > scripts/results/<date>-t5-profile-cpu.txt
"""
from __future__ import annotations

import argparse
import collections
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _patch_clip():
    """``jnp.clip`` taking the ``a_min``/``a_max`` keywords JAX 0.10 no longer takes."""
    import jax.numpy as jnp
    clip = jnp.clip
    if getattr(clip, "takes_a_min", False):
        return

    def patched(a, a_min=None, a_max=None, **kw):
        return clip(a, kw.pop("min", a_min), kw.pop("max", a_max), **kw)

    patched.takes_a_min = True
    jnp.clip = patched


def hf_t5(batch_size: int = 4, dtype: str = "float32", num_layers: int = 2,
          seq_len: int = 16, target_len: int = 8):
    """``FlaxT5ForConditionalGeneration`` with ``num_layers`` encoder and decoder layers
    (d_model 32, 4 heads, feed-forward 128, vocabulary 64, no dropout), cross-entropy on
    the next target token."""
    import jax
    import jax.numpy as jnp
    from transformers import FlaxT5ForConditionalGeneration, T5Config

    from cfp.models import Workload
    _patch_clip()
    vocab = 64
    config = T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=128, num_layers=num_layers,
                      num_decoder_layers=num_layers, num_heads=4,
                      relative_attention_num_buckets=8, relative_attention_max_distance=16,
                      dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    model = FlaxT5ForConditionalGeneration(config, seed=0, _do_init=False)

    def init(key):
        return model.init_weights(key, (batch_size, seq_len))

    def batch(key):
        k1, k2 = jax.random.split(key)
        target = jax.random.randint(k2, (batch_size, target_len + 1), 0, vocab)
        return {"x": jax.random.randint(k1, (batch_size, seq_len), 0, vocab),
                "y_in": target[:, :-1], "y": target[:, 1:]}

    def loss(params, b):
        logits = model(b["x"], decoder_input_ids=b["y_in"], params=params).logits
        logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
        return -jnp.mean(jnp.sum(logp * jax.nn.one_hot(b["y"], vocab), axis=-1))

    return Workload("hf_t5", "small", None, batch_size, dtype, init, batch, loss)


def counts(num_layers: int, mesh_shape=(2, 4), max_combinations: int = 32) -> dict:
    """What the analysis finds and what the profile would time, for ``num_layers``."""
    from cfp.passes.analysis import run_analysis
    from cfp.passes.profile import needed_reshards
    from cfp.windows import boundaries, split_windows, window_space
    from cfp.mesh import AXIS_NAMES
    from cfp.workloads import WorkloadSpec
    spec = WorkloadSpec("t5_segments:hf_t5", None, None, "float32",
                        (("num_layers", num_layers),)).resolved()
    a = run_analysis(spec, mesh_shape)
    windows, reps = split_windows(a, max_combinations)
    per_type = collections.Counter(s.type for s in a.segments.instances)
    return {
        "layers": num_layers,
        "blocks": len(a.blocks.blocks),
        "segment types (blocks: instances)": ", ".join(
            f"{s.end - s.start}: {per_type[s.type]}" for s in
            (a.segments.instances[r] for r in a.segments.representatives)),
        "window types": len(reps),
        "combinations": sum(math.prod(window_space(a, windows[r])) for r in reps),
        "reshardings": len(needed_reshards(boundaries(a, windows), a.blocks.blocks,
                                           AXIS_NAMES[:len(mesh_shape)])),
    }


def profile(num_layers: int, mesh_shape=(2, 4)) -> dict:
    """The measured profile (cfp's defaults) of ``num_layers`` per stack: wall seconds, per
    phase too, and what it timed."""
    from cfp.passes.analysis import run_analysis
    from cfp.passes.profile import ProfileOptions, run_profile
    from cfp.workloads import WorkloadSpec
    spec = WorkloadSpec("t5_segments:hf_t5", None, None, "float32",
                        (("num_layers", num_layers),)).resolved()
    a = run_analysis(spec, mesh_shape)
    rec = run_profile(a, ProfileOptions())
    return {"layers": num_layers, "profile_s": f"{rec.time_s:.1f}",
            "window types": len(rec.representatives),
            "combinations": sum(len(p.results) for p in rec.window_profiles.values()),
            "compiled": rec.compiled, "reshardings": len(rec.reshard_s),
            "phases_s": " ".join(f"{k}={v:.1f}" for k, v in rec.phase_s.items())}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", type=int, metavar="LAYERS",
                        help="run the measured profile at this many layers per stack, timed")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "scripts"))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    import cfp
    print(f"# scripts/t5_segments.py at {commit}, cfp from {Path(cfp.__file__).parent}, "
          f"{os.cpu_count()} cores, mesh 2x4 of virtual CPU devices, max_combinations 32")
    if args.profile:
        print(f"# load average before: {_load()}", flush=True)
        row = profile(args.profile)
        print(f"# load average after: {_load()}")
        print("  ".join(f"{k}={v}" for k, v in row.items()))
        return
    for n in (2, 4, 8):
        print("  ".join(f"{k}={v}" for k, v in counts(n).items()), flush=True)


def _load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg()) + " (1, 5, 15 min)"


if __name__ == "__main__":
    main()
