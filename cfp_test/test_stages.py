import random

import pytest

from cfp.stages import StageCost, Submesh, brute_force_stages, plan_stages, submeshes


def _check(plan, num_layers, num_devices, budget):
    """Contiguous stages covering every layer, every device used, memory fitting 1F1B."""
    S = len(plan.stages)
    assert [s.first_layer for s in plan.stages] == \
        [0] + [s.last_layer + 1 for s in plan.stages[:-1]]
    assert plan.stages[-1].last_layer == num_layers - 1
    assert sum(s.submesh.num_devices for s in plan.stages) == num_devices
    for p, s in enumerate(plan.stages):
        in_flight = min(S - p, plan.micro_batches)  # 1F1B: at most every micro-batch
        assert budget is None or s.cost.memory_bytes + in_flight * s.cost.activation_bytes <= budget


def _random_price(rng, calls):
    table = {}

    def price(first, last, mesh):
        calls[first, last, mesh] = calls.get((first, last, mesh), 0) + 1
        if (first, last, mesh) not in table:
            n = last - first + 1
            table[first, last, mesh] = None if rng.random() < 0.1 else StageCost(
                n * rng.uniform(0.7, 1.3) / mesh.num_devices ** 0.7,
                rng.randint(1, 100) * n, rng.randint(0, 30))
        return table[first, last, mesh]
    return price


def _identical(first, last, mesh, slow_layer=None, embeddings=0.0, num_layers=8):
    """Layers of one cost: compute splits over the devices, a gradient all-reduce grows with
    them, and each stage pays a fixed send (and ``embeddings`` per end of the model it holds)."""
    n, d = last - first + 1, mesh.num_devices
    work = n + (3 if slow_layer is not None and first <= slow_layer <= last else 0)
    extra = embeddings * ((first == 0) + (last == num_layers - 1))
    return StageCost(work / d + 0.1 * work * (d - 1) / d + 0.3 + extra, 10 * n // d + 1, n)


def test_submesh_shapes():
    assert [m.shape for m in submeshes(1, 8)] == [(1, 1), (1, 2), (1, 4), (1, 8)]
    assert [m.shape for m in submeshes(3, 8)][-2:] == [(2, 8), (3, 8)]
    assert [m.shape for m in submeshes(2, 6)] == [(1, 1), (1, 2), (1, 4), (1, 6), (2, 6)]
    assert Submesh(2, 4).num_devices == 8


@pytest.mark.parametrize("seed", range(20))
def test_dp_matches_brute_force(seed):
    rng = random.Random(seed)
    layers = rng.randint(1, 5)
    nodes, per_node = rng.choice([(1, 2), (1, 4), (2, 2), (2, 4), (1, 3), (2, 3)])
    budget = rng.choice([None, rng.randint(0, 150), rng.randint(100, 600)])
    kw = dict(micro_batches=rng.randint(1, 8), memory_budget_bytes=budget)
    calls = {}
    price = _random_price(rng, calls)
    got = plan_stages(layers, nodes, per_node, price, **kw)
    assert max(calls.values()) == 1  # priced once per (first, last, submesh)
    want = brute_force_stages(layers, nodes, per_node, price, **kw)
    if want is None:
        assert got is None
    else:
        assert got.latency_s == pytest.approx(want.latency_s, rel=1e-12, abs=0)
        _check(got, layers, nodes * per_node, budget)


def test_nothing_fits():
    price = _random_price(random.Random(0), {})
    for run in (plan_stages, brute_force_stages):
        assert run(3, 2, 2, price, micro_batches=4, memory_budget_bytes=0) is None


def test_identical_layers_split_evenly():
    plan = plan_stages(8, 1, 8, _identical, micro_batches=16)
    _check(plan, 8, 8, None)
    assert plan.latency_s == pytest.approx(
        brute_force_stages(8, 1, 8, _identical, micro_batches=16).latency_s, rel=1e-12, abs=0)
    assert len(plan.stages) > 1
    assert len({s.last_layer - s.first_layer for s in plan.stages}) == 1
    assert len({s.submesh for s in plan.stages}) == 1


def test_one_expensive_layer_breaks_the_even_split():
    plan = plan_stages(8, 1, 8, lambda a, b, m: _identical(a, b, m, slow_layer=3),
                       micro_batches=16)
    _check(plan, 8, 8, None)
    assert len({(s.last_layer - s.first_layer, s.submesh) for s in plan.stages}) > 1


def test_pruning_skips_most_bounds():
    def price(first, last, mesh):
        return _identical(first, last, mesh, embeddings=0.5, num_layers=24)
    plan = plan_stages(24, 2, 8, price, micro_batches=16)
    _check(plan, 24, 16, None)
    assert plan.t_max_tried < plan.t_max_candidates / 4
    assert plan.latency_s == pytest.approx(
        sum(s.cost.time_s for s in plan.stages) + 15 * plan.slowest_s)


def test_memory_budget_forces_more_stages():
    def price(first, last, mesh):  # weights replicated over the submesh: they do not shrink
        n = last - first + 1
        return StageCost(n / mesh.num_devices, 100 * n, 10 * n)
    free = plan_stages(6, 2, 2, price, micro_batches=8)
    assert len(free.stages) == 1
    budget = 260
    tight = plan_stages(6, 2, 2, price, micro_batches=8, memory_budget_bytes=budget)
    _check(tight, 6, 4, budget)
    assert len(tight.stages) > len(free.stages)
    want = brute_force_stages(6, 2, 2, price, micro_batches=8, memory_budget_bytes=budget)
    assert tight.latency_s == pytest.approx(want.latency_s, rel=1e-12, abs=0)


# --- the stages pass on real programs ------------------------------------------------------

def _gpt(layers: int):
    from cfp.workloads import WorkloadSpec
    return WorkloadSpec("gpt", "tiny", 16, "float32", (("num_layers", layers),)).resolved()


@pytest.fixture(scope="module")
def staged_gpt():
    """A 2-layer GPT planned for one node of 8 A100s with 4 micro-batches."""
    from cfp.cluster import load_cluster
    from cfp.passes.stages import StageOptions, run_stages
    cluster = load_cluster("a100-8")
    rec = run_stages(_gpt(2), cluster, StageOptions(4, cluster.memory_per_device_bytes))
    return rec


def test_stages_cover_the_layers_on_disjoint_submeshes(staged_gpt):
    rec = staged_gpt
    assert len(rec.stages) >= 2  # 4 micro-batches make a pipeline pay at this size
    assert [s.first_layer for s in rec.stages][0] == 0
    assert rec.stages[-1].last_layer == rec.num_layers - 1 == 1
    assert sum(s.submesh[0] * s.submesh[1] for s in rec.stages) == 8
    assert [s.blocks[0] for s in rec.stages[1:]] == [s.blocks[1] for s in rec.stages[:-1]]
    assert all(len(s.strategies) == s.blocks[1] - s.blocks[0] for s in rec.stages)
    assert [s.in_flight for s in rec.stages] == [min(len(rec.stages) - p, 4)
                                                 for p in range(len(rec.stages))]


def test_staged_run_matches_one_device(staged_gpt, monkeypatch):
    """Each stage runs as its own programs on its own devices, under its intra-op plan, and
    loss and gradients averaged over the micro-batches are the single-device step's.
    Negative control: a transfer between programs that loses its value is caught."""
    import jax.numpy as jnp
    from cfp import sharding
    from cfp.execute import numerics_error, reference_loss_and_grads
    from cfp.passes.stages import run_staged
    spec = _gpt(2)
    want = reference_loss_and_grads(spec.build())
    got, _, programs = run_staged(spec, staged_gpt.stages, 4)
    assert programs == 2 * len(staged_gpt.stages) - 1  # forward runs, the turn, backward runs
    loss_err, grad_excess = numerics_error(got, want)
    assert loss_err < 1e-5 and grad_excess == 0
    real = sharding.sub_function
    calls = []

    def lossy(*args, **kwargs):
        fn = real(*args, **kwargs)
        calls.append(fn)
        if len(calls) > 1:
            return fn
        return lambda *ins: [jnp.zeros_like(o) if k == 0 else o
                             for k, o in enumerate(fn(*ins))]

    monkeypatch.setattr(sharding, "sub_function", lossy)
    loss_err, grad_excess = numerics_error(run_staged(spec, staged_gpt.stages, 4)[0],
                                           want)
    assert loss_err > 1e-3 or grad_excess > 0


def test_stages_mode_for_a_cluster(tmp_path, capsys):
    import json
    from cfp.cli import main
    assert main(["--mode", "stages", "--model", "gpt", "--num-layers", "2", "--cluster",
                 "a100-8", "--micro-batches", "4", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "predicted latency (1F1B" in out and "stage 0: layers 0-" in out
    assert "staged run here" not in out  # a described cluster is planned, not run
    plan = json.loads((tmp_path / "stages" / "plan.json").read_text())
    assert plan["stages"][-1]["layers"][1] == 1 and plan["stages"][0]["constraints"]
    assert main(["--mode", "stages", "--model", "gpt", "--micro-batches", "3", "--cluster",
                 "a100-8", "--workdir", str(tmp_path)]) == 2
    assert "--micro-batches 3 does not divide" in capsys.readouterr().err


def test_a_stage_pays_for_what_crosses_to_later_stages():
    """The whole model as one stage sends nothing; the first layer's stage sends each tensor
    (not a step input) that crosses between its blocks and later ones, once, at the link's
    alpha and beta. The crossing tensors are found here from the graph, independently."""
    from cfp.grouping import group_blocks
    from cfp.cluster import load_cluster
    from cfp.problem import SCALE
    from cfp.passes.stages import StageOptions, _SubmeshPricing
    from cfp.tracing import trace_step
    spec = _gpt(2)
    graph = trace_step(spec.build()).graph()
    pricing = _SubmeshPricing(spec, load_cluster("a100-8"), graph, group_blocks(graph),
                              StageOptions(4, None), Submesh(1, 2))
    strategies, cost, *_ = pricing.candidates[0]
    assert len(pricing.candidates) == 1  # no budget: one candidate
    whole, _ = pricing.price(0, 1)
    edges = sum(int(t[strategies[i], strategies[j]]) for (i, j), t in
                pricing.problem.edges.items())
    assert whole.time_s == (cost.sum() + edges) / SCALE
    lo, hi = pricing.block_range(0, 0)
    first, _ = pricing.price(0, 0)
    inside = [g for g, grp in enumerate(pricing.problem.groups) if lo <= grp.blocks[0] < hi]
    edges = sum(int(t[strategies[i], strategies[j]]) for (i, j), t in
                pricing.problem.edges.items() if lo <= i < hi and lo <= j < hi)
    block_of = pricing.analysis.blocks.owner
    later = {}
    for op in graph.ops:
        for v in op.outputs:
            for u in graph.users.get(v, ()):
                a, b = block_of.get(op.index), block_of.get(u)
                if a is None or b is None or graph.values[v].input_index is not None:
                    continue
                if (lo <= a < hi and b >= hi) or (a >= hi and lo <= b < hi):
                    later[v] = graph.values[v].nbytes
    alpha, beta = pricing.link
    assert later  # the residual stream and its gradient at least
    sent = sum(alpha + n * beta for n in later.values())
    assert first.time_s == pytest.approx(cost[inside].sum() / SCALE + edges / SCALE + sent,
                                         rel=1e-9)


@pytest.mark.slow  # the staged run stays in the suite through test_staged_run_matches_one_device
def test_staged_run_of_users_models(tmp_path, capsys):
    """An Equinox model (its module class made per build) is staged and checked here; a Flax
    model with dropout keys in its batch is refused in one line, since micro-batches draw other
    masks than the whole batch, and nothing is written."""
    from cfp.cli import main
    common = ["--mode", "stages", "--batch-size", "8", "--micro-batches", "4",
              "--memory-budget", "2"]
    assert main(common + ["--model", "users_models:equinox_attention",
                          "--workdir", str(tmp_path / "eqx")]) == 0
    assert "loss and gradients match one device" in capsys.readouterr().out
    assert main(common + ["--model", "users_models:flax_dropout",
                          "--workdir", str(tmp_path / "flax")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "draws randomness from a key" in err
    assert not (tmp_path / "flax" / "stages").exists()


def test_work_per_mesh_runs_in_other_processes_in_order():
    """``map_meshes`` gives what a loop here gives, in order, from other processes; an
    item's exception is raised here. Control: the processes are others than this one."""
    import math
    import os
    from cfp.pool import map_meshes
    items = [5, 1, 7, 3]
    assert map_meshes(math.factorial, (), items, processes=2) == [math.factorial(n) for n in items]
    assert os.getpid() not in map_meshes(_pid, (), [0, 1], processes=2)
    with pytest.raises(ValueError, match="not defined for negative"):
        map_meshes(math.factorial, (), [3, -1], processes=2)


def _pid(_):
    import os
    return os.getpid()


def test_stages_here_take_the_links_given_per_axis_of_a_two_axis_mesh():
    """``--mode stages`` without ``--cluster`` prices this machine's devices as one node:
    ``--alpha``/``--beta`` given per axis of ``--mesh 2x4`` (as the options check asks) price
    its links as the slower axis's. Control: one value for the two axes is refused."""
    from cfp.api import _local_cluster
    from cfp.errors import CfpError
    from cfp.options import Options, check_options
    options = Options(mode="stages", mesh="2x4", alpha="1e-5,2e-6", beta="1e-9,1e-10",
                      memory_budget_gb=1)
    cluster = _local_cluster(check_options(options), options)
    assert [(lv.alpha_s, lv.beta_s_per_byte) for lv in cluster.levels] == [(1e-5, 1e-9)] * 2
    with pytest.raises(CfpError, match="one value per mesh axis"):
        check_options(Options(mode="stages", mesh="2x4", alpha="1e-5", memory_budget_gb=1))
