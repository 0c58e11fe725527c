"""The plan in the user's own jit, timed next to cfp's own planned step.

Three programs of one step under one plan, side by side in one process, taking turns one
step at a time over rounds (``cfp.execute.time_interleaved``), medians:

- ``cfp``: cfp's planned step (``cfp.execute.PlannedStep``, what search ran);
- ``plan.jit``: ``cfp.plan.jit(train_step, plan, mesh, ...)``: the user's step with the plan's
  layouts at its edges and the block constraints inside;
- ``edges only``: ``jax.jit(train_step, in_shardings=..., out_shardings=...)`` from
  ``cfp.plan.step_shardings``: the interior left to XLA's sharding propagation.

The plan is the work dir's ``plan.json`` (the default job's unless ``--workdir`` names
another; the job is run first if the plan is missing).

    python scripts/user_jit_bench.py --rounds 9

Writes ``scripts/results/<date>-user-jit-<backend>.csv`` (one row per program and round) and a
PNG of the medians.
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workdir", default=str(ROOT / "profiles" / "gpt-tiny-8"))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    from cfp.cli import main as cli
    workdir = Path(args.workdir)
    if not (workdir / "plan.json").exists():
        assert cli(["--memory-budget", "2", "--workdir", str(workdir)]) == 0

    import jax
    from cfp.execute import PlannedStep, example_inputs, time_interleaved, time_steps
    from cfp.models import adam_init
    from cfp.plan import jit as plan_jit
    from cfp.plan import DONATE_ARGNUMS, load_plan, step_shardings
    from cfp.records import read_record
    from cfp.collectives import collectives
    from cfp.workdir import ANALYSIS_FORMAT
    from cfp.mesh import make_mesh
    from cfp.tracing import trace_step

    analysis = read_record(workdir / "analysis.pkl", ANALYSIS_FORMAT, None, hint="")
    plan = load_plan(workdir / "plan.json")
    mesh = make_mesh(tuple(plan["mesh"]["shape"]))
    w = analysis.spec.build()
    params, batch = example_inputs(w)
    opt_state = jax.jit(w.opt_init or adam_init)(params)
    train_step = w.train_step()

    ours = PlannedStep(trace_step(w), analysis, [b["strategy_index"] for b in plan["blocks"]],
                       mesh)
    ours.compile()
    in_sh, out_sh = step_shardings(plan, mesh, params, opt_state, batch)
    compiled = {
        "cfp": ours.compiled,
        "plan.jit": plan_jit(train_step, plan, mesh, params, opt_state, batch)
        .lower(params, opt_state, batch).compile(),
        "edges only": jax.jit(train_step, in_shardings=in_sh, out_shardings=out_sh,
                              donate_argnums=DONATE_ARGNUMS)
        .lower(params, opt_state, batch).compile(),
    }

    def user_loop(c):  # the user's loop: the new (params, opt_state) fed back, donated
        args = list(jax.device_put((params, opt_state, batch), in_sh))

        def run():
            out = c(*args)
            args[:2] = out[:2]
            return out
        return run

    programs = {"cfp": ours.loop(jax.tree_util.tree_leaves((params, opt_state, batch))),
                "plan.jit": user_loop(compiled["plan.jit"]),
                "edges only": user_loop(compiled["edges only"])}
    mesh_shape = tuple(plan["mesh"]["shape"])
    colls = {name: len(collectives(c.as_text(), mesh_shape)) for name, c in compiled.items()}
    for run in programs.values():  # warm up
        time_steps(run, iters=2)
    backend = jax.devices()[0].platform
    names = list(programs)
    per_round = time_interleaved([programs[n] for n in names], rounds=args.rounds)
    rows = [(name, r, t) for name, times in zip(names, per_round) for r, t in enumerate(times)]
    date = datetime.date.today().isoformat()
    out = Path(args.out or ROOT / "scripts" / "results" / f"{date}-user-jit-{backend}.csv")
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        f.write("workload,mesh,backend,devices,program,round,step_s,collectives\n")
        for name, r, t in rows:
            f.write(f"{analysis.spec.label},{'x'.join(map(str, mesh_shape))},{backend},"
                    f"{len(jax.devices())},{name},{r},{t:.6g},{colls[name]}\n")
    medians = {n: statistics.median(t for m, _, t in rows if m == n) for n in names}
    for n in names:
        print(f"{n}: median {1e3 * medians[n]:.3f} ms per step over {args.rounds} rounds, "
              f"{colls[n]} collectives")
    print(f"plan source: {plan.get('source')}; wrote {out.relative_to(ROOT)}")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(4, 3))
    ax.bar(names, [1e3 * medians[n] for n in names])
    ax.set_ylabel("ms per step (median)")
    ax.set_title(f"{analysis.spec.label}, mesh {'x'.join(map(str, mesh_shape))}, {backend}")
    fig.tight_layout()
    fig.savefig(out.with_suffix(".png"), dpi=100)


if __name__ == "__main__":
    from cfp.host_memory import run_pooled
    run_pooled()  # timing measures programs, not the host allocator
    main()
