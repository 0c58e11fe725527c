"""Segment types, window types and profiled combinations of the training recipes
(``cfp_test/recipes.py``) at 4 and 8 layers, on mesh 8, against the textbook step (Adam): a
recipe is planned layer by layer when its counts equal Adam's and do not grow with depth.

    python scripts/recipe_analysis.py [--out scripts/results/<date>-recipes-cpu.csv]

Analysis only (tracing and grouping, no compile): about a minute on 2 cores.
"""
import argparse
import datetime
import math
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cfp_test"))

MODELS = ("gpt", "llama", "flax", "flax_bf16")
MAX_COMBINATIONS = 100  # the profile pass's default


def counts(model: str, recipe: str, num_layers: int, mesh_shape=(8,)) -> dict:
    """The analysis of one recipe: blocks, segment types, window types and combinations."""
    from cfp.grouping import build_blocks
    from cfp.segments import find_segments
    from cfp.windows import split_windows, window_space
    from cfp.tracing import trace_step
    import recipes
    graph = trace_step(getattr(recipes, f"{model}_{recipe}")(num_layers=num_layers)).graph()
    blocks = build_blocks(graph, mesh_shape)
    segments = find_segments(graph, blocks)

    class Analysis:  # what split_windows and window_space read
        pass
    a = Analysis()
    a.graph, a.blocks, a.segments, a.mesh_shape = graph, blocks, segments, mesh_shape
    windows, reps = split_windows(a, MAX_COMBINATIONS)
    combos = sum(math.prod(window_space(a, windows[r])) for r in reps)
    return {"model": model, "recipe": recipe, "num_layers": num_layers,
            "blocks": len(blocks.blocks), "segment_types": segments.num_types,
            "window_types": len(reps), "combinations": combos}


def main() -> None:
    import pandas as pd
    import recipes
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=f"scripts/results/{datetime.date.today()}-recipes-cpu.csv")
    ap.add_argument("--models", default=",".join(MODELS))
    args = ap.parse_args()
    rows = []
    for model in args.models.split(","):
        for recipe in recipes.ALL:
            for num_layers in (4, 8):
                rows.append(counts(model, recipe, num_layers))
                print(rows[-1], flush=True)
    df = pd.DataFrame(rows)
    adam = df[df.recipe == "adam"].set_index(["model", "num_layers"])
    cols = ["segment_types", "window_types", "combinations"]
    df["segment_types_as_adam"] = [
        r.segment_types == adam.loc[(r.model, r.num_layers), "segment_types"]
        for r in df.itertuples()]
    wide = df.pivot_table(index=["model", "recipe"], columns="num_layers", values=cols)
    df["same_at_4_and_8"] = [all(wide.loc[(r.model, r.recipe), (c, 4)]
                                 == wide.loc[(r.model, r.recipe), (c, 8)] for c in cols[1:])
                             for r in df.itertuples()]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    df.to_csv(args.out, index=False)
    print(df.to_string(index=False))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
