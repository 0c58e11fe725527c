"""Plans for A100s made with no GPU here, their memory against XLA's compile for the A100s.

``--part 6.7b``: GPT-6.7B in bfloat16, batch 16, on ``a100-8`` (80 GB per device), mesh 8, the
full 32 layers. The profile is made two ways, each timed:
  analytic  every window priced from the analysis, nothing compiled (``cfp/analytic.py``);
  A100      every window combination and resharding compiled, compile only, for 8 A100s by
            XLA's GPU compiler, no GPU here (``cfp.gpu_compile``), its memory that compile's.
For each, cfp's plan and every hand plan priced from it: predicted step, composed memory per
device, and the whole 32-layer step compiled for 8 A100s, with composed over compiled.

``--part rows``: the memory-bound rows (gpt and llama at hidden 256, sequence 128, 8 heads, 2
layers, batch 8, float32) on meshes 8 and 2x4 of ``a100-8``. Per row: the windows compiled for
8 A100s; every hand plan's whole step compiled for the A100s and on 8 CPU devices; then cfp's
plan predicted under a budget of 1.1 x the fsdp hand plan's A100 peak, and its own whole step
compiled for the A100s (where the composition's first plan is over the budget once compiled,
search calibrates it on that peak and solves again, as it does before running plans), which
must fit that budget. A CSV row per plan and a plot.

Needs JAX's CUDA plugin (``pip install -e ".[gpu-compile]"``, in the ``dev`` extra)::

    python scripts/cluster_memory_check.py --part 6.7b|rows [--models gpt,llama] [--meshes 8,2x4]
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZE = (("hidden_size", 256), ("num_heads", 8), ("num_layers", 2), ("seq_len", 128))
CASE = ["--model", "gpt", "--config", "6.7b", "--batch-size", "16", "--dtype", "bfloat16",
        "--cluster", "a100-8", "--mesh", "8"]


def analysis_of(workdir: Path):
    from cfp.cli import main
    from cfp.cluster import load_cluster
    from cfp.workdir import WorkDir
    from cfp.workloads import WorkloadSpec, run_fingerprint
    if main(CASE + ["--workdir", str(workdir), "--mode", "analysis"]):
        raise SystemExit("cfp --mode analysis failed")
    spec = WorkloadSpec("gpt", "6.7b", 16, "bfloat16", ()).resolved()
    wd = WorkDir(workdir, run_fingerprint(spec, (8,)) + (("cluster", repr(load_cluster("a100-8"))),))
    return wd.read_analysis()


def plans_of(analysis, profile, budget_bytes):
    """The prediction, and (name, predicted seconds, composed bytes, strategies, storage) of
    cfp's plan and each hand plan priced from ``profile``, fastest first."""
    from cfp.passes.search import predict_plan
    from cfp.problem import baseline_candidates, build_problem, plan_storage
    pred = predict_plan(analysis, profile, budget_bytes, 60.0)
    problem = build_problem(analysis, profile, None)[0]
    hand = dict(baseline_candidates(analysis, problem, [], within_budget=False))
    rows = [("cfp", pred.predicted_s, pred.memory_bytes, pred.strategies, pred.storage)]
    rows += [(name, seconds, nbytes, hand[name].strategies,
              plan_storage(analysis, problem, profile.windows, hand[name].choices))
             for name, seconds, nbytes, _ in pred.hand_plans]
    return pred, sorted(rows, key=lambda r: r[1])


def part_67b(out: str) -> None:
    import jax
    from cfp.cluster import load_cluster
    from cfp.gpu_compile import gpu_mesh
    from cfp.passes.profile import ProfileOptions, run_profile
    from cfp.passes.search import compiled_peak_for
    jax.config.update("jax_enable_compilation_cache", False)  # every program compiled here
    gpus = gpu_mesh("a100", (8,), ("m0",))  # raises, in one line, without the plugin
    cluster = load_cluster("a100-8")
    lines = []

    def say(text):
        print(text, flush=True)
        lines.append(text)

    say(f"GPT-6.7B bfloat16, batch 16, {cluster.describe()}; mesh 8; "
        f"{os.cpu_count()} cores here; jax {jax.__version__}")
    with tempfile.TemporaryDirectory() as d:
        analysis = analysis_of(Path(d))
        for name, options in (
                ("analytic", ProfileOptions(cost="analytic", max_combinations=32,
                                            cost_model=cluster.cost_model((8,)))),
                ("A100", ProfileOptions(cost="model", max_combinations=32,
                                        cost_model=cluster.cost_model((8,)), compile_for="a100",
                                        memory_budget_bytes=cluster.memory_per_device_bytes))):
            t0 = time.perf_counter()
            profile = run_profile(analysis, options)
            profile_s = time.perf_counter() - t0
            results = [m for w in profile.window_profiles.values() for m in w.results.values()]
            statuses = {s: sum(m.status == s for m in results) for s in {m.status for m in results}}
            pred, rows = plans_of(analysis, profile, cluster.memory_per_device_bytes)
            say(f"profile {name}: {profile_s:.0f} s; {len(results)} combinations of "
                f"{len(profile.window_profiles)} window types {statuses}; "
                f"{len(profile.reshard_s)} reshardings; memory from {profile.memory_source()}")
            say(f"  cfp's state: {pred.storage.describe()}")
            for plan, seconds, nbytes, strategies, storage in rows:
                t0 = time.perf_counter()
                peak = compiled_peak_for(analysis, strategies, storage, "a100")
                say(f"  {plan:<10} predicted {seconds * 1e3:7.1f} ms, composed "
                    f"{nbytes / 2**30:6.2f} GiB, whole step compiled for 8 A100s "
                    f"{peak / 2**30:6.2f} GiB ({time.perf_counter() - t0:.0f} s), "
                    f"composed/compiled {nbytes / peak:.3f}")
    del gpus
    Path(out).write_text("python scripts/cluster_memory_check.py --part 6.7b\n" + "\n".join(lines)
                         + "\n")
    print(f"wrote {out}")


def part_rows(out: str, models: str, meshes: str) -> None:
    import jax
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import pandas as pd
    from cfp.cluster import load_cluster
    from cfp.execute import PlannedStep
    from cfp.measure import memory_of
    from cfp.passes.analysis import run_analysis
    from cfp.passes.profile import ProfileOptions, run_profile
    from cfp.passes.search import compiled_peak_for, predict_plan
    from cfp.problem import baseline_candidates, build_problem, plan_storage
    from cfp.tracing import trace_step
    from cfp.workloads import WorkloadSpec
    jax.config.update("jax_enable_compilation_cache", False)  # every program compiled here
    cluster = load_cluster("a100-8")
    rows = []
    for model in models.split(","):
        for mesh_text in meshes.split(","):
            shape = tuple(int(x) for x in mesh_text.split("x"))
            spec = WorkloadSpec(model, "tiny", None, "float32", SIZE).resolved()
            analysis = run_analysis(spec, shape)
            t0 = time.perf_counter()
            profile = run_profile(analysis, ProfileOptions(
                cost="model", max_combinations=32, cost_model=cluster.cost_model(shape),
                compile_for="a100", memory_budget_bytes=cluster.memory_per_device_bytes))
            profile_s = time.perf_counter() - t0
            problem = build_problem(analysis, profile, None)[0]
            program = trace_step(spec.build())
            peaks = {}
            for name, sol in baseline_candidates(analysis, problem, [], within_budget=False):
                storage = plan_storage(analysis, problem, profile.windows, sol.choices)
                cpu = PlannedStep(program, analysis, sol.strategies, analysis.mesh(), storage)
                peaks[name] = (compiled_peak_for(analysis, sol.strategies, storage, "a100"),
                               memory_of(cpu.compile())["peak_bytes"], sol.memory)
            if "fsdp" not in peaks:
                print(f"{model} {mesh_text}: no fsdp hand plan in the profile; row skipped")
                continue
            budget = int(1.1 * peaks["fsdp"][0])
            pred = predict_plan(analysis, profile, budget, 60.0)  # compiled for the A100s too
            own = pred.compiled_peak_bytes
            for name, (gpu, cpu, composed) in [*peaks.items(),
                                               ("cfp", (own, None, pred.memory_bytes))]:
                rows.append({"model": model, "mesh": mesh_text, "plan": name,
                             "a100_peak_mib": gpu / 2**20,
                             "cpu_peak_mib": None if cpu is None else cpu / 2**20,
                             "composed_mib": composed / 2**20, "budget_mib": budget / 2**20,
                             "fits": gpu <= budget, "profile_s": profile_s,
                             "state": pred.storage.describe() if name == "cfp" else ""})
                print(rows[-1], flush=True)
    df = pd.DataFrame(rows)
    df.to_csv(out + ".csv", index=False)
    fig, axes = plt.subplots(1, max(1, df.groupby(["model", "mesh"]).ngroups), figsize=(14, 4))
    for ax, ((model, mesh), g) in zip(getattr(axes, "flat", [axes]), df.groupby(["model", "mesh"])):
        x = range(len(g))
        ax.bar([i - 0.2 for i in x], g["a100_peak_mib"], 0.4, label="compiled for 8 A100s")
        ax.bar([i + 0.2 for i in x], g["cpu_peak_mib"].fillna(0), 0.4, label="compiled on 8 CPU devices")
        ax.axhline(g["budget_mib"].iloc[0], color="k", lw=1, ls="--", label="1.1 x fsdp's A100 peak")
        ax.set_xticks(list(x), g["plan"], rotation=45)
        ax.set_title(f"{model}, mesh {mesh}")
        ax.set_ylabel("peak per device (MiB)")
    axes.flat[0].legend(fontsize=7) if hasattr(axes, "flat") else axes.legend(fontsize=7)
    fig.suptitle("whole-step peaks, compile only (jax " + jax.__version__ + ", no GPU here)")
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=100)
    print(f"wrote {out}.csv and {out}.png")



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("6.7b", "rows"), required=True)
    p.add_argument("--models", default="gpt,llama")
    p.add_argument("--meshes", default="8,2x4")
    p.add_argument("--out", default=None, help="the results file (default under "
                   "scripts/results/, dated)")
    a = p.parse_args()
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=8").strip()
    sys.path.insert(0, str(ROOT))
    import cfp  # noqa: F401 - quiets JAX's CUDA plugin before JAX starts
    stem = ROOT / "scripts" / "results" / f"{datetime.date.today()}-"
    if a.part == "6.7b":
        part_67b(a.out or f"{stem}cluster-memory-cpu.txt")
    else:
        part_rows(a.out or f"{stem}gpu-memory-rows-cpu", a.models, a.meshes)


if __name__ == "__main__":
    main()
