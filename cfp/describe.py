"""A plan in words: which mesh axis splits which role, per segment of the step.

A block's strategy names, per mesh axis, the loop dim of its contraction that the axis
splits. Each loop dim plays a *role*, found in the graph as the rule-file baselines find theirs
(``cfp.baselines``), for any model:

- ``batch``: a dim that descends from a batch input's leading dim;
- ``experts``: a batch dim of the contraction that a parameter operand holds;
- ``heads``: any other batch dim of the contraction (attention's heads: both operands are
  activations);
- ``weight columns``: a free dim of a parameter operand (a column-parallel split);
- ``weight rows``: a contracting dim of a parameter operand (a row-parallel split, summed by
  an all-reduce);
- ``activations``: a free or contracting dim that only activations hold (a sequence).

A plan is "the same program as" a hand plan when every block has the strategy the hand plan's
rule gives it (``cfp.baselines.baseline_strategy_indices``).

Example:
    >>> axis_words((0, None), ["batch", "heads"], ("m0", "m1"))
    ['m0 splits batch']
"""
from __future__ import annotations

ROLES = ("batch", "experts", "heads", "weight columns", "weight rows", "activations")


def loop_roles(analysis) -> list[list[str]]:
    """Per block, per loop dim of its contraction, the role that dim plays."""
    from cfp.baselines import params_and_data, static_roles
    g = analysis.graph
    params, data = params_and_data(analysis)
    out = []
    for b in analysis.blocks.blocks:
        found = static_roles(b, g, params, data)
        words = []
        for i, ld in enumerate(b.loop_dims):
            if i in found["data"]:
                words.append("batch")
            elif i in found["expert"]:
                words.append("experts")
            elif ld.kind == "batch":
                words.append("heads")
            elif i in found["weight_out"]:
                words.append("weight columns")
            elif i in found["weight_in"]:
                words.append("weight rows")
            else:
                words.append("activations")
        out.append(words)
    return out


def axis_words(axes, roles: list[str], axis_names) -> list[str]:
    """``<axis> splits <role>`` for each mesh axis a strategy's ``axes`` uses."""
    return [f"{name} splits {roles[loop]}" for name, loop in zip(axis_names, axes)
            if loop is not None]


def block_splits(analysis, strategies) -> list[dict[str, list[str]]]:
    """Per block, mesh axis name -> the roles it splits under ``strategies`` (a strategy
    index per block); an axis that splits nothing in the block is absent."""
    names = axis_names_of(analysis)
    roles = loop_roles(analysis)
    out = []
    for b, i in zip(analysis.blocks.blocks, strategies):
        axes = b.strategies[i].axes
        out.append({name: [roles[b.index][loop]] for name, loop in zip(names, axes)
                    if loop is not None})
    return out


def _segment_text(splits: list[dict[str, list[str]]], axis_names) -> str:
    """The roles each axis splits over a range of blocks, in ``ROLES`` order."""
    parts = []
    for name in axis_names:
        seen = [r for r in ROLES if any(r in s.get(name, ()) for s in splits)]
        if len(seen) == 1:
            parts.append(f"{name} splits {seen[0]}")
        elif len(seen) == 2:  # each block splits one: say so, not both of one weight
            parts.append(f"{name} splits {seen[0]} in some blocks, {seen[1]} in others")
        elif seen:
            parts.append(f"{name} splits {', '.join(seen[:-1])} or {seen[-1]}, one per "
                         f"block")
        else:
            parts.append(f"{name} splits nothing")
    return "; ".join(parts)


def axis_names_of(analysis) -> tuple[str, ...]:
    """The mesh's axis names, as the plan speaks them."""
    from cfp.mesh import AXIS_NAMES
    return tuple(getattr(analysis, "mesh_axes", None) or AXIS_NAMES[:len(analysis.mesh_shape)])


def state_layout_of(analysis, storage) -> str | None:
    """The one state layout every state leaf of ``storage`` takes, or None when they differ."""
    layouts = set((storage or _plain()).layouts(len(analysis.graph.state_pairs())))
    return layouts.pop() if len(layouts) == 1 else None


def state_of_blocks(analysis, storage, start: int, end: int) -> str:
    """Where ``storage`` keeps the state that blocks ``[start, end)`` read first and update
    (``cfp.windows.held_state``'s rule): its one layout (``zero1``), the count of leaves per
    layout where they differ (``layouts_text``), or "" where they hold none."""
    from collections import Counter
    from cfp.windows import Window, held_state
    layouts = (storage or _plain()).layouts(len(analysis.graph.state_pairs()))
    held = Counter(layouts[k] for k in held_state(analysis, Window(start, end, -1)))
    if len(held) <= 1:
        return next(iter(held), "")
    from cfp.execute import layouts_text
    return layouts_text(held)


def _plain():
    from cfp.execute import Storage
    return Storage()


def same_programs(analysis, strategies, storage=None) -> list[str]:
    """The hand plans (rule-file baselines) whose every block has the plan's strategy and
    that keep the state where the plan keeps it."""
    from cfp.baselines import baseline_strategy_indices
    layout = state_layout_of(analysis, storage)
    return [name for name, (idx, kept) in baseline_strategy_indices(analysis,
                                                                     storage=True).items()
            if tuple(idx) == tuple(strategies) and kept == layout]


def plan_words(analysis, strategies, storage=None, recompute: dict | None = None) -> list[str]:
    """The plan in words: one line per group of segment instances that split alike (the
    first says which hand plan it is the same program as, when it is one), where the
    state is kept when not as the blocks compute (``storage``), and per policy the layers
    it recomputes (``recompute``, ``cfp.recompute.Recompute.to_json``)."""
    names = axis_names_of(analysis)
    splits = block_splits(analysis, strategies)
    groups: dict[str, list] = {}
    for seg in analysis.segments.instances:
        text = _segment_text(splits[seg.start:seg.end], names)
        groups.setdefault(text, []).append(seg)
    lines = []
    for text, segs in groups.items():
        types = sorted({s.type for s in segs})
        whole = all(s.type not in types or s in segs for s in analysis.segments.instances)
        if len(groups) == 1:
            where = "every segment"
        elif whole:  # every instance of these types
            where = (f"segment type{'s' if len(types) > 1 else ''} "
                     f"{', '.join(map(str, types))} ({len(segs)} "
                     f"instance{'s' if len(segs) > 1 else ''})")
        else:
            where = "blocks " + ", ".join(str(s.start) if s.end == s.start + 1
                                          else f"{s.start}-{s.end - 1}" for s in segs)
        lines.append(f"{where}: {text}")
    if storage is not None and state_layout_of(analysis, storage) != "plan":
        lines[-1] += f"; state: {storage.describe()}"
    same = same_programs(analysis, strategies, storage)
    if same:
        lines.insert(0, "same program as " + " and ".join(same))
    return lines + recompute_words(analysis, recompute)


def recompute_words(analysis, recompute: dict | None) -> list[str]:
    """Per policy, the layers (segment instances, by their blocks) it recomputes, in JAX's
    names: what ``jax.checkpoint(layer, policy=...)`` on those layers does."""
    by_policy: dict[str, list[int]] = {}
    for layer in (recompute or {}).get("layers", ()):
        by_policy.setdefault(layer["policy"], []).append(layer["segment"])
    instances = analysis.segments.instances
    lines = []
    for policy, segments in by_policy.items():
        runs: list[list[int]] = []  # consecutive layers, as [first, last]
        for k in sorted(segments):
            if runs and runs[-1][1] == k - 1:
                runs[-1][1] = k
            else:
                runs.append([k, k])
        blocks = ", ".join(f"{instances[a].start}-{instances[b].end - 1}" for a, b in runs)
        lines.append(f"recompute {policy} (jax.checkpoint_policies.{policy}) on "
                     f"{len(segments)} of {len(instances)} segments: blocks {blocks}")
    return lines
