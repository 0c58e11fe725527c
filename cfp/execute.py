"""Running the full training step under a plan (one strategy per block).

``PlannedStep`` re-evaluates the traced step with each block's strategy applied through public
APIs: parameter, optimizer-state and batch shardings as ``jax.jit`` input shardings (the layout
the first block that reads each wants), the new state as output shardings, and
``with_sharding_constraint`` on every contraction's operands and result inside.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Sequence

import numpy as np

from cfp import dims as dimrules
from cfp.jax_compat import compiler_options as jax_compiler_options
from cfp.jax_compat import dtype_name, is_key, to_dtype
from cfp.sharding import STATE_LAYOUTS, block_constraints, state_specs, step_function
from cfp.strategies import Strategy


def _strategy(block, s):
    return s if isinstance(s, Strategy) else block.strategies[s]


@dataclasses.dataclass(frozen=True)
class Storage:
    """Where a plan keeps the training state between steps, and the step-input layouts it
    fixes itself.

    ``state``: ``plan`` keeps each state leaf in the layout its first reader computes with;
    ``zero1`` splits the optimizer state further, over the mesh axes that layout leaves
    replicated (``split_rest``): gradients are reduced into that layout, the update runs on
    shards and the parameters are gathered after it; ``fsdp`` splits the parameters so too,
    gathered before use. Either way the new state leaves the step in the layout it came in.
    ``inputs``: (step-input position, PartitionSpec entries) pairs that override the
    plan's (a baseline that splits only the batch). ``leaves``: (state pair index, layout)
    pairs that override ``state`` for those leaves (a searched plan chooses per window).
    ``cfp.sharding.state_specs`` applies them."""

    state: str = "plan"
    inputs: tuple = ()
    leaves: tuple = ()

    def __post_init__(self):
        for layout in (self.state, *(z for _, z in self.leaves)):
            if layout not in STATE_LAYOUTS:
                raise ValueError(f"state layout {layout!r} is not one of {STATE_LAYOUTS}")

    def layouts(self, num_pairs: int) -> list[str]:
        """The layout of each of ``num_pairs`` state pairs."""
        out = [self.state] * num_pairs
        for k, layout in self.leaves:
            out[k] = layout
        return out

    def describe(self) -> str:
        """In words: ``plan``, ``zero1``, ``fsdp``, or the count of leaves per layout."""
        if not self.leaves:
            return self.state
        counts = {}
        for _, z in self.leaves:
            counts[z] = counts.get(z, 0) + 1
        return layouts_text(counts)


def layouts_text(counts: dict[str, int]) -> str:
    """State leaves counted per layout, in words: ``2 state leaves fsdp, 4 state leaves as
    the blocks compute them`` (the ``plan`` layout last)."""
    return ", ".join(f"{n} state {'leaf' if n == 1 else 'leaves'} "
                     + ("as the blocks compute them" if z == "plan" else z)
                     for z, n in sorted(counts.items(), key=lambda zn: (zn[0] == "plan", zn)))


def plan_specs(analysis, strategies: Sequence[int | Strategy] | None, axis_names,
               storage: Storage | None = None) -> tuple[dict, dict, dict]:
    """(in specs per step-input value, out specs per step-output value, constraints per op).

    ``strategies`` holds per block a strategy index or a ``Strategy`` (a manual plan may use
    one that enumeration pruned); ``None`` puts no constraint anywhere. A step input enters
    in the layout its first reader wants (or ``storage``'s); the new state leaves in the
    layout its input came in, so that a loop can feed it back (the plan is a fixed point),
    and the other outputs as their producer makes them."""
    g, ba = analysis.graph, analysis.blocks
    storage = storage or Storage()
    member = {m.op: (b, m) for b in ba.blocks for m in b.members}
    want: dict[int, tuple] = {}
    made: dict[int, tuple] = {}
    for op in g.ops:
        if op.index not in member or strategies is None:
            continue
        block, m = member[op.index]
        strat = _strategy(block, strategies[block.index])
        for v, lab in zip(op.inputs, m.ins):
            if g.values[v].producer is None and v not in want:
                want[v] = dimrules.spec_axes(lab, strat.axes, axis_names)
        for v, lab in zip(op.outputs, m.outs):
            made[v] = dimrules.spec_axes(lab, strat.axes, axis_names)
    none = lambda v: (None,) * len(g.values[v].shape)  # noqa: E731
    for i, spec in storage.inputs:
        want[g.inputs[i]] = tuple(spec)
    ins = {v: want.get(v, none(v)) for v in g.inputs}
    constraints = {}
    for b in ba.blocks if strategies is not None else ():
        constraints.update(block_constraints(b, _strategy(b, strategies[b.index]), axis_names))
    pairs = g.state_pairs()
    stored = state_specs(g, range(len(pairs)), storage.layouts(len(pairs)), ins, constraints,
                         analysis.mesh_shape, axis_names)
    outs = {v: made.get(v, none(v)) for v in g.outputs}
    for k, (_, new) in enumerate(pairs):
        outs[new] = stored[k]
    return ins, outs, constraints


class PlannedStep:
    """The whole step under ``strategies``; ``compile()`` once, then ``loop`` to run it.

    The state inputs are donated, as a training loop donates them: each step's new state
    takes its inputs' place (``donate=False`` keeps them, for a program run on the same
    inputs again)."""

    def __init__(self, program, analysis, strategies, mesh, storage: Storage | None = None,
                 *, donate: bool = True):
        from jax.sharding import NamedSharding, PartitionSpec
        self.program, self.analysis, self.mesh = program, analysis, mesh
        self.strategies = None if strategies is None else tuple(strategies)
        self.storage = storage or Storage()
        ins, outs, self.constraints = plan_specs(analysis, strategies, mesh.axis_names,
                                                 self.storage)
        g = analysis.graph
        shard = lambda s: NamedSharding(mesh, PartitionSpec(*s))  # noqa: E731
        self.in_shardings = [shard(ins[v]) for v in g.inputs]
        self.out_shardings = [shard(outs[v]) for v in g.outputs]
        self.in_specs = [ins[v] for v in g.inputs]
        self.out_specs = [outs[v] for v in g.outputs]
        self.state_count = len(g.state_pairs())
        self.donate = donate
        self.fn, self.rolled = step_function(program, constraints=self.constraints, mesh=mesh)
        self.compiled, self.compile_s = None, 0.0

    def compile(self, compiler_options: dict | None = None):
        """Lower and compile the step (its seconds in ``compile_s``)."""
        import jax
        t0 = time.perf_counter()
        g = self.analysis.graph
        args = [jax.ShapeDtypeStruct(g.values[v].shape, to_dtype(g.values[v].dtype), sharding=s)
                for v, s in zip(g.inputs, self.in_shardings)]
        jitted = jax.jit(self.fn, in_shardings=self.in_shardings,
                         out_shardings=self.out_shardings,
                         donate_argnums=tuple(range(self.state_count)) if self.donate else ())
        self.compiled = jitted.lower(*args).compile(
            {**(jax_compiler_options(self.mesh) or {}), **(compiler_options or {})} or None)
        self.compile_s = time.perf_counter() - t0
        return self.compiled

    def place(self, flat_inputs):
        from cfp.multihost import put
        return [put(x, s) for x, s in zip(flat_inputs, self.in_shardings)]

    def loop(self, flat_inputs) -> "StepLoop":
        """The compiled step as a training loop from ``flat_inputs`` (host arrays)."""
        return StepLoop(self.compiled, self.place(flat_inputs), self.state_count)


def compile_steps(steps: Sequence["PlannedStep"]) -> None:
    """Compile the steps not compiled yet, several at once: XLA releases the GIL while it
    compiles, so each core compiles one (at most 8). On a GPU one at a time: a compile times
    kernels on the device to choose them, and beside another compile it would choose by
    noisy times."""
    import os
    from concurrent.futures import ThreadPoolExecutor
    todo = [ps for ps in steps if ps.compiled is None]
    if not todo:
        return
    on_gpu = todo[0].mesh.devices.flat[0].platform != "cpu"
    threads = 1 if on_gpu else max(1, min(os.cpu_count() or 1, 8, len(todo)))
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for future in [pool.submit(ps.compile) for ps in todo]:
            future.result()


class StepLoop:
    """A compiled step run as a training loop: each call runs one step and feeds its new
    state (the first ``state_count`` outputs) back as the next step's state."""

    def __init__(self, compiled, args, state_count: int):
        self.compiled, self.args, self.state_count = compiled, list(args), state_count

    def __call__(self):
        outs = self.compiled(*self.args)
        self.args[:self.state_count] = outs[:self.state_count]
        return outs


MIN_STEPS, MIN_SECONDS = 5, 0.1  # a measurement of ``time_steps``, by default


def steps_for(step_s: float) -> int:
    """How many steps of ``step_s`` seconds a default measurement takes: at least
    ``MIN_STEPS`` and ``MIN_SECONDS``."""
    return max(MIN_STEPS, math.ceil(MIN_SECONDS / max(step_s, 1e-9)))


def time_steps(run, *, iters: int | None = None, min_steps: int = MIN_STEPS,
               min_seconds: float = MIN_SECONDS) -> float:
    """Mean seconds per step of ``run()`` (a ``StepLoop``) over one measurement: ``iters``
    steps, or (default) at least ``min_steps`` steps and ``min_seconds``. Each step is waited
    for before the next starts: the profile pass times windows the same way, and queueing
    steps instead measures another thing (dispatch overlapped with the previous step, which
    ranked mlp plans differently here) and, hundreds deep, starves XLA CPU's collective
    rendezvous."""
    from cfp.timing import run_once_s
    n, total_s = 0, 0.0
    while True:
        total_s += run_once_s(run, ())
        n += 1
        if iters is not None and n >= iters:
            break
        if iters is None and n >= min_steps and total_s >= min_seconds:
            break
    return total_s / n


def time_interleaved(runs, *, rounds: int, min_steps: int = 5,
                     min_seconds: float = 0.3) -> list[list[float]]:
    """Seconds per step of each of ``runs`` (``StepLoop``s), one figure per round: the median
    of that run's steps in the round.

    Within a round the runs take turns one step at a time, and every run takes as many steps
    as the others, until each has run ``min_steps`` steps and ``min_seconds``. Steps taken in
    turn share the machine's state of the same seconds, so the ratio of two runs' figures in
    one round carries little of the machine's drift; a run's steps taken in one block each
    (``time_steps``, round after round) put seconds between the steps compared. The order is
    shuffled on every pass (seeded; no run takes two steps in a row), since a step runs slower
    right after some others: in an order that only rotated, each run always followed the same
    one, and the first plan, always after the last, carried its cost in every step. The median
    keeps one step delayed by another process out of the figure. Each step is waited for, as
    in ``time_steps``."""
    import random
    import statistics
    from cfp.timing import run_once_s
    rng, last = random.Random(0), None
    times: list[list[float]] = [[] for _ in runs]
    for _ in range(rounds):
        steps_s: list[list[float]] = [[] for _ in runs]
        while any(len(s) < min_steps or sum(s) < min_seconds for s in steps_s):
            order = rng.sample(range(len(runs)), len(runs))
            if len(order) > 1 and order[0] == last:
                order[0], order[1] = order[1], order[0]
            for i in order:
                steps_s[i].append(run_once_s(runs[i], ()))
            last = order[-1]
        for i, s in enumerate(steps_s):
            times[i].append(statistics.median(s))
    return times


def example_inputs(workload, seed: int = 0):
    """Concrete ``(params, batch)`` for the workload (seeds ``seed`` and ``seed + 1``), made by
    one jitted program each rather than op by op."""
    import jax
    params = jax.jit(workload.init_params)(jax.random.key(seed))
    batch = jax.jit(workload.make_batch)(jax.random.key(seed + 1))
    return params, batch


def real_inputs(workload, seed: int = 0) -> list:
    """Concrete (params, opt_state, batch) leaves for the workload, on the host (typed PRNG
    keys, which have no NumPy form, stay JAX arrays; a forward step has no opt_state)."""
    import jax
    params, batch = example_inputs(workload, seed)
    opt = jax.jit(workload.init_opt_state)(params)
    return [x if is_key(dtype_name(x.dtype)) else np.asarray(x)
            for x in jax.tree_util.tree_leaves((params, opt, batch))]


@dataclasses.dataclass(frozen=True)
class Numerics:
    """The sharded step against the single-device step: the loss's relative error and, over
    the gradients compared, the largest excess beyond the tolerance of their dtype
    (``tolerance``), with the value that had it."""

    loss_rel_err: float
    grad_excess: float
    loss_tol: float
    worst: str = ""

    @property
    def ok(self) -> bool:
        return self.loss_rel_err <= self.loss_tol and self.grad_excess <= 0

    def describe(self) -> str:
        return (f"loss rel. error {self.loss_rel_err:.2e} (tolerance {self.loss_tol:.0e}), "
                f"gradients off by {self.grad_excess:.2e} beyond tolerance"
                + (f", most at {self.worst}" if self.grad_excess > 0 and self.worst else ""))


def tolerance(dtype: str) -> float:
    """The relative tolerance of values computed in ``dtype``: sixteen units of its last
    place, and no finer than 2e-3. A split reduction adds in another order and rounds its
    partial sums, and a backward pass carries the rounding of every layer above: a 2-layer
    transformer's weight gradients in bfloat16 differ between the data-parallel plan and
    one device by up to 6% of their root mean square (``cfp_test/test_recipes.py``), where a
    wrong collective is off by whole multiples. A value may differ by it relative to itself
    plus the same share of its tensor's root mean square."""
    return max(2e-3, 16 * _eps(dtype))


def lowest_precision(g) -> dict[int, str]:
    """Per value of graph ``g``, the floating dtype of least precision among it and every
    value it is computed from: a float32 gradient summed from bfloat16 activations (a norm
    scale's, under bfloat16 compute over float32 parameters) carries bfloat16's rounding,
    in whatever order a plan sums it."""
    low: dict[int, str] = {}
    for op in g.ops:  # in the order they were traced: each op's inputs come first
        found = [low.get(v, g.values[v].dtype) for v in op.inputs]
        for v in op.outputs:
            low[v] = max(found + [g.values[v].dtype], key=_eps)
    return low


@functools.cache
def _eps(dtype: str) -> float:
    """The resolution of a floating dtype (0 for other dtypes)."""
    import jax.numpy as jnp
    t = to_dtype(dtype)
    return float(jnp.finfo(t).eps) if jnp.issubdtype(t, jnp.floating) else 0.0


def checked_values(analysis) -> list[tuple[int, str]]:
    """(value, name) of what the numerical check compares, by identity in the step's graph:
    the loss (the step's last output, when a scalar) and the result of every weight-gradient
    contraction, named by the weight it is the gradient of. Paired with the single-device
    run by identity, not by position, so a step that interleaves forward and backward work
    (an accumulation over micro-batches) is checked as it runs."""
    from cfp.graph import loss_op
    g, ba = analysis.graph, analysis.blocks
    paths = analysis.spec.build().input_paths()
    out = []
    if loss_op(g) is not None:
        out.append((g.outputs[-1], "the loss"))
    for b in ba.blocks:
        seed = g.ops[b.seed]
        for m in b.members:
            if m.role != "weight-grad":
                continue
            grad = g.ops[m.op].outputs[0]
            weight = next((paths[i] for v in seed.inputs[:2]
                           if (i := _input_of(g, v)) is not None
                           and math.prod(g.values[v].shape) == math.prod(g.values[grad].shape)),
                          f"block {b.index}'s weight")
            out.append((grad, f"the gradient of {weight} (op {m.op})"))
    from cfp.dims import REDUCTIONS, SCATTERS
    from cfp.sharding import state_updates
    done = {v for v, _ in out}
    for v, k in state_updates(g).items():  # a bias's, a norm scale's, an embedding table's
        op = g.producer_op(v)
        if v not in done and op.primitive in REDUCTIONS | SCATTERS and g.values[v].shape:
            leaf = paths[g.values[g.state_pairs()[k][0]].input_index]
            out.append((v, f"the gradient of {leaf} (op {op.index})"))
    return out


def _input_of(g, v) -> int | None:
    """The step input ``v`` is a layout change of (its position), or None."""
    while (op := g.producer_op(v)) is not None and len(op.inputs) == 1:
        v = op.inputs[0]
    return g.values[v].input_index if op is None else None


def step_values(workload, analysis, strategies, mesh, storage=None, values=(), *,
                program=None, host=None) -> list:
    """``values`` of the step (value ids of ``analysis.graph``) on real data (seed 0): under
    the plan (``strategies``, ``storage``) on ``mesh``, or on one device with ``mesh=None``.
    Only the operators they need are compiled (the loss and gradients need no optimizer
    update). ``program`` and ``host``: the traced step and ``real_inputs``, where the caller
    has them."""
    import jax
    from cfp.multihost import put, to_host
    from cfp.sharding import SubProgram, sub_function
    from cfp.tracing import trace_step
    from jax.sharding import NamedSharding, PartitionSpec
    program, g = program or trace_step(workload), analysis.graph
    host = real_inputs(workload) if host is None else host
    sub = SubProgram(tuple(program.restricted(list(values))[1]), tuple(g.inputs),
                     tuple(values))
    if mesh is None:
        fn = sub_function(program, sub)
        return [np.asarray(x) for x in jax.jit(fn)(*host)]
    ins, _, constraints = plan_specs(analysis, strategies, mesh.axis_names, storage)
    shardings = [NamedSharding(mesh, PartitionSpec(*ins[v])) for v in g.inputs]
    fn = sub_function(program, sub, constraints=constraints, mesh=mesh)
    out = jax.jit(fn, in_shardings=shardings)(
        *[put(x, s) for x, s in zip(host, shardings)])
    return [to_host(x) for x in out]


_LAST: dict = {}  # the last step run on one device: its inputs and checked values


def reference_run(workload, analysis, program=None) -> tuple[list, list, list | None]:
    """(``real_inputs``, the checked values on one device, how far a second run of them
    differs from the first) of the analysed step, made once per step in a process: the
    profile's check, search's runs and its check share them. On CPU a run repeats exactly,
    and is not made twice (None); a GPU adds in no fixed order where it scatters (atomics),
    so a bfloat16 embedding's gradient, summed over every token, differs between two runs of
    one program, and a plan's is held to no more than that."""
    import jax
    from cfp.tracing import trace_step
    values = tuple(v for v, _ in checked_values(analysis))
    key = (analysis.spec, analysis.graph.fingerprint(), values)
    if key not in _LAST:
        host = real_inputs(workload)
        _LAST.clear()
        program = program or trace_step(workload)
        runs = [step_values(workload, analysis, None, None, None, values, program=program,
                            host=host)
                for _ in range(1 if jax.default_backend() == "cpu" else 2)]
        noise = ([np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))
                  for a, b in zip(*runs)] if len(runs) == 2 else None)
        _LAST[key] = host, runs[0], noise
    return _LAST[key]


def forget_reference_run() -> None:
    """Drop the inputs and values ``reference_run`` keeps (a step handed to
    ``cfp.autoshard`` is done with them once it returns)."""
    _LAST.clear()


def compare_numerics(workload, analysis, strategies, mesh, storage=None, *,
                     program=None) -> Numerics:
    """The step's checked values (``checked_values``) under the plan against one device's."""
    from cfp.tracing import trace_step
    program = program or trace_step(workload)
    host, want, noise = reference_run(workload, analysis, program)
    checked = checked_values(analysis)
    got = step_values(workload, analysis, strategies, mesh, storage,
                      tuple(v for v, _ in checked), program=program, host=host)
    return numerics_of(analysis.graph, checked, got, want, noise)


NOISE_MARGIN = 4  # a plan's value may differ from one device's by this many times one
# device's own run-to-run difference, beside the dtype's tolerance


def numerics_of(g, checked: list[tuple[int, str]], got: list, want: list,
                noise: list | None = None) -> Numerics:
    """``got`` against ``want``, the ``checked`` values (``checked_values``) of graph ``g``,
    each within the tolerance of the least precise dtype it is computed from
    (``tolerance``, ``lowest_precision``) plus
    ``NOISE_MARGIN`` times ``noise``, how far one device differs from itself
    (``reference_run``; None: not at all)."""
    low = lowest_precision(g)
    loss_tol = max([1e-4] + [_eps(low.get(v, g.values[v].dtype)) for v, _ in checked])
    loss_err, worst, worst_name = 0.0, 0.0, ""
    rms = [float(np.sqrt(np.mean(np.square(np.asarray(b, np.float64))))) if np.size(b) else 0.0
           for b in want]
    floor = 1e-3 * max(rms, default=0.0)  # a gradient of rounding noise is held to the others'
    for k, ((v, name), a, b, b_rms) in enumerate(zip(checked, got, want, rms)):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        spread = NOISE_MARGIN * noise[k] if noise is not None else 0.0
        if not (np.isfinite(a).all() and np.isfinite(b).all()):
            loss_err, worst, worst_name = np.inf, np.inf, f"{name}, not finite"
            break
        if name == "the loss":
            loss_err = max(0.0, abs(float(a) - float(b)) - float(spread)) / max(
                abs(float(b)), 1e-12)
            continue
        rtol = tolerance(low.get(v, g.values[v].dtype))
        atol = rtol * max(b_rms, floor)
        excess = float((np.abs(a - b) - (atol + rtol * np.abs(b)) - spread).max(initial=0.0))
        if excess > worst:
            worst, worst_name = excess, name
    return Numerics(loss_err, worst, loss_tol, worst_name)


def reference_loss_and_grads(workload):
    """Loss and gradients of the unsharded step on one device (real data, seed 0)."""
    import jax
    params, batch = example_inputs(workload)
    loss, grads = jax.jit(workload.grad_fn())(params, batch)  # uncommitted: one device
    return loss, jax.tree_util.tree_leaves(grads)


def numerics_error(got, want, *, rtol=2e-3, atol=2e-5) -> tuple[float, float]:
    """(relative loss error, largest gradient error beyond ``atol + rtol*|want|``); gradients
    are compared rather than Adam-updated parameters, whose sign-like update amplifies
    reduction-order noise."""
    (loss, grads), (loss_ref, grads_ref) = got, want
    loss_err = abs(float(loss) - float(loss_ref)) / max(abs(float(loss_ref)), 1e-12)
    worst = 0.0
    for a, b in zip(grads, grads_ref):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        worst = max(worst, float((np.abs(a - b) - (atol + rtol * np.abs(b))).max(initial=0.0)))
    return loss_err, worst


def checkable(analysis) -> bool:
    """Whether the step is small enough for the single-device numerical check."""
    g = analysis.graph
    return sum(g.values[v].nbytes for v in g.inputs) < 2**29


def check_numerics(workload, analysis, strategies, mesh, storage=None) -> tuple[float, float]:
    """(the loss's relative error, the gradients' largest excess beyond tolerance) of the
    sharded step against the single-device step (``compare_numerics``)."""
    n = compare_numerics(workload, analysis, strategies, mesh, storage)
    return n.loss_rel_err, n.grad_excess


def memory_gb(compiled) -> float:
    from cfp.measure import memory_of
    return memory_of(compiled)["peak_bytes"] / 2**30
