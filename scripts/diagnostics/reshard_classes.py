"""Whether the reshardings the profile times could be fewer: HF Flax T5 (2 layers per stack)
and tiny GPT on 2x4.

The profile times each distinct (shape, dtype, source layout, destination layout) once. This
counts them, then asks whether keys that move the same bytes between the same devices
compile to the same program:

- *merged*: a dim that neither layout splits joined to the dim before it, a size-1 dim
  dropped, and a leading mesh axis both layouts split a dim by taken off (the per-device
  data is the same, reshaped). Counted, and on a random sample of keys that merging changes,
  the compiled collectives (kind, mesh axes, bytes) of the key and of its merged form
  compared;
- *twins*: the keys of one shape whose compiled programs (``measure.normalized_hlo``) are
  equal.

Usage:
    PYTHONPATH=scripts python scripts/diagnostics/reshard_classes.py \\
        > scripts/results/<date>-reshard-classes-cpu.txt
"""
from __future__ import annotations

import argparse
import collections
import os
import random
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = Path(__file__).resolve().parents[2]
MESH, NAMES = (2, 4), ("m0", "m1")


def needed(model: str, size, extras) -> set:
    from cfp.passes.analysis import run_analysis
    from cfp.passes.profile import needed_reshards
    from cfp.windows import boundaries, split_windows
    from cfp.workloads import WorkloadSpec
    a = run_analysis(WorkloadSpec(model, size, None, "float32", extras).resolved(), MESH)
    return needed_reshards(boundaries(a, split_windows(a, 32)[0]), a.blocks.blocks, NAMES)


def _axes(entry) -> tuple:
    return () if entry is None else entry if isinstance(entry, tuple) else (entry,)


def _entry(axes: tuple):
    return None if not axes else axes[0] if len(axes) == 1 else axes


def merged(key: tuple) -> tuple:
    """``key`` with the leading mesh axes both layouts split a dim by taken off that dim,
    then each dim neither layout splits joined to the dim before it (size-1 dims dropped)."""
    shape, dtype, src, dst = key
    sizes = dict(zip(NAMES, MESH))
    dims, s_out, d_out = [], [], []
    for n, a, b in zip(shape, src, dst):
        a, b = _axes(a), _axes(b)
        while a and b and a[0] == b[0]:
            n, a, b = n // sizes[a[0]], a[1:], b[1:]
        if not a and not b and (dims or n == 1):
            if dims:
                dims[-1] *= n
            continue
        dims.append(n)
        s_out.append(_entry(a))
        d_out.append(_entry(b))
    return tuple(dims), dtype, tuple(s_out), tuple(d_out)


def compiled(mesh, key):
    from cfp.worker import _compile_reshard
    return _compile_reshard(mesh, *key)


def collectives_of(exe) -> list:
    from cfp.sharding import collectives
    return sorted((c.kind, c.axes, c.bytes) for c in collectives(exe.as_text(), MESH))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sample", type=int, default=120)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "scripts"))
    from cfp.measure import normalized_hlo
    from cfp.workloads import make_mesh
    mesh = make_mesh(MESH)
    print(f"# scripts/diagnostics/reshard_classes.py, mesh 2x4, max_combinations 32, "
          f"sample {args.sample}")
    for model, size, extras in (("t5_segments:hf_t5", None, (("num_layers", 2),)),
                                ("gpt", "tiny", ())):
        keys = needed(model, size, extras)
        per_shape = collections.Counter(k[:2] for k in keys)
        print(f"{model}: reshardings {len(keys)}, (shape, dtype) {len(per_shape)}, most "
              f"layout pairs of one {max(per_shape.values())}; merged forms "
              f"{len({merged(k) for k in keys})}")
        changed = sorted((k for k in keys if merged(k) != k), key=repr)
        sample = random.Random(0).sample(changed, min(args.sample, len(changed)))
        differ = [k for k in sample
                  if collectives_of(compiled(mesh, k)) != collectives_of(compiled(mesh, merged(k)))]
        print(f"  merged forms compiled to other collectives: {len(differ)} of {len(sample)}")
        for k in differ[:3]:
            print(f"    {k} -> {merged(k)}: {collectives_of(compiled(mesh, k))} against "
                  f"{collectives_of(compiled(mesh, merged(k)))}")
        if model.startswith("t5"):
            shape = max(per_shape, key=lambda s: (per_shape[s], repr(s)))
            of_shape = sorted((k for k in keys if k[:2] == shape), key=repr)
            programs = {normalized_hlo(compiled(mesh, k)) for k in of_shape}
            print(f"  {shape}: {len(of_shape)} reshardings compile to {len(programs)} "
                  f"distinct programs")


if __name__ == "__main__":
    main()
