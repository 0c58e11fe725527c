"""A step's effects (``jax.debug.print``, ``io_callback``) are kept: the analysed program holds
them though no output needs them, and the plan runs them in the user's loop."""
import dataclasses

import jax
import numpy as np

import zoo_extra
from cfp.program import trace_program


def _effect_ops(program) -> list[str]:
    return [e.primitive.name for e in program.eqns
            if e.primitive.name in ("debug_print", "debug_callback", "io_callback")]


def test_a_restricted_program_keeps_its_effects():
    """Restricted to the loss alone, the step keeps its print and its callback. Control: the
    same program with its equations marked effect-free loses both, as it did before."""
    workload = zoo_extra.effects_step()
    params, opt_state = jax.eval_shape(_init)
    batch = jax.eval_shape(workload.make_batch, jax.random.key(1))
    program = trace_program(zoo_extra.effects_train_step, params, opt_state, batch)
    loss = program.outputs[-1]
    assert len(_effect_ops(program.restricted([loss])[0])) == 2  # the print, the callback
    plain = dataclasses.replace(program, eqns=[dataclasses.replace(e, effects=False)
                                               for e in program.eqns])
    assert _effect_ops(plain.restricted([loss])[0]) == []


def _init():
    import optax
    k1, k2 = jax.random.split(jax.random.key(0))
    params = {"w1": jax.random.normal(k1, (32, 64)) * 0.1,
              "w2": jax.random.normal(k2, (64, 32)) * 0.1}
    return params, optax.adam(1e-3).init(params)


def test_a_planned_step_prints_and_calls_back_in_the_users_loop(tmp_path, capsys):
    """Planned (priced, one candidate run) and run for 3 donated steps through ``plan.jit``:
    each step prints its loss and calls the callback once, and each loss matches the step on
    one device. cfp's own timed runs print nothing to the console."""
    import cfp
    plan = cfp.autoshard("zoo_extra:effects_step", mesh="4", memory_budget_gb=1,
                         workdir=tmp_path, cost="model", validate_top=1,
                         validate_baselines=False)
    assert capsys.readouterr().out.count("step loss") <= 4  # the checks' runs, not the timed
    params, opt_state = _init()
    batch = zoo_extra.effects_step().make_batch(jax.random.key(1))
    ref_params, ref_opt = _init()
    one_device = jax.jit(zoo_extra.effects_train_step)
    step = plan.jit(zoo_extra.effects_train_step, params, opt_state, batch)
    del zoo_extra.EFFECT_CALLS[:]
    for _ in range(3):
        params, opt_state, loss = step(params, opt_state, batch)
        ref_params, ref_opt, ref_loss = one_device(ref_params, ref_opt, batch)
        np.testing.assert_allclose(float(loss), float(ref_loss), rtol=1e-5)
    jax.effects_barrier()
    printed = [line for line in capsys.readouterr().out.splitlines() if "step loss" in line]
    assert len(printed) == 6 and len(zoo_extra.EFFECT_CALLS) == 6  # 3 planned, 3 one-device
