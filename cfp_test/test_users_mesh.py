"""The user's own mesh: ``jax.make_mesh`` axes named as the user names them, Auto or
Explicit, over the devices in the user's order, handed to ``autoshard``; cfp measures on those
devices in that order, and the plan speaks those names and runs on that mesh."""
import jax
import numpy as np
import pytest
from jax.sharding import AxisType

import zoo_extra
from cfp.api import autoshard
from cfp.errors import CfpError
from cfp.passes.analysis import run_analysis
from cfp.plan import jit as plan_jit
from cfp.plan import make_plan, shardings, step_shardings
from cfp.mesh import mesh_from, parse_mesh
from cfp.workloads import WorkloadSpec
from helpers import assert_users_loop

NAMES = ("data", "model")


def users_mesh(axis_type):
    return jax.make_mesh((2, 4), NAMES, axis_types=(axis_type,) * 2)


@pytest.fixture(scope="module")
def found():
    """The plan of the most split strategies for the user's named mesh (the three passes on
    the user's ``Mesh`` itself: ``test_autoshard_on_the_users_mesh``, slow)."""
    spec = WorkloadSpec("zoo_extra:einsum_net_momentum").resolved()
    a = run_analysis(spec, (2, 4), axis_names=NAMES)
    return make_plan(a, [len(b.strategies) - 1 for b in a.blocks.blocks])


users_step = zoo_extra.einsum_net_momentum_step


def reversed_mesh(axis_type=AxisType.Auto):
    """The user's 2x4 mesh over JAX's devices in reverse order."""
    return jax.sharding.Mesh(np.array(jax.devices())[::-1].reshape(2, 4), NAMES,
                             axis_types=(axis_type,) * 2)


def device_ids(mesh) -> tuple:
    return tuple(int(d.id) for d in mesh.devices.flat)


def test_the_plan_speaks_the_users_axis_names(found):
    assert found["mesh"] == {"shape": [2, 4], "axes": list(NAMES)}
    named = {a for part in ("params", "opt_state", "batch") for spec in found[part].values()
             for e in spec if e is not None for a in ([e] if isinstance(e, str) else e)}
    assert named and named <= set(NAMES)  # every axis the plan splits over is the user's


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_the_plan_runs_on_the_users_mesh(found, axis_type):
    """Three steps in the user's loop on the user's mesh match one device, under
    ``plan.jit`` and ``jax.jit`` with ``step_shardings``; the new state is on the user's
    mesh, named and typed as it was (Explicit stays Explicit, its names in the arrays'
    types)."""
    mesh = users_mesh(axis_type)
    train_step, params, velocity, batch = users_step()
    new_params = assert_users_loop(train_step, found, mesh, params, velocity, batch)
    want = shardings(params, found, mesh)
    for x, s in zip(jax.tree_util.tree_leaves(new_params), jax.tree_util.tree_leaves(want)):
        assert x.sharding.mesh.axis_names == NAMES
        assert x.sharding.mesh.axis_types == (axis_type,) * 2
        if axis_type == AxisType.Explicit:
            assert jax.typeof(x).sharding.spec == s.spec
    assert mesh.axis_types == (axis_type,) * 2


def test_an_auto_copy_of_the_mesh_would_be_seen(found):
    """Control for the check above: the same plan run on an Auto copy of an Explicit mesh
    gives arrays whose mesh is not the user's typed one."""
    mesh = users_mesh(AxisType.Explicit)
    auto = jax.sharding.Mesh(mesh.devices, NAMES, axis_types=(AxisType.Auto,) * 2)
    train_step, params, velocity, batch = users_step()
    step = plan_jit(train_step, found, auto, params, velocity, batch)
    placed = jax.device_put((params, velocity, batch), step_shardings(
        found, auto, params, velocity, batch)[0])
    new_params = step(*placed)[0]
    assert all(x.sharding.mesh.axis_types != mesh.axis_types
               for x in jax.tree_util.tree_leaves(new_params))


def test_a_plan_for_other_axes_is_refused(found):
    """The plan's axes must be the mesh's: other names, other sizes, or a further axis that
    splits are refused in one line; a further axis of one device is taken."""
    train_step, params, velocity, batch = users_step()
    for shape, names in [((2, 4), ("m0", "m1")), ((4, 2), NAMES),
                         ((2, 2, 2), ("data", "model", "x"))]:
        mesh = jax.make_mesh(shape, names)
        with pytest.raises(CfpError, match="the plan is for the mesh data=2,model=4"):
            step_shardings(found, mesh, params, velocity, batch)
        with pytest.raises(CfpError, match="the plan is for the mesh data=2,model=4"):
            plan_jit(train_step, found, mesh, params, velocity, batch)
    maxtext = jax.make_mesh((1, 2, 4), ("stage", "data", "model"))
    assert_users_loop(train_step, found, maxtext, params, velocity, batch)


def test_mesh_names_on_the_command_line_and_from_a_mesh():
    assert parse_mesh("data=2,model=4") == ((2, 4), NAMES)
    assert parse_mesh("2x4") == ((2, 4), ("m0", "m1"))
    assert mesh_from(jax.make_mesh((1, 2, 4), ("stage", "data", "model"))) == ((2, 4), NAMES)
    assert mesh_from(users_mesh(AxisType.Auto)) == ((2, 4), NAMES)
    for bad in ["data=2,data=4", "data=2,model", "2x4,model=4", "da-ta=2", "data=0"]:
        with pytest.raises(CfpError, match="--mesh"):
            parse_mesh(bad)
    with pytest.raises(CfpError, match="jax.sharding.Mesh"):
        mesh_from((2, 4))


@pytest.mark.slow  # the three passes, ~1 min on a loaded 2-core machine
def test_autoshard_on_the_users_mesh(tmp_path):
    """``autoshard`` takes the user's mesh, Explicit axes over the devices in reverse order:
    the worker measured the windows on those devices in that order, and search ran the kept
    plan on them; the plan speaks the user's names and runs three steps on that mesh."""
    from cfp.api import workdir_of
    from cfp.options import Options
    mesh = reversed_mesh(AxisType.Explicit)
    kw = dict(model="zoo_extra:einsum_net_momentum", mesh=mesh, workdir=tmp_path,
              memory_budget_gb=1, max_combinations=4, validate_top=1,
              validate_baselines=False, iters=2)
    plan = autoshard(**kw)
    assert plan.data["mesh"] == {"shape": [2, 4], "axes": list(NAMES),
                                 "devices": list(device_ids(mesh))}
    wd = workdir_of(Options(**kw))
    analysis = wd.read_analysis()
    measured = {"analysis": analysis.device_ids,
                "profile": wd.read_profile(analysis, max_combinations=4).device_ids,
                "search": wd.read_search().device_ids}
    assert measured == dict.fromkeys(measured, device_ids(mesh))
    default_order = jax.make_mesh((2, 4), NAMES)
    assert measured != dict.fromkeys(measured, device_ids(default_order))  # control
    train_step, params, velocity, batch = users_step()
    assert_users_loop(train_step, plan.data, mesh, params, velocity, batch)


def test_named_axes_on_the_command_line_reach_the_record(tmp_path, capsys):
    """``--mesh data=2,model=4``: the analysis record carries the names and the run's
    fingerprint holds them, so a work dir of another naming is not taken for this one."""
    from cfp.cli import main
    from cfp.workdir import WorkDir
    from cfp.workloads import run_fingerprint
    base = ["--mode", "analysis", "--model", "zoo_extra:einsum_net_momentum",
            "--workdir", str(tmp_path)]
    assert main(base + ["--mesh", "data=2,model=4"]) == 0
    spec = WorkloadSpec("zoo_extra:einsum_net_momentum").resolved()
    rec = WorkDir(tmp_path, run_fingerprint(spec, (2, 4), NAMES)).read_analysis()
    assert rec.mesh_axes == NAMES
    with pytest.raises(CfpError):  # control: the same shape, axes m0, m1
        WorkDir(tmp_path, run_fingerprint(spec, (2, 4))).read_analysis()
    assert main(base + ["--mesh", "data=2,data=4"]) == 2
    assert "names an axis twice" in capsys.readouterr().err


def test_a_users_device_order_is_measured_and_kept(tmp_path, caplog):
    """A mesh over the devices in another order than JAX's: the analysis record holds that
    order, the mesh the later passes measure on is laid out so, the work dir's fingerprint
    holds it (a work dir of JAX's order is not read for it), and the plan keeps it and runs
    three steps on that mesh matching one device. Applying the plan on a mesh of JAX's order
    works and says in one log line that the plan was measured on another order."""
    import logging
    from cfp.api import run, workdir_of
    from cfp.options import Options
    from cfp.plan import mesh_of
    mesh = reversed_mesh()
    options = Options(mode="analysis", model="zoo_extra:einsum_net_momentum", mesh=mesh,
                      workdir=tmp_path)
    run(options)
    rec = workdir_of(options).read_analysis()
    assert rec.device_ids == device_ids(mesh) == (7, 6, 5, 4, 3, 2, 1, 0)
    assert device_ids(rec.mesh()) == device_ids(mesh)
    default_order = jax.make_mesh((2, 4), NAMES, axis_types=(AxisType.Auto,) * 2)
    assert device_ids(rec.mesh()) != device_ids(default_order)  # control: the check can fail
    with pytest.raises(CfpError, match="devices differ"):  # the same run in JAX's order
        workdir_of(Options(mode="analysis", model="zoo_extra:einsum_net_momentum",
                           mesh="data=2,model=4", workdir=tmp_path)).read_analysis()

    plan = make_plan(rec, [len(b.strategies) - 1 for b in rec.blocks.blocks])
    assert plan["mesh"]["devices"] == list(device_ids(mesh))
    assert device_ids(mesh_of(plan)) == device_ids(mesh)
    train_step, params, velocity, batch = users_step()
    with caplog.at_level(logging.WARNING, logger="cfp.plan"):
        new_params = assert_users_loop(train_step, plan, mesh, params, velocity, batch)
        assert not [r for r in caplog.records if "measured" in r.getMessage()]
        assert all(device_ids(x.sharding.mesh) == device_ids(mesh)
                   for x in jax.tree_util.tree_leaves(new_params))
        step_shardings(plan, default_order, params, velocity, batch)  # control: JAX's order
        assert [r for r in caplog.records if "the plan was measured on [7, 6" in r.getMessage()]
