"""The training state's layout as a decision of the search: a window that holds state (reads a
leaf first and computes its new value) is measured with it as its blocks compute, with the
optimizer state split (zero1) and with the parameters split too (fsdp); search picks one per
window, and a split plan runs as a loop that matches one device."""
import functools
import math

import pytest

from cfp.errors import CfpError
from cfp.execute import PlannedStep
from cfp.measure import WindowProgram, memory_of
from cfp.passes.analysis import run_analysis
from cfp.sharding import STATE_LAYOUTS, state_kinds
from cfp.windows import held_state, split_windows, window_space
from cfp.mesh import make_mesh
from cfp.tracing import trace_step
from cfp.workloads import WorkloadSpec

GPT = (("num_layers", 2), ("num_heads", 8))


@functools.lru_cache(maxsize=None)
def setup(mesh_shape):
    spec = WorkloadSpec("gpt", "tiny", None, "float32", GPT).resolved()
    analysis = run_analysis(spec, mesh_shape)
    windows, reps = split_windows(analysis, 32)
    return spec, analysis, windows, reps, trace_step(spec.build())


def split_dims(spec) -> int:
    return sum(e is not None for e in spec)


def test_a_window_holding_state_takes_and_returns_it_in_each_layout():
    spec, analysis, windows, reps, program = setup((8,))
    g = analysis.graph
    holding = [w for w in (windows[r] for r in reps) if held_state(analysis, w)]
    bare = [w for w in (windows[r] for r in reps) if not held_state(analysis, w)]
    assert holding
    for w in bare:  # control: no state, no state dimension
        assert len(window_space(analysis, w)) == w.end - w.start
    w = max(holding, key=lambda w: len(held_state(analysis, w)))
    assert window_space(analysis, w)[-1] == len(STATE_LAYOUTS)
    wp = WindowProgram(program, analysis, w, make_mesh((8,)))
    pairs, kinds = g.state_pairs(), state_kinds(g)
    blocks = (0,) * (w.end - w.start)  # every block on its first strategy: data parallel here
    peaks = {}
    for z, layout in enumerate(STATE_LAYOUTS):
        ins, outs, _ = wp.layouts(blocks + (z,))
        at_in = dict(zip(wp.sub.live_ins, ins))
        at_out = dict(zip(wp.sub.live_outs, outs))
        for k in held_state(analysis, w):
            v, new = pairs[k]
            assert at_out[new] == at_in[v]  # the fixed point, inside the window
            split = layout == "fsdp" or (layout == "zero1" and kinds[k] == "opt")
            assert (split_dims(at_in[v]) > 0) == split, (layout, kinds[k], at_in[v])
        compiled, _ = wp.compile(blocks + (z,))
        assert wp.unnamed_collectives(compiled, blocks + (z,)) == []
        assert wp.check_compiled(compiled, blocks + (z,)) == ""
        peaks[layout] = memory_of(compiled)["argument_bytes"]
    assert peaks["fsdp"] < peaks["zero1"] < peaks["plan"], peaks


@pytest.fixture(scope="module")
def analytic_problem():
    """gpt on mesh 8 priced by the analytic model (no compile): the search problem and the
    windows, with the memory of dp's plan and of the smallest plan."""
    from cfp.cost_model import CostModel
    from cfp.passes.profile import ProfileOptions, run_profile
    from cfp.problem import build_problem
    spec, analysis, *_ = setup((8,))
    # a fixed model (what one fit on this machine gave), not fitted at each run: the plans
    # the tests solve for, and so the calibration path they take, must not vary by run
    model = CostModel((3.3e-4,), (4.6e-10,), 2.1e10, 1.6e9)
    profile = run_profile(analysis, ProfileOptions(cost="analytic", cost_model=model))
    return spec, analysis, profile, build_problem


def test_where_memory_binds_search_splits_the_state_and_the_plan_runs_as_a_loop(
        analytic_problem):
    """A budget under every plan that keeps the state as its blocks compute: the search finds
    one with split state, and three steps of it in a loop match one device; without the
    split layouts (the control) no plan fits."""
    import dataclasses
    from helpers import assert_loop_matches, planned_loop
    from cfp.problem import plan_storage, top_plans
    from cfp.solver import least_memory
    spec, analysis, profile, build_problem = analytic_problem
    problem, _ = build_problem(analysis, profile, None)
    unsplit = dataclasses.replace(problem, groups=[
        dataclasses.replace(grp, options=[o for o in grp.options
                                          if len(o.strategies) == len(grp.blocks)
                                          or o.strategies[-1] == 0]) for grp in problem.groups])
    budget = least_memory(unsplit) - 1  # under every unsplit plan
    assert least_memory(problem) < budget < least_memory(unsplit)
    with pytest.raises(CfpError, match="no plan fits"):  # control
        top_plans(dataclasses.replace(unsplit, memory_budget=budget), 1, 30.0)
    problem.memory_budget = budget
    sol = top_plans(problem, 1, 30.0)[0]
    storage = plan_storage(analysis, problem, profile.windows, sol.choices)
    assert {z for _, z in storage.leaves} & {"zero1", "fsdp"}, storage
    step = PlannedStep(trace_step(spec.build()), analysis, sol.strategies, make_mesh((8,)),
                       storage)
    step.compile()
    assert_loop_matches(*planned_loop(step, spec.build()))
    kinds = state_kinds(analysis.graph)
    split = [k for k, z in storage.leaves if z == "fsdp" or (z == "zero1"
                                                             and kinds[k] == "opt")]
    shapes = [math.prod(analysis.graph.values[analysis.graph.inputs[k]].shape) for k in split]
    got = [math.prod(step.in_shardings[k].shard_shape(
        analysis.graph.values[analysis.graph.inputs[k]].shape)) for k in split]
    assert any(g < s for g, s in zip(got, shapes))  # stored split, not only described so


def test_a_gradient_split_otherwise_by_its_block_keeps_its_layout():
    """GPT's tied embedding is stored as its first reader (the lookup) wants it, split
    further under zero1, and its head's gradient is a contraction the head's strategy lays
    out. Where the stored split does not refine that layout (hidden-split storage, a
    vocabulary-split head), constraining the contraction would make XLA gather its other
    operand (the logits' gradient) whole: its result keeps the block's layout. Control: a
    head that leaves the gradient whole (data parallel) has it reduced straight into the
    split layout, as ZeRO does."""
    from cfp.sharding import state_specs, state_updates
    spec, analysis, *_ = setup((2, 4))
    g = analysis.graph
    pairs = g.state_pairs()
    (k, (wte, _)), = [(k, p) for k, p in enumerate(pairs)  # the table the lookup reads
                      if any(g.ops[u].primitive == "gather" for u in g.users.get(p[0], ()))]
    (dot,) = {g.producer_op(u).index for u, j in state_updates(g).items()
              if j == k and g.producer_op(u).is_contraction}
    ins = {v: (None,) * len(g.values[v].shape) for v, _ in pairs}
    ins[wte] = (None, "m1")  # the lookup splits hidden over m1; zero1 adds m0 on vocab
    layouts = {j: "zero1" for j in range(len(pairs))}
    for head, kept in ((("m1", None), True), ((None, None), False)):
        constraints = {dot: ([None, None], [head])}
        state_specs(g, range(len(pairs)), layouts, dict(ins), constraints, (2, 4),
                    ("m0", "m1"))
        assert (constraints[dot][1][0] == head) == kept, (head, constraints[dot])
        if not kept:
            assert constraints[dot][1][0] == ("m0", "m1")


@pytest.fixture
def xla_stand_in(analytic_problem, monkeypatch):
    """XLA's step can hold more than the composition counts for parameters kept whole
    (copies laid out for its kernels). Standing in for XLA: a "compiled" peak of the
    composed memory plus half the bytes of the parameters each window keeps whole, plus
    ``xla_peak.extra`` bytes; nothing compiles. Returns (problem
    without a budget, analysis, profile, that peak of a plan's choices)."""
    import cfp.execute
    import cfp.measure
    from cfp.solver import evaluate
    spec, analysis, profile, build_problem = analytic_problem
    problem, _ = build_problem(analysis, profile, None)
    windows, g = profile.windows, analysis.graph

    def choices(strategies, storage):
        layouts = storage.layouts(len(g.state_pairs()))
        out = []
        for w, grp in zip(windows, problem.groups):
            combo = tuple(strategies[b] for b in range(w.start, w.end))
            held = held_state(analysis, w)
            combo += (STATE_LAYOUTS.index(layouts[held[0]]),) if held else ()
            out.append(next(k for k, o in enumerate(grp.options) if o.strategies == combo))
        return out

    def xla_peak(c):
        kept = sum(grp.options[k].waiting for grp, k in zip(problem.groups, c))
        return evaluate(problem, c)[1] + kept // 2 + xla_peak.extra

    xla_peak.extra = 0

    class Step:  # compiles nothing: its peak is xla_peak's
        def __init__(self, program, analysis, strategies, mesh, storage):
            self.compiled = xla_peak(choices(strategies, storage))

        def compile(self):
            pass

    monkeypatch.setattr(cfp.execute, "PlannedStep", Step)
    monkeypatch.setattr(cfp.measure, "memory_of", lambda peak: {"peak_bytes": peak})
    return problem, analysis, profile, xla_peak


def test_a_prediction_over_the_budget_once_compiled_is_replaced(xla_stand_in, monkeypatch):
    """Where some predictions fit once compiled and others do not, search keeps those that fit
    and solves again for the others, to plans it has not compiled: it returns more plans that
    fit than the first solve gave, and none over the budget. Control: without calibrating,
    only the first solve's plans that fit."""
    import cfp.problem
    import dataclasses
    import cfp.passes.search as search
    problem, analysis, profile, xla_peak = xla_stand_in
    for budget in sorted({xla_peak(s.choices) for s in cfp.problem.predicted_plans(problem, 4, 30.0)}):
        tight = dataclasses.replace(problem, memory_budget=budget)
        first = cfp.problem.predicted_plans(tight, 3, 30.0)
        if min(map(xla_peak, (s.choices for s in first))) <= budget < max(
                map(xla_peak, (s.choices for s in first))):
            break
    else:
        raise AssertionError("no budget that some first predictions fit and others do not")
    fit_first = {s.choices for s in first if xla_peak(s.choices) <= budget}
    options = search.SearchOptions(budget, time_limit_s=30.0)
    sols, compiled, _ = search.fitting_predictions(analysis, tight, profile, options, None,
                                                   None)
    got = [s.choices for s in sols]
    assert len(set(got)) == len(got) and set(got) <= set(compiled)
    assert all(xla_peak(c) <= budget for c in got)
    assert fit_first < set(got)  # kept, and more found
    monkeypatch.setattr(search, "CALIBRATIONS", 1)  # control
    sols, _, _ = search.fitting_predictions(analysis, tight, profile, options, None, None)
    assert {s.choices for s in sols} == fit_first


def test_a_second_calibration_scales_the_budget_once():
    """Solved under a budget already scaled once (0.8 of the budget B), a prediction composed
    at 0.72 B still compiles to 1.2 B: the next solve composes against B x 0.72 / 1.2 = 0.6 B,
    where that prediction's ratio puts the plans that fit. Control: scaling the budget it
    was solved under counts the first shortfall twice (0.48 B), and cuts plans that fit."""
    from cfp.problem import calibrated
    from cfp.solver import Group, Option, Problem, Solution
    budget = 10**8
    problem = Problem([Group((0,), [Option((0,), 1, memory=budget)])], [1],
                      memory_budget=int(0.8 * budget))
    over = [(Solution((0,), (0,), 1, int(0.72 * budget), "OPTIMAL", 0.0), int(1.2 * budget))]
    got = calibrated(None, problem, (), over, first=False, budget_bytes=budget)
    assert got.memory_budget == pytest.approx(0.6 * budget, rel=1e-6)
    assert got.memory_budget > 0.8 * 0.72 / 1.2 * budget * 1.2  # the control's, far below


def test_where_xla_holds_more_than_composed_search_calibrates_and_fits(
        xla_stand_in, monkeypatch, caplog):
    """Under a budget that the first predictions fit only as composed, search calibrates the
    composition from their compiled peaks and solves again: the predictions it returns fit,
    and their memory stays the uncalibrated composition. Where XLA holds as much again per
    byte of the parameters kept whole, the per-byte calibration suffices; where it holds a
    fixed amount more besides, predictions are over the budget still after it, and search
    solves against a budget scaled down. Controls: without calibrating, none fits; where the
    per-byte factor accounts for all XLA holds, the budget is not scaled."""
    import cfp.problem
    import dataclasses
    import logging
    import cfp.passes.search as search
    from cfp.solver import evaluate
    problem, analysis, profile, xla_peak = xla_stand_in
    free = cfp.problem.predicted_plans(problem, 3, 30.0)
    for extra, scaled in ((2**18, True), (0, False)):
        xla_peak.extra = extra
        budget = min(xla_peak(s.choices) for s in free) - 1  # the free predictions are over
        for _ in range(5):  # and the first ones under the budget, too
            tight = dataclasses.replace(problem, memory_budget=budget)
            low = min(xla_peak(s.choices) for s in cfp.problem.predicted_plans(tight, 3, 30.0))
            if low > budget:
                break
            budget = low - 1
        else:
            raise AssertionError("no budget that every first prediction is over")
        options = search.SearchOptions(budget, time_limit_s=30.0)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="cfp.problem"):
            sols, _, _ = search.fitting_predictions(analysis, tight, profile, options, None,
                                                    None)
        assert sols and max(xla_peak(s.choices) for s in sols) <= budget, extra
        assert all(s.memory == evaluate(problem, s.choices)[1] for s in sols)
        calibrations = [r.getMessage() for r in caplog.records]
        assert "times their bytes more" in calibrations[0]
        assert any("solving against" in m for m in calibrations[1:]) == scaled, calibrations
    monkeypatch.setattr(search, "CALIBRATIONS", 1)  # control: no calibration
    sols, _, _ = search.fitting_predictions(analysis, tight, profile, options, None, None)
    assert max(s.memory for s in sols) <= budget < min(xla_peak(s.choices) for s in sols)


def test_a_tables_gradient_is_held_and_a_whole_kept_gradient_waits(analytic_problem):
    """The embedding table's gradient (a scatter-add into zeros of its size) adds up in the
    window that gathers from it, whatever its layout, and waits nowhere; the gradients of the
    other parameters a window keeps whole (plan, zero1) wait, and fsdp's do not. Control: with
    no tables the embedding window adds up less by exactly the table's bytes, and under zero1
    its gradient waits instead."""
    import dataclasses
    from cfp.windows import state_layout
    from cfp.window_memory import held_params, memory_terms, option_memory, term_sizers
    spec, analysis, profile, _ = analytic_problem
    names = analysis.mesh().axis_names
    seen = {"plan": 0, "zero1": 0, "fsdp": 0, "table": 0}
    for w in profile.windows:
        terms = memory_terms(analysis, w)
        plain = dataclasses.replace(terms, tables=frozenset())
        table = [t for t in terms.adding if t[0] in terms.tables]
        for combo, m in profile.window_profiles[w.type].results.items():
            if m.status != "ok":
                continue
            layout = state_layout(analysis, w, combo)
            mem, _, _, waiting, _ = option_memory(analysis, w, combo, m, names, terms=terms)
            mem0, _, _, waiting0, _ = option_memory(analysis, w, combo, m, names, terms=plain)
            size = term_sizers(analysis, w, combo, names)[0]
            table_bytes = sum(size(*t, stored=False) for t in table)
            assert mem - mem0 == table_bytes
            held_table = any(t[0] in held_params(analysis, w) for t in table)
            assert waiting0 - waiting == (table_bytes if held_table and layout != "fsdp" else 0)
            if held_params(analysis, w) - terms.tables:
                seen[layout] = max(seen[layout], waiting)
            if table and held_table and layout == "zero1":
                seen["table"] = table_bytes
    assert seen["table"] > 0  # the embedding window was checked under zero1
    assert seen["plan"] > 0 and seen["zero1"] > 0 and seen["fsdp"] == 0


def test_weight_copies_are_the_buffers_made_from_one_weight_alone():
    """A compiled program's weight copies: a weight that a contraction reads with its dims in
    another order (the backward pass of a [hidden, heads, head_dim] projection) is copied
    once, at its size, and a bfloat16 weight is converted to float32 on CPU. Controls: the
    same program counts nothing when that input is not a weight, a 2-D weight read either way
    round is not copied, a duplicate of a weight is left out, and a weight gathered over the
    mesh counts as gathered, not again as a copy."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec
    from cfp.measure import weight_copy_bytes

    def hlo(f, *shapes, dtype=jnp.float32, shardings=None, donate=()):
        args = [jax.ShapeDtypeStruct(s, dtype) for s in shapes]
        return jax.jit(f, in_shardings=shardings, donate_argnums=donate).lower(
            *args).compile().as_text()

    back = hlo(lambda w, x: jnp.einsum("bsnd,hnd->bsh", x, w), (256, 8, 32), (2, 16, 8, 32))
    assert weight_copy_bytes(back, [0]) == 256 * 256 * 4
    returned = hlo(lambda w: w.reshape(256, 256).T, (256, 8, 32))  # an output, counted as one
    assert " copy" in returned and weight_copy_bytes(returned, [0]) == 0
    assert weight_copy_bytes(hlo(lambda w, x: jnp.einsum("bsh,hnd->bsnd", x, w),
                                 (256, 8, 32), (2, 16, 256)), [0]) == 0  # no copy forward
    for f in (lambda w, x: x @ w, lambda w, x: x @ w.T):
        assert weight_copy_bytes(hlo(f, (256, 256), (32, 256)), [0]) == 0
    assert weight_copy_bytes(hlo(lambda w, x: x @ w, (256, 256), (32, 256),
                                 dtype=jnp.bfloat16), [0]) == 256 * 256 * 4  # to float32
    # read, then updated in place: XLA duplicates the weight to donate its buffer
    dup = hlo(lambda w, x: (x @ w, w - (x.T @ x)), (256, 256), (256, 256), donate=(0,))
    assert " copy(" in dup and weight_copy_bytes(dup, [0]) == 0
    mesh = make_mesh((8,))
    split = NamedSharding(mesh, PartitionSpec(mesh.axis_names[0]))
    gathered = hlo(lambda w, x: jnp.einsum("bsnd,hnd->bsh", x, jax.lax.with_sharding_constraint(
        w, NamedSharding(mesh, PartitionSpec()))), (256, 8, 32), (2, 16, 8, 32),
        shardings=(split, NamedSharding(mesh, PartitionSpec())))
    assert "all-gather" in gathered and weight_copy_bytes(gathered, [0]) == 0


def test_composed_memory_of_whole_kept_plans_counts_the_weight_copies():
    """llama's dp and zero1 plans keep every weight whole, and the compiled step holds a
    copy of each attention projection from the forward pass to the backward: composed with
    the copies its windows make, the step's memory is within 3% of its compiled peak.
    Control: without them it is more than 6% low."""
    from cfp.execute import Storage
    from cfp.measure import Measurement
    from cfp.windows import inputs_read_earlier
    from cfp.window_memory import option_memory
    from helpers import composed_bytes, hand_plan_windows
    spec = WorkloadSpec("llama", "tiny", 8, "float32", GPT + (
        ("seq_len", 128), ("hidden_size", 256))).resolved()
    analysis, mesh = run_analysis(spec, (8,)), make_mesh((8,))
    program, (windows, _) = trace_step(spec.build()), split_windows(analysis, 32)
    earlier = inputs_read_earlier(analysis, windows)
    for name in ("dp", "zero1"):
        plan, layout, measured = hand_plan_windows(analysis, program, windows, mesh, name)
        extra = sum(m[2]["weight_copy_bytes"] for m in measured) - 8 * 256 * 256 * 4
        assert 0 <= extra < 64, extra  # q, k, v, o of 2 layers, and the step count converted
        w, combo, mem = max(measured, key=lambda m: m[2]["weight_copy_bytes"])
        n = mem["weight_copy_bytes"]
        with_copies, without = (option_memory(analysis, w, combo, Measurement(
            "ok", **dict(mem, weight_copy_bytes=c)), mesh.axis_names) for c in (n, 0))
        # held from the step's start, so out of the window's transient
        assert (with_copies[0] - without[0], without[1] - with_copies[1]) == (n, n)

        def composed(with_copies):
            return composed_bytes(analysis, [(w, combo, option_memory(
                analysis, w, combo, Measurement("ok", **dict(
                    mem, weight_copy_bytes=mem["weight_copy_bytes"] if with_copies else 0)),
                mesh.axis_names, earlier[k])) for k, (w, combo, mem) in enumerate(measured)])
        peak = memory_of(PlannedStep(program, analysis, plan, mesh, Storage(layout))
                         .compile())["peak_bytes"]
        assert abs(composed(True) / peak - 1) < 0.03, (name, composed(True), peak)
        assert composed(False) / peak - 1 < -0.06, (name, composed(False), peak)


def test_a_value_a_later_window_gathers_for_its_backward_pass_is_held_gathered(monkeypatch):
    """gpt (batch 32, vocabulary 8192) kept data-parallel but for its vocabulary projection,
    which splits the vocabulary and so reads the batch whole: the compiled step holds the
    final layer norm's values gathered from the projection's forward pass to its backward
    (five all-gathers of a [32, 128, 256] activation live at its peak). Composed from the
    windows compiled here, the step counts four of them: the one its forward pass holds,
    counted before, and the three it does not, 4 MiB each (with a [32, 128, 1] one), and is
    still at most the compiled peak.
    Control: without the three the composition is more than 6 points further below it."""
    import dataclasses

    import cfp.problem
    from cfp.baselines import baseline_strategy_indices
    from cfp.execute import Storage
    from cfp.cost_model import fit_cost_model_for
    from cfp.passes.profile import ProfileOptions, run_profile
    from cfp.solver import evaluate
    from cfp.windows import inputs_read_earlier
    spec = WorkloadSpec("gpt", "tiny", 32, "float32", GPT + (
        ("seq_len", 128), ("hidden_size", 256), ("vocab_size", 8192))).resolved()
    analysis, mesh = run_analysis(spec, (8,)), make_mesh((8,))
    program = trace_step(spec.build())
    profile = run_profile(analysis, ProfileOptions(cost="analytic",
                                                   cost_model=fit_cost_model_for((8,))))
    hand = baseline_strategy_indices(analysis)
    plan = hand["dp"][:-1] + hand["megatron"][-1:]
    earlier = inputs_read_earlier(analysis, profile.windows)
    measured = []
    for k, w in enumerate(profile.windows):
        combo = tuple(plan[w.start:w.end]) + ((0,) if held_state(analysis, w) else ())
        measured.append((combo, WindowProgram(program, analysis, w, mesh).option_memory(
            combo, earlier[k])))

    def composed():
        problem, _ = cfp.problem.build_problem(analysis, profile, None)
        groups, choices = [], []
        for grp, (combo, terms) in zip(problem.groups, measured):
            c = next(i for i, o in enumerate(grp.options) if o.strategies == combo)
            options = list(grp.options)
            options[c] = dataclasses.replace(options[c], memory=terms[0], transient=terms[1],
                                             held=terms[2], waiting=terms[3])
            groups.append(dataclasses.replace(grp, options=options))
            choices.append(c)
        return evaluate(dataclasses.replace(problem, groups=groups), choices)[1]

    peak = memory_of(PlannedStep(program, analysis, plan, mesh, Storage("plan"))
                     .compile())["peak_bytes"]
    counted = composed()
    monkeypatch.setattr(cfp.problem, "read_back_across", lambda analysis: frozenset())
    without = composed()
    assert counted - without == (3 * 256 + 1) * 32 * 128 * 4, (counted, without)
    assert counted <= peak and without / peak < counted / peak - 0.06, (counted, without, peak)
