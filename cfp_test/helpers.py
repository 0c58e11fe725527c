"""Shared test helpers: traced tiny workloads, cached per process (tracing costs ~0.2 s)."""
import functools

from cfp.grouping import build_blocks
from cfp.models import get_workload
from cfp.tracing import trace_step

# the run that the session fixture ``mlp_profiled`` (conftest) has analysed and profiled
MLP_PROFILED = ["--model", "mlp", "--mesh", "4", "--max-combinations", "4"]


@functools.lru_cache(maxsize=None)
def traced(model: str, num_layers: int | None = None, **kw):
    """(program, graph) of a zoo model's tiny preset."""
    extra = {} if num_layers is None else {"num_layers": num_layers}
    program = trace_step(get_workload(model, "tiny", **extra, **kw))
    return program, program.graph()


@functools.lru_cache(maxsize=None)
def blocks_of(model: str, mesh_shape: tuple, num_layers: int | None = None):
    program, graph = traced(model, num_layers)
    return program, graph, build_blocks(graph, mesh_shape)


def run_loop(step, params, opt_state, batch, steps: int = 3, loss=lambda x: x):
    """(losses, params, opt_state) after ``steps`` steps of ``step``, each fed the state the
    last one returned, as a training loop does (the state may be donated); ``loss`` picks
    the loss out of what the step returns beside the state (its metrics)."""
    losses = []
    for _ in range(steps):
        params, opt_state, metrics = step(params, opt_state, batch)
        losses.append(float(loss(metrics)))
    return losses, params, opt_state


def assert_loop_matches(got, want, *, rtol=1e-4, atol=1e-4):
    """Two ``run_loop`` results agree: every step's loss and the final state. Adam's update,
    near the sign of the gradient, lifts reduction-order noise to a share of the learning
    rate (1e-3 here) where a gradient is near 0: hence ``atol``, a tenth of one update."""
    import jax
    import numpy as np
    np.testing.assert_allclose(got[0], want[0], rtol=rtol)
    for x, y in zip(jax.tree_util.tree_leaves(got[1:]), jax.tree_util.tree_leaves(want[1:])):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=rtol, atol=atol)


def planned_loop(planned_step, workload, steps: int = 3):
    """``run_loop`` of a compiled ``cfp.execute.PlannedStep`` from the workload's real inputs,
    as trees, and the single-device loop's from the same inputs; the planned step's new state
    is checked to come out in the layout it went in (else the next step could not take it)."""
    import jax
    from cfp.execute import real_inputs
    host = real_inputs(workload)
    tree = jax.tree_util.tree_structure(
        (workload.abstract_params(), workload.abstract_opt_state(), workload.abstract_batch()))
    loop = planned_step.loop(host)

    def step(params, opt_state, batch):
        outs = loop()
        n = planned_step.state_count
        assert all(x.sharding.is_equivalent_to(s, x.ndim)
                   for x, s in zip(outs[:n], planned_step.in_shardings[:n]))
        new = jax.tree_util.tree_unflatten(tree, list(outs[:n]) + list(loop.args[n:]))
        return new[0], new[1], outs[n]

    params, opt_state, batch = jax.tree_util.tree_unflatten(tree, host)
    want = run_loop(jax.jit(workload.train_step()), params, opt_state, batch, steps)
    return run_loop(step, None, None, None, steps), want


def assert_users_loop(train_step, plan, mesh, params, opt_state, batch, loss=lambda x: x):
    """Three steps of the user's loop, each fed the state the last returned and donating it,
    under ``plan.jit`` and under ``jax.jit`` with ``step_shardings``, match three on one
    device; the new state comes out in the layout it went in. Returns the last params. On
    Explicit axes the user's ``jax.jit`` takes the step with the axes Auto inside
    (``jax.sharding.auto_axes``), as a step that does not type its shardings needs."""
    import jax
    import numpy as np
    from cfp.jax_compat import auto_inside
    from cfp.plan import DONATE_ARGNUMS, step_shardings
    from cfp.plan import jit as plan_jit
    ref = run_loop(jax.jit(train_step), params, opt_state, batch, loss=loss)  # one device
    in_sh, out_sh = step_shardings(plan, mesh, params, opt_state, batch)
    steps = (plan_jit(train_step, plan, mesh, params, opt_state, batch),
             jax.jit(auto_inside(train_step, mesh, out_sh), in_shardings=in_sh,
                     out_shardings=out_sh, donate_argnums=DONATE_ARGNUMS))
    def host(x):  # a fresh copy to place; a typed PRNG key (dropout's) has no NumPy form
        return x if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else np.asarray(x)
    for step in steps:
        placed = jax.device_put(jax.tree_util.tree_map(host, (params, opt_state, batch)), in_sh)
        got = run_loop(step, *placed, loss=loss)
        assert_loop_matches(got, ref)
        assert all(x.sharding.is_equivalent_to(s, x.ndim) for x, s in zip(
            jax.tree_util.tree_leaves(got[1:]), jax.tree_util.tree_leaves(in_sh[:2])))
        # donated: every parameter (an optimizer-state leaf the step passes through as it
        # is, such as Adafactor's placeholder for an unfactored moment, needs no buffer)
        assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(placed[0]))
    return got[1]


def hand_plan_windows(analysis, program, windows, mesh, name: str):
    """The hand plan ``name``'s block strategies and state layout, and under it each window's
    (window, combination, memory fields of its compiled program)."""
    from cfp.baselines import baseline_strategy_indices
    from cfp.measure import WindowProgram
    from cfp.sharding import STATE_LAYOUTS
    from cfp.windows import held_state
    plan, layout = baseline_strategy_indices(analysis, storage=True)[name]
    rows = []
    for w in windows:
        combo = tuple(plan[w.start:w.end]) + (
            (STATE_LAYOUTS.index(layout),) if held_state(analysis, w) else ())
        wp = WindowProgram(program, analysis, w, mesh)
        rows.append((w, combo, wp.memory(wp.compile(combo)[0])))
    return plan, layout, rows


def composed_bytes(analysis, window_terms) -> int:
    """The step's memory per device composed as search composes it (``cfp.solver.evaluate``)
    from ``window_terms``: (window, combination, its ``option_memory`` terms) per window."""
    from cfp.solver import Group, Option, Problem, evaluate
    from cfp.window_memory import COMBINED_REDUCTION_BYTES
    groups = [Group(tuple(range(w.start, w.end)), [Option(combo, 0, *terms)])
              for w, combo, terms in window_terms]
    return evaluate(Problem(groups, [len(b.strategies) for b in analysis.blocks.blocks],
                            waiting_cap=COMBINED_REDUCTION_BYTES), [0] * len(groups))[1]


def handed_fingerprint(spec, _item) -> str:
    """In a pool's process (``cfp.pool.map_meshes``): the fingerprint of the step ``spec``
    names, traced there."""
    from cfp.tracing import trace_step
    return trace_step(spec.build()).graph().fingerprint()
