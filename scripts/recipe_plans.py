"""The training recipes planned end to end and run as the user's loop: for each (model,
recipe, mesh) at 2 layers, the three passes (``cfp.autoshard``), then three donated steps of
the user's own step under ``plan.jit`` and under ``jax.jit`` with ``plan.shardings``, each
step's loss against one device's.

    python scripts/recipe_plans.py [--models gpt] [--recipes clip,multisteps] [--meshes 8,2x4]
        [--max-combinations 4 --iters 2]

Writes ``scripts/results/<date>-recipe-plans-cpu.csv`` (``--out``; a case run again replaces
its row there, the others stay) and a plot beside it. Each case runs the whole job
(analysis, profile, search): 2 to 6 minutes on 2 cores at mesh 8, more on 2x4, which times
more reshardings. CPU, 8 virtual devices: the times say nothing of speed-ups; the loss
errors and memory are what count.
"""
import argparse
import datetime
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
TESTS = str(Path(__file__).resolve().parents[1] / "cfp_test")
sys.path.insert(0, TESTS)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [TESTS, os.environ.get("PYTHONPATH")]))


def users_step(model: str, recipe: str):
    """(the user's own step as written, a function that picks the loss from what it returns
    beside the state): Optax's recipes as ``train_step(params, opt_state, batch)``; the
    plain steps return their metrics. ``None`` for a ``TrainState`` step."""
    import jax
    import optax
    import recipes
    if recipe.startswith("accumulate"):
        return None, None
    loss_fn, _, _ = recipes.parts(model, 2)
    if recipe == "bf16_cast":
        base = loss_fn

        def loss_fn(params, b):  # noqa: F811
            return base(jax.tree.map(lambda p: p.astype("bfloat16"), params), b)
    tx = recipes.optimizer(recipe)
    if recipe in ("hand_clip", "clip_metrics"):
        return recipes.plain_step(loss_fn, tx, recipe == "hand_clip"), lambda m: m["loss"]

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    return train_step, lambda m: m


def loop_errors(plan, workload, model: str, recipe: str) -> dict:
    """The largest relative loss error over three donated steps, per way of running."""
    import jax
    import numpy as np
    from cfp.execute import example_inputs
    from cfp.plan import DONATE_ARGNUMS
    from helpers import run_loop
    step, loss = users_step(model, recipe)
    params, batch = example_inputs(workload)
    opt_state = jax.jit(workload.opt_init)(params)
    host = jax.tree_util.tree_map(np.asarray, (params, opt_state, batch))
    if step is None:  # a TrainState step: the state's shardings (cfp.models.state_step)
        step, loss = workload.state_step, lambda m: m
    ref = run_loop(jax.jit(step), *host, loss=loss)[0]
    in_sh, out_sh = plan.shardings(*host)
    runs = {"plan_jit": plan.jit(step, *host),
            "jax_jit": jax.jit(step, in_shardings=in_sh, out_shardings=out_sh,
                               donate_argnums=DONATE_ARGNUMS)}
    out = {}
    for name, run in runs.items():
        got = run_loop(run, *jax.device_put(host, in_sh), loss=loss)[0]
        out[f"loss_rel_err_{name}"] = max(abs(a - b) / abs(b) for a, b in zip(got, ref))
    return out


def one_case(model: str, recipe: str, mesh: str, workdir: Path,
             max_combinations: int | None = None, iters: int | None = None) -> dict:
    import json
    import pandas as pd
    import cfp
    start = time.perf_counter()
    plan = cfp.autoshard(f"recipes:{model}_{recipe}", mesh=mesh, memory_budget_gb=2,
                         workdir=workdir, num_layers=2, max_combinations=max_combinations,
                         iters=iters)
    seconds = time.perf_counter() - start
    report = json.loads((workdir / "debug_search" / "report.json").read_text())
    profile = pd.read_csv(workdir / "profile.csv")
    import recipes
    factory = getattr(recipes, f"{model}_{recipe}")
    row = {"model": model, "recipe": recipe, "mesh": mesh, "job_s": round(seconds, 1),
           "max_combinations": max_combinations or "all", "iters": iters or "auto",
           "window_types": profile.window_type.nunique(), "combinations": len(profile),
           "unexpected_collective": int((profile.status == "unexpected_collective").sum()),
           "kept": report["source"],
           "compiled_mb": round(report["memory_gb"] * 2**30 / 1e6, 3),
           "composed_mb": round(report["composed_memory_gb"] * 2**30 / 1e6, 3)}
    row.update(loop_errors(plan, factory(num_layers=2), model, recipe))
    return row


def main() -> None:
    import recipes
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="gpt,llama,flax")
    ap.add_argument("--recipes", default=",".join(recipes.ALL))
    ap.add_argument("--meshes", default="8,2x4")
    ap.add_argument("--workdir", default="profiles/recipes")
    ap.add_argument("--max-combinations", type=int, default=None,
                    help="per window type (cfp's option); default: all")
    ap.add_argument("--iters", type=int, default=None,
                    help="steps per validation round (cfp's option); default: cfp's")
    ap.add_argument("--out", default=f"scripts/results/{datetime.date.today()}"
                                     f"-recipe-plans-cpu.csv")
    args = ap.parse_args()
    rows = []
    for model in args.models.split(","):
        for recipe in args.recipes.split(","):
            for mesh in args.meshes.split(","):
                wd = Path(args.workdir) / f"{model}-{recipe}-{mesh}"
                rows.append(one_case(model, recipe, mesh, wd, args.max_combinations,
                                     args.iters))
                print(rows[-1], flush=True)
                df = with_rows(args.out, rows)
                df.to_csv(args.out, index=False)
    print(df.to_string(index=False))
    plot(df, Path(args.out).with_suffix(".png"))
    print(f"wrote {args.out}")


def with_rows(path: str, rows: list[dict]):
    """The CSV at ``path`` (if any) with ``rows`` in place of its rows of the same model,
    recipe and mesh: a rerun of a case replaces it, the other cases stay."""
    import pandas as pd
    new = pd.DataFrame(rows).astype({"mesh": str})
    if not Path(path).exists():
        return new
    old = pd.read_csv(path, dtype={"mesh": str})
    key = ["model", "recipe", "mesh"]
    kept = old[~old.set_index(key).index.isin(new.set_index(key).index)]
    return pd.concat([kept, new], ignore_index=True)


def plot(df, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(max(6, len(df) * 0.5), 4))
    labels = [f"{r.model} {r.recipe} {r.mesh}" for r in df.itertuples()]
    ax.bar(range(len(df)), df.compiled_mb, label="compiled peak")
    ax.plot(range(len(df)), df.composed_mb, "k_", markersize=14, label="composed")
    ax.set_xticks(range(len(df)), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("MB per device (CPU, 8 virtual devices)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


if __name__ == "__main__":
    main()
