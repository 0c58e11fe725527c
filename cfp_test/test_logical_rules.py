"""A plan as Flax logical-axis rules: applied through Flax's own partitioning, the rules give
the plan's shardings; a plan no rule list can express is said to be so, with its conflicts."""
import jax
import jax.numpy as jnp
import pytest

import users_models
from cfp.logical_rules import logical_rules, write_logical_rules
from cfp.passes.analysis import run_analysis
from cfp.plan import make_plan, shardings
from cfp.workloads import WorkloadSpec

NAMES = ("data", "model")
# batch over data everywhere; the MLP's hidden dim over model (Megatron's column then row
# split), the embedding replicated
MEGATRON = ["SR = SR x RR @ {01}", "SS = SR x RS @ {0,1}", "SR = SS x SR @ {0,1} (allreduce @ 1)"]


@pytest.fixture(scope="module")
def analysed():
    spec = WorkloadSpec("users_models:flax_logical").resolved()
    boxed = jax.eval_shape(lambda k: users_models.flax_logical_model().init(
        k, jnp.zeros((1, users_models.VOCAB)))["params"], jax.random.key(0))
    return run_analysis(spec, (2, 4), axis_names=NAMES), spec.build(), boxed


def flax_shardings(boxed, rules, mesh):
    import flax.linen as nn
    with nn.logical_axis_rules(rules):
        return nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh)


def test_the_rules_through_flax_give_the_plans_shardings(analysed, tmp_path):
    import json
    a, w, boxed = analysed
    plan = make_plan(a, [[s.name for s in b.strategies].index(name)
                         for b, name in zip(a.blocks.blocks, MEGATRON)])
    rules = logical_rules(plan, boxed)
    assert rules.expressible and dict(rules.rules) == {"vocab": None, "embed": None,
                                                       "mlp": "model"}
    mesh = jax.make_mesh((2, 4), NAMES)
    params = w.abstract_params()
    want = jax.tree_util.tree_leaves(shardings(params, plan, mesh))
    got = jax.tree_util.tree_leaves(flax_shardings(boxed, rules.rules, mesh))
    assert [s.spec for s in got] == [s.spec for s in want]
    # control: rules that leave mlp replicated do not give the plan back
    other = flax_shardings(boxed, [("mlp", None)] + list(rules.rules), mesh)
    assert [s.spec for s in jax.tree_util.tree_leaves(other)] != [s.spec for s in want]
    write_logical_rules(tmp_path / "logical_rules.json", plan, rules)
    written = json.loads((tmp_path / "logical_rules.json").read_text())
    assert written["expressible"] and [tuple(r) for r in written["rules"]] == list(rules.rules)


def test_a_plan_no_rule_list_expresses_is_said_to_be_so(analysed):
    """The most split plan splits the first dim of every kernel: ``embed`` is split in one
    kernel and whole in another, so no rule list gives it."""
    a, _, boxed = analysed
    plan = make_plan(a, [len(b.strategies) - 1 for b in a.blocks.blocks])
    rules = logical_rules(plan, boxed)
    assert not rules.expressible and rules.rules == ()
    assert any("logical axis 'embed'" in c for c in rules.conflicts)


@pytest.mark.parametrize("model", ["flax_logical_boxed", "flax_logical"])
def test_logical_rules_json_beside_the_plan(model, tmp_path, capsys):
    """A run whose params stay boxed writes logical_rules.json beside plan.json (the plan's
    keys then reach into the boxes); one whose params were unboxed says why there is none."""
    import json
    from cfp.api import _write_logical_rules
    from cfp.plan import write_plan
    spec = WorkloadSpec(f"users_models:{model}").resolved()
    a = run_analysis(spec, (2, 4), axis_names=NAMES)
    plan = make_plan(a, [[s.name for s in b.strategies].index(name)
                         for b, name in zip(a.blocks.blocks, MEGATRON)])
    write_plan(tmp_path / "plan.json", plan)
    _write_logical_rules(tmp_path, a, True)
    if model == "flax_logical":
        assert not (tmp_path / "logical_rules.json").exists()
        assert "carry no logical axis names" in capsys.readouterr().out
        return
    assert all(k.endswith(".value") for k in plan["params"])
    written = json.loads((tmp_path / "logical_rules.json").read_text())
    assert written["expressible"] and ["mlp", "model"] in written["rules"]
