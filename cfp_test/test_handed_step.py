"""A step handed to ``cfp.autoshard`` as a function with example arguments, a factory or a
``Workload`` (``cfp.workloads.hand_in``): the mistakes are one ``CfpError`` line before any
work, the run is named by its traced program's fingerprint, a pool's processes get the step
by value without running the caller's script again, and the command line refuses a work dir
it cannot resume."""
import os
import subprocess
import sys
import threading
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

import cfp
from cfp.errors import CfpError
from cfp.workloads import WorkloadSpec, hand_in

ROOT = Path(__file__).resolve().parents[1]
TX = optax.adam(1e-3)


def _loss(params, batch):
    return jnp.mean((jnp.tanh(batch["x"] @ params["w1"]) @ params["w2"] - batch["y"]) ** 2)


def train_step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(_loss)(params, batch)
    updates, opt_state = TX.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss


def _inputs(hidden=16, as_shapes=False):
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = {"w1": jax.random.normal(k1, (8, hidden)) * 0.1,
              "w2": jax.random.normal(k2, (hidden, 8)) * 0.1}
    x = jax.random.normal(k3, (8, 8))
    args = (params, TX.init(params), {"x": x, "y": jnp.sin(x)})
    return jax.eval_shape(lambda: args) if as_shapes else args


def _name(handed, *args, **options):
    return hand_in(handed, args, WorkloadSpec("", **options)).model


def test_the_run_is_named_by_its_traced_program():
    """The same step and shapes: one name; arrays or their shapes: one name; another hidden
    size, or another step body at the same shapes: another (control: the name is not just
    the function's)."""
    def body_changed(params, opt_state, batch):
        loss, grads = jax.value_and_grad(_loss)(params, batch)
        updates, opt_state = TX.update(jax.tree_util.tree_map(lambda g: 2 * g, grads),
                                       opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss
    body_changed.__name__ = "train_step"
    first = _name(train_step, *_inputs())
    assert first.startswith("train_step@")
    assert _name(train_step, *_inputs()) == first
    assert _name(train_step, *_inputs(as_shapes=True)) == first
    assert _name(train_step, *_inputs(hidden=24)) != first
    assert _name(body_changed, *_inputs()) != first


def _four(params, opt_state, batch, lr):
    return train_step(params, opt_state, batch)


def _loss_only(params, opt_state, batch):
    return _loss(params, batch)


def _lock_closure():
    lock = threading.Lock()

    def step(params, opt_state, batch):
        with lock:
            return train_step(params, opt_state, batch)
    return step


def _bad_batch():
    params, opt_state, batch = _inputs()
    return params, opt_state, {"x": jnp.ones((8, 5)), "y": batch["y"]}


@pytest.mark.parametrize("case,handed,args,message", [
    ("four arguments", _four, lambda: _inputs() + (1e-3,), "4 example arguments"),
    ("four, given three", _four, _inputs, "takes 4 positional arguments"),
    ("a loss only", _loss_only, _inputs, "not \\(params, opt_state, metrics\\)"),
    ("args that do not match", train_step, _bad_batch, "train_step raised TypeError"),
    ("a lock in a closure", _lock_closure(), _inputs, "cannot be sent to cfp's measurement"),
    ("a number", 123, lambda: (), "not 123"),
    ("a step without its arguments", train_step, lambda: (), "takes 3 positional arguments"),
    ("a factory given arguments", lambda: None, _inputs, "takes 0 positional arguments"),
    ("a (params, batch) loss without step='forward'", _loss, lambda: _inputs()[::2],
     "step='forward'"),
])
def test_a_step_handed_in_wrong_is_one_line_before_any_work(tmp_path, case, handed, args,
                                                           message):
    """Control: the right step, arguments and form plan (``test_the_run_is_named...``); a
    loss with step='forward' is taken."""
    with pytest.raises(CfpError, match=message) as e:
        cfp.autoshard(handed, *args(), mesh="2x4", memory_budget_gb=1,
                      workdir=tmp_path / "wd")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "wd").exists()


def test_a_forward_loss_and_a_workload_are_taken():
    """The loss with step='forward'; a Workload, or its factory, with no example arguments."""
    from cfp.models import user_workload
    params, _, batch = _inputs()
    assert _name(_loss, params, batch, step="forward").startswith("_loss@")
    workload = user_workload(_loss, lambda key: params, lambda key: batch, optimizer=TX)
    assert "@" in _name(workload)
    assert "@" in _name(lambda: workload)
    with pytest.raises(CfpError, match="without example arguments"):
        _name(workload, params)


def test_the_command_line_refuses_a_work_dir_of_a_handed_step(tmp_path):
    """The analysis of a handed step reads back in its process (control); ``python -m cfp
    --mode search`` on its work dir says, in one line and with exit 2, to call autoshard."""
    from cfp.api import run, workdir_of
    options = cfp.Options(model=_name(train_step, *_inputs()), mesh="2x4", mode="analysis",
                          workdir=str(tmp_path / "wd"))
    run(options)
    assert workdir_of(options).read_analysis().spec.model == options.model
    done = subprocess.run([sys.executable, "-m", "cfp", "--mode", "search", "--mesh", "2x4",
                           "--memory-budget", "1", "--workdir", str(tmp_path / "wd")],
                          capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert done.returncode == 2, done.stderr[-2000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("cfp: error")]
    assert len(said) == 1 and "call cfp.autoshard with it again" in said[0]
    assert "Traceback" not in done.stderr


SCRIPT = """
import jax, jax.numpy as jnp
print("THE SCRIPT RUNS")
from cfp.pool import map_meshes
from cfp.workloads import WorkloadSpec, hand_in
from helpers import handed_fingerprint

def step(params, batch):
    return jnp.mean((batch @ params) ** 2)

spec = hand_in(step, (jnp.ones((4, 4)), jnp.ones((2, 4))), WorkloadSpec("", step="forward"))
print("FINGERPRINTS", spec.model, *map_meshes(handed_fingerprint, (spec,), [0, 1], processes=2))
"""


@pytest.mark.parametrize("how", [pytest.param("file", marks=pytest.mark.slow), "stdin"])
def test_a_pools_processes_get_the_step_by_value(tmp_path, how):
    """A script with no ``__main__`` guard, run from a file or from standard input, hands in
    a step defined in it: a pool's two processes trace it to its fingerprint, and the script
    runs once (Python's spawn would run it again in each, or fail on ``<stdin>``)."""
    (tmp_path / "s.py").write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "cfp_test"), str(ROOT)]))
    cmd = [sys.executable, "s.py"] if how == "file" else [sys.executable, "-"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300, input=SCRIPT if how == "stdin" else None)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("THE SCRIPT RUNS") == 1
    line = next(x for x in done.stdout.splitlines() if x.startswith("FINGERPRINTS")).split()
    assert line[2:] == [line[1].partition("@")[2]] * 2


def _losses_match_one_device(step, plan, args, loss=lambda m: m):
    """Three steps of ``plan.jit(step)``, each fed the state the last returned (donated),
    against three on one device from the same state: every loss within 1e-5 relative.
    Returns the two lists of losses."""
    import numpy as np
    from helpers import run_loop
    host = jax.tree_util.tree_map(lambda x: np.asarray(x) if hasattr(x, "dtype") else x, args)
    want = run_loop(jax.jit(step), *host, loss=loss)[0]
    got = run_loop(plan.jit(step, *host), *host, loss=loss)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    return got, want


@pytest.mark.slow
def test_an_nnx_step_handed_in_plans_and_runs_in_the_users_loop(tmp_path):
    """An NNX ``train_step(model, optimizer, batch)`` and its objects handed to autoshard;
    the plan on 2x4 runs three steps of the user's loop (the state split as ``nnx.split``
    splits it), each loss within 1e-5 of one device. Control: the losses change by step."""
    import users_models
    from flax import nnx
    model = users_models._nnx_model(32, 4, 2, nnx.Rngs(jax.random.key(0)))
    optimizer = nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)
    x, y = users_models._tokens(jax.random.key(1), 4, 16)
    batch = {"x": x, "y": y}
    plan = cfp.autoshard(users_models.nnx_step, model, optimizer, batch, mesh="2x4",
                         memory_budget_gb=1, workdir=tmp_path / "wd", validate_top=1)
    graphdef, params, rest = nnx.split((model, optimizer), nnx.Param, ...)

    def train_step(params, rest, batch):  # the user's: merge, step in place, split
        model, optimizer = nnx.merge(graphdef, params, rest)
        loss = users_models.nnx_step(model, optimizer, batch)
        _, params, rest = nnx.split((model, optimizer), nnx.Param, ...)
        return params, rest, loss

    got, _ = _losses_match_one_device(train_step, plan, (params, rest, batch))
    assert got[0] != got[2]


def _equinox_step(tx):
    import equinox as eqx

    def train_step(model, opt_state, batch):
        def loss_fn(model):
            return jnp.mean((jax.vmap(model)(batch["x"]) - batch["y"]) ** 2)
        loss, grads = eqx.filter_value_and_grad(loss_fn)(model)
        updates, opt_state = tx.update(grads, opt_state, eqx.filter(model, eqx.is_array))
        return eqx.apply_updates(model, updates), opt_state, loss
    return train_step


@pytest.mark.slow
def test_an_equinox_step_handed_in_plans_and_runs_in_the_users_loop(tmp_path):
    """An Equinox module as the params of ``train_step(model, opt_state, batch)`` (its
    activation function is not an array), handed in by its objects; three steps of the
    user's loop on its arrays (``eqx.partition``) match one device within 1e-5."""
    import equinox as eqx
    from equinox_models import Mlp
    model = Mlp(32, 128, jax.random.key(0))
    tx = optax.adam(1e-3)
    opt_state = tx.init(eqx.filter(model, eqx.is_array))
    x = jax.random.normal(jax.random.key(1), (16, 32))
    batch = {"x": x, "y": jnp.sin(x)}
    train_step = _equinox_step(tx)
    plan = cfp.autoshard(train_step, model, opt_state, batch, mesh="2x4",
                         memory_budget_gb=1, workdir=tmp_path / "wd", validate_top=1)
    arrays, static = eqx.partition(model, eqx.is_array)

    def array_step(arrays, opt_state, batch):  # the user's jit takes the arrays
        new, opt_state, loss = train_step(eqx.combine(arrays, static), opt_state, batch)
        return eqx.partition(new, eqx.is_array)[0], opt_state, loss

    got, _ = _losses_match_one_device(array_step, plan, (arrays, opt_state, batch))
    assert got[0] != got[2]


def test_a_pytree_class_the_workers_cannot_rebuild_is_refused_in_one_line(tmp_path):
    """cloudpickle rebuilds a class it sends by value before its fields are set, so a worker
    would flatten an Equinox module, or a Flax TrainState subclass, of a class defined in a
    function (or ``__main__``) to another tree: refused before any work. Controls: the same
    Equinox step on a module of a top-level class hands in, and so does an NNX model of a
    class defined in a function (NNX flattens what the object holds)."""
    import equinox as eqx
    import users_models
    from equinox_models import Mlp
    tx = optax.adam(1e-3)
    x = jnp.ones((4, 32))
    local = users_models._equinox_model(1, 32, 4)(jax.random.key(0))
    with pytest.raises(CfpError, match="_equinox_model.<locals>.Model, defined in __main__ "
                                       "or a function") as e:
        cfp.autoshard(_equinox_step(tx), local, tx.init(eqx.filter(local, eqx.is_array)),
                      {"x": jnp.zeros((4, 16), jnp.int32), "y": x}, mesh="2x4",
                      workdir=tmp_path / "wd")
    assert "\n" not in str(e.value) and not (tmp_path / "wd").exists()
    top = Mlp(32, 64, jax.random.key(0))
    assert "@" in _name(_equinox_step(tx), top, tx.init(eqx.filter(top, eqx.is_array)),
                        {"x": x, "y": x})

    from typing import Any
    from flax import nnx
    from flax.training import train_state

    class State(train_state.TrainState):
        ema: Any = None

    def state_step(state, batch):
        loss, grads = jax.value_and_grad(_loss)(state.params, batch)
        return state.apply_gradients(grads=grads), loss
    params, _, batch = _inputs()
    state = State.create(apply_fn=None, params=params, tx=tx, ema=params)
    with pytest.raises(CfpError, match="test_a_pytree_class.*State, defined in"):
        _name(state_step, state, batch)

    class Linear(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(8, 8, rngs=rngs)

        def __call__(self, x):
            return self.dense(x)

    def nnx_step(model, optimizer, batch):
        loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(batch["x"]) - batch["y"]) ** 2))(
            model)
        optimizer.update(model, grads)
        return loss
    model = Linear(nnx.Rngs(0))
    assert "@" in _name(nnx_step, model, nnx.Optimizer(model, tx, wrt=nnx.Param), batch)


@pytest.mark.slow
def test_a_second_call_measures_nothing_and_a_changed_step_is_profiled(tmp_path, capsys):
    """The same step, shapes and mesh again: the profile line says 0 compiled. Another
    hidden size, and another step body at the same shapes, each compile again (control: the
    first call compiles)."""
    import re

    def clipped(params, opt_state, batch):
        loss, grads = jax.value_and_grad(_loss)(params, batch)
        grads = optax.clip_by_global_norm(1.0).update(grads, None)[0]
        updates, opt_state = TX.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    compiled = []
    for step, hidden in [(train_step, 16), (train_step, 16), (train_step, 24), (clipped, 16)]:
        cfp.autoshard(step, *_inputs(hidden), mesh="2x4", memory_budget_gb=1,
                      workdir=tmp_path / "wd", validate_top=1, validate_baselines=False)
        out = capsys.readouterr().out
        compiled.append(int(re.search(r"compiled in this run: (\d+)", out).group(1)))
    assert compiled[0] > 0 and compiled[1] == 0 and compiled[2] > 0 and compiled[3] > 0


@pytest.mark.slow
def test_a_notebook_plans_the_step_of_its_cells(tmp_path):
    """``notebooks/autoshard.ipynb``, executed by a real kernel: a Flax linen model and a
    clipped AdamW step returning a dict of metrics, defined in its cells and handed to
    autoshard; planned on 2x4, three steps under ``plan.jit`` each within 1e-5 relative of
    one device. Control: the losses change by step."""
    import json
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(ROOT / "cfp_test" / "notebooks" / "autoshard.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=900, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    out = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", ()))
    said = {line.split(" ", 1)[0]: line.split(" ", 1)[1] for line in out.splitlines()
            if line.startswith(("ONE", "PLANNED"))}
    planned = json.loads(out.split("PLANNED ", 1)[1].splitlines()[0])
    one = json.loads(out.split("ONE DEVICE ", 1)[1].splitlines()[0])
    assert said and len(planned) == len(one) == 3
    assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(planned, one)), (planned, one)
    assert planned[0] != planned[2]
    assert (tmp_path / "profiles" / "notebook" / "plan.json").exists()


def test_shapes_for_example_arguments_make_the_inputs_and_say_so(capsys):
    """``ShapeDtypeStruct``s for the example arguments: cfp makes inputs of their shapes (the
    optimizer state zeros, as Adam starts), and says so; arrays are used as they are
    (control: the check runs on the user's own values, and nothing is said)."""
    import numpy as np
    from cfp.api import _hand_in
    from cfp.execute import example_inputs
    from cfp.workloads import HandedStep
    shapes, arrays = _inputs(as_shapes=True), _inputs()
    assert "@" in _hand_in(train_step, shapes, {"mesh": "2x4"})
    assert "hold shapes" in capsys.readouterr().out
    made = HandedStep(train_step, shapes)()
    params, batch = example_inputs(made)
    assert jax.tree_util.tree_map(jnp.shape, params) == jax.tree_util.tree_map(
        jnp.shape, arrays[0])
    assert all(not np.any(x) for x in jax.tree_util.tree_leaves(made.init_opt_state(params))
               if jnp.issubdtype(x.dtype, jnp.floating))
    assert "@" in _hand_in(train_step, arrays, {"mesh": "2x4"})
    assert "hold shapes" not in capsys.readouterr().out
    own = example_inputs(HandedStep(train_step, arrays)())[0]
    np.testing.assert_array_equal(own["w1"], arrays[0]["w1"])
