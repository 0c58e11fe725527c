"""Compiling for GPUs that are not here (``cfp.gpu_compile``): a mesh of described GPUs, the
memory and cost of programs XLA's GPU compiler makes for them, the fallback without JAX's
CUDA plugin, and the descriptions against a GPU where one is present."""
import json
import os
import re

import jax
import jax.numpy as jnp

import pytest
from jax.sharding import NamedSharding, PartitionSpec

from cfp import gpu_compile
from cfp.cli import main
from cfp.jax_compat import cost_analysis
from cfp.passes.analysis import run_analysis
from cfp.workloads import WorkloadSpec

needs_plugin = pytest.mark.skipif(gpu_compile.unavailable_reason("a100") is not None,
                                  reason="JAX's CUDA plugin is not installed")


@needs_plugin
@pytest.mark.parametrize("gpu", gpu_compile.GPUS)
def test_a_mesh_of_described_gpus_is_built_with_no_gpu_present(gpu):
    """8 GPUs as their description names them, while JAX here has CPU devices only. The
    control: a GPU with no description is refused."""
    assert all(d.platform == "cpu" for d in jax.devices())
    mesh = gpu_compile.gpu_mesh(gpu, (2, 4), ("data", "model"))
    assert mesh.devices.shape == (2, 4) and mesh.axis_names == ("data", "model")
    assert {d.device_kind for d in mesh.devices.flat} == {gpu_compile.device_name(gpu)}
    assert {d.platform for d in mesh.devices.flat} == {"gpu"}
    with pytest.raises(ValueError, match="no description of the GPU 'v100'"):
        gpu_compile.gpu_mesh("v100", (8,), ("m0",))


def test_without_the_plugin_the_reason_is_one_line_with_the_install_command(monkeypatch):
    monkeypatch.setattr(gpu_compile, "_plugin_installed", lambda: False)
    with pytest.raises(gpu_compile.Unavailable) as e:
        gpu_compile.gpu_mesh("a100", (8,), ("m0",))
    assert "\n" not in str(e.value) and gpu_compile.INSTALL in str(e.value)


def _grad_of_matmuls(mesh, dtype=jnp.float32):
    def loss(x, w1, w2):
        return jnp.tanh(jnp.tanh(x @ w1) @ w2).sum()
    shard = lambda *s: NamedSharding(mesh, PartitionSpec(*s))  # noqa: E731
    args = [jax.ShapeDtypeStruct((512, 256), dtype, sharding=shard(mesh.axis_names[0])),
            jax.ShapeDtypeStruct((256, 1024), dtype, sharding=shard()),
            jax.ShapeDtypeStruct((1024, 128), dtype, sharding=shard())]
    return jax.jit(jax.grad(loss, argnums=(1, 2))).lower(*args).compile()


def test_hlo_cost_counts_the_contractions_xla_counts():
    """On CPU, where XLA's cost analysis is there to compare with: the contractions' FLOPs
    read from the HLO are XLA's count less its elementwise work (under 1%), and the bytes
    are within 25% of its own. The control: the same text with its dots renamed counts no
    FLOPs."""
    compiled = _grad_of_matmuls(jax.make_mesh((1,), ("m0",)))
    xla = cost_analysis(compiled)
    flops, nbytes = gpu_compile.hlo_cost(compiled.as_text())
    assert flops == 2 * 512 * (2 * 256 * 1024 + 3 * 1024 * 128)  # two forward, three backward
    assert 0.99 * xla["flops"] <= flops <= xla["flops"]
    assert 0.75 * xla["bytes accessed"] <= nbytes <= 1.25 * xla["bytes accessed"]
    assert gpu_compile.hlo_cost(compiled.as_text().replace(" dot(", " add("))[0] == 0


@needs_plugin
def test_a_program_compiled_for_described_gpus_peaks_as_written():
    """A 24-layer tanh stack's gradient (bf16, 2**20 rows of 2048: 4 GiB per activation)
    compiled for one A100 with cfp's options holds every activation XLA's schedule keeps:
    over 100 GiB, nothing recomputed. Control: with XLA's defaults its own rematerialization
    recomputes until the temporaries fit its limit (80% of the device, times 95%), and the
    same program compiles to under 64 GiB."""
    from cfp.jax_compat import compiler_options
    from cfp.measure import memory_of
    mesh = gpu_compile.gpu_mesh("a100", (1,), ("x",))
    whole = NamedSharding(mesh, PartitionSpec())

    def loss(ws, x):
        for w in ws:
            x = jnp.tanh(x @ w)
        return jnp.sum(x.astype(jnp.float32))
    ws = [jax.ShapeDtypeStruct((2048, 2048), jnp.bfloat16, sharding=whole) for _ in range(24)]
    x = jax.ShapeDtypeStruct((1 << 20, 2048), jnp.bfloat16, sharding=whole)
    lowered = jax.jit(jax.grad(loss)).lower(ws, x)
    ours, xlas = (lowered.compile(options) for options in (compiler_options(mesh), None))
    assert memory_of(ours)["peak_bytes"] > 100 * 2**30 and "remat" not in ours.as_text()
    assert memory_of(xlas)["peak_bytes"] < 64 * 2**30 and "remat" in xlas.as_text()
    assert compiler_options(jax.sharding.Mesh(jax.devices()[:1], ("x",))) is None


@needs_plugin
def test_a_bf16_program_compiled_for_gpus_holds_less_than_on_cpu():
    """The same bfloat16 gradient, split by rows over 8 devices: XLA's CPU backend computes
    the contractions in float32 copies, the A100 compile does not. Both figures are checked:
    the CPU's temporaries hold float32 copies of both weights (over 2.6 MB); the A100's hold
    under a third of that. Its FLOPs per device are an eighth of the program's."""
    gpus = gpu_compile.gpu_mesh("a100", (8,), ("m0",))
    on_gpus = _grad_of_matmuls(gpus, jnp.bfloat16)
    on_cpu = _grad_of_matmuls(jax.make_mesh((8,), ("m0",)), jnp.bfloat16)
    gpu_temp = on_gpus.memory_analysis().temp_size_in_bytes
    cpu_temp = on_cpu.memory_analysis().temp_size_in_bytes
    weights_f32 = 4 * (256 * 1024 + 1024 * 128)
    assert cpu_temp > 1.6 * weights_f32
    assert 0 < gpu_temp < cpu_temp / 3
    assert gpu_compile.hlo_cost(on_gpus.as_text())[0] == pytest.approx(
        gpu_compile.hlo_cost(on_cpu.as_text())[0], rel=0.01)
    assert re.search(r"reduce-scatter|all-reduce", on_gpus.as_text())


@needs_plugin
def test_a_bf16_window_compiled_for_gpus_holds_less_than_compiled_on_cpu():
    """The window of cfp's GPT in bfloat16 that reads the most weights (batch split over 8),
    compiled by the profile's own ``WindowProgram`` for 8 A100s and on 8 CPU devices. The
    CPU's temporaries exceed the window's bfloat16 weights (it computes in float32 copies);
    the A100's are under three quarters of the CPU's, and above nothing."""
    import math
    from cfp.measure import WindowProgram
    from cfp.windows import split_windows
    from cfp.tracing import trace_step
    spec = WorkloadSpec("gpt", "tiny", None, "bfloat16", (("num_layers", 2),)).resolved()
    analysis = run_analysis(spec, (8,))
    windows, reps = split_windows(analysis, 32)
    program, g = trace_step(spec.build()), analysis.graph
    state = dict(g.state_pairs())

    def weight_bytes(window):
        live_ins = WindowProgram(program, analysis, window, analysis.mesh()).sub.live_ins
        return sum(2 * math.prod(g.values[v].shape) for v in live_ins
                   if v in state and len(g.values[v].shape) == 2)

    window = max((windows[r] for r in reps), key=weight_bytes)
    temp = {}
    for where, mesh in (("gpu", gpu_compile.gpu_mesh("a100", (8,), ("m0",))),
                        ("cpu", analysis.mesh())):
        compiled, _ = WindowProgram(program, analysis, window, mesh).compile(
            (0,) * (window.end - window.start))
        temp[where] = compiled.memory_analysis().temp_size_in_bytes
    assert temp["cpu"] > weight_bytes(window) > 0
    assert 0 < temp["gpu"] < 0.75 * temp["cpu"]


@pytest.mark.skipif(not any(d.platform == "gpu" for d in jax.devices()), reason="no GPU here")
def test_each_description_matches_the_gpu_it_names():
    """On a GPU: the description of its kind gives its name, and its memory: JAX's allocator
    may use XLA_PYTHON_CLIENT_MEM_FRACTION of it (0.75 by default; on an H200, 112.58 GB of
    the 150.75 GB described, 0.747: ``scripts/results/2026-11-27-gpu-compile-checks.csv``)."""
    device = next(d for d in jax.devices() if d.platform == "gpu")
    named = [g for g in gpu_compile.GPUS if gpu_compile.label(g) in device.device_kind]
    if not named:
        pytest.skip(f"no description of {device.device_kind}")
    gpu = named[0]
    limit = (device.memory_stats() or {}).get("bytes_limit")
    assert device.device_kind.split()[1][:4] == gpu_compile.device_name(gpu).split()[1][:4]
    if limit:
        share = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75))
        assert 0.95 * share <= limit / gpu_compile.memory_bytes(gpu) <= 1.01 * share


@needs_plugin
def test_a_program_that_needs_cudnn_is_told_apart():
    """cuDNN attention needs the NVIDIA libraries, which a compile without a GPU does not
    load: its error is recognised (cfp then prices as before). The control: attention
    written out compiles."""
    mesh = gpu_compile.gpu_mesh("a100", (1,), ("m0",))
    q = jax.ShapeDtypeStruct((2, 128, 4, 64), jnp.bfloat16,
                             sharding=NamedSharding(mesh, PartitionSpec()))
    cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
    with pytest.raises(RuntimeError) as e:
        cudnn.lower(q, q, q).compile()
    assert gpu_compile.needs_nvidia_libraries(e.value)
    xla = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="xla"))
    assert xla.lower(q, q, q).compile().memory_analysis().temp_size_in_bytes > 0
    assert not gpu_compile.needs_nvidia_libraries(RuntimeError("RESOURCE_EXHAUSTED: out of memory"))


def _cluster_plan(tmp_path, capsys) -> tuple[str, dict]:
    assert main(["--model", "mlp", "--cluster", "a100-8", "--mesh", "8",
                 "--workdir", str(tmp_path)]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    return capsys.readouterr().out, plan


@needs_plugin
def test_a_cluster_is_planned_from_windows_compiled_for_its_gpus(tmp_path, capsys):
    """a100-8 names the A100's description: the window combinations search asks for are
    compiled for 8 A100s (none refused for a collective its strategies do not name), the
    kept plan's whole step too, and the console and plan.json say so."""
    out, plan = _cluster_plan(tmp_path, capsys)
    assert "compile-only for 8 A100s (XLA's GPU compiler, described GPUs)" in out
    assert re.search(r"^profile: \d+ of \d+ combinations compiled and priced \(ok \d+\)", out,
                     re.M)
    line = next(x for x in out.splitlines() if x.startswith("memory per device"))
    assert re.match(r"memory per device: [\d.]+ GiB compiled for A100, XLA's own "
                    r"rematerialization off \([\d.]+ GiB composed "
                    r"from windows compiled for A100; budget 80 GiB\)", line)
    memory = plan["memory_per_device"]
    assert memory["compiled_for"] == "A100" and memory["composed_from"] == "windows compiled for A100"
    assert memory["xla_flags"] == "--xla_disable_hlo_passes=rematerialization"
    assert 0.5 < memory["composed_bytes"] / memory["compiled_bytes"] < 2


def test_without_the_plugin_a_cluster_is_planned_as_before_and_says_so_once(
        tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(gpu_compile, "_plugin_installed", lambda: False)
    gpu_compile._probe.cache_clear()
    try:
        out, plan = _cluster_plan(tmp_path, capsys)
    finally:
        gpu_compile._probe.cache_clear()
    told = [x for x in out.splitlines() if "not compiled for A100s" in x]
    assert len(told) == 1 and gpu_compile.INSTALL in told[0]
    assert "compiled for A100" not in out.replace("not compiled for A100s", "")
    assert plan["memory_per_device"]["composed_from"] in ("windows compiled on CPU",
                                                          "the analysis (no window compiled)")
    assert "compiled_for" not in plan["memory_per_device"]


@needs_plugin
@pytest.mark.slow  # the compile for described GPUs runs in the suite through a100-8 (above)
def test_a_device_preset_named_compiles_for_that_gpu(tmp_path, capsys):
    """--cost model --device-preset h200 compiles the profile for 8 H200s; the preset left
    out prices A100 figures on the programs compiled here, as before (the control)."""
    for preset, says in ((["--device-preset", "h200"], True), ([], False)):
        args = ["--model", "mlp", "--mesh", "8", "--cost", "model", "--memory-budget", "1",
                "--max-combinations", "4", "--workdir", str(tmp_path / str(says))] + preset
        assert main(args + ["--mode", "analysis"]) == 0
        assert main(args + ["--mode", "profile"]) == 0
        out = capsys.readouterr().out
        assert ("compile-only for 8 H200s (XLA's GPU compiler, described GPUs)" in out) == says
    # search reads the profile compiled for the H200s, and runs its plan on the devices here
    assert main(args + ["--mode", "search", "--validate-top", "1"]) == 0
    assert (tmp_path / str(says) / "plan.json").exists()


def _scaled_memory(profile, scale: float):
    """``profile`` with every window's bytes times ``scale``: a composition that counts
    ``scale`` times what its windows hold."""
    import dataclasses
    fields = ("peak_bytes", "argument_bytes", "output_bytes", "temp_bytes")
    return dataclasses.replace(profile, window_profiles={
        k: dataclasses.replace(p, results={c: dataclasses.replace(
            m, **{f: int(getattr(m, f) * scale) for f in fields}) for c, m in p.results.items()})
        for k, p in profile.window_profiles.items()})


def _gpt_for_a100s():
    """The tiny GPT analysed for 8 A100s and priced from the analysis; a budget that admits
    its leanest hand plan once compiled (within ``COMPILED_FIT_SHARE``, with a quarter to
    spare), and the fastest plan with no budget, which that budget does not admit once
    compiled."""
    from cfp.baselines import baseline_strategy_indices, load_rules
    from cfp.cluster import load_cluster
    from cfp.execute import Storage
    from cfp.passes.profile import ProfileOptions, run_profile
    from cfp.passes.search import compiled_peaks_for, predict_plan
    from cfp.problem import COMPILED_FIT_SHARE
    analysis = run_analysis(WorkloadSpec("gpt", "tiny", None, "float32", ()).resolved(), (8,))
    profile = run_profile(analysis, ProfileOptions(
        cost="analytic", cost_model=load_cluster("a100-8").cost_model((8,))))
    rules = load_rules()
    hand = [(idx, Storage(rules[name].storage))
            for name, (idx, _) in baseline_strategy_indices(analysis, storage=True).items()]
    budget = int(min(compiled_peaks_for(analysis, hand, "a100")) / COMPILED_FIT_SHARE * 1.25)
    free = predict_plan(analysis, profile, None, 10.0, compile_for="a100", hand_plans=False)
    assert free.compiled_peak_bytes > budget * COMPILED_FIT_SHARE  # the fastest does not fit
    return analysis, profile, budget, free


@pytest.mark.parametrize("xla_share,dropped", [(1.3, True), (0.9, False)])
def test_a_cluster_plan_over_the_budget_once_compiled_is_dropped(monkeypatch, xla_share,
                                                                  dropped):
    """The tiny GPT priced for 8 A100s from the analysis, its budget the composed memory of
    its fastest plan, each plan's compiled peak given as ``xla_share`` of its composition:
    where XLA holds 1.3x, the fastest plan is over the budget once compiled and dropped, and
    the plan kept fits once compiled (within ``COMPILED_FIT_SHARE``). The control: where XLA
    holds 0.9x, the fastest plan fits and is kept."""
    from cfp.cluster import load_cluster
    from cfp.passes import search
    from cfp.passes.profile import ProfileOptions, run_profile
    from cfp.problem import COMPILED_FIT_SHARE
    analysis = run_analysis(WorkloadSpec("gpt", "tiny", None, "float32", ()).resolved(), (8,))
    profile = run_profile(analysis, ProfileOptions(
        cost="analytic", cost_model=load_cluster("a100-8").cost_model((8,))))
    monkeypatch.setattr(search, "plan_peaks", lambda analysis, problem, profile, sols, gpus,
                        storages=(): [int(sol.memory * xla_share) for sol in sols])
    free = search.predict_plan(analysis, profile, None, 10.0, compile_for="a100",
                               hand_plans=False)
    rec = search.predict_plan(analysis, profile, free.memory_bytes, 10.0, compile_for="a100",
                              hand_plans=False)
    assert (rec.strategies != free.strategies) == dropped
    assert rec.compiled_peak_bytes == int(rec.memory_bytes * xla_share)
    assert rec.compiled_peak_bytes <= free.memory_bytes * COMPILED_FIT_SHARE


@needs_plugin
@pytest.mark.slow  # more whole steps compiled; the rule's fast test is the one above
def test_a_cluster_plan_the_composition_refuses_is_found_once_compiled():
    """A composition counting 10x what the windows hold fits no plan under a budget that
    plans fit once compiled: calibrated on compiled peaks (or the hand plans compiled), a
    plan that fits once compiled is found. The control: under a budget below every compiled
    peak, no plan fits, said from the compiled figures."""
    from cfp.errors import CfpError
    from cfp.passes.search import predict_plan
    from cfp.problem import COMPILED_FIT_SHARE
    from cfp.problem import build_problem
    from cfp.solver import least_memory
    analysis, profile, budget, _ = _gpt_for_a100s()
    high = _scaled_memory(profile, 10.0)
    assert least_memory(build_problem(analysis, high, None)[0]) > budget  # composes none
    rec = predict_plan(analysis, high, budget, 10.0, compile_for="a100")
    assert rec.compiled_peak_bytes <= budget * COMPILED_FIT_SHARE
    with pytest.raises(CfpError, match=r"no plan fits the memory budget of [\d.]+ GiB per "
                                       r"device once compiled for A100 .* the least of the"):
        predict_plan(analysis, high, budget // 3, 10.0, compile_for="a100")
