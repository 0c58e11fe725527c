import dataclasses
import jax
import pytest

import zoo_extra
from cfp.cli import main
from cfp.execute import check_numerics
from cfp.passes.analysis import run_analysis
from helpers import assert_loop_matches, assert_users_loop, run_loop
from cfp.mesh import make_mesh
from cfp.workloads import WorkloadSpec


@pytest.mark.slow  # the README quick start (test_readme.py) runs a user's Optax step so too
def test_users_own_step_and_optimizer_through_three_passes(tmp_path, capsys):
    """``cfp.autoshard`` on a user's step: a ``Plan`` whose ``jit`` and ``shardings`` run
    the user's loop (three steps, state donated) matching one device; ``save``/``load``
    round-trips it. Nothing global changes in the caller's process: JAX's settings, the
    logging handlers, ``sys.stdout``, ``XLA_FLAGS`` and the SIGINT handler are as before."""
    import logging
    import os
    import signal
    import sys
    import cfp

    def snapshot():
        return (dict(jax.config.values), list(logging.getLogger().handlers),
                logging.getLogger().level, sys.stdout, os.environ.get("XLA_FLAGS"),
                signal.getsignal(signal.SIGINT))
    before = snapshot()
    plan = cfp.autoshard("zoo_extra:einsum_net_momentum", mesh="4", workdir=tmp_path,
                         memory_budget_gb=1, max_combinations=4, validate_top=1, iters=2,
                         validate_baselines=False)
    assert snapshot() == before
    assert "numerical check" in capsys.readouterr().out
    assert isinstance(plan, cfp.Plan) and plan.mesh.devices.shape == (4,)
    assert len(plan.data["blocks"]) == 4 and plan.data["mesh"]["axes"] == ["m0"]
    assert "m0" in plan.describe() or "replicated" in plan.describe()
    plan.save(tmp_path / "copy.json")
    again = cfp.Plan.load(tmp_path / "copy.json")
    assert again.data == plan.data
    train_step, params, velocity, batch = zoo_extra.einsum_net_momentum_step()
    assert_users_loop(train_step, again.data, again.mesh, params, velocity, batch)
    ref = run_loop(jax.jit(train_step), params, velocity, batch)
    step = again.jit(train_step, params, velocity, batch)
    placed = jax.device_put((params, velocity, batch), again.shardings(params, velocity,
                                                                       batch)[0])
    assert_loop_matches(run_loop(step, *placed), ref)


def test_autoshard_raises_cfp_error_with_the_message(tmp_path, capsys):
    """A mistake is a ``CfpError`` carrying the one-line reason, raised before any work;
    the control: the same step on a valid mesh gets past the checks (analysis only)."""
    import cfp
    with pytest.raises(cfp.CfpError, match="has an axis of one device") as e:
        cfp.autoshard("zoo_extra:convnet", mesh="1x4", workdir=tmp_path)
    assert "\n" not in str(e.value) and not (tmp_path / "analysis.pkl").exists()
    cache = jax.config.jax_compilation_cache_dir
    try:  # the control of the snapshot above: the command line's run, which owns its
        # process, turns JAX's compilation cache on in it
        cfp.run(cfp.Options(model="zoo_extra:convnet", mesh="4", workdir=str(tmp_path),
                            mode="analysis", compilation_cache=str(tmp_path / "cache")),
                own_process=True)
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "cache")
    finally:
        jax.config.update("jax_compilation_cache_dir", cache)
    assert (tmp_path / "analysis.pkl").exists()


@pytest.mark.slow  # the Equinox model is analysed in the suite by test_users_models
def test_an_equinox_module_handed_over_whole():
    """``user_workload`` keeps a module's arrays as the params (the rest aside), and a
    factory that declares one keyword gets only that one."""
    spec = WorkloadSpec("users_models:equinox_module", None, None, "float32",
                        (("num_layers", 2),)).resolved()
    w = spec.build()
    leaves = jax.tree_util.tree_leaves(w.abstract_params())
    assert leaves and all(hasattr(x, "shape") for x in leaves)
    a = run_analysis(spec, (4,))
    assert a.segments.num_types == 2
    loss_err, grad_excess = check_numerics(w, a, [len(b.strategies) - 1 for b in a.blocks.blocks],
                                           make_mesh((4,)))
    assert loss_err < 1e-5 and grad_excess == 0.0


def test_a_step_is_traced_once():
    """Tracing a user's step runs their loss and their init once each: the loss is checked
    on the traced step, not traced again alone. Control: a loss that is not a scalar is still
    refused in one line, in a training step (whose trace fails at the gradient) and in a
    forward one (checked on the traced output)."""
    import jax.numpy as jnp
    import optax
    from cfp.errors import CfpError
    from cfp.models import user_workload
    from cfp.tracing import trace_step
    calls = {"loss": 0, "init": 0}

    def init(key):
        calls["init"] += 1
        return {"w": jax.random.normal(key, (8, 8))}

    def batch(key):
        return {"x": jax.random.normal(key, (4, 8))}

    def loss(params, b):
        calls["loss"] += 1
        return jnp.mean((b["x"] @ params["w"]) ** 2)

    trace_step(user_workload(loss, init, batch, optimizer=optax.adam(1e-3)))
    assert calls == {"loss": 1, "init": 1}
    per_example = lambda params, b: jnp.mean((b["x"] @ params["w"]) ** 2, axis=1)  # noqa: E731
    for step in ("train", "forward"):
        w = dataclasses.replace(user_workload(per_example, init, batch, optimizer=optax.adam(1e-3)),
                                step=step)
        with pytest.raises(CfpError, match=r"returns \(4,\), not a scalar"):
            trace_step(w)


def test_bad_user_steps_get_one_line(tmp_path, capsys):
    base = ["--mode", "analysis", "--mesh", "4", "--workdir", str(tmp_path)]
    assert main(base + ["--model", "users_models:equinox_module", "--num-heads", "8"]) == 2
    assert "takes no num_heads (it declares num_layers)" in capsys.readouterr().err
    assert main(base + ["--model", "zoo_extra:per_example_loss"]) == 2
    assert "not a scalar" in capsys.readouterr().err


@pytest.mark.parametrize("guarded", [False, True])
def test_a_script_with_or_without_a_main_guard_runs_once(tmp_path, guarded):
    """Workers are spawned processes that do not run the user's script again
    (``cfp.pool.main_left_out``), so a script whose call to cfp is not under a main guard
    runs as a guarded one does: it prints its line once, and its worker starts and gets the
    analysis over its pipe (the analysis of even the tiny GPT is larger than a pipe's
    buffer, so it must not travel in the spawn; the profile budget is spent at once)."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path
    body = textwrap.dedent(f"""
        import sys
        from cfp.cli import main
        print("THE SCRIPT RUNS")
        args = ["--model", "gpt", "--config", "tiny", "--mesh", "4",
                "--workdir", {str(tmp_path / "wd")!r}]
        def run():
            sys.exit(main(args + ["--mode", "analysis"])
                     or main(args + ["--mode", "profile", "--profile-budget", "0.001"]))
        """)
    body += "if __name__ == '__main__':\n    run()\n" if guarded else "run()\n"
    script = tmp_path / "train.py"
    script.write_text(body)
    here = str(Path(__file__).parent)
    env = dict(os.environ, XLA_FLAGS=os.environ["XLA_FLAGS"].replace("count=8", "count=4"),
               PYTHONPATH=os.pathsep.join([here] + [p for p in [os.environ.get("PYTHONPATH")]
                                                    if p]))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "died while starting" not in done.stderr
    assert done.stdout.count("THE SCRIPT RUNS") == 1
