"""Recompute applied to the step as written (``cfp.recompute``): a policy forced on every layer
runs in the user's loop through ``plan.jit`` and matches one device; the compiled program
computes the forward contractions again; a step that already rematerializes is not recomputed
twice; compiled for A100s a recomputing step holds less, and on CPU it does not."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cfp.errors import CfpError
from cfp.execute import PlannedStep, example_inputs
from cfp.mesh import make_mesh
from cfp.models import adam_init
from cfp.passes.analysis import run_analysis
from cfp.plan import jit as plan_jit
from cfp.plan import make_plan
from cfp.program import trace_program
from cfp.recompute import Recompute, forced, recomputed
from cfp.tracing import trace_step
from cfp.graph import loss_op
from cfp.workloads import WorkloadSpec
from helpers import assert_loop_matches, run_loop


def _two_layers(w1, w2, x):
    h = jnp.tanh(x @ w1)
    return jnp.sum(jnp.tanh(h @ w2) ** 2)


def _step(w1, w2, x):
    loss, (g1, g2) = jax.value_and_grad(_two_layers, argnums=(0, 1))(w1, w2, x)
    return w1 - 0.1 * g1, w2 - 0.1 * g2, loss


def _contractions(program) -> int:
    return sum(e.primitive.name == "dot_general" for e in program.eqns)


@pytest.mark.parametrize("policy, more", [("nothing_saveable", 2), ("dots_saveable", 0),
                                          ("dots_with_no_batch_dims_saveable", 0), ("none", 0)])
def test_a_policy_recomputes_what_it_does_not_save(policy, more):
    """The whole forward pass as one layer: ``nothing_saveable`` computes its two
    contractions again, ``dots_saveable`` and ``dots_with_no_batch_dims_saveable`` (its
    contractions have no batch dimension) only the tanh around them, ``none`` nothing; the
    step's values are the same. Control: the counts differ between the policies."""
    args = (jnp.full((16, 16), 0.1), jnp.full((16, 16), 0.2), jnp.arange(64.).reshape(4, 16) / 64)
    program = trace_program(_step, *args)
    loss = loss_op(program.graph())
    again = recomputed(program, Recompute(((0, tuple(range(loss)), policy),), loss))
    assert _contractions(again) == _contractions(program) + more
    tanhs = sum(e.primitive.name == "tanh" for e in again.eqns)
    assert tanhs == 2 + (2 if policy != "none" else 0)
    assert (again is program) == (policy == "none")
    run = lambda p: jax.jit(lambda *a: p.output_values(p.evaluate(a)))(*args)  # noqa: E731
    for got, want in zip(run(again), run(program)):
        assert jnp.allclose(got, want, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("model, mesh_shape, lighter", [
    ("gpt", (8,), True),
    pytest.param("llama", (2, 4), False, marks=pytest.mark.slow),
    pytest.param("gpt", (2, 4), False, marks=pytest.mark.slow),
    ("scanned_models:flax_unrolled", (2, 4), False),
])
def test_a_forced_recompute_runs_in_the_users_loop(model, mesh_shape, lighter):
    """``nothing_saveable`` on every layer (where ``lighter``, the second layer under
    ``dots_with_no_batch_dims_saveable``, as search's three runs give), in ``plan.json``:
    three donated steps of the user's loop through ``plan.jit`` match one device (1e-5), and
    the compiled program holds more contractions than the plan's without recompute (the
    forward's again). Control: the same plan without recompute compiles to fewer."""
    from cfp.recompute import mixed
    spec = WorkloadSpec(model, "tiny" if ":" not in model else None, None, "float32",
                        (("num_layers", 2),)).resolved()
    a = run_analysis(spec, mesh_shape)
    w = spec.build()
    recompute = forced(a, "nothing_saveable")
    assert recompute and len(recompute.layers) == 2
    if lighter:
        recompute = mixed(recompute, 1, 1, "dots_with_no_batch_dims_saveable")
        assert [p for _, _, p in recompute.layers] == ["nothing_saveable",
                                                       "dots_with_no_batch_dims_saveable"]
    strategies = [len(b.strategies) - 1 for b in a.blocks.blocks]  # the most split
    plan = make_plan(a, strategies, recompute=recompute.to_json())
    params, batch = example_inputs(w)
    opt_state = jax.jit(w.opt_init or adam_init)(params)
    mesh = make_mesh(mesh_shape)
    want = run_loop(jax.jit(w.train_step()), params, opt_state, batch)  # one device
    step = plan_jit(w.train_step(), plan, mesh, params, opt_state, batch)
    placed = jax.device_put(jax.tree_util.tree_map(np.asarray, (params, opt_state, batch)),
                            step.in_shardings)
    got = run_loop(step, *placed)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
    # a recomputed activation is fused anew, so it may differ in its last bits; Adam lifts
    # that to a share of an update (1e-3) where a gradient is near 0: a fifth of one here
    assert_loop_matches(got, want, atol=2e-4)
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(placed[0]))  # donated
    plain = make_plan(a, strategies)

    def dots(p):
        text = plan_jit(w.train_step(), p, mesh, params, opt_state, batch).lower(
            params, opt_state, batch).compile().as_text()
        return sum(" dot(" in line or "custom-call" in line and "matmul" in line
                   for line in text.splitlines())
    assert dots(plan) > dots(plain)


@pytest.mark.parametrize("model, remats", [("scanned_models:flax_remat", True),
                                           ("scanned_models:jax_checkpoint", True),
                                           ("scanned_models:flax_unrolled", False),
                                           ("scanned_models:jax_unrolled", False)])
def test_a_step_that_rematerializes_is_not_recomputed_twice(model, remats):
    """Under ``nn.remat`` or ``jax.checkpoint`` the backward pass reads the layers' recomputed
    values and their inputs through the remat's barrier: nothing more is inserted. Control:
    the same stacks without remat get each layer's recompute."""
    spec = WorkloadSpec(model, None, None, "float32", ()).resolved()
    a = run_analysis(spec, (8,))
    program = trace_step(spec.build())
    again = recomputed(program, forced(a, "nothing_saveable"))
    assert (again is program) == remats
    if not remats:
        assert _contractions(again) > _contractions(program)


def test_recompute_on_a_forward_step_or_none_is_nothing():
    spec = WorkloadSpec("gpt", "tiny", 8, overrides=(("num_layers", 2),), step="forward")
    assert forced(run_analysis(spec, (8,)), "nothing_saveable") is None
    train = run_analysis(WorkloadSpec("gpt", "tiny", None, "float32",
                                      (("num_layers", 2),)).resolved(), (8,))
    assert forced(train, "none") is None
    assert forced(train, "dots_saveable")  # control
    with pytest.raises(CfpError, match="not a policy"):
        forced(train, "everything_saveable")


def test_a_plan_names_its_recompute_and_a_bad_one_is_refused(tmp_path):
    from cfp.api import Plan
    spec = WorkloadSpec("gpt", "tiny", None, "float32", (("num_layers", 2),)).resolved()
    a = run_analysis(spec, (8,))
    recompute = forced(a, "dots_saveable").to_json()
    plan = make_plan(a, [0] * len(a.blocks.blocks), recompute=recompute)
    from cfp.describe import recompute_words
    plan["description"] = recompute_words(a, recompute)
    Plan(plan).save(tmp_path / "plan.json")
    loaded = Plan.load(tmp_path / "plan.json")
    assert "recompute dots_saveable" in loaded.describe() and "2 of 3 segments" in loaded.describe()
    plan["recompute"]["layers"][0]["policy"] = "everything_saveable"
    Plan(plan).save(tmp_path / "bad.json")
    with pytest.raises(CfpError, match="its recompute is not"):
        Plan.load(tmp_path / "bad.json")


def _temp_mib(model: str, mesh, recompute: bool) -> float:
    """The temporaries of ``model``'s bf16 step (4 layers, hidden 256, batch 32, sequence
    256), dp over 8, compiled for ``mesh``, with every layer recomputed or not."""
    from cfp.measure import memory_of
    spec = WorkloadSpec(model, None, None, "bfloat16",
                        (("num_layers", 4), ("hidden", 256), ("seq_len", 256),
                         ("batch_size", 32))).resolved()
    a = run_analysis(spec, (8,))
    program = trace_step(spec.build())
    if recompute:
        program = recomputed(program, forced(a, "nothing_saveable"))
    step = PlannedStep(program, a, [0] * len(a.blocks.blocks), mesh)  # the batch split
    return memory_of(step.compile())["temp_bytes"] / 2**20


def test_recompute_holds_less_compiled_for_a100s_and_not_on_cpu():
    """A bf16 residual MLP stack, dp over 8, compiled for 8 A100s (no GPU here): with
    ``nothing_saveable`` on every layer its temporaries are under 60% of those without, and
    within 20% of the same stack under the user's own ``jax.checkpoint`` on every layer.
    Control: compiled for the 8 CPU devices here it holds at least 90% as much, as the stack
    does under its own ``jax.checkpoint`` there (within 2%): XLA's CPU scheduler does not
    hold the inputs in place of the activations."""
    from cfp.gpu_compile import gpu_mesh, unavailable_reason
    why = unavailable_reason("a100")
    if why is not None:
        pytest.skip(why)
    a100 = gpu_mesh("a100", (8,), ("m0",))
    plain = _temp_mib("scanned_models:jax_unrolled", a100, False)
    ours = _temp_mib("scanned_models:jax_unrolled", a100, True)
    jaxs = _temp_mib("scanned_models:jax_checkpoint", a100, False)
    assert ours < 0.6 * plain and ours < 1.2 * jaxs, (plain, ours, jaxs)
    cpu = make_mesh((8,))
    ours_on_cpu = _temp_mib("scanned_models:jax_unrolled", cpu, True)
    on_cpu = ours_on_cpu / _temp_mib("scanned_models:jax_unrolled", cpu, False)
    jaxs_on_cpu = _temp_mib("scanned_models:jax_checkpoint", cpu, False)
    assert on_cpu >= 0.9 and abs(ours_on_cpu / jaxs_on_cpu - 1) < 0.02, (on_cpu, jaxs_on_cpu)


@pytest.mark.slow  # four whole gpt steps compiled, two for A100s: about 35 s
def test_saving_nothing_holds_less_than_saving_the_dots_on_gpt_for_a100s():
    """gpt (bf16, 3 layers), dp over 8, compiled for 8 A100s: ``nothing_saveable`` on every
    layer holds a tenth less than ``dots_saveable`` (the barrier's wait on the backward pass
    survives XLA: a barrier's cotangent that nothing reads from it is dropped, and the
    recomputation then runs in the forward pass, holding more than saving the dots). Control:
    compiled for the 8 CPU devices here the two are within 2% of each other."""
    from cfp.gpu_compile import gpu_mesh, unavailable_reason
    from concurrent.futures import ThreadPoolExecutor
    from cfp.measure import memory_of
    why = unavailable_reason("a100")
    if why is not None:
        pytest.skip(why)
    spec = WorkloadSpec("gpt", "tiny", 16, "bfloat16",
                        (("num_layers", 3), ("hidden_size", 128), ("num_heads", 4),
                         ("seq_len", 128))).resolved()
    a = run_analysis(spec, (8,))
    program = trace_step(spec.build())
    for mesh, ordered in ((gpu_mesh("a100", (8,), ("m0",)), True), (make_mesh((8,)), False)):
        with ThreadPoolExecutor(2) as pool:  # a compile for described GPUs runs no kernel
            dots, nothing = pool.map(lambda p: memory_of(PlannedStep(
                recomputed(program, forced(a, p)), a, [0] * len(a.blocks.blocks), mesh
            ).compile())["temp_bytes"], ("dots_saveable", "nothing_saveable"))
        assert (nothing < 0.9 * dots) if ordered else abs(nothing / dots - 1) < 0.02, \
            (mesh, dots, nothing)


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_every_barrier_result_is_read_after_it(model):
    """Each barrier recompute inserts holds what passes it: every result it gives is read
    by a later equation (XLA drops a barrier's result nothing reads, and with a dropped
    cotangent the barrier no longer waits for the backward pass: the recomputation then
    runs in the forward pass and holds more than saving the dots, as ``gpt`` did compiled
    for A100s in the slow test above). Control: with the readers of a barrier's last
    result (the backward value at hand) pointed back at the value before it, the check
    fails."""
    import dataclasses
    spec = WorkloadSpec(model, "tiny", 8, "float32", (("num_layers", 3),)).resolved()
    a = run_analysis(spec, (8,))
    program = recomputed(trace_step(spec.build()), forced(a, "nothing_saveable"))

    def unread(p) -> list:
        read = {v for e in p.eqns for v in e.inputs} | set(p.outputs)
        return [v for e in p.eqns if e.primitive.name == "optimization_barrier"
                for v in e.outputs if v not in read]
    barriers = [e for e in program.eqns if e.primitive.name == "optimization_barrier"]
    assert len(barriers) >= 2 and unread(program) == []
    after, before = barriers[0].outputs[-1], barriers[0].inputs[-1]
    bypassed = dataclasses.replace(program, eqns=[dataclasses.replace(
        e, inputs=[before if v == after else v for v in e.inputs]) for e in program.eqns])
    assert unread(bypassed) == [after]


def test_a_bad_recompute_option_is_one_line(capsys):
    """``--recompute`` takes JAX's policy names only: one line and exit 2, before any work;
    the API's option the same as a ``CfpError``. Control: a policy passes the check."""
    from cfp.cli import main
    from cfp.options import Options, check_options
    assert main(["--recompute", "everything_saveable"]) == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'everything_saveable'" in err and err.count("\n") == 1
    with pytest.raises(CfpError, match="recompute"):
        check_options(Options(recompute="everything_saveable"))
    check_options(Options(recompute="dots_saveable", memory_budget_gb=2))


PEAK = 2**30  # every plan's compiled peak, in the model below, recomputing nothing


def _model_peaks(monkeypatch) -> list[int]:
    """Compiled peaks as a model, not a compile: ``PEAK``, less a tenth of it per layer
    recomputed whole and 6% per layer saving its contractions without a batch dimension;
    each plan's policies per layer asked for, in order (whole steps recomputing nothing:
    cfp's plans as None, the hand plans as "hand")."""
    from cfp.passes import search
    asked = []
    saves = {"nothing_saveable": 0.1, "dots_with_no_batch_dims_saveable": 0.06}

    def peaks(analysis, plans, gpu):
        layers = [p[2].layers if len(p) > 2 and p[2] else () for p in plans]
        asked.extend(tuple(policy for _, _, policy in r) for r in layers)
        return [int(PEAK * (1 - sum(saves[policy] for _, _, policy in r))) for r in layers]

    def plan_peaks(analysis, problem, profile, sols, gpus, storages=()):
        asked.extend(["hand"] * len(storages) + [None] * (len(sols) - len(storages)))
        return [PEAK] * len(sols)
    monkeypatch.setattr(search, "compiled_peaks_for", peaks)
    monkeypatch.setattr(search, "plan_peaks", plan_peaks)
    return asked


NOTHING, LIGHTER = "nothing_saveable", "dots_with_no_batch_dims_saveable"


@pytest.mark.parametrize("share, policies", [(1.1, []), (0.85, [LIGHTER] * 4),
                                             (0.65, [NOTHING] * 4), (0.5, None)])
def test_where_no_plan_fits_search_recomputes_the_fewest_layers(monkeypatch, share, policies):
    """The 4-layer tiny GPT priced for 8 A100s, compiled peaks modelled (``_model_peaks``),
    under a budget of ``share`` of the peak: at 1.1 a plan fits, nothing is recomputed and no
    hand plan is priced recomputing (the control); at 0.85 it fits recomputing two layers
    whole (within 95% of the budget) or four saving their projections, priced lower, and
    recomputes the four so; at 0.65 only four recomputed whole fit; at 0.5 even those do not
    fit, and "no plan fits" is said. A plan recomputing is priced higher by what it
    recomputes, and each hand plan is priced beside it recomputing every layer. Where the
    leanest plan does not fit, calibrating stops (three of cfp's plans compiled, not five);
    recomputing every layer, two plans are compiled (the fastest and the fastest hand plan),
    the slower hand plans' lines composed only. Control: where none fits even recomputing,
    every plan is compiled so."""
    from cfp.cluster import load_cluster
    from cfp.passes.profile import ProfileOptions, run_profile
    from cfp.passes.search import predict_plan, recompute_seconds
    from cfp.recompute import mixed
    analysis = run_analysis(WorkloadSpec("gpt", "tiny", None, "float32",
                                         (("num_layers", 4),)).resolved(), (8,))
    profile = run_profile(analysis, ProfileOptions(
        cost="analytic", cost_model=load_cluster("a100-8").cost_model((8,))))
    asked = _model_peaks(monkeypatch)
    budget = int(PEAK * share)
    if policies is None:
        with pytest.raises(CfpError, match="no plan fits.*recomputing every layer, the least"):
            predict_plan(analysis, profile, budget, 10.0, compile_for="a100")
        assert asked.count((NOTHING,) * 4) > 2
        return
    rec = predict_plan(analysis, profile, budget, 10.0, compile_for="a100")
    recomputing = [h for h in rec.hand_plans if h[0].endswith("recomputing every layer")]
    if not policies:
        assert rec.recompute is None and rec.recompute_s == 0 and not recomputing
        return
    assert [layer["policy"] for layer in rec.recompute["layers"]] == policies
    assert [layer["segment"] for layer in rec.recompute["layers"]] == list(range(len(policies)))
    if LIGHTER in policies:  # priced below the two layers recomputed whole that also fit
        whole = mixed(forced(analysis, NOTHING), 2, 0, LIGHTER)
        assert rec.recompute_s < recompute_seconds(
            analysis, whole, rec.predicted_s - rec.recompute_s, "a100")
    assert rec.compiled_peak_bytes <= 0.95 * budget
    assert 0 < rec.recompute_s < rec.predicted_s
    plain = {h[0]: h[1] for h in rec.hand_plans}
    assert recomputing and all(h[1] > plain[h[0].split()[0]] for h in recomputing)
    assert asked.count(None) == 3 and asked.count((NOTHING,) * 4) == 2
    assert min(recomputing, key=lambda h: h[1])[3] is not None
    assert any(h[3] is None for h in recomputing)


def test_a_plan_composes_to_less_recomputing_and_makes_its_layers_again():
    """The 4-layer tiny GPT in bfloat16 priced for 8 A100s, its dp plan composed with every
    layer recomputed: under ``nothing_saveable`` the activations held across windows fall to
    under a third and what they held is made again in the backward pass (``remade``), a
    layer's at once: the step composes to more than with each window's made again alone;
    ``dots_saveable`` holds between the two. The fsdp plan holds no weight gathered from the
    forward pass to the backward (which gathers again): what it adds up besides activations
    falls under half of zero1's (weights whole), where without recompute the two are equal.
    Control: ``none`` composes as no recompute does, and makes nothing again."""
    from cfp.cluster import load_cluster
    from cfp.passes.profile import ProfileOptions, run_profile
    from cfp.problem import baseline_candidates, build_problem
    from cfp.solver import evaluate
    analysis = run_analysis(WorkloadSpec("gpt", "tiny", None, "bfloat16",
                                         (("num_layers", 4),)).resolved(), (8,))
    profile = run_profile(analysis, ProfileOptions(
        cost="analytic", cost_model=load_cluster("a100-8").cost_model((8,))))
    plain = build_problem(analysis, profile, None)[0]
    hand = dict(baseline_candidates(analysis, plain, [], within_budget=False))
    dp = hand["dp"].choices

    def stored(policy, name):  # adding up, less the activations held
        problem = build_problem(analysis, profile, None, forced(analysis, policy))[0]
        return sum(g.options[c].memory - g.options[c].held
                   for g, c in zip(problem.groups, hand[name].choices))
    assert stored("none", "fsdp") == stored("none", "zero1")
    assert stored("nothing_saveable", "fsdp") < 0.5 * stored("nothing_saveable", "zero1")

    def composed(policy):
        problem = build_problem(analysis, profile, None, forced(analysis, policy))[0]
        options = [g.options[c] for g, c in zip(problem.groups, dp)]
        alone = evaluate(dataclasses.replace(problem, layer_starts={}), dp)[1]
        return (evaluate(problem, dp)[1], sum(o.held for o in options),
                sum(o.remade for o in options), alone)
    none, dots, nothing = map(composed, ("none", "dots_saveable", "nothing_saveable"))
    assert none[0] == evaluate(plain, dp)[1] == none[3] and none[2] == 0
    assert nothing[1] < none[1] / 3 and nothing[2] > 0 and nothing[0] > nothing[3]
    assert nothing[1] < dots[1] < none[1]
    # At this size the state outweighs the activations: the peaks compose within 2%, as the
    # whole steps compile for A100s (within 0.2%); the slow test below checks a larger one.
    assert abs(nothing[0] / none[0] - 1) < 0.02 and abs(dots[0] / none[0] - 1) < 0.02


@pytest.mark.slow  # three whole steps compiled for A100s: about 45 s
def test_a_recomputing_plan_composes_within_a_tenth_of_its_compiled_peak():
    """gpt in bfloat16 where activations outweigh the state (2 layers, hidden 128, sequence
    256, batch 64), dp priced for 8 A100s: with every layer ``nothing_saveable``, or
    ``LIGHTER``, the composition is within 10% of the whole step compiled for 8 A100s, and
    without recompute within 15%. Control: each window's activations made again alone (no
    layer made again at once), the composition is over a fifth under the compiled peak."""
    from cfp.cluster import load_cluster
    from cfp.execute import Storage
    from cfp.gpu_compile import unavailable_reason
    from cfp.passes.profile import ProfileOptions, run_profile
    from cfp.passes.search import LIGHTER, compiled_peaks_for
    from cfp.problem import baseline_candidates, build_problem
    from cfp.recompute import mixed
    from cfp.solver import evaluate
    why = unavailable_reason("a100")
    if why is not None:
        pytest.skip(why)
    analysis = run_analysis(WorkloadSpec("gpt", "tiny", 64, "bfloat16", (
        ("num_layers", 2), ("hidden_size", 128), ("num_heads", 8), ("seq_len", 256))
    ).resolved(), (8,))
    profile = run_profile(analysis, ProfileOptions(
        cost="analytic", cost_model=load_cluster("a100-8").cost_model((8,))))
    plain = build_problem(analysis, profile, None)[0]
    dp = dict(baseline_candidates(analysis, plain, [], within_budget=False))["dp"]
    full = forced(analysis, "nothing_saveable")
    recomputes = (None, full, mixed(full, 0, len(full.layers), LIGHTER))
    peaks = compiled_peaks_for(analysis, [(dp.strategies, Storage(), r) for r in recomputes],
                               "a100")
    for recompute, peak, within in zip(recomputes, peaks, (0.15, 0.1, 0.1)):
        problem = build_problem(analysis, profile, None, recompute)[0]
        composed = evaluate(problem, dp.choices)[1]
        alone = evaluate(dataclasses.replace(problem, layer_starts={}), dp.choices)[1]
        assert abs(composed / peak - 1) <= within, (recompute, composed, peak)
        assert recompute is None or alone < 0.8 * peak, (recompute, alone, peak)


@pytest.mark.slow  # about 40 whole steps compiled for A100s
def test_a_cluster_plan_recomputes_where_nothing_fits_compiled_for_a100s():
    """The bf16 tiny GPT (4 layers, hidden 128, sequence 256, batch 32) for 8 A100s, under a
    budget between the leanest hand plan's compiled peak and that plan's recomputing every
    layer: the kept plan recomputes some layers, its whole step compiled with them fits, and
    it is predicted faster than every hand plan recomputing every layer, one of which fits."""
    from cfp.baselines import baseline_strategy_indices, load_rules
    from cfp.cluster import load_cluster
    from cfp.execute import Storage
    from cfp.gpu_compile import unavailable_reason
    from cfp.passes.profile import ProfileOptions, run_profile
    from cfp.passes.search import compiled_peaks_for, predict_plan
    from cfp.problem import COMPILED_FIT_SHARE, compiled_fits
    if unavailable_reason("a100") is not None:
        pytest.skip(unavailable_reason("a100"))
    spec = WorkloadSpec("gpt", "tiny", 32, "bfloat16", (("num_layers", 4), ("hidden_size", 128),
                                                       ("seq_len", 256))).resolved()
    a = run_analysis(spec, (8,))
    profile = run_profile(a, ProfileOptions(
        cost="analytic", cost_model=load_cluster("a100-8").cost_model((8,))))
    rules = load_rules()
    hand = [(idx, Storage(rules[name].storage))
            for name, (idx, _) in baseline_strategy_indices(a, storage=True).items()]
    full = forced(a, "nothing_saveable")
    plain = compiled_peaks_for(a, hand, "a100")
    recomputing = compiled_peaks_for(a, [h + (full,) for h in hand], "a100")
    budget = int((min(plain) + min(recomputing)) / 2 / COMPILED_FIT_SHARE)
    rec = predict_plan(a, profile, budget, 10.0, compile_for="a100")
    assert rec.recompute and 0 < len(rec.recompute["layers"]) <= 4
    assert compiled_fits(rec.compiled_peak_bytes, budget, "gpu")
    recomputing = [h for h in rec.hand_plans if h[0].endswith("recomputing every layer")]
    # a line not compiled recomputing (peak None) is slower than the plan kept
    assert any(h[3] is not None and compiled_fits(h[3], budget, "gpu") for h in recomputing)
    assert all(rec.predicted_s < h[1] for h in recomputing)


@pytest.mark.slow  # three recipes through the passes' analysis and plan.jit, 2x4
@pytest.mark.parametrize("model, rtol", [("recipes:gpt_clip", 1e-5),
                                         ("recipes:gpt_accumulate", 1e-5),
                                         ("recipes:flax_bf16_clip", 2.5e-4)])
def test_a_forced_recompute_runs_the_steps_people_train_with(model, rtol):
    """Clipped AdamW, accumulation over micro-batches by ``lax.scan`` in a ``TrainState``
    step, and a Flax model computing in bfloat16 over float32 weights, each with
    ``nothing_saveable`` on every layer: something is recomputed, and three donated steps
    through ``plan.jit`` on 2x4 keep each loss within ``rtol`` of one device's (bfloat16's
    as the README's recipe rows hold it)."""
    spec = WorkloadSpec(model, None, None, "float32", (("num_layers", 2),)).resolved()
    a = run_analysis(spec, (2, 4))
    w = spec.build()
    recompute = forced(a, "nothing_saveable")
    program = trace_step(w)
    assert _contractions(recomputed(program, recompute)) > _contractions(program)
    strategies = [len(b.strategies) - 1 for b in a.blocks.blocks]
    params, batch = example_inputs(w)
    opt_state = jax.jit(w.opt_init or adam_init)(params)
    want = run_loop(jax.jit(w.train_step()), params, opt_state, batch)
    step = plan_jit(w.train_step(), make_plan(a, strategies, recompute=recompute.to_json()),
                    make_mesh((2, 4)), params, opt_state, batch)
    placed = jax.device_put(jax.tree_util.tree_map(np.asarray, (params, opt_state, batch)),
                            step.in_shardings)
    got = run_loop(step, *placed)
    np.testing.assert_allclose(got[0], want[0], rtol=rtol)
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(placed[0]))
