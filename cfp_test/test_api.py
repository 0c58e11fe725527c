import jax
import numpy as np

import zoo_extra
from cfp.api import autoshard
from cfp.plan import shardings
from cfp.workloads import make_mesh


def test_users_own_step_and_optimizer_through_three_passes(tmp_path, capsys):
    plan = autoshard("zoo_extra:einsum_net_momentum", mesh="4", workdir=tmp_path,
                     memory_budget_gb=1, max_combinations=16, validate_top=1,
                     extra_args=["--iters", "2"])
    assert "numerical check against one device" in capsys.readouterr().out
    assert len(plan["blocks"]) == 4 and plan["mesh"]["axes"] == ["m0"]
    w = zoo_extra.einsum_net_momentum()
    params = w.init_params(jax.random.key(0))
    sh = shardings(params, plan, make_mesh((4,)))
    new_params, _ = jax.jit(lambda p, v, b: w.opt_update(jax.grad(w.loss_fn)(p, b), v, p),
                            in_shardings=(sh, sh, None))(
        jax.device_put(params, sh), jax.device_put(w.opt_init(params), sh),
        w.make_batch(jax.random.key(1)))
    assert all(np.isfinite(np.asarray(x)).all() for x in jax.tree_util.tree_leaves(new_params))
