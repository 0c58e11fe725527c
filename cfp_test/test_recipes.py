"""The steps people train with (``recipes.py``): global-norm clipping, ``optax.MultiSteps``,
bfloat16 compute over float32 weights, a plain ``train_step`` returning metrics. One fast case
per rule, each with a control that fails without the rule; the whole matrix (every recipe on
gpt, llama and Flax, at 4 and 8 layers) is ``scripts/recipe_analysis.py``."""
import functools

import jax
import numpy as np
import pytest

import recipes
from cfp import grouping as blockrules
from cfp import program as graphrules
from cfp.grouping import build_blocks
from cfp.segments import find_segments
from cfp.mesh import make_mesh
from cfp.tracing import trace_step
from cfp.workloads import WorkloadSpec


def segment_types(model: str, recipe: str, num_layers: int) -> int:
    graph = trace_step(recipes.recipe_workload(model, recipe, num_layers)).graph()
    return find_segments(graph, build_blocks(graph, (8,))).num_types


@functools.lru_cache(maxsize=None)
def adam_types(model: str, num_layers: int) -> int:
    return segment_types(model, "adam", num_layers)


@pytest.mark.parametrize("recipe", ["clip", pytest.param("hand_clip", marks=pytest.mark.slow)])
def test_global_norm_clipping_keeps_the_layers(recipe, monkeypatch):
    """The norm's sum over every layer's gradient and the clip factor are shared scalars: the
    layers' update work stays with the layers, which repeat as under plain Adam. Control:
    with the sum owned by the block of its last term, as before, the layers merge into one
    segment."""
    assert adam_types("gpt", 4) == 2
    assert segment_types("gpt", recipe, 4) == 2
    monkeypatch.setattr(blockrules._Builder, "shared_scalar", lambda self, op, producers: False)
    assert segment_types("gpt", recipe, 4) == 1


def test_multisteps_cond_splits_by_leaf(monkeypatch):
    """``optax.MultiSteps``'s ``cond`` (accumulate, or apply AdamW) splits into one cond per
    leaf, which follows its leaf's block. Control: kept whole, the cond reads every gradient
    and the layers merge."""
    assert segment_types("llama", "multisteps", 4) == adam_types("llama", 4) == 2
    monkeypatch.setattr(graphrules, "_independent_parts",
                        lambda eqn: [(list(range(len(eqn.outvars))),
                                      list(range(len(eqn.invars) - 1)))])
    assert segment_types("llama", "multisteps", 4) == 1


def test_the_cond_parts_compute_what_the_cond_computes():
    """The split conds compute the step as traced: the unrolled program, evaluated equation
    by equation, gives the jitted step's new state over two steps (one accumulating, one
    applying). Control: the first step leaves the parameters as they were and the second
    moves them, so each branch ran where it should. The attention's key bias is compared to
    AdamW's learning rate: its gradient is zero up to rounding (softmax ignores a shift all
    keys share), so its step is rounding noise over Adam's epsilon, which the order of a sum
    decides."""
    w = recipes.recipe_workload("gpt", "multisteps", 2)
    paths = jax.tree_util.tree_flatten_with_path(w.abstract_params())[0]
    noise = {i for i, (path, _) in enumerate(paths) if path[-1] == jax.tree_util.DictKey("bk")}
    assert noise
    program = trace_step(w)
    assert sum(e.primitive.name == "cond" for e in program.eqns) > 10
    from cfp.execute import real_inputs
    args = real_inputs(w)
    step = jax.jit(lambda *xs: program.output_values(program.evaluate(xs)))
    ref = jax.jit(lambda *xs: jax.tree_util.tree_leaves(w.step_fn()(*jax.tree_util.tree_unflatten(
        program.in_tree, list(xs)))))
    n_state = len(args) - len(jax.tree_util.tree_leaves(w.abstract_batch()))
    got, want = list(args), list(args)
    params = [np.asarray(args[0])]
    for _ in range(2):
        out_got, out_want = step(*got), ref(*want)
        for i, (a, b) in enumerate(zip(out_got, out_want)):
            np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                                       atol=1e-3 if i in noise else 1e-6)
        got = list(out_got[:n_state]) + got[n_state:]
        want = list(out_want[:n_state]) + want[n_state:]
        params.append(np.asarray(out_got[0]))
    assert np.array_equal(params[1], params[0])  # the first step accumulates
    assert not np.allclose(params[2], params[1])  # the second applies AdamW


@pytest.fixture(scope="module")
def clip_analysis():
    from cfp.passes.analysis import run_analysis
    spec = WorkloadSpec("recipes:workload", None, None, "float32",
                        (("model", "gpt"), ("recipe", "clip"))).resolved()
    return spec, run_analysis(spec, (8,))


def test_the_norm_of_split_state_is_summed_from_shards(clip_analysis, monkeypatch):
    """Under zero1 and fsdp, a layer's gradient is reduced into the split layout and the
    global norm squares it there: the sum of squares adds shards (a scalar all-reduce the
    update implies), with no gather of the gradient. Control: without the norm's square in
    the update's layout, the window's gradients are gathered whole at the square and refused
    as unexpected collectives."""
    from cfp import sharding
    from cfp.measure import WindowProgram
    from cfp.sharding import STATE_LAYOUTS
    from cfp.windows import held_state, split_windows
    spec, a = clip_analysis
    windows, reps = split_windows(a, 100)
    w = max((windows[r] for r in reps), key=lambda w: len(held_state(a, w)))
    assert held_state(a, w)
    program = trace_step(spec.build())

    def refused(analysis, program):
        wp = WindowProgram(program, analysis, w, make_mesh((8,)))
        out = {}
        for z in (STATE_LAYOUTS.index("zero1"), STATE_LAYOUTS.index("fsdp")):
            combo = (0,) * (w.end - w.start) + (z,)
            compiled, _ = wp.compile(combo)
            out[STATE_LAYOUTS[z]] = wp.unnamed_collectives(compiled, combo)
        return out

    assert refused(a, program) == {"zero1": [], "fsdp": []}
    import dataclasses
    fresh = dataclasses.replace(a, graph=dataclasses.replace(a.graph))  # its own memo
    monkeypatch.setattr(sharding, "_statistics", lambda graph, updates: ({}, {}))
    bad = refused(fresh, program)
    assert all(any("square" in c for c in cs) for cs in bad.values()), bad


def test_bfloat16_compute_is_checked_at_its_resolution():
    """A Flax model computing in bfloat16 over float32 parameters: under the data-parallel
    plan its weight gradients differ from one device within bfloat16's tolerance, and the
    check passes. Control: held to float32's tolerance, the same figures fail, naming a
    parameter's gradient."""
    import dataclasses
    from cfp.baselines import baseline_plan, load_rules
    from cfp.execute import checked_values, numerics_of, step_values
    from cfp.passes.analysis import run_analysis
    spec = WorkloadSpec("recipes:workload", None, None, "float32",
                        (("model", "flax_bf16"), ("recipe", "adam"))).resolved()
    a = run_analysis(spec, (8,))
    w = spec.build()
    dp = baseline_plan(load_rules()["dp"], a)
    checked = checked_values(a)
    values = [v for v, _ in checked]
    assert any(a.graph.values[v].dtype == "bfloat16" for v in values)
    got = step_values(w, a, dp.strategies, make_mesh((8,)), dp.storage, values)
    want = step_values(w, a, None, None, values=values)
    assert numerics_of(a.graph, checked, got, want).ok
    f32 = dataclasses.replace(a.graph, values={v: dataclasses.replace(val, dtype="float32")
                                               for v, val in a.graph.values.items()})
    strict = numerics_of(f32, checked, got, want)
    assert not strict.ok and "the gradient of ['params']" in strict.worst


@pytest.mark.slow
def test_a_bfloat16_loss_moves_with_the_order_of_summation_alone():
    """Why a plan's bfloat16 loss is not held to 1e-4 of one device's: on one device, the
    Flax model computing in bfloat16 over float32 weights, three steps of clipped AdamW, the
    batch summed in 8 chunks (a data-parallel plan's order) moves the loss by more than 1e-4
    relative at some step. Control: computing in float32, the same chunks stay within 1e-5."""
    import optax
    from cfp.execute import example_inputs
    from helpers import run_loop
    params, batch = example_inputs(recipes.recipe_workload("flax_bf16", "clip"))

    def losses(model, chunks):
        loss_fn, tx = recipes.parts(model, 2)[0], recipes.optimizer("clip")

        def chunked(p, b):
            parts = jax.tree.map(lambda x: x.reshape(chunks, -1, *x.shape[1:]), b)
            return sum(loss_fn(p, jax.tree.map(lambda x: x[i], parts))
                       for i in range(chunks)) / chunks

        def step(p, s, b):
            loss, grads = jax.value_and_grad(chunked)(p, b)
            updates, s = tx.update(grads, s, p)
            return optax.apply_updates(p, updates), s, loss
        return np.array(run_loop(jax.jit(step), params, tx.init(params), batch)[0])

    def moved(model):
        whole, split = losses(model, 1), losses(model, 8)
        return np.max(np.abs(split - whole) / np.abs(whole))
    assert moved("flax_bf16") > 1e-4
    assert moved("flax") < 1e-5


def test_a_step_whose_check_cannot_pass_is_refused_before_the_profile(tmp_path, monkeypatch,
                                                                    capsys):
    """A step whose sharded gradients differ from one device under the dp plan (here made so
    by skewing what the sharded run returns) is refused in one line, exit 2, before any
    window is profiled. Control: unskewed, the same job gets past the check and profiles (its
    budget spent at once: nothing timed)."""
    from cfp import execute
    from cfp.cli import main
    real = execute.step_values

    def skewed(workload, analysis, strategies, mesh, storage=None, values=(), **kw):
        out = real(workload, analysis, strategies, mesh, storage, values, **kw)
        return out if mesh is None else [x * 1.5 for x in out]

    monkeypatch.setattr(execute, "step_values", skewed)
    base = ["--model", "mlp", "--mesh", "4", "--workdir", str(tmp_path)]
    args = base + ["--mode", "profile", "--max-combinations", "2"]
    assert main(base + ["--mode", "analysis"]) == 0
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cannot be checked against one device" in err[0], err
    assert not list(tmp_path.glob("window_*.pkl"))
    monkeypatch.setattr(execute, "step_values", real)
    assert main(args + ["--profile-budget", "0.001"]) == 0
    assert list(tmp_path.glob("window_*.pkl"))


def test_a_plain_step_returning_metrics_runs_in_the_users_loop():
    """Recipe (a) written as ``train_step(params, opt_state, batch) -> (params, opt_state,
    {"loss", "grad_norm"})`` and ``init(key) -> (params, opt_state)``: analysed layer by layer,
    and the user's own step, metrics and all, runs the plan through ``plan.jit`` and through
    ``jax.jit`` with its shardings, three donated steps matching one device. Control: the same
    step clipped by hand too is another step, refused."""
    from cfp.errors import CfpError
    from cfp.execute import example_inputs
    from cfp.passes.analysis import run_analysis
    from cfp.plan import jit as plan_jit
    from cfp.plan import make_plan
    from helpers import assert_users_loop
    spec = WorkloadSpec("recipes:workload", None, None, "float32",
                        (("model", "gpt"), ("recipe", "clip_metrics"))).resolved()
    a = run_analysis(spec, (8,))
    assert a.segments.num_types == 2
    plan = make_plan(a, [len(b.strategies) - 1 for b in a.blocks.blocks])
    loss_fn, init, _ = recipes.parts("gpt", 2)
    tx = recipes.optimizer("clip_metrics")
    params, batch = example_inputs(spec.build())
    opt_state = tx.init(params)
    train_step = recipes.plain_step(loss_fn, tx, clip_by_hand=False)
    assert_users_loop(train_step, plan, make_mesh((8,)), params, opt_state, batch,
                      loss=lambda metrics: metrics["loss"])
    twice = recipes.plain_step(loss_fn, tx, clip_by_hand=True)  # clipped by hand, then by tx
    with pytest.raises(CfpError, match="not the step the plan was made for"):
        plan_jit(twice, plan, make_mesh((8,)), params, opt_state, batch)


@pytest.mark.parametrize("in_loss", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_accumulation_over_micro_batches_keeps_the_layers(in_loss, monkeypatch):
    """A ``lax.scan`` over two micro-batches, in a ``TrainState`` step (forward and backward
    per micro-batch) or in the loss (both forwards, then both backwards): each micro-batch's
    run of a layer repeats the layer's seed (the same weight, or the same layer's
    projections) and joins its block, so the blocks and segments are plain Adam's. Control:
    without repeats, each micro-batch's layers are blocks of their own and merge."""
    def analysed(num_layers):
        graph = trace_step(recipes.accumulating_state("gpt", num_layers, 2, in_loss)).graph()
        ba = build_blocks(graph, (8,))
        return len(ba.blocks), find_segments(graph, ba).num_types

    plain = trace_step(recipes.recipe_workload("gpt", "adam", 4)).graph()
    assert analysed(4) == (len(build_blocks(plain, (8,)).blocks), 2)
    monkeypatch.setattr(blockrules._Builder, "repeats_seed", lambda self, c, bi: False)
    blocks, types = analysed(4)
    assert types == 1 and blocks > len(build_blocks(plain, (8,)).blocks)


def test_cfps_models_compute_in_bfloat16_over_float32_weights():
    """``--compute-dtype bfloat16`` over float32 parameters (cfp's GPT): the parameters and
    the optimizer state stay float32, the contractions and their gradients are bfloat16, the
    layers repeat, and the dp plan passes the check at bfloat16's tolerance. Control: without
    it, every contraction is float32."""
    from cfp.baselines import baseline_plan, load_rules
    from cfp.execute import compare_numerics
    from cfp.passes.analysis import run_analysis

    def analysed(extra):
        spec = WorkloadSpec("gpt", "tiny", None, "float32",
                            (("num_layers", 2),) + extra).resolved()
        a = run_analysis(spec, (8,))
        dots = {a.graph.values[op.outputs[0]].dtype for op in a.graph.ops if op.is_contraction}
        return spec, a, dots

    spec, a, dots = analysed((("compute_dtype", "bfloat16"),))
    assert dots == {"bfloat16"} and a.segments.num_types == 2
    w = spec.build()
    assert {x.dtype for x in jax.tree_util.tree_leaves((w.abstract_params(),
                                                        w.abstract_opt_state()))
            if x.ndim} == {np.dtype("float32")}
    dp = baseline_plan(load_rules()["dp"], a)
    assert compare_numerics(w, a, dp.strategies, make_mesh((8,)), dp.storage).ok
    assert analysed(())[2] == {"float32"}


def test_a_weight_cast_held_for_the_backward_pass_counts_once():
    """Float32 weights cast to bfloat16 in the loss (Flax, 2 layers, mesh 8): the backward
    pass reads each cast weight, which the forward pass made from the weight alone. The
    compiled windows make it as a weight copy (``cfp.measure.weight_copy_bytes``), so the
    held activations leave it out: composed, the dp step is within 10% of its compiled peak.
    Control: counted as a held activation too, it is more than 15% high."""
    import dataclasses

    from cfp.execute import PlannedStep, Storage
    from cfp.measure import Measurement, memory_of
    from cfp.passes.analysis import run_analysis
    from cfp.window_memory import memory_terms, option_memory
    from cfp.windows import inputs_read_earlier, split_windows
    from helpers import composed_bytes, hand_plan_windows
    spec = WorkloadSpec("recipes:flax_bf16_cast", overrides=(("num_layers", 2),)).resolved()
    analysis, mesh = run_analysis(spec, (8,)), make_mesh((8,))
    program, (windows, _) = trace_step(spec.build()), split_windows(analysis, 4)
    earlier = inputs_read_earlier(analysis, windows)
    plan, layout, measured = hand_plan_windows(analysis, program, windows, mesh, "dp")
    terms = [memory_terms(analysis, w, earlier[k]) for k, w in enumerate(windows)]
    assert any(t.weight_copies for t in terms)

    def composed(once):
        return composed_bytes(analysis, [(w, combo, option_memory(
            analysis, w, combo, Measurement("ok", **mem), mesh.axis_names, terms=t if once
            else dataclasses.replace(t, weight_copies=frozenset())))
            for (w, combo, mem), t in zip(measured, terms)])
    peak = memory_of(PlannedStep(program, analysis, plan, mesh, Storage(layout))
                     .compile())["peak_bytes"]
    assert abs(composed(True) / peak - 1) < 0.10, (composed(True), peak)
    assert composed(False) / peak - 1 > 0.15, (composed(False), peak)


def test_a_float32_gradient_summed_from_bfloat16_is_held_to_bfloat16():
    """A float32 norm scale over bfloat16 activations: its gradient is float32 but summed
    from bfloat16 values, so its tolerance is bfloat16's (``lowest_precision``). The
    data-parallel plan's figures pass; one 1% off (a reordered bfloat16 sum's size) passes.
    Controls: held to the gradient's own dtype, the 1% fails; a gradient 1.5 times too large
    still fails, naming the scale."""
    import dataclasses
    import jax.numpy as jnp
    import optax
    from cfp.baselines import baseline_plan, load_rules
    from cfp.execute import checked_values, numerics_of, step_values
    from cfp.passes.analysis import run_analysis
    from cfp.workloads import hand_in
    bf16, tx = jnp.bfloat16, optax.adam(1e-3)

    def loss_fn(params, batch):
        h = (batch["x"].astype(bf16) @ params["w1"].astype(bf16)).astype(jnp.float32)
        h = h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + 1e-6) * params["scale"]
        out = (h.astype(bf16) @ params["w2"].astype(bf16)).astype(jnp.float32)
        return jnp.mean((out - batch["y"]) ** 2)

    def train_step(params, opt_state, batch):
        loss, grads = jax.value_and_grad(loss_fn)(params, batch)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    k = jax.random.split(jax.random.key(0), 4)
    params = {"w1": jax.random.normal(k[0], (32, 64)) * 0.2, "scale": jnp.ones(64),
              "w2": jax.random.normal(k[1], (64, 32)) * 0.2}
    batch = {"x": jax.random.normal(k[2], (64, 32)), "y": jax.random.normal(k[3], (64, 32))}
    spec = hand_in(train_step, (params, tx.init(params), batch), WorkloadSpec(""))
    a = run_analysis(spec, (8,))
    w = spec.build()
    checked = checked_values(a)
    values = [v for v, _ in checked]
    k_scale = next(i for i, (_, name) in enumerate(checked) if "['scale']" in name)
    assert a.graph.values[values[k_scale]].dtype == "float32"
    dp = baseline_plan(load_rules()["dp"], a)
    got = step_values(w, a, dp.strategies, make_mesh((8,)), dp.storage, values)
    want = step_values(w, a, None, None, values=values)
    assert numerics_of(a.graph, checked, got, want).ok

    def off_by(factor):
        return [x * factor if i == k_scale else x for i, x in enumerate(want)]
    assert numerics_of(a.graph, checked, off_by(1.01), want).ok
    own = dataclasses.replace(a.graph, values={
        v: dataclasses.replace(val, dtype="float32") if val.dtype == "bfloat16" else val
        for v, val in a.graph.values.items()})
    strict = numerics_of(own, checked, off_by(1.01), want)
    assert not strict.ok and "['scale']" in strict.worst
    wrong = numerics_of(a.graph, checked, off_by(1.5), want)
    assert not wrong.ok and "['scale']" in wrong.worst
