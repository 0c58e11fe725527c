"""``--cost mock`` (a node of GPUs profiled on the one GPU here) where no GPU is: the refusal,
the pricing of a compiled program's collectives, and the split of a prediction into what was
timed and what was priced. The profile itself runs on a GPU only (scripts/mock_gpu_check.sh)."""
import dataclasses
import math
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from cfp.api import run
from cfp.options import Options
from cfp.cluster import load_cluster
from cfp.errors import CfpError
from cfp.gpu_compile import mock_unavailable_reason
from cfp.measure import Measurement
from cfp.cost_model import CostModel, collectives_cost
from cfp.passes.analysis import run_analysis
from cfp.passes.profile import ProfileOptions, on_one_scale, run_profile
from cfp.passes.search import predict_plan, priced_seconds
from cfp.problem import build_problem, predicted_seconds
from cfp.mesh import make_mesh
from cfp.workloads import WorkloadSpec

no_gpu = pytest.mark.skipif(mock_unavailable_reason() is None, reason="a GPU is here")


@no_gpu
def test_mock_without_a_gpu_is_one_line_and_exit_2_before_any_work(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "cfp", "--model", "gpt", "--cluster", "h100-8",
                           "--cost", "mock", "--workdir", str(tmp_path / "wd")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "cfp: error: --cost mock times programs on a GPU here, and this machine has no "
        "NVIDIA GPU (no driver)"]
    assert not (tmp_path / "wd").exists()  # nothing traced, nothing written
    # the control: the same run priced without a GPU gets past the options
    proc = subprocess.run([sys.executable, "-m", "cfp", "--model", "gpt", "--cluster", "h100-8",
                           "--cost", "model", "--mode", "analysis",
                           "--workdir", str(tmp_path / "wd")],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and (tmp_path / "wd" / "analysis.pkl").exists()


def test_mock_needs_a_described_node_of_one_mesh(tmp_path):
    for options, words in [(Options(model="gpt", cost="mock"), "give --cluster"),
                           (Options(model="gpt", cost="mock", cluster="h100-8", mesh="auto"),
                            "profiles the windows of one mesh"),
                           (Options(model="gpt", cost="mock", cluster="h100-8", mode="stages"),
                            "profiles the windows of one mesh")]:
        with pytest.raises(CfpError, match=words):
            run(dataclasses.replace(options, workdir=str(tmp_path)))
    assert not any(tmp_path.iterdir())


def test_collectives_are_priced_from_the_compiled_program():
    """A sum over a dim split 8 ways compiles to one all-reduce of the result's bytes,
    priced alpha + beta * 2 (n - 1) / n * bytes on the axis it runs over; the same program
    with the dim whole has no collective and is priced 0 (the control)."""
    cost = CostModel(alpha=(1e-5, 2e-6), beta=(1e-9, 1e-11), device_flops=1e12,
                     device_bandwidth=1e12)
    mesh = make_mesh((2, 4))
    x = jnp.ones((8, 1024), jnp.float32)
    out = NamedSharding(mesh, PartitionSpec())
    split_m1 = jax.jit(lambda v: v.sum(0), in_shardings=NamedSharding(mesh, PartitionSpec("m1")),
                       out_shardings=out).lower(x).compile()
    seconds, colls = collectives_cost(split_m1.as_text(), (2, 4), cost)
    assert [(kind, axes) for kind, axes, _ in colls] == [("all-reduce", (1,))]
    assert colls[0][2] == 1024 * 4
    assert seconds == pytest.approx(2e-6 + 1e-11 * 2 * 3 / 4 * 4096)
    split_m0 = jax.jit(lambda v: v.sum(0), in_shardings=NamedSharding(mesh, PartitionSpec("m0")),
                       out_shardings=out).lower(x).compile()
    assert collectives_cost(split_m0.as_text(), (2, 4), cost)[0] == pytest.approx(
        1e-5 + 1e-9 * 2 * 1 / 2 * 4096)  # the slower axis, of 2
    whole = jax.jit(lambda v: v.sum(0), in_shardings=out, out_shardings=out).lower(x).compile()
    assert collectives_cost(whole.as_text(), (2, 4), cost) == (0.0, ())


def test_a_rescaled_profile_keeps_its_priced_seconds():
    """The profile rescales each timed figure to one speed scale; the priced part of a
    mocked window's figure ran on no machine and stays as priced."""
    m = Measurement("ok", 3.0, 2.5, 4.0, 10, anchor_s=2.0, priced_s=1.0)
    fast = Measurement("ok", 1.0, 1.0, 1.0, 10, anchor_s=1.0)
    from cfp.passes.profile import WindowProfile
    profiles = {0: WindowProfile(0, (0,), (2,), {(0,): m, (1,): fast})}
    scaled, scale_s = on_one_scale(profiles)
    got = scaled[0].results[(0,)]
    assert scale_s == 1.5
    assert got.time_s == pytest.approx((3.0 - 1.0) * 0.75 + 1.0)
    assert got.time_min_s == pytest.approx((2.5 - 1.0) * 0.75 + 1.0)
    assert got.priced_s == 1.0
    assert scaled[0].results[(1,)].time_s == pytest.approx(1.5)  # nothing priced: all scaled


def test_a_prediction_says_how_much_of_it_was_priced():
    """``priced_seconds`` composes the step from the windows' priced seconds and the
    reshardings: all of it where every window's time was priced, the reshardings alone where
    none was (the control), in between otherwise."""
    spec = WorkloadSpec("gpt", "tiny", None, "float32", ()).resolved()
    cluster = load_cluster("h100-8")
    analysis = run_analysis(spec, (8,))
    profile = run_profile(analysis, ProfileOptions(cost="analytic",
                                                   cost_model=cluster.cost_model((8,))))

    def with_priced(share):
        return dataclasses.replace(profile, cost="mock", window_profiles={
            k: dataclasses.replace(p, results={c: dataclasses.replace(m, priced_s=m.time_s * share)
                                               for c, m in p.results.items()})
            for k, p in profile.window_profiles.items()})

    rec = predict_plan(analysis, with_priced(0.5), None, 10.0)
    problem, _ = build_problem(analysis, profile, None)
    total = predicted_seconds(problem, rec.choices, 0.0)
    reshards = priced_seconds(analysis, with_priced(0.0), rec.choices)
    assert rec.pricing == "mock"
    assert priced_seconds(analysis, with_priced(1.0), rec.choices) == pytest.approx(total)
    units = len(profile.windows) * 1e-7  # each window's figure is rounded to 0.1 us
    assert rec.priced_s == pytest.approx(reshards + (total - reshards) / 2, abs=units)
    assert 0 <= reshards < rec.priced_s < total
    assert math.isclose(rec.predicted_s, total + profile.launch_overhead_s)
