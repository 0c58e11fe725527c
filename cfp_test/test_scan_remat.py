"""Layers under ``lax.scan`` / Flax ``nn.scan`` and under ``jax.checkpoint`` / ``nn.remat``
(``scanned_models``): analysed as their unrolled twins are, planned with one strategy per
scan body, run as a scan, remat kept."""
import functools
import math

import jax
import pytest

from cfp.grouping import build_blocks
from cfp.cli import main
from cfp.errors import CfpError
from cfp.execute import PlannedStep, check_numerics
from cfp.program import trace_program
from cfp.passes.analysis import run_analysis
from cfp.windows import split_windows, window_space
from cfp.mesh import make_mesh
from cfp.tracing import trace_step
from cfp.workloads import WorkloadSpec

TWINS = [("flax_scan", "flax_unrolled"), ("flax_remat", "flax_unrolled"),
         ("flax_scan_remat", "flax_unrolled"), ("jax_scan", "jax_unrolled"),
         ("jax_checkpoint", "jax_unrolled")]


def _spec(model, **over):
    return WorkloadSpec(f"scanned_models:{model}", None, None, "float32",
                        tuple(over.items())).resolved()


def _layer_view(a):
    """What the analysis makes of each block (its seed, its other contractions but remat's
    recomputations, its strategy count), the segment types, and the profile's windows with
    their combination counts. Not the windows' types: a scan updates its stacked weights
    once, in the operators of one iteration's windows, which makes those window types of
    their own (``cfp.windows``), and which state a window holds (a scan reads its stacked
    weights in every iteration and updates them once), so only the blocks' spaces count."""
    from cfp.segments import contraction_signature
    g = a.graph
    blocks = [(contraction_signature(g, b.seed),
               sorted(contraction_signature(g, m.op) for m in b.contractions
                      if m.role not in ("seed", "recompute")),
               len(b.strategies)) for b in a.blocks.blocks]
    windows, _ = split_windows(a, 8)
    return (blocks, a.segments.num_types, [s.type for s in a.segments.instances],
            [(w.start, w.end, window_space(a, w)[:w.end - w.start]) for w in windows])


@functools.lru_cache(maxsize=None)
def _layer_view_of(model, num_layers):
    """``_layer_view`` of a model's analysis on mesh 8, once per run: the unrolled twins
    serve several stacks. Not for tests that patch the analysis or read memos of its graph."""
    return _layer_view(run_analysis(_spec(model, num_layers=num_layers), (8,)))


@pytest.mark.parametrize("model,twin", TWINS)
def test_scanned_and_remat_stacks_analyse_as_their_unrolled_twin(model, twin):
    """Same blocks (contractions, strategy counts), segments and profiled combinations as
    the unrolled twin, at 2 and 4 layers; one segment type for the stack at any depth."""
    for layers in (2, 4):
        got = _layer_view_of(model, layers)
        assert got == _layer_view_of(twin, layers)
        assert got[2].count(got[2][0]) == layers  # the layer segment repeats once per layer


def test_without_remats_recomputation_matched_the_twins_differ(monkeypatch):
    """Negative control: with recomputed contractions not matched to what they repeat, the
    remat stack gets blocks of its own and no longer analyses as its twin."""
    import cfp.grouping
    a = run_analysis(_spec("flax_scan_remat"), (8,))
    twin = _layer_view(run_analysis(_spec("flax_unrolled"), (8,)))
    monkeypatch.setattr(cfp.grouping, "repeats", lambda graph: {})
    broken = build_blocks(a.graph, (8,))
    assert len(broken.blocks) > len(twin[0])


def test_without_residuals_passed_through_a_scan_differs():
    """Negative control: the stacked residuals sliced again (not passed through by the trace)
    hide each backward contraction from its forward one."""
    from cfp import program as graphmod
    w = _spec("jax_scan").build()
    program = trace_step(w)
    original = graphmod._Builder.layer_slice
    try:
        graphmod._Builder.layer_slice = lambda self, stacked, i: self.traced(
            lambda a: jax.lax.index_in_dim(a, i, 0, keepdims=False), stacked)
        sliced = trace_step(w)
    finally:
        graphmod._Builder.layer_slice = original
    n = len(build_blocks(program.graph(), (8,)).blocks)
    assert len(build_blocks(sliced.graph(), (8,)).blocks) > n


def layer_loops(hlo_text: str, num_layers: int) -> int:
    """The compiled step's loops over its layers: XLA's while loops that run ``num_layers``
    times (the forward scan and the backward one; a scatter XLA lowers to a loop runs once
    per index)."""
    return sum(f'"known_trip_count":{{"n":"{num_layers}"}}' in line
               for line in hlo_text.splitlines() if " while(" in line)


@pytest.mark.parametrize("model", [pytest.param("flax_scan_remat", marks=pytest.mark.slow),
                                   "flax_scan", "jax_scan", "jax_checkpoint"])
def test_planned_scan_runs_as_a_scan_and_matches_one_device(model):
    """Each block's last strategy (weights split on a non-layer dim): the step compiles with
    the scans as loops, the stacked weights split but never on the layer axis, and loss and
    gradients match the single-device step. In the Flax stacks a layer's leading norm belongs
    to the previous layer's last block, but in the first iteration to the layer's own: those
    copies differ and the step still rolls (``Program.rolled_constraints``)."""
    spec = _spec(model, num_layers=3)
    a, w, mesh = run_analysis(spec, (8,)), spec.build(), make_mesh((8,))
    plan = [len(b.strategies) - 1 for b in a.blocks.blocks]
    step = PlannedStep(trace_step(w), a, plan, mesh)
    assert step.rolled == ("scan" in model)
    compiled = step.compile()
    assert layer_loops(compiled.as_text(), 3) == (2 if "scan" in model else 0)
    stacked = [s for v, s in zip(a.graph.inputs, step.in_specs)
               if a.graph.values[v].shape[:1] == (3,) and len(a.graph.values[v].shape) == 3]
    assert ("scan" in model) == bool(stacked)
    assert all(s[0] is None for s in stacked)
    assert not stacked or any(any(s[1:]) for s in stacked)
    loss_err, grad_excess = check_numerics(w, a, plan, mesh)
    assert loss_err < 1e-5 and grad_excess == 0.0


def test_a_plan_that_differs_per_layer_runs_unrolled():
    """Negative control for the rolled step: layers given different strategies cannot share
    one scan body, so the step runs unrolled."""
    spec = _spec("jax_scan", num_layers=3)
    a, w, mesh = run_analysis(spec, (8,)), spec.build(), make_mesh((8,))
    plan = [b.index % len(b.strategies) for b in a.blocks.blocks]
    step = PlannedStep(trace_step(w), a, plan, mesh)
    assert not step.rolled
    assert layer_loops(step.compile().as_text(), 3) == 0


def test_composed_memory_holds_only_what_remat_saves():
    """Under remat the forward pass holds each layer's input for the backward pass (read
    again by the barrier in front of the recomputation), and less than half of what the
    unrolled twin holds, whose layers keep activations of shapes remat recomputes."""
    (g, remat), (g_twin, twin) = _held("flax_remat"), _held("flax_unrolled")
    saved = _read_by_barrier(g)
    assert len(saved) >= 4 and saved <= remat  # the 4 layers' inputs
    shapes = lambda graph, held: {graph.values[v].shape for v in held}  # noqa: E731
    assert shapes(g_twin, twin) - shapes(g, remat)  # activations of shapes remat recomputes
    size = lambda graph, held: sum(math.prod(graph.values[v].shape) for v in held)  # noqa: E731
    assert size(g, remat) < 0.5 * size(g_twin, twin)


def test_without_the_barrier_remats_inputs_are_not_held(monkeypatch):
    """Negative control: not counting what remat's barrier reads, the layer inputs it saves
    (each a residual add's result, cheap to recompute) drop out of the held set."""
    import cfp.window_memory
    feeds = cfp.window_memory._feeds_contraction
    monkeypatch.setattr(cfp.window_memory, "_feeds_contraction", lambda g, i, depth=3: (
        g.ops[i].primitive != "optimization_barrier" and feeds(g, i, depth)))
    g, held = _held("flax_remat")
    assert not _read_by_barrier(g) <= held


def test_an_elementwise_residual_is_held_where_xla_cannot_recompute_it_cheaply():
    """A tanh-gelu's backward reads the tanh (expensive: held) and the pre-activation, a bias
    add (cheap: recomputed from the contraction's result, which is held); the control, the
    held set without elementwise residuals, holds neither: only the gelu's output, which the
    next contraction's backward reads."""
    import jax.numpy as jnp
    from cfp.program import trace_program
    from cfp.window_memory import held_for_backward

    def loss(w1, b, w2, x):
        h = x @ w1 + b
        y = 0.5 * h * (1 + jnp.tanh(0.8 * (h + 0.04 * h ** 3)))
        return (y @ w2).sum()

    def step(w1, b, w2, x):
        value, grads = jax.value_and_grad(loss, argnums=(0, 1, 2))(w1, b, w2, x)
        return grads, value

    g = trace_program(step, jnp.ones((8, 16)), jnp.ones(16), jnp.ones((16, 8)),
                      jnp.ones((4, 8))).graph()
    made_by = lambda held: sorted(g.ops[g.values[v].producer].primitive  # noqa: E731
                                  for v in held)
    assert made_by(held_for_backward(g)) == ["dot_general", "mul", "tanh"]
    assert made_by(held_for_backward(g, elementwise_residuals=False)) == ["mul"]



def test_a_softmax_exp_is_held_on_cpu_and_recomputed_on_gpu_in_float32():
    """XLA's GPU fusion names an exp in float32 or float16 as cheap and recomputes it in the
    backward fusion that reads it, where XLA on CPU holds it: on GPU the held set keeps what
    the exp reads (the logits, a contraction's result) instead. Control: XLA's rule does not
    name a bfloat16 exp as cheap, so the held set keeps it on GPU too."""
    import jax.numpy as jnp
    from cfp.program import trace_program
    from cfp.window_memory import held_for_backward

    def loss(w, x):
        logits = x @ w
        shifted = logits - jax.lax.stop_gradient(logits.max(-1, keepdims=True))
        p = jnp.exp(shifted)
        return (jnp.log(p.sum(-1)) - shifted[:, 0]).sum().astype(jnp.float32)

    def step(w, x):
        value, grad = jax.value_and_grad(loss)(w, x)
        return grad, value

    def made_by(dtype, platform):
        g = trace_program(step, jnp.ones((16, 8), dtype), jnp.ones((4, 16), dtype)).graph()
        return {g.ops[g.values[v].producer].primitive
                for v in held_for_backward(g, platform=platform)}

    assert "exp" in made_by(jnp.float32, "cpu")
    on_gpu = made_by(jnp.float32, "gpu")
    assert "exp" not in on_gpu and "dot_general" in on_gpu, on_gpu
    assert "exp" in made_by(jnp.bfloat16, "gpu")  # the control


def _held(model):
    from cfp.window_memory import held_for_backward
    g = run_analysis(_spec(model, num_layers=4), (8,)).graph
    return g, held_for_backward(g)


def _read_by_barrier(g) -> set:
    """The forward values remat's barriers read in the backward pass."""
    loss_op = g.values[g.outputs[-1]].producer
    return {v for op in g.ops if op.primitive == "optimization_barrier" for v in op.inputs
            if g.values[v].producer is not None and g.values[v].producer < loss_op}


@pytest.mark.slow  # in the suite: the planned scan's step, the twins' analysis and memory
@pytest.mark.parametrize("model", ["flax_scan_remat", "flax_scan", "flax_remat", "jax_scan",
                                   "jax_checkpoint"])
def test_three_passes_on_scanned_and_remat_stacks(tmp_path, capsys, model):
    args = ["--model", f"scanned_models:{model}", "--num-layers", "2", "--mesh", "8",
            "--workdir", str(tmp_path), "--max-combinations", "8", "--memory-budget", "1",
            "--validate-top", "1", "--iters", "1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "gradients match" in out
    assert "scans run as lax.scan" in out or "scan" not in model


@pytest.mark.parametrize("where", ["cond", "while"])
def test_a_contraction_under_cond_or_while_is_refused_with_what_to_change(where):
    def f(w, x):
        if where == "cond":
            y = jax.lax.cond(x.sum() > 0, lambda a: a @ w, lambda a: a, x)
        else:
            y = jax.lax.while_loop(lambda c: c[1] < 3, lambda c: (c[0] @ w, c[1] + 1),
                                   (x, 0))[0]
        return y.sum()

    with pytest.raises(CfpError) as e:
        trace_program(jax.grad(f) if where == "cond" else f,
                      jax.numpy.ones((4, 4)), jax.numpy.ones((2, 4)))
    assert "\n" not in str(e.value) and ("jnp.where" in str(e.value) or "lax.scan" in str(e.value))
