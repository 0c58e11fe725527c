import jax
import numpy as np
import pytest

import zoo_extra
from cfp.api import autoshard
from cfp.cli import main
from cfp.execute import check_numerics
from cfp.passes.analysis import run_analysis
from helpers import assert_users_loop
from cfp.workloads import WorkloadSpec, make_mesh


def test_users_own_step_and_optimizer_through_three_passes(tmp_path, capsys):
    plan = autoshard("zoo_extra:einsum_net_momentum", mesh="4", workdir=tmp_path,
                     memory_budget_gb=1, max_combinations=16, validate_top=1,
                     extra_args=["--iters", "2", "--no-validate-baselines"])
    assert "numerical check against one device" in capsys.readouterr().out
    assert len(plan["blocks"]) == 4 and plan["mesh"]["axes"] == ["m0"]
    w = zoo_extra.einsum_net_momentum()
    params = w.init_params(jax.random.key(0))
    velocity, batch = w.opt_init(params), w.make_batch(jax.random.key(1))

    def train_step(p, v, b):
        loss, grads = jax.value_and_grad(w.loss_fn)(p, b)
        return (*w.opt_update(grads, v, p), loss)
    assert_users_loop(train_step, plan, make_mesh((4,)), params, velocity, batch)


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


def test_bad_user_steps_get_one_line(tmp_path, capsys):
    base = ["--mode", "analysis", "--mesh", "4", "--workdir", str(tmp_path)]
    assert main(base + ["--model", "users_models:equinox_module", "--num-heads", "8"]) == 2
    assert "takes no num_heads (it declares num_layers)" in capsys.readouterr().err
    assert main(base + ["--model", "zoo_extra:per_example_loss"]) == 2
    assert "not a scalar" in capsys.readouterr().err


@pytest.mark.parametrize("guarded", [False, True])
def test_a_script_without_a_main_guard_stops_with_one_line(tmp_path, guarded):
    """Workers are spawned processes that import the user's script again, so a script whose
    call to cfp is not under a main guard kills its worker before the worker takes its end of
    the pipe: cfp says so in one line and stops instead of waiting for ever (the analysis of
    even the tiny GPT is larger than a pipe's buffer, so it must not travel in the spawn).
    Control: the same script guarded gets past the worker's start (its profile budget spent
    at once)."""
    import os
    import subprocess
    import sys
    import textwrap
    from pathlib import Path
    body = textwrap.dedent(f"""
        import sys
        from cfp.cli import main
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
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4",
               PYTHONPATH=os.pathsep.join([here] + [p for p in [os.environ.get("PYTHONPATH")]
                                                    if p]))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=240, env=env)
    if guarded:
        assert done.returncode == 0, done.stderr[-2000:]
        assert "died while starting" not in done.stderr
    else:
        assert done.returncode != 0
        last = done.stderr.strip().splitlines()[-1]
        assert "died while starting" in last and "__name__" in last, done.stderr[-2000:]
