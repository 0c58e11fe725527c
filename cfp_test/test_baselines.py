"""Baseline plans: each is what it claims, judged from its compiled collectives, and computes
the same loss and gradients as the single-device step."""
import functools
import math
import re

import jax
import pytest

from cfp.baselines import applies, baseline_plan, input_kinds, load_rules
from cfp.errors import CfpError
from cfp.execute import PlannedStep, check_numerics
from cfp.measure import memory_of
from cfp.collectives import collectives
from cfp.mesh import make_mesh
from cfp.tracing import trace_step
from cfp.workloads import WorkloadSpec
from cfp.passes.analysis import run_analysis

GPT = (("num_layers", 2), ("num_heads", 8))  # 8 heads: Megatron splits them 8 ways


@functools.lru_cache(maxsize=None)
def setup(model, mesh_shape, overrides):
    spec = WorkloadSpec(model, "tiny", None, "float32", overrides).resolved()
    rec = run_analysis(spec, mesh_shape)
    return spec, rec, trace_step(spec.build())


@functools.lru_cache(maxsize=None)
def compiled(model, mesh_shape, overrides, rule):
    bp = baseline_plan(load_rules()[rule], setup(model, mesh_shape, overrides)[1])
    text = planned(model, mesh_shape, overrides, rule).compiled.as_text()
    return bp, text, collectives(text, mesh_shape)


def param_bytes(spec):
    return sum(math.prod(x.shape) * x.dtype.itemsize
               for x in jax.tree_util.tree_leaves(spec.build().abstract_params()))


def test_rule_files_are_checked(tmp_path):
    assert {"dp", "megatron", "fsdp", "dp_tp", "expert", "batch_only"} <= set(load_rules())
    (tmp_path / "bad.json").write_text('{"title": "x", "axes": [["heads"]], "storage": "plan"}')
    with pytest.raises(CfpError, match="unknown role 'heads'"):
        load_rules(tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(CfpError, match="not a baseline rule file"):
        load_rules(tmp_path)


def test_data_parallel_has_one_gradient_allreduce():
    spec, _, _ = setup("gpt", (8,), GPT)
    _, _, colls = compiled("gpt", (8,), GPT, "dp")
    assert [c.kind for c in colls] == ["all-reduce"]
    # The tied embedding's two gradient terms (gather's scatter-add and the head's) are
    # reduced before they are added: one table's bytes more.
    table = spec.build().config.vocab_size * spec.build().config.hidden_size * 4
    assert param_bytes(spec) <= colls[0].bytes <= param_bytes(spec) + table + 64


def test_megatron_has_two_allreduces_per_layer_each_way():
    spec, rec, _ = setup("gpt", (8,), GPT)
    bp, _, colls = compiled("gpt", (8,), GPT, "megatron")
    cfg = spec.build().config
    act = spec.build().batch_size * cfg.seq_len * cfg.hidden_size * 4
    big = [c for c in colls if c.kind == "all-reduce" and c.bytes >= act]
    layers = cfg.num_layers
    # 2 forward (attention out, FFN out) + 2 backward (input gradients of the column-parallel
    # q/k/v and FFN-in) per layer, plus the vocab-parallel head's input gradient.
    assert 4 * layers <= len(big) <= 4 * layers + 1, [c.bytes for c in big]
    assert not any(c.kind == "all-reduce" and c.bytes >= param_bytes(spec) for c in colls)
    # Column then row: the FFN-out contraction splits its contracting dim (named all-reduce).
    ffn = [b for b in rec.blocks.blocks if any(ld.kind == "contract" and ld.size == 4 * cfg.hidden_size
                                               for ld in b.loop_dims)]
    assert ffn and all(b.loop_dims[bp.strategies[b.index].axes[0]].kind == "contract"
                       for b in ffn)


def state_bytes(spec):
    w = spec.build()
    return sum(math.prod(x.shape) * x.dtype.itemsize for x in jax.tree_util.tree_leaves(
        (w.abstract_params(), w.abstract_opt_state())))


@functools.lru_cache(maxsize=None)
def planned(model, mesh_shape, overrides, rule, donate=True):
    spec, rec, program = setup(model, mesh_shape, overrides)
    bp = baseline_plan(load_rules()[rule], rec)
    ps = PlannedStep(program, rec, bp.strategies, make_mesh(mesh_shape), bp.storage,
                     donate=donate)
    ps.compile()
    return ps


def sqrt_shapes(hlo_text) -> set:
    """The shapes of every square root in a compiled module: Adam's ``sqrt(nu)``, one per
    parameter, wherever XLA fused it."""
    return {tuple(int(d) for d in dims.split(",") if d)
            for dims in re.findall(r"= f32\[([\d,]*)\]\S* sqrt\(", hlo_text)}


def test_donation_aliases_the_state_and_lowers_the_peak():
    """On XLA CPU every donated state leaf is aliased to its update (``alias_size_in_bytes``
    is the whole state), so the state is held once, not as arguments and again as outputs;
    XLA holds more temporaries for the in-place update, so the peak drops by less than the
    state. Control: the undonated step aliases nothing."""
    spec = setup("gpt", (8,), GPT)[0]
    kept, donated = (memory_analysis(planned("gpt", (8,), GPT, "dp", d).compiled)
                     for d in (False, True))
    assert kept.alias_size_in_bytes == 0
    assert donated.alias_size_in_bytes == state_bytes(spec), state_bytes(spec)
    assert peak(donated) <= peak(kept) - 0.25 * state_bytes(spec), (peak(donated), peak(kept))


def memory_analysis(compiled):
    return compiled.memory_analysis()


def peak(ma) -> int:
    return (ma.argument_size_in_bytes + ma.output_size_in_bytes + ma.temp_size_in_bytes
            - ma.alias_size_in_bytes)


# Each rule runs in the suite on one mesh; the other two cases run with the slow tests.
HAND = [pytest.param("zero1", (8,), marks=pytest.mark.slow), ("fsdp", (8,)), ("zero1", (2, 4)),
        pytest.param("fsdp", (2, 4), marks=pytest.mark.slow), ("fsdp_tp", (2, 4))]


@pytest.mark.parametrize("rule,mesh_shape", HAND)
def test_state_splitting_plans_are_what_they_claim(rule, mesh_shape):
    """zero1, fsdp and fsdp_tp, each judged by what it compiles to, with dp (donated too) as
    the control: the peak is below dp's by at least half of the state's (N-1)/N; Adam runs
    on shards (every square root has the per-device shape of a split optimizer-state leaf,
    where dp's have whole parameters' shapes); fsdp stores the parameters split and zero1
    does not; and three steps in a loop, the new state fed back, match one device."""
    from helpers import assert_loop_matches, planned_loop
    spec, rec, _ = setup("gpt", mesh_shape, GPT)
    n = math.prod(mesh_shape)
    ps, dp = planned("gpt", mesh_shape, GPT, rule), planned("gpt", mesh_shape, GPT, "dp")
    saved = memory_of(dp.compiled)["peak_bytes"] - memory_of(ps.compiled)["peak_bytes"]
    assert saved >= 0.5 * state_bytes(spec) * (n - 1) / n, saved
    kinds = input_kinds(rec)
    shards = {tuple(s.shard_shape(rec.graph.values[v].shape))
              for v, k, s in zip(rec.graph.inputs, kinds, ps.in_shardings) if k == "opt"}
    assert sqrt_shapes(ps.compiled.as_text()) <= shards
    assert not sqrt_shapes(dp.compiled.as_text()) <= shards  # control
    split = [any(e is not None for e in s)
             for s, k in zip(ps.in_specs, kinds) if k == "param"]
    assert all(split) if rule.startswith("fsdp") else split.count(True) == sum(
        any(e is not None for e in s) for s, k in zip(dp.in_specs, kinds) if k == "param")
    assert_loop_matches(*planned_loop(ps, spec.build()))


def test_dp_tp_splits_data_on_axis_0_and_features_on_axis_1():
    _, rec, _ = setup("gpt", (2, 4), GPT)
    assert not applies(load_rules()["dp_tp"], setup("gpt", (8,), GPT)[1])
    bp, _, colls = compiled("gpt", (2, 4), GPT, "dp_tp")
    b0 = rec.blocks.blocks[0]
    s = bp.strategies[0]
    assert b0.loop_dims[s.axes[0]].kind == "lhs" and b0.loop_dims[s.axes[1]].kind == "rhs"
    assert {c.axes for c in colls if c.kind == "all-reduce"} <= {(0,), (1,), (0, 1)}


def test_expert_parallel_splits_experts():
    ov = (("num_layers", 2), ("num_experts", 8))
    spec, rec, _ = setup("moe", (8,), ov)
    rule = load_rules()["expert"]
    assert applies(rule, rec) and not applies(rule, setup("gpt", (8,), GPT)[1])
    bp = baseline_plan(rule, rec)
    expert = [b for b in rec.blocks.blocks if b.loop_dims[0].kind == "batch"
              and b.loop_dims[0].size == 8 and bp.strategies[b.index].axes == (0,)
              and rec.graph.values[rec.graph.ops[b.seed].inputs[1]].shape[0] == 8]
    assert len(expert) >= 2  # the expert FFN's two contractions
    err = check_numerics(spec.build(), rec, bp.strategies, make_mesh((8,)), bp.storage)
    assert err[0] < 1e-4 and err[1] == 0


# fsdp in a loop: test_state_splitting_plans_are_what_they_claim
@pytest.mark.parametrize("rule", ["megatron", pytest.param("fsdp", marks=pytest.mark.slow),
                                  "batch_only"])
def test_baselines_match_single_device(rule):
    spec, rec, _ = setup("gpt", (8,), GPT)
    bp = baseline_plan(load_rules()[rule], rec)
    loss_err, grad_excess = check_numerics(spec.build(), rec, bp.strategies, make_mesh((8,)),
                                           bp.storage)
    assert loss_err < 1e-4 and grad_excess == 0


def test_benchmark_statistics():
    from cfp.bench import bootstrap_ratio, ordering_accuracy
    m, lo, hi = bootstrap_ratio([2.0, 2.1, 1.9, 2.0], [1.0, 1.0, 1.0, 1.0])
    assert lo <= m <= hi and 1.9 <= lo and hi <= 2.1
    acc, pairs = ordering_accuracy([1, 2, 3], [1.0, 1.05, 3.0])
    assert pairs == 2 and acc == 1.0
    assert ordering_accuracy([3, 2, 1], [1.0, 2.0, 3.0]) == (0.0, 3)


def test_benchmark_table_and_chart(tmp_path):
    """The benchmark's CSVs (one row per round) turn into the README's table and chart."""
    import csv
    from cfp.bench import FIELDS, PLAN_FIELDS, append_rows, plot, summarize
    rows = [dict(workload="w", mesh="2x4", plan=p, round=r, step_s=1e-3 * t * (1 + 0.01 * r),
                 backend="cpu", devices=8)
            for p, t in (("cfp", 1.0), ("dp", 2.0), ("megatron", 1.0)) for r in range(5)]
    append_rows(tmp_path / "2026-01-01-cpu.csv", FIELDS, rows)
    append_rows(tmp_path / "2026-01-01-cpu-plans.csv", PLAN_FIELDS, [
        dict(workload="w", mesh="2x4", plan=p, same_program_as_cfp=p != "dp")
        for p in ("cfp", "dp", "megatron")])
    append_rows(tmp_path / "2026-01-01-cpu.csv", FIELDS, rows[:5])  # a rerun replaces w, 2x4
    with open(tmp_path / "2026-01-01-cpu.csv") as f:
        assert len(list(csv.DictReader(f))) == 5
    append_rows(tmp_path / "2026-01-01-cpu.csv", FIELDS, rows)
    out = summarize(str(tmp_path / "2026-01-01-cpu.csv"))
    assert "| w | 2x4 | 1.02 | 0.50 [0.50, 0.50] | tie | megatron: tie |" in out
    assert "| dp | 1 | 0 | 0 |" in out and "| megatron | 0 | 1 | 0 |" in out
    assert plot(tmp_path, "2026-01-01") == [tmp_path / "2026-01-01-cpu.png"]
    assert (tmp_path / "2026-01-01-cpu.png").stat().st_size > 0


def test_benchmark_questions(tmp_path):
    """The method's questions: cfp_own against the cost model's measured pick and the best
    manual plan; a row where the cost model's pick is faster says so (the control)."""
    from cfp.bench import FIELDS, OVERHEAD_FIELDS, PLAN_FIELDS, append_rows, summarize
    times = {"a": {"cfp": 1.0, "cfp_own": 1.0, "analytic": 2.0, "analytic_top1": 3.0,
                   "dp": 1.5, "megatron": 4.0},
             "b": {"cfp": 1.0, "cfp_own": 2.0, "analytic": 1.0, "analytic_top1": 1.0,
                   "dp": 1.0, "megatron": 4.0}}
    append_rows(tmp_path / "2026-01-01-cpu.csv", FIELDS, [
        dict(workload=w, mesh="8", plan=p, round=r, step_s=t * (1 + 0.01 * r), backend="cpu",
             devices=8) for w, plans in times.items() for p, t in plans.items() for r in range(5)],
        keys=("workload", "mesh", "plan"))
    append_rows(tmp_path / "2026-01-01-cpu-plans.csv", PLAN_FIELDS, [
        dict(workload=w, mesh="8", plan=p, same_program_as_cfp=False,
             same_program_as_cfp_own=w == "b" and p == "dp") for w in times for p in times[w]],
        keys=("workload", "mesh", "plan"))
    append_rows(tmp_path / "2026-01-01-cpu-overheads.csv", OVERHEAD_FIELDS, [
        dict(workload=w, mesh="8", launch_s=0.01) for w in times])
    out = summarize(str(tmp_path / "2026-01-01-cpu.csv"))
    assert "| a | 8 | 1.0% | 0.50 [0.50, 0.50] | 0.33 [0.33, 0.33] | dp | 0.67 [0.67, 0.67]: met |" in out
    assert "| b | 8 | 0.5% | 2.00 [2.00, 2.00] | 2.00 [2.00, 2.00] | dp | tie: tie |" in out
    assert "cfp_own faster than analytic (upper end below 1) on 1 of 2 rows" in out


def test_plans_in_chunks_compare_through_cfps_plan():
    """Four plans besides cfp's, in chunks of three: the machine runs at half speed during the
    second chunk. Times relative to cfp's plan in the same rounds keep the plans' true order,
    and at most three steps are compiled at once; the raw times (the control) would put the
    second chunk's plans above the first's."""
    from cfp.bench import time_in_chunks
    true_s = {"cfp": 1.0, "a": 0.8, "b": 1.2, "c": 0.9, "d": 1.1}
    loaded, most, slow = set(), [0], {"c", "d"}
    raw = {n: [] for n in true_s}

    def load(n):
        loaded.add(n)
        most[0] = max(most[0], len(loaded))

    def measure(n):
        seconds = true_s[n] * (2.0 if loaded & slow else 1.0)
        raw[n].append(seconds)
        return seconds
    times, chunk_of = time_in_chunks(list(true_s), 3, 5, load, loaded.discard, measure)
    median = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
    assert sorted(median, key=median.get) == ["a", "c", "cfp", "d", "b"]
    assert abs(median["c"] / median["a"] - 0.9 / 0.8) < 1e-9
    assert chunk_of == {"cfp": 0, "a": 1, "b": 1, "c": 2, "d": 2} and most[0] == 3
    raw_median = {n: sorted(t)[len(t) // 2] for n, t in raw.items()}
    assert raw_median["c"] > raw_median["b"]  # the control: raw times across chunks mislead


def test_enumerated_spaces():
    """The exhaustive check's two spaces on a toy problem: two instances of window type 0
    (blocks 0, 1) and one of type 1 (block 2), three options each."""
    from cfp.bench import distinct_plans, plan_space
    from cfp.solver import Group, Option, Problem
    from cfp.windows import Window
    opts = lambda: [Option((s,), 10 + s, memory=s) for s in range(3)]  # noqa: E731
    problem = Problem([Group((0,), opts()), Group((1,), opts()), Group((2,), opts())], [3] * 3,
                      memory_budget=4)
    windows = [Window(0, 1, 0), Window(1, 2, 0), Window(2, 3, 1)]
    cfp = (1, 0, 2)  # differs between the instances of type 0: outside the uniform space
    _, counts, size, picks = plan_space(problem, windows, cfp, "uniform")
    plans, over = distinct_plans(problem, picks)
    assert counts == [3, 3] and size == 9 and plans["cfp"] == cfp and "p0-0" in plans
    assert over == 2  # (2, 2, 1) and (2, 2, 2) hold more than 4 bytes
    assert len(plans) == 1 + 9 - over
    _, counts, size, picks = plan_space(problem, windows, cfp, "around")
    plans, over = distinct_plans(problem, picks)
    # type 0 -> o at both instances (3 plans), type 1 -> o with cfp's type-0 choices (3 plans,
    # one of them cfp's own); over the budget: (2, 2, 2)
    assert size == 6 and set(plans) == {"cfp", "t0o0", "t0o1", "t1o0", "t1o1"} and over == 1
    assert plans["t0o1"] == (1, 1, 2) and plans["t1o0"] == (1, 0, 0)


@pytest.mark.parametrize("law", ["alpha-beta", "shrinking"])
def test_cost_model_fitted_here(monkeypatch, law):
    """The fit recovers each axis's alpha and beta from all-reduce times that follow
    ``alpha + beta * bytes moved`` (the timer replaced by that law, the programs compiled and
    run here), and FLOP/s and bandwidth from the matmul's and the add's times. Control: times
    that shrink as the size grows have no positive fit, and the fit says so with its floor
    values (1e-7 s, 1e-13 s/B) rather than the law's."""
    import cfp.cost_model
    from cfp.cost_model import fit_cost_model
    law_alpha, law_beta = {2: 3e-5, 4: 7e-5}, {2: 2e-9, 4: 5e-9}
    t_matmul, t_add, k = 4e-3, 1e-3, 512

    def fake_time_runs(fn, args, **kwargs):
        jax.block_until_ready(fn(*args))  # the program runs here
        x = args[0]
        if len(args) == 2:
            return [t_matmul] * 3, False
        if x.shape[0] > 4:
            return [t_add] * 3, False
        n, nbytes = x.shape[0], x.shape[1] * 4
        moved = 2 * (n - 1) / n * nbytes
        t = law_alpha[n] + law_beta[n] * moved if law == "alpha-beta" else 1.0 / moved
        return [t] * 3, False
    monkeypatch.setattr(cfp.cost_model, "time_runs", fake_time_runs)
    cm = fit_cost_model(make_mesh((2, 4)), sizes=(2**12, 2**16))
    if law == "alpha-beta":
        assert cm.alpha == pytest.approx((3e-5, 7e-5), rel=1e-6)
        assert cm.beta == pytest.approx((2e-9, 5e-9), rel=1e-6)
    else:
        assert cm.beta == (1e-13, 1e-13)
    assert cm.device_flops == pytest.approx(2 * k**3 / t_matmul)
    assert cm.device_bandwidth == pytest.approx(2 * 4 * k * k / t_add)


@pytest.mark.slow  # 13 s for a fit the search would waste, not a wrong plan
def test_figures_fitted_here_are_fitted_once_per_profile(tmp_path, capsys, monkeypatch,
                                                          mlp_profiled):
    """``--cost model --device-preset here``: the profile fits alpha, beta and the device's
    speed on the mesh (the control: the count sees that fit), and search, which only asks
    which GPUs the profile was compiled for (none), fits nothing again."""
    import shutil
    import cfp.cost_model
    from cfp.cli import main
    from helpers import MLP_PROFILED
    fits = []
    real = cfp.cost_model.fit_cost_model
    monkeypatch.setattr(cfp.cost_model, "fit_cost_model",
                        lambda *a, **k: fits.append(1) or real(*a, **k))
    wd = tmp_path / "w"
    shutil.copytree(mlp_profiled, wd)
    args = MLP_PROFILED + ["--workdir", str(wd), "--cost", "model", "--device-preset", "here"]
    assert main(args + ["--mode", "profile"]) == 0
    assert len(fits) == 1 and "fitted here: " in capsys.readouterr().out
    assert main(args + ["--mode", "search", "--memory-budget", "1", "--validate-top", "1",
                        "--iters", "2"]) == 0
    assert len(fits) == 1 and "fitted here: " not in capsys.readouterr().out
