import dataclasses
import json
import random
import re
import shutil

import jax
import numpy as np
import pytest

from cfp.cli import main
from helpers import MLP_PROFILED
from cfp.execute import check_numerics, checked_values, numerics_of, step_values
from cfp.baselines import baseline_plan, load_rules
from cfp.plan import load_plan, shardings
from cfp.records import read_record
from cfp.workdir import SEARCH_FORMAT
from cfp.mesh import make_mesh
from cfp.workloads import WorkloadSpec
from cfp.passes.analysis import run_analysis

MODELS = [("mlp", {}), ("gpt", {"num_layers": 1}), ("llama", {"num_layers": 1}),
          ("moe", {"num_layers": 2}), ("bert", {"num_layers": 1})]


# mlp on both meshes and gpt on the 2-D one here; the other models and meshes are slow tests
# (bash scripts/slow_tests.sh).
STEP_CASES = [pytest.param(m, o, mesh, marks=[] if m == "mlp" or (m, mesh) == ("gpt", (2, 2))
                           else [pytest.mark.slow])
              for m, o in MODELS for mesh in [(2, 2), (4,)]]


@pytest.mark.parametrize("model,over,mesh_shape", STEP_CASES)
def test_sharded_step_matches_single_device(model, over, mesh_shape):
    spec = WorkloadSpec(model, "tiny", None, "float32", tuple(over.items())).resolved()
    a = run_analysis(spec, mesh_shape)
    rng = random.Random(hash((model, mesh_shape)) % 1000)
    plans = [[rng.randrange(len(b.strategies)) for b in a.blocks.blocks] for _ in range(2)]
    mesh = make_mesh(mesh_shape)
    for plan in plans:
        loss_err, grad_excess = check_numerics(spec.build(), a, plan, mesh)
        assert loss_err < 1e-5 and grad_excess == 0, (plan, loss_err, grad_excess)


def test_numerics_check_can_fail():
    """Negative control: gradients 5% off, or a loss 1% off, are reported, and the gradient
    named; an error a bfloat16 value's resolution explains passes there and fails in
    float32."""
    spec = WorkloadSpec("mlp", "tiny", None, "float32", ()).resolved()
    a = run_analysis(spec, (4,))
    w = spec.build()
    checked = checked_values(a)
    assert checked[0][1] == "the loss" and len(checked) > 2
    values = [v for v, _ in checked]
    got = step_values(w, a, [0] * len(a.blocks.blocks), make_mesh((4,)), values=values)
    want = step_values(w, a, None, None, values=values)
    assert numerics_of(a.graph, checked, got, want).ok
    skewed = [want[0]] + [x * 1.05 + 1e-3 for x in want[1:]]
    bad = numerics_of(a.graph, checked, got, skewed)
    assert not bad.ok and bad.grad_excess > 0 and "['params']" in bad.worst
    assert not numerics_of(a.graph, checked, got, [want[0] * 1.01] + want[1:]).ok
    off = [want[0]] + [x * (1 + 2**-8) for x in want[1:]]  # half a bfloat16 unit
    assert not numerics_of(a.graph, checked, got, off).ok
    import dataclasses
    g16 = dataclasses.replace(a.graph, values={v: dataclasses.replace(val, dtype="bfloat16")
                                               for v, val in a.graph.values.items()})
    assert numerics_of(g16, checked, got, off).ok
    # where one device differs from itself between runs (a GPU's scatter), a plan may differ
    # by a few times as much; no more (the control) and not where it does not
    shift = [np.abs(x - y) for x, y in zip(skewed, want)]
    assert numerics_of(a.graph, checked, got, skewed, [x / 2 for x in shift]).ok
    assert not numerics_of(a.graph, checked, got, skewed, [x / 8 for x in shift]).ok
    assert not numerics_of(a.graph, checked, got, skewed, [0 * x for x in shift]).ok


def test_one_device_is_run_twice_where_it_may_not_repeat(monkeypatch):
    """Off the CPU, the one-device reference runs twice and their difference is kept for the
    check (here the CPU stands in: the two runs agree to the bit); on the CPU it runs once,
    and no difference is kept (the control)."""
    from cfp import execute
    spec = WorkloadSpec("mlp", "tiny", None, "float32", ()).resolved()
    a = run_analysis(spec, (4,))
    execute._LAST.clear()
    assert execute.reference_run(spec.build(), a)[2] is None
    execute._LAST.clear()
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    host, want, noise = execute.reference_run(spec.build(), a)
    assert len(noise) == len(want) == len(checked_values(a))
    assert all(not np.any(x) for x in noise)
    execute._LAST.clear()


def test_three_passes_plan_json_and_user_jit(tmp_path, capsys):
    """The whole job: its console is at most 12 lines besides the progress lines (one per
    pass, the plan in words, step time against the hand plans, memory, the numerical check,
    how to use plan.json), without the lines drivers read, which ``--driver-lines`` adds to
    a search run again; the candidates are in report.json. Control: with -v the analysis
    alone prints more than 15 lines."""
    base = ["--model", "mlp", "--num-layers", "2", "--mesh", "2x2", "--workdir", str(tmp_path)]
    search = ["--memory-budget", "1", "--validate-top", "2", "--iters", "2",
              "--max-combinations", "4"]
    assert main(base + search) == 0
    out = capsys.readouterr().out
    lines = [x for x in out.splitlines() if not x.startswith("[")]  # progress: "[n/total"
    assert len(lines) <= 12, out
    drivers = ("searched ParallelBlock Strategies solution (", "searched training cost",
               "TFLOP_COUNT: ")
    for start in ("analysis: ", "profile: ", "search: ", "plan on mesh 2x2: ", "step time: ",
                  "memory per device: ", "numerical check against one device: ",
                  "use it: plan = cfp.Plan.load("):
        assert sum(x.startswith(start) for x in lines) == 1, (start, out)
    assert not any(x.startswith(drivers) for x in lines), out
    assert "best hand plan run that fits: " in out
    rec = read_record(tmp_path / "search.pkl", SEARCH_FORMAT, None, hint="")
    # achieved throughput beside the step time: the step's FLOPs over its time, per device
    step = next(x for x in lines if x.startswith("step time: "))
    achieved = float(re.search(r", ([\d.e+-]+) TFLOP/s per device \(predicted", step)[1])
    # printed to 3 significant digits: within half a unit of the third
    assert achieved == pytest.approx(rec.step_flops / rec.plan.median_s / 4 / 1e12, rel=6e-3)
    assert achieved != pytest.approx(rec.step_flops / rec.plan.median_s / 1e12, rel=6e-3)
    candidates = json.loads((tmp_path / "debug_search" / "report.json").read_text())["candidates"]
    assert [c["source"] for c in candidates] == [c.source for c in rec.candidates]
    assert main(base + search + ["--mode", "search", "--driver-lines"]) == 0
    with_drivers = capsys.readouterr().out.splitlines()
    for start in drivers:
        assert sum(x.startswith(start) for x in with_drivers) == 1, (start, with_drivers)
    assert any("memory_cost (GiB per device):" in x for x in with_drivers)
    assert main(["--model", "mlp", "--mesh", "2x2", "--workdir", str(tmp_path / "v"),
                 "--mode", "analysis", "-v"]) == 0
    assert len(capsys.readouterr().out.splitlines()) > 15
    # the dp baseline is validated too: as its own candidate, or as one of the predicted ones
    spec = WorkloadSpec("mlp", "tiny", None, "float32", (("num_layers", 2),)).resolved()
    analysis = run_analysis(spec, (2, 2))
    dp = tuple(baseline_plan(load_rules()["dp"], analysis).strategies)
    by_axes = [tuple(analysis.blocks.blocks[b].strategies[i].axes for b, i in enumerate(c.strategies))
               for c in rec.candidates]
    assert tuple(s.axes for s in dp) in by_axes
    dbg = tmp_path / "debug_search"
    for f in ("after_ir.txt", "input_placement_specs.txt", "output_placement_specs.txt",
              "mem_usage.txt", "report.json", "plan.png", "predicted_vs_measured.png"):
        assert (dbg / f).exists(), f
    report = json.loads((dbg / "report.json").read_text())
    assert report["backend"] == "cpu" and report["devices"] == 4
    # plan.json back into the user's own jit
    plan = load_plan(tmp_path / "plan.json")
    assert plan["source"].startswith(("predicted", "baseline "))
    w = spec.build()
    params = w.init_params(jax.random.key(0))
    mesh = make_mesh((2, 2))
    sh = shardings(params, plan, mesh)
    assert jax.tree_util.tree_structure(sh) == jax.tree_util.tree_structure(params)
    placed = jax.device_put(params, sh)
    batch = w.make_batch(jax.random.key(1))
    loss = jax.jit(w.loss_fn, in_shardings=(sh, None))(placed, batch)
    one_device = jax.jit(w.loss_fn)(params, batch)
    np.testing.assert_allclose(float(loss), float(one_device), rtol=1e-5)
    other_batch = jax.jit(w.loss_fn)(params, w.make_batch(jax.random.key(2)))
    assert abs(float(other_batch) - float(one_device)) > 1e-5 * abs(float(one_device))  # control
    for leaf, s in zip(jax.tree_util.tree_leaves(placed), jax.tree_util.tree_leaves(sh)):
        assert leaf.sharding.is_equivalent_to(s, leaf.ndim)


def test_search_runs_each_hand_plan_as_written(tmp_path, mlp_profiled):
    """A hand plan that splits the state (zero1, fsdp) is validated, and kept, with its own
    layout for every leaf, as the user's hand plan would be. Control: the per-window layouts
    that its strategy choices translate to keep some leaves whole (those no window holds)."""
    from cfp.baselines import load_rules
    from cfp.execute import Storage
    from cfp.problem import build_problem, plan_storage
    from cfp.workdir import ANALYSIS_FORMAT, PROFILE_FORMAT
    wd = tmp_path / "wd"
    shutil.copytree(mlp_profiled, wd)
    assert main(MLP_PROFILED + ["--workdir", str(wd), "--mode", "search", "--memory-budget",
                                "1", "--validate-top", "1", "--iters", "1"]) == 0
    rec = read_record(wd / "search.pkl", SEARCH_FORMAT, None, hint="")
    analysis = read_record(wd / "analysis.pkl", ANALYSIS_FORMAT, None, hint="")
    profile = read_record(wd / "profile.pkl", PROFILE_FORMAT, None, hint="")
    hand = {c.source: c for c in rec.candidates if c.source.startswith("baseline ")}
    assert hand["baseline zero1"].storage == Storage("zero1")
    assert hand["baseline fsdp"].storage == Storage("fsdp")
    assert all(c.storage == Storage(load_rules()[c.source.split()[1]].storage)
               for c in hand.values())
    problem, _ = build_problem(analysis, profile, None)
    translated = plan_storage(analysis, problem, profile.windows, hand["baseline zero1"].choices)
    layouts = translated.layouts(len(analysis.graph.state_pairs()))
    assert "zero1" in layouts and "plan" in layouts  # the control


def test_search_errors(tmp_path, capsys, mlp_profiled):
    base = MLP_PROFILED + ["--workdir", str(tmp_path / "wd")]
    assert main(base + ["--mode", "search", "--memory-budget", "1"]) == 2
    assert "analysis" in capsys.readouterr().err  # nothing analysed yet
    assert main(base + ["--mode", "analysis"]) == 0
    assert main(base + ["--mode", "search", "--memory-budget", "1"]) == 2
    assert "run --mode profile first" in capsys.readouterr().err
    shutil.rmtree(tmp_path / "wd")
    shutil.copytree(mlp_profiled, tmp_path / "wd")  # the same analysis, profiled
    assert main(base + ["--mode", "search"]) == 2
    assert "give --memory-budget" in capsys.readouterr().err
    assert main(base + ["--mode", "search", "--memory-budget", "0.000001"]) == 2
    err = capsys.readouterr().err
    assert "no plan fits the memory budget" in err and "smallest any plan reaches" in err
    # profiles from another analysis: re-analyse with another batch into the same dir
    assert main(base + ["--mode", "analysis", "--batch-size", "16"]) == 0
    assert main(base + ["--mode", "search", "--memory-budget", "1", "--batch-size", "16"]) == 2
    assert "another run" in capsys.readouterr().err


@pytest.mark.slow
def test_passes_chain_records_in_memory():
    """Each pass takes the previous pass's record and returns its own; no work dir."""
    from cfp.passes.profile import ProfileOptions, run_profile
    from cfp.passes.search import SearchOptions, run_search
    analysis = run_analysis(WorkloadSpec("mlp", "tiny", None, "float32", ()).resolved(), (4,))
    profile = run_profile(analysis, ProfileOptions())
    assert profile.compiled == sum(m.status != "estimated" for s in profile.window_profiles.values()
                                   for m in s.results.values())
    assert {"worker start", "tracing", "compiling", "running"} <= set(profile.phase_s)
    assert sum(profile.phase_s.values()) <= profile.time_s * 1.01
    rec = run_search(analysis, profile, SearchOptions(2**30, validate_top=2, iters=2))
    assert rec.plan.median_s == min(c.median_s for c in rec.candidates)
    assert rec.numerics["grad_excess_over_tol"] == 0
    assert {"solving", "compiling", "running"} <= set(rec.phase_s)
    assert 5 <= len(rec.plan.measured_s) <= 7  # rounds stop once the plans separate
    assert "dot" in rec.compiled_text and rec.memory["peak_bytes"] > 0


def test_plan_figure_colours_what_each_axis_splits():
    """One cell per block, coloured by what each mesh axis splits there (a replicated block
    too), and one bar per candidate. Control: a plan whose blocks all split alike is one
    colour."""
    from cfp.dumps import plan_figure
    rows = [("blocks 0-2 (type 0)", ["m0: batch; m1: heads", "m0: batch; m1: weight rows",
                                     "replicated"]),
            ("blocks 3-5 (type 0)", ["m0: batch; m1: heads", "m0: batch; m1: weight rows",
                                     "replicated"])]
    candidates = [("cfp 0", 2e-3, 2**20, False, True), ("dp", 3e-3, 2**21, True, False)]

    def colours(fig):
        return {p.get_facecolor() for p in fig.axes[0].patches}
    fig = plan_figure(rows, candidates, title="t")
    assert len(fig.axes[0].patches) == 6 and len(colours(fig)) == 3
    assert len(fig.axes[1].patches) == 2
    fig.canvas.draw()
    pixels = np.asarray(fig.canvas.buffer_rgba())[..., :3]
    assert pixels.std() > 10  # drawn, not blank
    alike = [(label, ["m0: batch"] * 3) for label, _ in rows]
    assert len(colours(plan_figure(alike, candidates))) == 1


@pytest.mark.parametrize("mesh_shape", [(8,), (2, 4)])
def test_plan_in_words(mesh_shape):
    """The dp plan reads as the same program as dp, the batch split on every axis; on 2x4
    the dp_tp plan of the GPT splits the heads over m1. Control: a plan that mixes the two
    is no hand plan's program, and says which segment instances split what."""
    from cfp.baselines import baseline_strategy_indices
    from cfp.describe import plan_words
    spec = WorkloadSpec("gpt", "tiny", None, "float32", ()).resolved()
    a = run_analysis(spec, mesh_shape)
    hand = baseline_strategy_indices(a)
    dp = plan_words(a, hand["dp"])
    axes = "; ".join(f"{name} splits batch" for name in ("m0", "m1")[:len(mesh_shape)])
    assert dp == ["same program as dp", f"every segment: {axes}"]
    if mesh_shape == (8,):
        return
    tp = plan_words(a, hand["dp_tp"])
    assert tp[0] == "same program as dp_tp"
    assert any("m0 splits batch; m1 splits heads" in x for x in tp[1:]), tp
    first = a.segments.instances[0]
    mixed = [hand["dp"][b] if first.start <= b < first.end else hand["dp_tp"][b]
             for b in range(len(hand["dp"]))]
    words = plan_words(a, mixed)
    assert not any(x.startswith("same program") for x in words), words
    assert words[0].startswith(f"blocks {first.start}-{first.end - 1}: m0 splits batch; "
                               f"m1 splits batch"), words


def test_kept_plan_fits_the_budget_once_compiled():
    """A budget between a plan's composed and compiled memory: the next plan is kept, or the
    run says none fits."""
    from cfp.errors import CfpError
    from cfp.passes.search import Candidate
    from cfp.problem import fastest_within_budget
    gb = 2**30

    def cand(median_s, composed_gb, compiled_gb):
        return Candidate("predicted", (0,), (0,), median_s, int(composed_gb * gb),
                         (median_s,), 0.0, int(compiled_gb * gb))

    cands = [cand(1.0, 1.0, 1.5), cand(1.2, 1.0, 1.1), cand(0.9, 1.0, 2.0)]
    assert fastest_within_budget(cands, None) == 2
    assert fastest_within_budget(cands, 3 * gb) == 2
    assert fastest_within_budget(cands, int(1.6 * gb)) == 0
    assert fastest_within_budget(cands, int(1.2 * gb)) == 1  # composed 1.0 fits, compiled not
    with pytest.raises(CfpError, match="no candidate plan fits"):
        fastest_within_budget(cands, int(1.05 * gb))


def test_validation_rounds_separate_plans_round_by_round():
    """``slower``, which stops search's validation rounds: plan b 3% slower than a in every
    round is measurably slower, though the machine sped up and slowed down across the rounds
    so much that the two plans' ranges overlap (the rule before this one compared ranges and
    ran on); a plan within 1% either way round by round is not."""
    from cfp.timing import slower
    from cfp.passes.search import _separated
    fast = [1.00, 1.10, 1.20, 1.30, 1.40]  # drift across rounds, the same for both plans
    behind = [1.03 * t for t in fast]
    assert slower(behind, fast) and not slower(fast, behind)
    assert _separated([fast, behind])
    assert max(fast) >= min(behind)  # control: their ranges overlap
    tied = [t * f for t, f in zip(fast, [1.01, 0.99, 1.005, 1.0, 0.995])]
    assert not slower(tied, fast) and not slower(fast, tied)
    assert not _separated([fast, tied])


def test_benchmark_plans_take_turns_one_step_at_a_time():
    """``time_interleaved``: between two steps of one plan another plan takes one, every plan
    follows several others (the order is shuffled on every pass), and a round's figure is the
    median of its steps (one step held up by another process does not move it). Controls:
    ``time_steps`` called plan after plan, as the benchmark did before, runs each plan's steps
    in one block; an order that only rotates each round puts every plan after the same one."""
    import time
    from cfp.execute import time_interleaved, time_steps
    log = []

    def run(name, slow_step=None):
        def step():
            log.append(name)
            time.sleep(0.050 if log.count(name) == slow_step else 0.002)
            return 0
        return step

    def take_turns(names):
        return all(names[i] != names[i + 1] for i in range(len(names) - 1))

    def same_predecessor(names):  # per run, the share of its steps after its usual predecessor
        import collections
        before = collections.defaultdict(collections.Counter)
        for i in range(1, len(names)):
            before[names[i]][names[i - 1]] += 1
        return [max(c.values()) / sum(c.values()) for c in before.values()]

    a, b = run("a", slow_step=3), run("b")
    times = time_interleaved([a, b], rounds=2, min_steps=5, min_seconds=0.0)
    assert len(log) == 20 and take_turns(log)
    assert times[0][0] < 0.010  # the mean of a's first round would be 11.6 ms
    log.clear()
    time_interleaved([run("a"), run("b"), run("c")], rounds=3, min_steps=5, min_seconds=0.0)
    assert take_turns(log) and max(same_predecessor(log)) < 0.7
    rotated = [n for r in range(3) for _ in range(5) for n in ("abc"[r:] + "abc"[:r])]
    assert min(same_predecessor(rotated)) > 0.9  # control
    log.clear()
    for r in (a, b):
        time_steps(r, min_steps=5, min_seconds=0.0)
    assert not take_turns(log)


def test_a_profile_batch_rotates_which_combination_follows_the_anchor(monkeypatch):
    """``time_rounds`` runs the anchor first in every round and then every combination still
    timed, in an order that rotates each round, each timed run right after an untimed run of
    the same program: in a fixed order a window type's first combination (every block at its
    first strategy, data parallelism in most models) would always follow the anchor, and
    without the untimed run each program would be timed on the caches another one left.
    Controls: the log of a fixed order fails the first check, and a log without the untimed
    runs the second."""
    import cfp.timing
    from cfp.timing import time_rounds
    log = []
    timed = cfp.timing.run_once_s
    monkeypatch.setattr(cfp.timing, "run_once_s",
                        lambda fn, args: log.append("timed") or timed(fn, args))

    def program(name):
        return (lambda: log.append(name) or 0), ()

    def after_anchor(names):
        names = [n for n in names if n != "timed"]
        return {names[i + 1] for i, n in enumerate(names[:-1]) if n == "anchor"}

    def warm(names):  # every timed combination ran untimed just before
        return all(names[i + 1] == names[i - 1] != "anchor" for i, n in enumerate(names)
                   if n == "timed" and names[i + 1] != "anchor")

    time_rounds([program("a"), program("b"), program("c")], best_s=None, warmup=0,
                min_rounds=3, max_rounds=3, anchor=program("anchor"))
    assert log.count("anchor") == 3 and log.count("timed") == 12
    assert after_anchor(log) == {"a", "b", "c"} and warm(log)
    fixed = ["timed", "anchor"] + ["a", "timed", "a", "b", "timed", "b", "c", "timed", "c"]
    assert after_anchor(fixed * 3) == {"a"} and warm(fixed * 3)
    cold = ["timed", "anchor", "timed", "a", "timed", "b", "timed", "c"]
    assert not warm(cold * 3)


def test_search_also_validates_the_best_plan_without_reshardings():
    """Three one-block windows of two strategies. Boundary (0, 1) reshards at a price of 1 and
    boundary (1, 2) at a price of 0 (an interval that included 0): the plan (1, 1, 0) costs
    nothing in reshardings but still reshards, so the plan without any is (0, 0, 0)."""
    from cfp.problem import UNRESHARDED, predicted_plans
    from cfp.solver import Group, Option, Problem
    moved = np.array([[False, True], [True, False]])
    problem = Problem([Group((0,), [Option((0,), 10), Option((1,), 13)]),
                       Group((1,), [Option((0,), 14), Option((1,), 10)]),
                       Group((2,), [Option((0,), 9), Option((1,), 14)])], [2, 2, 2],
                      {(0, 1): moved.astype(np.int64), (1, 2): np.zeros((2, 2), np.int64)},
                      reshards={(0, 1): moved, (1, 2): moved})
    plans = predicted_plans(problem, 2, 10.0)
    assert [(p.strategies, p.objective) for p in plans] == [
        ((0, 1, 0), 30), ((1, 1, 0), 32), ((0, 0, 0), 33)]
    assert [p.status == UNRESHARDED for p in plans] == [False, False, True]
    # Controls: when a top plan already reshards nothing, or the problem does not say which
    # layouts change, nothing is added.
    assert [p.strategies for p in predicted_plans(problem, 3, 10.0)] == [
        (0, 1, 0), (1, 1, 0), (0, 0, 0)]
    unknown = dataclasses.replace(problem, reshards={})
    assert len(predicted_plans(unknown, 2, 10.0)) == 2


def test_the_plan_picture_says_where_each_segment_keeps_its_state():
    """A segment instance's row names the state layout of the leaves its blocks read first
    and update: zero1 under zero1, a count per layout where they differ, nothing for a
    segment that updates no state. Control: the plan layout reads as plan."""
    from cfp.describe import state_of_blocks
    from cfp.execute import Storage
    analysis = run_analysis(WorkloadSpec("gpt", "tiny", None, "float32", ()).resolved(), (8,))
    segs = analysis.segments.instances
    said = [state_of_blocks(analysis, Storage("zero1"), s.start, s.end) for s in segs]
    assert "zero1" in said and set(said) <= {"zero1", ""}
    assert {state_of_blocks(analysis, Storage(), s.start, s.end) for s in segs} <= {"plan", ""}
    one = Storage(leaves=((0, "fsdp"),))  # the first state leaf fsdp, the rest as computed
    owner = next(s for s in segs if "fsdp" in state_of_blocks(analysis, one, s.start, s.end))
    text = state_of_blocks(analysis, one, owner.start, owner.end)
    assert re.fullmatch(r"1 state leaf fsdp, \d+ state leaves as the blocks compute them",
                        text), text


def test_plans_compiled_to_one_program_are_run_once_with_their_state_alone(monkeypatch):
    """Validation runs a program once however many candidates compiled to it (a hand plan
    that is cfp's own plan, say), and each gets its times. Control: the megatron plan, another
    program, is run beside dp. Under a budget the plans' states do not fit together, no other
    plan's state is on the devices while a plan runs (memory-bound candidates each fit, and
    together would not); the probe sees the running plan's own state alive. Control: with
    room for all, each plan's state is placed once and stays."""
    import collections
    import weakref
    from cfp import execute
    from cfp.execute import real_inputs
    from cfp.passes.search import SearchOptions, measure_plans
    from cfp.tracing import trace_step
    a = run_analysis(WorkloadSpec("mlp", overrides=(("num_layers", 2),)).resolved(), (4,))
    rules = load_rules()
    dp, megatron = (baseline_plan(rules[name], a) for name in ("dp", "megatron"))
    plans = [(p.strategies, p.storage) for p in (dp, megatron, dp)]
    timed = collections.Counter()
    real = execute.time_steps
    placed = {}  # id of a measurement's run -> weak references to its arguments now
    others_alive = []

    def counted(run, **kwargs):
        timed[id(run.compiled)] += 1
        placed[id(run)] = [weakref.ref(x) for x in run.args]
        assert all(r() is not None for r in placed[id(run)])  # control: the probe sees them
        others_alive.append(sum(r() is not None for k, refs in placed.items()
                                if k != id(run) for r in refs))
        return real(run, **kwargs)

    monkeypatch.setattr(execute, "time_steps", counted)
    workload = a.spec.build()
    steps, times = measure_plans(trace_step(workload), a, plans, a.mesh(),
                                 real_inputs(workload), SearchOptions(1, iters=1))
    assert timed[id(steps[0].compiled)] >= 5 and timed[id(steps[1].compiled)] >= 5  # control
    assert timed[id(steps[2].compiled)] == 0
    assert times[2] == times[0] and times[1] != times[0]
    assert len(others_alive) >= 10 and set(others_alive) == {0}
    others_alive.clear()
    placed.clear()
    measure_plans(trace_step(workload), a, steps, a.mesh(), real_inputs(workload),
                  SearchOptions(None, iters=1))
    assert others_alive[-1] > 0  # the control: room for all, every state stays placed


def test_the_race_separates_plans_10_percent_apart_and_calls_twins_a_tie():
    """Three plans, the first cfp's, the second its rival (a hand plan), the third 30%
    slower, each round's seconds drawn around their means with 4% noise, in 100 seeded
    races. A rival 10% slower is told apart in every race; a rival of the same mean (a twin
    in speed) is raced on to ``race_rounds`` and called a tie in at least 85 of them (91
    measured; a race stopped at ``rounds``, told apart at 95%, calls 77). The control: with
    no rival, the rounds stop at ``rounds`` at most."""
    import random
    from cfp.passes.search import SearchOptions, race
    from cfp.timing import RACE_LEVEL, slower
    options = SearchOptions(None)

    def races(rival_share, rivals=(1,)):
        for seed in range(100):
            rng = random.Random(seed)
            means = {0: 1.0, 1: rival_share, 2: 1.3}
            yield race(lambda i: means[i] * (1 + rng.uniform(-0.04, 0.04)), [0, 1, 2],
                       list(rivals), options)

    def told_apart(t):
        return slower(t[1], t[0], RACE_LEVEL) or slower(t[0], t[1], RACE_LEVEL)

    assert all(slower(t[1], t[0], RACE_LEVEL) for t in races(1.1))
    ties = [t for t in races(1.0) if not told_apart(t)]
    assert len(ties) >= 85 and all(len(t[0]) == options.race_rounds for t in ties)
    assert all(len(t[0]) <= options.rounds for t in races(1.0, rivals=()))
