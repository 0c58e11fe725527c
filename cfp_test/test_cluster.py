"""Planning for clusters that are not here: cluster descriptions, analytic pricing, the
logical mesh choice, and the analysis and edge tables that keep large cases small."""
import dataclasses
import json
import re

import pytest

from cfp.cli import main
from cfp.cluster import PRESETS, load_cluster, logical_meshes
from cfp.errors import CfpError
from cfp.grouping import group_blocks
from cfp.passes.analysis import run_analysis
from cfp.passes.profile import ProfileOptions, run_profile
from cfp.passes.search import rank_meshes
from cfp.problem import build_problem
from cfp.tracing import trace_step
from cfp.workloads import WorkloadSpec


def test_mesh_axes_take_the_slowest_level_they_span():
    c = load_cluster("alpa-50x4")
    assert c.num_devices == 200 and c.mesh_shape == (50, 4)
    fast, slow = 1 / 100e9, 1 / 1e9
    assert c.cost_model((50, 4)).beta == (slow, fast)  # nodes, then GPUs inside a node
    assert c.cost_model((100, 2)).beta == (slow, fast)  # 2 GPUs of one node
    assert c.cost_model((25, 8)).beta == (slow, slow)  # 8 GPUs span two nodes
    assert c.cost_model((200,)).beta == (slow,)
    with pytest.raises(CfpError, match="200"):
        c.cost_model((8,))


def test_cluster_files_and_presets(tmp_path):
    path = tmp_path / "two.json"
    path.write_text(json.dumps({
        "name": "two", "memory_per_device_GB": 16, "peak_TFLOPs": 100,
        "memory_bandwidth_GBps": 1000,
        "levels": [{"name": "node", "size": 2, "alpha_s": 1e-5, "bandwidth_GBps": 1},
                   {"name": "gpu", "size": 4, "alpha_s": 1e-6, "bandwidth_GBps": 100}]}))
    c = load_cluster(str(path))
    assert c.mesh_shape == (2, 4) and c.memory_per_device_bytes == 16 * 2**30
    assert set(PRESETS) >= {"a100-8", "h100-8", "alpa-50x4"}
    path.write_text('{"name": "broken"}')
    with pytest.raises(CfpError, match="levels must be a list of one level or more"):
        load_cluster(str(path))
    with pytest.raises(CfpError, match="unknown cluster"):
        load_cluster("tpu-9000")
    assert logical_meshes(8) == [(8,), (2, 4), (4, 2), (2, 2, 2)]


def _cluster(tmp_path, inside_gbps, across_gbps, memory_gb):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({
        "name": "c", "memory_per_device_GB": memory_gb, "peak_TFLOPs": 100,
        "memory_bandwidth_GBps": 1000,
        "levels": [{"name": "node", "size": 2, "alpha_s": 1e-5, "bandwidth_GBps": across_gbps},
                   {"name": "gpu", "size": 4, "alpha_s": 1e-5, "bandwidth_GBps": inside_gbps}]}))
    return load_cluster(str(path))


def _weight_axes(prediction, spec):
    """Mesh axes that split a weight dim (a loop dim a parameter operand holds) in the plan."""
    from cfp.baselines import _params, input_kinds
    a = run_analysis(spec, prediction.mesh_shape)
    params = _params(a.graph, input_kinds(a))
    axes = set()
    for b, k in zip(a.blocks.blocks, prediction.strategies):
        seed = a.graph.ops[b.seed]
        for mesh_axis, loop in enumerate(b.strategies[k].axes):
            ld = None if loop is None else b.loop_dims[loop]
            if ld is not None and any(v in params and pos is not None
                                      for v, pos in zip(seed.inputs, (ld.lhs, ld.rhs))):
                axes.add(mesh_axis)
    return a, axes


@pytest.mark.parametrize("fast", ["inside", "across"])
def test_mesh_choice_puts_tensor_parallelism_on_the_fast_axis(tmp_path, fast):
    """2 nodes of 4 devices, one level 100x faster than the other, weights that must be split
    to fit 3 GB: with the GPUs of a node 100x faster, the chosen mesh splits weights only over
    axes inside a node (data parallel across nodes). Control: with the levels' speeds swapped,
    the weights are split across nodes too."""
    inside, across = (100, 1) if fast == "inside" else (1, 100)
    cluster = _cluster(tmp_path, inside, across, memory_gb=3)
    spec = WorkloadSpec("mlp", "wide", 16384, "float32", (("num_layers", 2),)).resolved()
    graph = trace_step(spec.build()).graph()
    ranked = rank_meshes(spec, cluster, graph, group_blocks(graph), max_combinations=32,
                         memory_budget_bytes=cluster.memory_per_device_bytes, time_limit_s=30)
    best = ranked[0].prediction
    assert best is not None and best.memory_bytes <= cluster.memory_per_device_bytes
    a, axes = _weight_axes(best, spec)
    assert axes, "the weights must be split to fit"
    spans = [cluster.levels_of_axis(best.mesh_shape, axis) for axis in axes]
    node, gpu = 0, 1  # the levels, outermost first
    if fast == "inside":
        assert all(levels == (gpu,) for levels in spans)
    else:
        assert any(node in levels for levels in spans)


def test_seed_comparisons_per_contraction_do_not_grow_with_depth():
    """Each contraction is compared only with the seeds that share one of its operands' roots,
    so the comparisons per contraction are the same at 20 and 80 layers, where comparing with
    every earlier seed (the negative control) grows with depth."""
    per, everyone = {}, {}
    for layers in (20, 80):
        a = run_analysis(WorkloadSpec("mlp", "tiny", None, "float32",
                                      (("num_layers", layers),)).resolved(), (8,))
        contractions = [op.index for op in a.graph.ops if op.is_contraction]
        per[layers] = a.blocks.seed_comparisons / len(contractions)
        seeds = sorted(b.seed for b in a.blocks.blocks)
        everyone[layers] = sum(sum(s < c for s in seeds) for c in contractions) / len(contractions)
    assert per[80] == pytest.approx(per[20], rel=0.05)
    assert everyone[80] > 3 * everyone[20]


def test_edges_are_priced_per_distinct_layout_pair_on_a_3_axis_mesh():
    """gpt tiny on a 4x4x4 mesh (about 80 strategies per block), priced analytically: the
    reshardings priced are the distinct (tensor, layout, layout) cases, a small fraction of the
    strategy pairs of the boundaries (what pricing per strategy pair would price), and the
    edge tables are built from them."""
    from cfp.windows import layouts
    cluster = load_cluster("h100-64")
    a = run_analysis(WorkloadSpec("gpt", "tiny", None, "float32", ()).resolved(), (4, 4, 4))
    profile = run_profile(a, ProfileOptions(cost="analytic", max_combinations=32,
                                            cost_model=cluster.cost_model((4, 4, 4))))
    blocks, names = a.blocks.blocks, ("m0", "m1", "m2")
    strategy_pairs = sum(len(blocks[b.src].strategies) * len(blocks[b.dst].strategies)
                         for b in profile.boundaries)
    assert len(profile.reshard_s) < strategy_pairs / 10
    problem, _ = build_problem(a, profile, None)
    for b in profile.boundaries[:20]:  # each table entry is its layout pair's price
        src, src_of = layouts(b.src_labels, blocks[b.src].strategies, names)
        dst, dst_of = layouts(b.dst_labels, blocks[b.dst].strategies, names)
        if (b.src, b.dst) in problem.edges and sum(
                1 for c in profile.boundaries if (c.src, c.dst) == (b.src, b.dst)) == 1:
            table = problem.edges[b.src, b.dst]
            for s in range(0, len(src_of), 7):
                for t in range(0, len(dst_of), 7):
                    key = (b.shape, b.dtype, src[src_of[s]], dst[dst_of[t]])
                    want = 0 if key[2] == key[3] else round(profile.reshard_s[key] * 1e7)
                    assert table[s, t] == want


def test_repeated_layers_are_composed_once(monkeypatch):
    """gpt at 2 and 8 layers, priced analytically: the memory of a window type's
    combinations is composed once per way its instances read and hold (the first layer's may
    differ), however many layers repeat it, and the problem is the one
    composed window by window. Control: a window reading an input an earlier one read holds
    less, and its key says so."""
    import numpy as np
    from cfp import problem as problem_module
    from cfp import window_memory
    from cfp.window_memory import memory_terms, terms_key
    cluster = load_cluster("a100-8")
    composed = []
    real = window_memory.option_memory

    def counted(analysis, window, *args, **kwargs):
        composed.append(window.type)
        return real(analysis, window, *args, **kwargs)

    monkeypatch.setattr(problem_module, "option_memory", counted)
    built = {}
    for layers in (2, 8):
        a = run_analysis(WorkloadSpec("gpt", "tiny", None, "float32",
                                      (("num_layers", layers),)).resolved(), (8,))
        profile = run_profile(a, ProfileOptions(cost="analytic", max_combinations=32,
                                                cost_model=cluster.cost_model((8,))))
        composed.clear()
        problem, _ = build_problem(a, profile, 2**30)
        types = {w.type for w in profile.windows}
        assert len(profile.windows) > len(types)
        ok = {t: sum(m.status == "ok" for m in profile.window_profiles[t].results.values())
              for t in types}
        # at least once per type; fewer than window by window (the first layer's instance
        # of a type, which also makes the causal mask, reads otherwise and has its own key)
        assert sum(ok.values()) <= len(composed) < sum(ok[w.type] for w in profile.windows)
        built[layers] = (a, profile, problem, len(composed))
    assert built[2][3] == built[8][3]  # constant in depth
    a, profile, problem, _ = built[8]
    monkeypatch.setattr(problem_module, "terms_key", lambda analysis, w, terms: (w.start,))
    whole, _ = build_problem(a, profile, 2**30)  # every window composed for itself
    assert problem.groups == whole.groups
    for field in ("edges", "reshards", "edge_memory"):
        mine, theirs = getattr(problem, field), getattr(whole, field)
        assert mine.keys() == theirs.keys()
        assert all(np.array_equal(mine[k], theirs[k]) for k in mine)
    w = next(w for w in profile.windows if memory_terms(a, w).adding)
    read = frozenset({memory_terms(a, w).adding[0][0]})
    assert terms_key(a, w, memory_terms(a, w)) != terms_key(a, w, memory_terms(a, w, read))


def test_plan_for_a_cluster_through_the_passes(tmp_path, capsys):
    """A mesh of 8 that JAX has here: compiling its 192 combinations and their reshardings
    would take over a minute, so they are priced analytically (and the report says why);
    nothing runs; plan.json."""
    assert main(["--model", "gpt", "--cluster", "a100-8", "--mesh", "2x4",
                 "--workdir", str(tmp_path), "--max-combinations", "8"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"priced for a100-8 \(analytic\): compiling would take \d+ programs", out)
    assert "predicted step time" in out and "nothing runs" in out
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["mesh"]["shape"] == [2, 4] and plan["source"].startswith("predicted for a100-8")


def test_a_cluster_too_large_here_is_priced_analytically(tmp_path, capsys):
    assert main(["--model", "gpt", "--cluster", "alpa-50x4", "--workdir", str(tmp_path),
                 "--mode", "analysis"]) == 0
    assert main(["--model", "gpt", "--cluster", "alpa-50x4", "--workdir", str(tmp_path),
                 "--mode", "profile"]) == 0
    assert "(analytic): 200 devices" in capsys.readouterr().out


def test_compile_only_where_compiling_everything_is_quick():
    from cfp.passes.profile import cluster_pricing
    a = run_analysis(WorkloadSpec("mlp", "tiny", None, "float32", ()).resolved(), (8,))
    assert cluster_pricing(a, 32, limit_s=3600)[0] == "model"
    assert cluster_pricing(a, 32, limit_s=1e-6)[0] == "analytic"  # the control
    assert cluster_pricing(a, 32, max_devices=4)[0] == "analytic"


def test_mesh_auto_traces_once_and_starts_from_the_ranked_plan(tmp_path, monkeypatch, capsys):
    """--mesh auto ranks each logical mesh by its plan whose repeated layers are alike; the
    chosen mesh's passes reuse the step traced for the ranking, and its whole problem starts
    from the plan that ranked it: no alike problem is solved again. Controls: a second run
    on the chosen mesh traces again; given no ranked plan, the search solves the alike
    problem itself."""
    import os
    import cfp.passes.search as search
    import cfp.problem
    import cfp.program
    monkeypatch.setattr(os, "cpu_count", lambda: 1)  # the ranking runs in this process
    monkeypatch.setattr(cfp.problem, "ALIKE_FROM_OPTIONS", 0)  # every whole problem too
    seen = {"traces": 0, "alike in search": 0, "searching": False}
    trace, solve_alike, predict = (cfp.program.trace_program, cfp.problem.solve_alike,
                                   search.predict_plan)

    def counted_trace(*a, **k):
        seen["traces"] += 1
        return trace(*a, **k)

    def counted_alike(*a, **k):
        seen["alike in search"] += seen["searching"]
        return solve_alike(*a, **k)

    def searching(*a, **k):
        seen["searching"] = not k.get("alike_only")
        try:
            return predict(*a, **k)
        finally:
            seen["searching"] = False
    monkeypatch.setattr(cfp.program, "trace_program", counted_trace)
    monkeypatch.setattr(cfp.problem, "solve_alike", counted_alike)
    monkeypatch.setattr(search, "predict_plan", searching)
    path = tmp_path / "c.json"
    path.write_text(json.dumps({
        "name": "c", "memory_per_device_GB": 1, "peak_TFLOPs": 100, "memory_bandwidth_GBps": 1000,
        "levels": [{"name": "node", "size": 2, "alpha_s": 1e-5, "bandwidth_GBps": 10},
                   {"name": "gpu", "size": 2, "alpha_s": 1e-5, "bandwidth_GBps": 100}]}))
    flags = ["--model", "mlp", "--cluster", str(path), "--profile-budget", "0.001"]
    assert main(flags + ["--mesh", "auto", "--workdir", str(tmp_path / "auto")]) == 0
    chosen = json.loads((tmp_path / "auto" / "plan.json").read_text())["mesh"]["shape"]
    assert "mesh chosen: " + "x".join(map(str, chosen)) in capsys.readouterr().out
    assert seen["traces"] == 1 and seen["alike in search"] == 0, seen
    assert main(flags + ["--mesh", "x".join(map(str, chosen)), "--mode", "analysis",
                         "--workdir", str(tmp_path / "given")]) == 0
    assert seen["traces"] == 2  # control
    monkeypatch.setattr(search, "predict_plan",
                        lambda *a, **k: searching(*a, **{**k, "ranked": None}))
    assert main(flags + ["--mesh", "auto", "--workdir", str(tmp_path / "again")]) == 0
    assert seen["alike in search"] >= 1  # control


def test_mesh_auto_without_a_cluster_is_one_line(capsys):
    assert main(["--mesh", "auto"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--cluster" in err
    assert main(["--cluster", "alpa-50x4", "--mesh", "8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cluster alpa-50x4 has 200" in err


def test_a_cluster_plan_is_printed_beside_the_hand_plans_priced_the_same_way(tmp_path, capsys):
    """Under a budget dp's priced memory is over, cfp's prediction is at most the fastest hand
    plan that fits, and each hand plan is marked as fitting or not (the control: without a
    budget every one fits). Composed memory alone, nothing compiled for the A100s
    (test_gpu_compile.py has the compiled figures)."""
    from cfp.passes.search import predict_plan
    from cfp.report import prediction_console
    from cfp.workdir import WorkDir
    from cfp.workloads import run_fingerprint
    args = ["--model", "gpt", "--cluster", "a100-8", "--mesh", "8", "--workdir", str(tmp_path),
            "--max-combinations", "8"]
    assert main(args + ["--mode", "analysis"]) == 0
    assert main(args + ["--mode", "profile"]) == 0
    spec = WorkloadSpec("gpt", "tiny", None, "float32", ()).resolved()
    from cfp.cluster import load_cluster
    wd = WorkDir(tmp_path, run_fingerprint(spec, (8,))
                 + (("cluster", repr(load_cluster("a100-8"))),))
    analysis = wd.read_analysis()
    profile = wd.read_profile(analysis, "analytic", 8, False)
    free = predict_plan(analysis, profile, None, 30.0)
    hand = {name: (s, mem) for name, s, mem, _ in free.hand_plans}
    assert {"dp", "zero1", "fsdp"} <= set(hand)
    assert hand["fsdp"][1] <= hand["zero1"][1] < hand["dp"][1]
    budget = (hand["zero1"][1] + hand["dp"][1]) // 2
    bound = predict_plan(analysis, profile, budget, 30.0)
    fitting = [s for _, s, mem, _ in bound.hand_plans if mem <= budget]
    assert fitting and bound.predicted_s <= min(fitting) * (1 + 1e-6)
    assert bound.memory_bytes <= budget
    capsys.readouterr()
    prediction_console(bound, load_cluster("a100-8"))
    out = capsys.readouterr().out
    assert re.search(r"fsdp +predicted .* fits", out) and re.search(r"dp +predicted .* does not "
                                                                     r"fit", out)
    # a hand plan recomputing every layer that was not compiled (slower than the plan kept)
    # says so; the lines not recomputing, not compiled either, say what they compose to
    slower = dataclasses.replace(bound, hand_plans=bound.hand_plans + (
        ("dp recomputing every layer", 1.0, 2**20, None),))
    prediction_console(slower, load_cluster("a100-8"))
    out = capsys.readouterr().out
    assert re.search(r"dp recomputing every layer predicted .* composed, not compiled \(slower "
                     r"than the plan kept\)", out) and out.count("not compiled") == 1


def test_a_forward_step_planned_for_a_cluster_beside_the_hand_plans(tmp_path, capsys):
    """--step forward plans the loss alone: the hand plans are priced from the same profile
    and printed beside the plan, which is no slower; data parallel's memory holds no
    gradients nor Adam moments, so it is under half the training step's (the
    control: the same plan of the training step)."""
    dp_gb = {}
    for step in ("forward", "train"):
        assert main(["--model", "gpt", "--num-layers", "2", "--hidden-size", "1024",
                     "--cluster", "a100-8", "--mesh", "2x4", "--step", step,
                     "--workdir", str(tmp_path / step), "--max-combinations", "8"]) == 0
        out = capsys.readouterr().out
        hand = {name: (float(ms), float(gb)) for name, ms, gb in re.findall(
            r"^  (\w+) +predicted +([\d.]+) ms, +([\d.]+) GiB per device", out, re.M)}
        assert {"dp", "dp_tp"} <= set(hand)
        plan_ms = float(re.search(r"predicted step time: ([\d.]+) ms", out)[1])
        assert plan_ms <= min(ms for ms, _ in hand.values()) * 1.001  # the solver's optimum
        dp_gb[step] = hand["dp"][1]
    plan = json.loads((tmp_path / "forward" / "plan.json").read_text())
    assert plan["step"]["kind"] == "forward" and "opt_state" not in plan
    assert 0 < dp_gb["forward"] < dp_gb["train"] / 2
