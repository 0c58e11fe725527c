"""Hostile input: a work dir's files never choose what runs, numbers are checked as numbers, and
every refusal is one line with status 2 before any work."""
import dataclasses

import jax  # noqa: F401  (started here, on the 8 devices conftest asks for)
import pytest

from cfp.cli import main
from cfp.errors import CfpError
from cfp.records import read_record, write_record
from cfp.workdir import ANALYSIS_FORMAT, WorkDir
from cfp.workloads import WorkloadSpec, run_fingerprint


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cfp: error:"), err
    return err[0]


@pytest.fixture(scope="module")
def mlp_analysis(tmp_path_factory):
    """A genuine analysis record of the tiny MLP on 4 devices, and its run's fingerprint."""
    workdir = tmp_path_factory.mktemp("genuine")
    assert main(["--mode", "analysis", "--model", "mlp", "--mesh", "4",
                 "--workdir", str(workdir)]) == 0
    record = read_record(workdir / "analysis.pkl", ANALYSIS_FORMAT, None, hint="")
    return record, run_fingerprint(record.spec, (4,))


def test_a_record_naming_other_code_runs_nothing(tmp_path, capsys, mlp_analysis):
    """An analysis record under a genuine header whose spec names ``os:system`` is refused by
    profile and search in one line, and the command never runs. Controls: the crafted spec
    does run its command when built, and the same record with the genuine spec is read."""
    genuine, fp = mlp_analysis
    marker = tmp_path / "command-ran"
    evil = WorkloadSpec("os:system", overrides=(("command", f"touch {marker}"),))
    write_record(tmp_path / "analysis.pkl", ANALYSIS_FORMAT, fp,
                 dataclasses.replace(genuine, spec=evil))
    capsys.readouterr()
    for mode in ("profile", "search"):
        assert main(["--mode", mode, "--model", "mlp", "--mesh", "4", "--memory-budget", "1",
                     "--workdir", str(tmp_path)]) == 2
        assert "names the workload 'os:system', not this run's 'mlp'" in _one_line(capsys)
    assert not marker.exists()

    with pytest.raises(CfpError, match="returned a int"):
        evil.build()
    assert marker.exists()  # the marker does show a command that ran
    write_record(tmp_path / "analysis.pkl", ANALYSIS_FORMAT, fp, genuine)
    assert WorkDir(tmp_path, fp).read_analysis().spec == genuine.spec


def test_a_record_holding_a_callable_is_refused(tmp_path, mlp_analysis):
    """No field of a record may hold a class or a function, the kind of value a later pass
    could call. Control: the same record without it is read."""
    genuine, fp = mlp_analysis
    path = tmp_path / "analysis.pkl"
    write_record(path, ANALYSIS_FORMAT, fp, dataclasses.replace(genuine, mesh_shape=WorkloadSpec))
    with pytest.raises(CfpError, match="holds a callable .'WorkloadSpec'."):
        read_record(path, ANALYSIS_FORMAT, fp, hint="h")
    write_record(path, ANALYSIS_FORMAT, fp, genuine)
    assert read_record(path, ANALYSIS_FORMAT, fp, hint="h").mesh_shape == (4,)


def test_a_user_step_is_read_only_by_the_run_that_names_it(tmp_path, mlp_analysis):
    """Read with no run to compare against (the scripts' reads), a record naming a user's
    factory is refused; the run that names that factory reads it."""
    genuine, _ = mlp_analysis
    spec = WorkloadSpec("zoo_extra:convnet", None, 8, "float32", ())
    fp = run_fingerprint(spec, (4,))
    path = tmp_path / "analysis.pkl"
    write_record(path, ANALYSIS_FORMAT, fp, dataclasses.replace(genuine, spec=spec))
    with pytest.raises(CfpError, match="names the workload 'zoo_extra:convnet'"):
        read_record(path, ANALYSIS_FORMAT, None, hint="h")
    assert read_record(path, ANALYSIS_FORMAT, fp, hint="h").spec == spec


@pytest.mark.parametrize("make", ["directory", "device"])
def test_a_record_that_is_no_regular_file_is_refused(tmp_path, make):
    """A directory, or a link to /dev/zero (read until memory ran out), in a record's place."""
    path = tmp_path / "analysis.pkl"
    if make == "directory":
        path.mkdir()
    else:
        path.symlink_to("/dev/zero")
    with pytest.raises(CfpError, match="is not a regular file: h$"):
        read_record(path, ANALYSIS_FORMAT, None, hint="h")


NAN_INF = [(flag, value) for flag in ("--memory-budget", "--profile-budget", "--time-limit",
                                      "--device-flops", "--device-bandwidth")
           for value in ("nan", "inf", "-inf")]
NUMBERS = [([f"{flag}={value}"], f"{flag} must be positive") for flag, value in NAN_INF] + [
    (["--alpha", "-1", "--beta", "1e-9"], "--alpha must be zero or more"),
    (["--alpha", "1e-6", "--beta", "-1"], "--beta must be zero or more"),
    (["--alpha", "nan"], "--alpha must be zero or more"),
    (["--alpha", "fast"], "is not a list of numbers"),
    (["--alpha", "1e-6,1e-6"], "one value per mesh axis (1)"),
    (["--batch-size", str(10**23)], "--batch-size must be positive, at most 2147483648"),
    (["--num-layers", str(10**6)], "--num-layers must be positive, at most 1024"),
    (["--num-devices", "100000"], "--num-devices must be positive, at most 512"),
    (["--mesh", "1000x1000"], "over the 512 a run here may use"),
    (["--iters", str(10**20)], "--iters must be positive, at most 10000"),
    (["--validate-top", str(10**6)], "--validate-top must be positive, at most 64"),
    (["--max-combinations", str(10**9)], "--max-combinations must be positive"),
    (["--micro-batches", "0"], "--micro-batches must be positive"),
    (["--join-timeout", "0"], "--join-timeout must be positive"),
    (["--mesh", "1x8"], "has an axis of one device, which splits nothing: write 8"),
    (["--mesh", "2X4"], "is not a mesh shape"),
    (["--mesh", "2x-4"], "is not a mesh shape"),
    (["--mesh", " 8"], "is not a mesh shape"),
    (["--mesh", "2x\u00b2"], "is not a mesh shape"),  # a digit to isdigit(), not to int()
    (["--mesh", "data=2,model=\u00b2"], "is not a mesh: name each axis with its size"),
    (["--mesh", "\uff18"], "is not a mesh shape"),  # a full-width 8
    (["--mesh", "1x1x1x8"], "has an axis of one device, which splits nothing: write 8"),
    (["--mesh", "2x2x2x2"], "splits over 4 axes; cfp plans for at most 3"),
    (["--mesh", "9" * 5000], "is not a mesh shape"),  # past int()'s digit limit
]


@pytest.mark.parametrize("argv,expected", NUMBERS, ids=[" ".join(a) for a, _ in NUMBERS])
def test_numbers_are_checked_as_numbers_before_any_work(tmp_path, capsys, compiles, argv,
                                                        expected):
    """Each value out of its stated bounds, NaN and infinities included, is one line and
    status 2 before anything is analysed or compiled."""
    budget = [] if argv[0].startswith("--memory-budget") else ["--memory-budget", "1"]
    assert main(argv + budget + ["--workdir", str(tmp_path)]) == 2
    assert expected in _one_line(capsys)
    assert compiles == [] and not (tmp_path / "analysis.pkl").exists()


def test_numbers_at_their_bounds_are_taken(capsys):
    """The control: the bounds themselves, and zero alpha and beta, pass the checks."""
    from cfp.options import check_options
    from cfp.cli import parse
    argv = ["--num-layers", "1024", "--batch-size", str(2**31), "--iters", "10000",
            "--validate-top", "64", "--alpha", "0,0", "--beta", "0,1e-9", "--time-limit", "86400",
            "--memory-budget", "0.5", "--num-devices", "512", "--mesh", "2x256"]
    opts = check_options(parse(argv))
    assert opts.mesh_shape == (2, 256) and opts.num_devices == 512
    from cfp.cli import build_parser
    help_text = " ".join(build_parser().format_help().split())  # the bounds are in --help
    assert "layers, overriding the preset's [positive, at most 1024]" in help_text
    assert "[positive, at most 512]" in help_text
    assert "may have no array of more than 2^31 elements" in help_text


GOOD_CLUSTER = {"name": "c", "memory_per_device_GB": 80, "peak_TFLOPs": 312,
                "memory_bandwidth_GBps": 2039,
                "levels": [{"name": "node", "size": 2, "alpha_s": 1e-5, "bandwidth_GBps": 25},
                           {"name": "gpu", "size": 4, "alpha_s": 5e-6, "bandwidth_GBps": 150}]}
BAD_CLUSTERS = [
    ({"memory_per_device_GB": -80}, "memory_per_device_GB must be a finite number from"),
    ({"memory_per_device_GB": 0}, "memory_per_device_GB must be a finite number from"),
    ({"peak_TFLOPs": 0}, "peak_TFLOPs must be a finite number from 1e-06"),
    ({"peak_TFLOPs": float("nan")}, "peak_TFLOPs must be a finite number from 1e-06 to 1e+06, "
                                    "got nan"),
    ({"memory_bandwidth_GBps": float("inf")}, "memory_bandwidth_GBps must be a finite"),
    ({"levels": [{"name": "gpu", "size": 8, "alpha_s": -1, "bandwidth_GBps": 150}]},
     "gpu alpha_s must be a finite number from 0 to 1, got -1"),
    ({"levels": [{"name": "gpu", "size": 8, "alpha_s": 0, "bandwidth_GBps": float("nan")}]},
     "gpu bandwidth_GBps must be a finite number from 1e-09"),
    ({"levels": [{"name": "gpu", "size": 2.5, "alpha_s": 0, "bandwidth_GBps": 1}]},
     "level gpu's size must be a whole number from 1 to 65536, got 2.5"),
    ({"levels": [{"name": "gpu", "size": 2**17, "alpha_s": 0, "bandwidth_GBps": 1}]},
     "level gpu's size must be a whole number from 1 to 65536, got 131072"),
    ({"levels": [{"name": "node", "size": 2**9, "alpha_s": 0, "bandwidth_GBps": 1},
                 {"name": "gpu", "size": 2**8, "alpha_s": 0, "bandwidth_GBps": 1}]},
     "131072 devices, over the 65536"),
    ("directory", "cannot read the cluster file"),
    ({"memory_per_device_GB": 1e300}, "memory_per_device_GB must be a finite number from "
                                      "0.000976562 to 1.04858e+06, got 1e+300"),
    ({"levels": [{"name": "gpu", "size": 8, "alpha_s": 0, "bandwidth_GBps": 1e-320}]},
     "gpu bandwidth_GBps must be a finite number from 1e-09"),
    ({"memory_bandwidth_GBps": 1e300}, "memory_bandwidth_GBps must be a finite number"),
    ({"peak_TFLOPs": 1e300}, "peak_TFLOPs must be a finite number from 1e-06 to 1e+06"),
    ({"peak_TFLOPs": "312"}, "peak_TFLOPs must be a number, got '312'"),
    ({"peak_TFLOPs": True}, "peak_TFLOPs must be a number, got True"),
    ({"memroy_per_device_GB": 80}, "the cluster has the unknown key 'memroy_per_device_GB'"),
    ({"levels": [{"name": "gpu", "size": 8, "alpha_s": 0, "bandwidth_GBps": 1, "nic": 2}]},
     "level 0 has the unknown key 'nic'"),
    ({"name": "x/../../../escaped"}, "name must be a name of letters, digits"),
    ({"name": ".."}, "name must be a name of letters, digits"),
    ({"levels": [{"name": "g/../pu", "size": 8, "alpha_s": 0, "bandwidth_GBps": 1}]},
     "level 0's name must be a name"),
    ({"levels": "gpu"}, "levels must be a list of one level or more"),
    ({"gpu": ["a100"]}, "gpu ['a100'] has no description"),
    ({"assumed": "alpha_s"}, "assumed must be a list of the figures assumed"),
]


@pytest.mark.parametrize("change,expected", BAD_CLUSTERS,
                         ids=[str(c)[:60] for c, _ in BAD_CLUSTERS])
def test_a_bad_cluster_file_is_one_line_before_any_work(tmp_path, capsys, compiles, change,
                                                        expected):
    import json
    path = tmp_path / "cluster.json"
    if change == "directory":
        path.mkdir()
    else:
        path.write_text(json.dumps({**GOOD_CLUSTER, **change}))
    assert main(["--cluster", str(path), "--workdir", str(tmp_path / "w")]) == 2
    assert expected in _one_line(capsys)
    assert compiles == [] and not (tmp_path / "w" / "analysis.pkl").exists()


def test_a_cluster_s_name_writes_nothing_outside_profiles(tmp_path, monkeypatch, capsys):
    """A cluster file naming itself ``x/../../../escaped``, run with the default work dir, is
    refused in one line and writes nothing anywhere; the default work dir of any name is one
    folder under ``profiles/``. Control: the same file under a plain name gets the default
    work dir ``profiles/<model>-...-<name>-<mesh>``."""
    import json
    from cfp.cli import parse
    from cfp.options import check_options, default_workdir
    work = tmp_path / "a" / "b" / "c"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    path = work / "evil.json"
    path.write_text(json.dumps({**GOOD_CLUSTER, "name": "x/../../../escaped"}))
    assert main(["--model", "mlp", "--cluster", str(path)]) == 2
    assert "name must be a name of letters" in _one_line(capsys)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["a", "b", "c", "evil.json"]
    path.write_text(json.dumps({**GOOD_CLUSTER, "name": "mine"}))
    assert default_workdir(check_options(parse(["--model", "mlp", "--cluster", str(path)]))
                           ).parts == ("profiles", "mlp-tiny-mine-2x4")
    opts = check_options(parse(["--model", "/abs/../pkg:make", "--mesh", "4"]))
    assert default_workdir(opts).parts[0] == "profiles" and len(default_workdir(opts).parts) == 2


def test_a_good_cluster_file_and_the_readme_cluster_cases_pass_the_checks(tmp_path):
    """The controls: the README's cluster file loads, and every case of
    scripts/cluster_cases.sh (the README's) passes every check made before work."""
    import json
    import shlex
    from pathlib import Path
    from cfp.options import check_options
    from cfp.cli import parse
    from cfp.cluster import load_cluster
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(GOOD_CLUSTER))
    assert load_cluster(str(path)).num_devices == 8
    script = (Path(__file__).parents[1] / "scripts" / "cluster_cases.sh").read_text()
    cases = [shlex.split(line.replace("\\\n", " "))[1:]
             for line in script.replace("\\\n", " ").splitlines() if line.startswith("run ")]
    assert len(cases) == 9
    for argv in cases:
        opts = check_options(parse(argv))
        assert opts.cluster is not None and opts.num_devices in (8, 64, 200)


def test_a_step_too_large_to_run_here_is_refused_before_any_worker(tmp_path, capsys):
    """A step whose largest array is over 2^31 elements is refused once analysed, before its
    record is written or anything measured; priced by the cost model (abstract shapes only),
    the same step is analysed (the control)."""
    argv = ["--mode", "analysis", "--model", "gpt", "--hidden-size", "65536", "--num-heads",
            "1", "--mesh", "4", "--workdir", str(tmp_path)]
    assert main(argv) == 2
    assert "elements, over the 2147483648 a step run here may have" in _one_line(capsys)
    assert not (tmp_path / "analysis.pkl").exists()
    assert main(argv + ["--cost", "model"]) == 0
    assert (tmp_path / "analysis.pkl").exists()


@pytest.mark.parametrize("extra,refused", [([], True), (["--cost", "model"], False),
                                           (["--cluster", "a100-8"], False)])
def test_arrays_must_fit_the_host_only_where_the_step_runs_here(tmp_path, capsys, monkeypatch,
                                                                extra, refused):
    """On a host of 1 KB, the tiny GPT's largest array does not fit: refused when it would
    run here, planned when it is priced (--cost model) or planned for a cluster."""
    import cfp.workloads
    monkeypatch.setattr(cfp.workloads, "host_memory_bytes", lambda: 2**10)
    rc = main(["--mode", "analysis", "--model", "gpt", "--workdir", str(tmp_path)] + extra)
    if refused:
        assert rc == 2 and "does not fit this host's 9.54e-07 GiB of memory" in _one_line(capsys)
    else:
        assert rc == 0, capsys.readouterr().err


API_REFUSALS = [
    ({"dtype": "float16"}, "--dtype must be one of float32, bfloat16, got 'float16'"),
    ({"frobnicate": True}, "autoshard() takes no option 'frobnicate'"),
    ({"max_combinations": "32"}, "--max-combinations must be a whole number, got '32'"),
    ({"mesh": "1x4"}, "has an axis of one device"),
    ({"memory_budget_gb": float("nan")}, "--memory-budget must be positive"),
    ({"workdir": 123}, "--workdir must be text or a path, got 123"),
    ({"batch_size": 2.5}, "--batch-size must be a whole number, got 2.5"),
    ({"verbose": "yes"}, "--verbose must be true or false, got 'yes'"),
    ({"mesh": 8}, "a mesh is a jax.sharding.Mesh or text"),
]


@pytest.mark.parametrize("kwargs,expected", API_REFUSALS, ids=[str(k) for k, _ in API_REFUSALS])
def test_the_api_raises_cfp_error_with_the_reason(tmp_path, capsys, kwargs, expected):
    """``autoshard`` raises ``CfpError`` carrying the one-line reason (never SystemExit, which
    ``except Exception`` does not catch), and prints nothing of its own."""
    from cfp.api import autoshard
    with pytest.raises(CfpError) as e:
        autoshard("zoo_extra:convnet", **{"mesh": "4", "workdir": tmp_path, **kwargs})
    assert expected in str(e.value) and "\n" not in str(e.value)
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("call,expected", [
    (lambda cfp: cfp.run(cfp.Options(model=None)), "--model must be a zoo key"),
    (lambda cfp: cfp.run(cfp.Options(workdir=123)), "--workdir must be text or a path"),
    (lambda cfp: cfp.run("gpt"), "cfp.run takes cfp.Options, not a str"),
], ids=["model None", "workdir 123", "run text"])
def test_the_api_checks_its_arguments_types(tmp_path, monkeypatch, call, expected):
    """Values of the wrong type are one ``CfpError`` line, not a ``TypeError``, and nothing is
    written. Control: a ``cfp.Options`` of the right types runs (its analysis)."""
    import cfp
    monkeypatch.chdir(tmp_path)
    with pytest.raises(CfpError) as e:
        call(cfp)
    assert expected in str(e.value) and "\n" not in str(e.value)
    assert list(tmp_path.iterdir()) == []
    assert cfp.run(cfp.Options(model="mlp", mesh="4", mode="analysis", workdir=tmp_path / "w"))


def test_the_api_without_a_workdir_uses_the_default_one(tmp_path, monkeypatch):
    """``workdir=None`` is the command line's default work dir, not ``./None``; here the run
    stops after the analysis, so reading the plan names that dir. It names a user's factory
    by its module too: two modules' ``make`` do not share one."""
    from cfp.api import autoshard
    monkeypatch.chdir(tmp_path)
    default = "profiles/zoo_extra_convnet-4"
    with pytest.raises(CfpError, match=f"cannot read the plan {default}/plan.json"):
        autoshard("zoo_extra:convnet", mesh="4", mode="analysis")
    assert (tmp_path / default / "analysis.pkl").exists()
    assert not (tmp_path / "None").exists()
    assert WorkloadSpec("a.train:make").label != WorkloadSpec("b:make").label


_USER_HEAD = """
import jax, jax.numpy as jnp
from cfp.models import user_workload

def _batch(key):
    return {"x": jnp.ones((8, 4)), "y": jnp.ones((8, 2))}

def _loss(p, b):
    return jnp.mean((b["x"] @ p["w"] - b["y"]) ** 2)
"""
USER_ERRORS = [
    ("def make():\n    raise ValueError('5 heads do not divide a hidden size of 64')\n",
     "{mod}:make raised ValueError: 5 heads do not divide a hidden size of 64"),
    ("def make():\n    return user_workload(lambda p, b: jnp.mean(b['x'] @ p['w'].T), "
     "lambda k: {'w': jnp.ones((3, 2))}, _batch)\n",
     "{mod}:make raised TypeError: dot_general requires contracting dimensions"),
    ("def make():\n    import optax\n    return user_workload(_loss, "
     "lambda k: {'w': jnp.ones((4, 2))}, _batch, optimizer=optax.adamw)\n",
     "optimizer='adamw' is not an Optax GradientTransformation: call it"),
    ("def make():\n    return user_workload(_loss, lambda k: {'w': jnp.ones((4, 2)), "
     "'n': jnp.ones((2,), jnp.int32)}, _batch)\n", "['n'] is not floating point"),
    ("import sys\nsys.exit(3)\n", "{mod}:make: importing {mod} raised SystemExit: 3"),
    ("def make(:\n", "{mod}:make: importing {mod} raised SyntaxError: "),
    ("raise RuntimeError('no GPU here')\n",
     "{mod}:make: importing {mod} raised RuntimeError: no GPU here"),
]


@pytest.mark.parametrize("body,expected", USER_ERRORS, ids=range(len(USER_ERRORS)))
def test_an_error_in_user_code_is_one_line_naming_the_factory(tmp_path, capsys, monkeypatch,
                                                               caplog, body, expected):
    """A user's factory, model or module that raises is one line naming the factory path,
    status 2, with the user's own frames logged (shown under -v)."""
    mod = f"usermod_{tmp_path.name}"
    (tmp_path / f"{mod}.py").write_text(_USER_HEAD + body if "def make()" in body else body)
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level("INFO", logger="cfp.tracing"):
        rc = main(["--mode", "analysis", "--model", f"{mod}:make", "--mesh", "4",
                   "--workdir", str(tmp_path / "w")])
    assert rc == 2 and expected.format(mod=mod) in _one_line(capsys)
    if "raised" in expected:
        assert f"{mod}.py" in caplog.text  # the user's frame, for -v


@pytest.mark.parametrize("flags,expected", [
    (["--config", "tiny"], "--config picks a size preset of cfp's own models"),
    (["--dtype", "bfloat16"], ":make takes no dtype (it declares no keywords)"),
    ([], None),  # the control: the factory as it is
])
def test_flags_a_users_factory_does_not_take_are_refused(tmp_path, capsys, monkeypatch, flags,
                                                          expected):
    """A size preset, or a dtype that a user's factory does not declare, is one line, not
    dropped without a word."""
    mod = f"usermod_{tmp_path.name}"
    (tmp_path / f"{mod}.py").write_text(_USER_HEAD + "def make():\n    return user_workload("
                                        "_loss, lambda k: {'w': jnp.ones((4, 2))}, _batch)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = main(["--mode", "analysis", "--model", f"{mod}:make", "--mesh", "4",
               "--workdir", str(tmp_path / "w"), *flags])
    if expected is None:
        assert rc == 0
    else:
        assert rc == 2 and expected in _one_line(capsys)


def test_model_without_a_factory_is_one_line(tmp_path, capsys):
    assert main(["--mode", "analysis", "--model", ":", "--workdir", str(tmp_path)]) == 2
    assert "--model ':' names no factory" in _one_line(capsys)


def test_a_bug_in_cfp_under_a_user_step_keeps_its_traceback(monkeypatch, tmp_path):
    """The control: an exception raised in cfp's own code while it traces a user's step is
    cfp's bug, raised as it is (its traceback printed), not blamed on the user."""
    import cfp.program

    def broken(*args, **kwargs):
        raise RuntimeError("a bug in cfp")
    monkeypatch.setattr(cfp.program, "trace_program", broken)
    with pytest.raises(RuntimeError, match="a bug in cfp"):
        main(["--mode", "analysis", "--model", "zoo_extra:convnet", "--mesh", "4",
              "--workdir", str(tmp_path)])


_SOLVE_AND_INTERRUPT = """
import os, signal, sys, threading, time
signal.signal(signal.SIGINT, signal.default_int_handler)  # as from a terminal, whatever ran us
from ortools.sat.python import cp_model
from cfp.solver import _solve_interruptibly
m = cp_model.CpModel()  # a search that runs until its time limit (10 s were not enough)
xs = [m.NewIntVar(0, 1000, f"x{i}") for i in range(60)]
for i in range(59):
    m.Add(xs[i] * 3 + xs[i + 1] * 7 != 500 + i)
m.AddAllDifferent(xs)
m.Minimize(sum((i % 7 + 1) * x for i, x in enumerate(xs)))
solver = cp_model.CpSolver()
solver.parameters.max_time_in_seconds = 30
solver.parameters.num_workers = 1
threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
start = time.perf_counter()
try:
    _solve_interruptibly(solver, m) if sys.argv[1] == "cfp" else solver.Solve(m)
    print("search ended", flush=True)
except KeyboardInterrupt:
    print(f"interrupted after {time.perf_counter() - start:.1f} s", flush=True)
try:
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
except KeyboardInterrupt:
    print("interrupted again", flush=True)
"""


@pytest.mark.parametrize("how", ["cfp", "cp-sat alone"])
def test_ctrl_c_during_the_solver_is_raised_at_once_and_keeps_the_handler(how):
    """Ctrl-C in CP-SAT's search stops it and is raised at once, and a second Ctrl-C is still
    a KeyboardInterrupt. Control: CP-SAT left to itself swallows the Ctrl-C (its search just
    ends) and leaves SIGINT at its default, so the second one kills with no word."""
    import os
    import subprocess
    import sys
    from pathlib import Path
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    done = subprocess.run([sys.executable, "-c", _SOLVE_AND_INTERRUPT, how], env=env,
                          capture_output=True, text=True, timeout=60)
    lines = done.stdout.splitlines()
    if how == "cfp":
        assert done.returncode == 0 and lines[1:] == ["interrupted again"], done
        assert lines[0].startswith("interrupted after 0.") and len(lines) == 2, lines
    else:
        assert lines == ["search ended"] and done.returncode == -2, done


@pytest.mark.parametrize("cause", [KeyboardInterrupt, None])
def test_an_interrupted_import_is_an_interrupt(tmp_path, monkeypatch, capsys, cause):
    """A Ctrl-C while an extension module (OR-Tools') initializes surfaces as ImportError
    from the KeyboardInterrupt: one line and status 130, and KeyboardInterrupt from the API.
    Control: an ImportError that no Ctrl-C caused is a bug, raised with its traceback."""
    import cfp.api
    from cfp.api import autoshard

    def interrupted_import(opts, args):
        try:
            raise cause() if cause else ImportError("initialization failed")
        except BaseException as e:
            raise ImportError("initialization failed") from e
    monkeypatch.setitem(cfp.api._RUNNERS, "analysis", interrupted_import)
    argv = ["--mode", "analysis", "--model", "mlp", "--mesh", "4", "--workdir", str(tmp_path)]
    if cause:
        assert main(argv) == 130
        assert capsys.readouterr().err.strip().splitlines() == [
            "cfp: interrupted; everything measured so far is kept in the work dir"]
        with pytest.raises(KeyboardInterrupt):
            autoshard("mlp", mesh="4", workdir=tmp_path, mode="analysis")
    else:
        with pytest.raises(ImportError, match="initialization failed"):
            main(argv)


@pytest.mark.parametrize("code", ["ENOSPC", "EIO"])
def test_a_full_disk_is_one_line_naming_what_was_kept(tmp_path, capsys, monkeypatch, code):
    """The disk filling after the analysis record is written: one line naming the work dir
    and the record kept, status 2. Control: another failure to write (EIO) is no user's
    mistake, and is raised with its traceback."""
    import errno
    import os
    import cfp.dumps

    def full(rec, directory):
        raise OSError(getattr(errno, code), os.strerror(getattr(errno, code)),
                      str(directory / "segments.txt"))
    monkeypatch.setattr(cfp.dumps, "write_analysis_dumps", full)
    argv = ["--mode", "analysis", "--model", "mlp", "--mesh", "4", "--workdir", str(tmp_path)]
    if code == "EIO":
        with pytest.raises(OSError, match="Input/output error"):
            main(argv)
        return
    assert main(argv) == 2
    line = _one_line(capsys)
    assert f"the disk of the work dir {tmp_path} is full (writing {tmp_path}/" in line
    assert "kept there: analysis.pkl: free some space and run again" in line


def test_the_records_named_as_kept_include_every_priced_profile(tmp_path):
    """What a full disk's line names as kept: the work dir's records and plan, and those of
    its priced profiles (``model/``, ``analytic/``, ``mock/``); not the dumps (the control)."""
    from cfp.workdir import record_files
    kept = ["analysis.pkl", "plan.json", "model/profile.pkl", "analytic/profile.pkl",
            "mock/window_0.pkl"]
    for rel in kept + ["debug_search/candidates.txt", "debug_search/x.pkl"]:
        (tmp_path / rel).parent.mkdir(exist_ok=True)
        (tmp_path / rel).write_text("")
    assert sorted(str(p.relative_to(tmp_path)) for p in record_files(tmp_path)) == sorted(kept)


def test_window_files_renamed_or_swapped_are_refused(tmp_path):
    """Each window file's header carries its window type's fingerprint (members, their
    shapes, strategies): two files of same-width types swapped, or one renamed to a type
    the profile does not have, are refused before any work. Control: in place, both are
    read back."""
    from cfp.measure import Measurement
    from cfp.passes.analysis import run_analysis
    from cfp.passes.profile import WindowProfile
    from cfp.windows import split_windows
    spec = WorkloadSpec("gpt", "tiny").resolved()
    analysis = run_analysis(spec, (4,))
    windows, reps = split_windows(analysis, 4)
    space = {k: tuple(len(analysis.blocks.blocks[b].strategies)
                      for b in range(windows[r].start, windows[r].end))
             for k, r in enumerate(reps)}
    a, b = [k for k in space if space[k] == space[0]][:2]  # two types of one width
    wd = WorkDir(tmp_path, run_fingerprint(spec, (4,)))
    checkpoint = wd.profile_checkpoint(analysis, "measure", 4)
    for k, t in ((a, 1.0), (b, 2.0)):
        blocks = tuple(range(windows[reps[k]].start, windows[reps[k]].end))
        checkpoint.save_window(k, WindowProfile(k, blocks, space[k],
                                                {(0,) * len(blocks): Measurement("ok", t)}))
    again = wd.profile_checkpoint(analysis, "measure", 4)
    assert [m.time_s for m in again.load_window(a).values()] == [1.0]
    assert [m.time_s for m in again.load_window(b).values()] == [2.0]

    fa, fb = tmp_path / f"window_{a}.pkl", tmp_path / f"window_{b}.pkl"
    tmp = tmp_path / "swap"
    fa.rename(tmp), fb.rename(fa), tmp.rename(fb)
    with pytest.raises(CfpError, match=f"window_{a}.pkl was made for another run .window "
                                       f"differ: window=type {b}: "):
        wd.profile_checkpoint(analysis, "measure", 4)
    fa.unlink()
    fb.rename(tmp_path / f"window_{len(reps)}.pkl")
    with pytest.raises(CfpError, match=f"window_{len(reps)}.pkl is no window type of this "
                                       f"profile .it has {len(reps)}."):
        wd.profile_checkpoint(analysis, "measure", 4)


def test_a_second_run_on_a_work_dir_refuses_naming_the_holder(tmp_path, capsys):
    """A work dir whose lock a live process holds is refused in one line naming its host and
    pid, before any work, and another host's lock likewise. Controls: once the holder is
    gone its stale lock is taken over (and released when the run ends); a work dir nobody
    holds is run."""
    import socket
    import subprocess
    from cfp.workdir import LOCK_NAME, _holder_text
    argv = ["--mode", "analysis", "--model", "mlp", "--mesh", "4", "--workdir", str(tmp_path)]
    lock = tmp_path / LOCK_NAME
    holder = subprocess.Popen(["sleep", "60"])
    try:
        lock.write_text(_holder_text(socket.gethostname(), holder.pid))
        assert main(argv) == 2
        assert (f"the work dir {tmp_path} is in use by process {holder.pid} on "
                f"{socket.gethostname()}") in _one_line(capsys)
        assert not (tmp_path / "analysis.pkl").exists()
    finally:
        holder.kill()
        holder.wait()
    assert main(argv) == 0  # the holder is gone: its lock is stale
    assert (tmp_path / "analysis.pkl").exists() and not lock.exists()

    lock.write_text("elsewhere.example 4242 123\n")
    assert main(argv) == 2
    assert "in use by process 4242 on elsewhere.example" in _one_line(capsys)
    lock.unlink()
    assert main(argv) == 0 and not lock.exists()


def test_a_reused_pid_does_not_hold_a_stale_lock(tmp_path):
    """A lock naming a live pid with another start time was left by a process that is gone
    (its pid since reused): stale."""
    import os
    import socket
    from cfp.workdir import _stale
    lock = tmp_path / "lock"
    lock.write_text("x")
    mine = f"{socket.gethostname()} {os.getpid()}"
    assert _stale(f"{mine} 1\n", lock)
    from cfp.workdir import _start_time
    assert not _stale(f"{mine} {_start_time(os.getpid())}\n", lock)


def _descendants(pid: int) -> dict[int, str]:
    """pid -> command line of every process below ``pid``."""
    from pathlib import Path
    parent_of = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent_of[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            pass
    found, frontier = {}, [pid]
    while frontier:
        p = frontier.pop()
        for child, parent in parent_of.items():
            if parent == p and child not in found:
                try:
                    found[child] = Path(f"/proc/{child}/cmdline").read_bytes().replace(
                        b"\0", b" ").decode()
                except OSError:
                    continue
                frontier.append(child)
    return found


def _running(pid: int) -> bool:
    from pathlib import Path
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


# cfp catches neither: both end the worker through its parent-death signal
@pytest.mark.parametrize("sig", ["SIGKILL", pytest.param("SIGTERM", marks=pytest.mark.slow)])
def test_workers_end_with_the_main_process(tmp_path, sig):
    """Killed while its measurement worker runs, the main process leaves no process behind
    for more than two seconds: neither the worker nor multiprocessing's resource tracker."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path
    argv = ["--model", "mlp", "--mesh", "4", "--workdir", str(tmp_path),
            "--compilation-cache", "none"]
    assert main(["--mode", "analysis"] + argv) == 0
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]),
               XLA_FLAGS=os.environ["XLA_FLAGS"].replace("count=8", "count=4"))
    proc = subprocess.Popen([sys.executable, "-m", "cfp", "--mode", "profile"] + argv, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, below = time.monotonic() + 120, {}
    while time.monotonic() < deadline and proc.poll() is None:
        below = _descendants(proc.pid)
        if any("spawn_main" in c for c in below.values()):
            break
        time.sleep(0.1)
    assert any("spawn_main" in c for c in below.values()), "no worker started"
    time.sleep(0.5)
    below = _descendants(proc.pid)
    proc.send_signal(getattr(signal, sig))
    proc.wait(timeout=30)
    killed, ended_s = time.monotonic(), {}
    while len(ended_s) < len(below) and time.monotonic() - killed < 10:
        ended_s.update({p: time.monotonic() - killed for p in below
                        if p not in ended_s and not _running(p)})
        time.sleep(0.05)
    for p in set(below) - set(ended_s):
        os.kill(p, signal.SIGKILL)
    lingered = {below[p][:60]: round(ended_s.get(p, 10.0), 2) for p in below}
    assert all(s < 2 for s in lingered.values()), lingered


_BUSY_CHILD = """
import subprocess, sys
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE, text=True)
print(child.pid, child.stdout.readline().strip(), flush=True)
child.wait()
"""
_BUSY = ("import os, time\nfrom cfp.worker import _exit_with_parent\n{call}\n"
         "print('busy', flush=True)\ntime.sleep(30)")


@pytest.mark.parametrize("watched", [True, False])
def test_a_busy_worker_ends_within_a_second_of_its_parent(watched):
    """A worker busy for long (a compile, a timing) whose parent is killed ends within a
    second. Control: the same process without the watch runs on."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]))
    body = _BUSY.format(call="_exit_with_parent(os.getppid())" if watched else "")
    parent = subprocess.Popen([sys.executable, "-c", _BUSY_CHILD, body], env=env,
                              stdout=subprocess.PIPE, text=True)
    pid, state = parent.stdout.readline().split()
    assert state == "busy"
    parent.kill()
    parent.wait()
    killed = time.monotonic()
    while _running(int(pid)) and time.monotonic() - killed < 2:
        time.sleep(0.05)
    try:
        assert _running(int(pid)) != watched
        assert not watched or time.monotonic() - killed < 1
    finally:
        if _running(int(pid)):
            os.kill(int(pid), signal.SIGKILL)


def test_a_worker_killed_timing_a_resharding_charges_it_and_goes_on():
    """A resharding whose timing kills the worker is charged as one that cannot run (None)
    and the rest of its batch is timed. Control: without the kill, every one is timed."""
    import os
    import signal
    from cfp.passes.analysis import run_analysis
    from cfp.passes.profile import needed_reshards
    from cfp.windows import boundaries, split_windows
    from cfp.worker import Worker, WorkerOptions

    class KillingWorker(Worker):
        """The real worker, killed (SIGKILL) as soon as it is asked to time the culprit."""

        culprit, asked = None, None

        def _ask(self, kind, payload):
            self.asked = payload if kind == "reshard" else None
            return super()._ask(kind, payload)

        def _recv(self):
            if self.asked is not None and self.culprit in self.asked:
                os.kill(self.proc.pid, signal.SIGKILL)
            return super()._recv()

    analysis = run_analysis(WorkloadSpec("mlp", "tiny").resolved(), (4,))
    windows, _ = split_windows(analysis, 32)
    items = sorted(needed_reshards(boundaries(analysis, windows), analysis.blocks.blocks,
                                   ("m0",)), key=repr)[:3]
    worker = KillingWorker(analysis, WorkerOptions("measure", 2**62, 16))
    try:
        assert all(worker.measure_reshards(items).values())  # the control
        worker.culprit = items[1]
        got = worker.measure_reshards(items)
    finally:
        worker.close()
    assert got[items[1]] is None and got[items[0]] and got[items[2]]


def test_a_refusal_by_the_worker_measuring_a_window_is_raised_as_it_is():
    """The worker's one-line refusal while it measures a window (a step that cannot be
    measured as analysed) reaches the caller as that ``CfpError``, not taken for a death
    whose combinations would be charged to it. Control: a bug in the worker is a
    ``WorkerBug``, which is no ``CfpError``."""
    from cfp.worker import Worker, WorkerBug, WorkerOptions

    class Replying(Worker):
        def __init__(self, reply):
            super().__init__(None, WorkerOptions("measure", 2**62, 16))
            self.reply = reply

        def ensure(self):
            self.conn = self

        def send(self, message):
            pass

        def _recv(self):
            return self.reply

    refusal = "the step cannot be measured as analysed"
    with pytest.raises(CfpError, match=f"^{refusal}$"):
        list(Replying(("error", refusal)).measure_window(None, [(0,)], None))
    with pytest.raises(WorkerBug, match="Traceback"):
        list(Replying(("bug", "Traceback (most recent call last)")).measure_window(
            None, [(0,)], None))


def test_under_nohup_a_sigint_stays_ignored(tmp_path, capsys, monkeypatch):
    """A run started with SIGINT ignored keeps it ignored: a SIGINT during a pass changes
    nothing. Control: the same pass under Python's handler stops with status 130
    (``test_a_ctrl_c_python_swallows_still_stops_the_run`` too)."""
    import signal
    import cfp.api
    ran = []

    def runner(opts, args):
        signal.raise_signal(signal.SIGINT)
        ran.append("to its end")
    monkeypatch.setitem(cfp.api._RUNNERS, "analysis", runner)
    argv = ["--mode", "analysis", "--model", "mlp", "--mesh", "4", "--workdir", str(tmp_path)]
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        assert main(argv) == 0 and ran == ["to its end"]
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        signal.signal(signal.SIGINT, signal.default_int_handler)  # the control
        assert main(argv) == 130 and ran == ["to its end"]
    finally:
        signal.signal(signal.SIGINT, before)


def test_a_ctrl_c_python_swallows_still_stops_the_run(tmp_path, capsys, monkeypatch,
                                                      python_sigint):
    """A Ctrl-C that lands in a ``__del__`` (or a garbage collector's callback, such as
    JAX's) is printed and ignored by Python; cfp remembers it and stops at the end of the
    pass: one line, status 130. Control: the pass did run to its end, the interrupt lost
    inside it."""
    import signal
    import cfp.api
    ran = []

    class Swallows:
        def __del__(self):
            signal.raise_signal(signal.SIGINT)

    def runner(opts, args):
        Swallows()
        ran.append("to its end")
    monkeypatch.setitem(cfp.api._RUNNERS, "analysis", runner)
    assert main(["--mode", "analysis", "--model", "mlp", "--mesh", "4",
                 "--workdir", str(tmp_path)]) == 130
    assert ran == ["to its end"]
    assert capsys.readouterr().err.strip().splitlines() == [  # Python's report not printed
        "cfp: interrupted; everything measured so far is kept in the work dir"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


def test_a_ctrl_c_in_the_garbage_collector_stops_the_run_at_once(tmp_path, capsys,
                                                                 monkeypatch, python_sigint):
    """A Ctrl-C that arrives while a collector callback runs (as JAX's does, on every
    collection) is held back and delivered once the collection ends: the pass stops there,
    not at its end. Control: the same pass without the Ctrl-C runs to its end."""
    import gc
    import signal
    import time
    import cfp.api
    ran, interrupting = [], []

    def interrupt(phase, info):
        if phase == "start":
            signal.raise_signal(signal.SIGINT)

    def runner(opts, args):
        if interrupting:
            gc.callbacks.insert(1, interrupt)  # inside cfp's watch of the collection
        try:
            gc.collect()
        finally:
            if interrupt in gc.callbacks:
                gc.callbacks.remove(interrupt)
        time.sleep(1)
        ran.append("past the collection")
    monkeypatch.setitem(cfp.api._RUNNERS, "analysis", runner)
    argv = ["--mode", "analysis", "--model", "mlp", "--mesh", "4", "--workdir", str(tmp_path)]
    assert main(argv) == 0 and ran == ["past the collection"]  # the control
    ran.clear()
    interrupting.append(True)
    assert main(argv) == 130 and ran == []
    assert capsys.readouterr().err.strip().splitlines() == [
        "cfp: interrupted; everything measured so far is kept in the work dir"]


@pytest.mark.slow
def test_the_readme_s_first_cluster_case_runs_every_pass_as_recorded(tmp_path, capsys):
    """LLaMA-2-13B on alpa-50x4 (scripts/cluster_cases.sh, the README's), whose arrays this
    host need not hold, is analysed, priced and searched as recorded in
    scripts/results/2026-11-27-cluster-cpu.txt: its search finds that no plan fits
    the 32 GB of a device, the verdict it had before these checks (its least memory, about
    72 GB at first, 47 GB now, moves as composed memory is refined)."""
    rc = main(["--model", "llama", "--config", "13b", "--dtype", "bfloat16", "--batch-size",
               "8", "--seq-len", "1024", "--cluster", "alpa-50x4", "--workdir", str(tmp_path)])
    out, err = capsys.readouterr()
    assert "priced for alpa-50x4 (analytic)" in out and "Search Pass (predicted" in out
    assert rc == 2 and "no plan fits the memory budget of 32.000 GiB per device; the smallest " \
                       "any plan reaches is about " in err, err


@pytest.mark.parametrize("where,users", [("installed", True), ("cfp", False),
                                         ("python", False)])
def test_who_raised_is_told_by_the_innermost_frame_not_jax_s_or_python_s(where, users):
    """An error raised in a package installed beside Python (a user's own, or one it calls,
    such as Hugging Face's) is the user's, though site-packages lies inside Python's library
    directory; one raised in cfp is cfp's (the control); Python's own frames are looked
    through, to cfp's below them."""
    import os
    import sysconfig
    import cfp
    from cfp.tracing import _raised_outside_cfp
    files = {"installed": os.path.join(sysconfig.get_paths()["purelib"], "mypkg", "model.py"),
             "cfp": os.path.join(os.path.dirname(cfp.__file__), "blocks.py"),
             "python": os.path.join(sysconfig.get_paths()["stdlib"], "functools.py")}
    code = compile("raise ValueError('5 heads do not divide 64')", files[where], "exec")

    def from_cfp():  # this test's own frame stands for cfp's code, the caller
        exec(code)
    from_cfp.__code__ = from_cfp.__code__.replace(co_filename=files["cfp"])
    with pytest.raises(ValueError) as e:
        from_cfp()
    assert _raised_outside_cfp(e.value) is users


def test_a_lock_cfp_did_not_write_is_refused(tmp_path, capsys):
    """A directory or a link in the lock's place is refused in one line (never removed)."""
    from cfp.workdir import LOCK_NAME
    (tmp_path / LOCK_NAME).mkdir()
    assert main(["--mode", "analysis", "--model", "mlp", "--mesh", "4",
                 "--workdir", str(tmp_path)]) == 2
    assert "is not a lock cfp wrote: delete it" in _one_line(capsys)
    assert (tmp_path / LOCK_NAME).is_dir()


def test_the_processes_of_one_run_share_its_lock(tmp_path, capsys):
    """Of a run over several processes, process 0 writes the work dir and holds its lock; the
    others neither take nor heed it (they share it). Control: process 0 heeds a lock held."""
    import socket
    import subprocess
    from cfp.workdir import LOCK_NAME, _holder_text
    holder = subprocess.Popen(["sleep", "60"])
    try:
        (tmp_path / LOCK_NAME).write_text(_holder_text(socket.gethostname(), holder.pid))
        argv = ["--mode", "analysis", "--model", "mlp", "--workdir", str(tmp_path),
                "--num-processes", "2", "--coordinator", "127.0.0.1:1"]
        assert main(argv + ["--process-id", "1"]) == 0, capsys.readouterr().err
        assert main(argv + ["--process-id", "0"]) == 2
        assert f"in use by process {holder.pid}" in _one_line(capsys)
        assert (tmp_path / LOCK_NAME).read_text().split()[1] == str(holder.pid)
    finally:
        holder.kill()
        holder.wait()


def _plan_json() -> dict:
    """A plan.json of the shape cfp writes: a 4-device mesh, one weight and its Adam state."""
    return {"format": "cfp-plan", "version": 3, "mesh": {"shape": [4], "axes": ["m0"]},
            "source": "predicted",
            "step": {"fingerprint": "0123456789abcdef", "kind": "train",
                     "loss_takes_key": False},
            "params": {"['w']": ["m0", None]}, "opt_state": {"[0].mu['w']": ["m0", None]},
            "batch": {"['x']": [None, ["m0"]]},
            "outputs": {"params": {"['w']": ["m0", None]},
                        "opt_state": {"[0].mu['w']": ["m0", None]}},
            "blocks": [{"block": 0, "strategy_index": 1, "strategy": "S0", "seed": "dot"}],
            "constraints": {"3": [[["m0", None], None], [[None]]]},
            "description": ["every segment: m0 splits the batch"]}


@pytest.mark.parametrize("change,expected", [
    ({"mesh": {"shape": [-8], "axes": ["m0"]}}, "mesh shape [-8] is not a list of positive"),
    ({"mesh": {"shape": [4], "axes": ["m0", "m1"]}}, "mesh axes ['m0', 'm1'] are not one"),
    ({"mesh": {"shape": [4], "axes": ["m0"], "devices": [0, 1, 1, 2]}}, "4 distinct device ids"),
    ({"params": {"['w']": 5}}, "its params is not an object of leaf paths and specs"),
    ({"params": {"['w']": ["model", None]}}, "its params is not an object of leaf paths"),
    ({"blocks": "x"}, "its blocks are not a list of block, strategy_index and strategy"),
    ({"constraints": {"op": [[], []]}}, "its constraints are not an object of operator index"),
    ({"step": {"fingerprint": 7}}, "its step is not a fingerprint"),
    ({"outputs": None}, "its outputs are not an object"),
], ids=lambda v: str(v)[:40])
def test_a_plan_file_is_checked_field_by_field(tmp_path, change, expected):
    """Each field of plan.json of the wrong type or shape is one ``CfpError`` naming it, from
    ``Plan.load``, before the plan is used. Control: the plan as cfp writes it loads, and its
    mesh is the 4 devices it names."""
    import json
    import cfp
    path = tmp_path / "plan.json"
    path.write_text(json.dumps({**_plan_json(), **change}))
    with pytest.raises(CfpError, match="is not a plan cfp wrote") as e:
        cfp.Plan.load(path)
    assert expected in str(e.value) and "\n" not in str(e.value)
    path.write_text(json.dumps(_plan_json()))
    assert dict(cfp.Plan.load(path).mesh.shape) == {"m0": 4}


def test_a_tiny_profile_budget_goes_on_run_by_run_and_says_what_it_resumed(tmp_path, capsys):
    """Under a budget spent before the first measurement, a run still measures one batch and
    says how long the rest would take; the next run resumes from it and says so. Control: the
    first run resumed nothing."""
    argv = ["--mode", "profile", "--model", "mlp", "--mesh", "4", "--memory-budget", "1",
            "--profile-budget", "1e-9", "--workdir", str(tmp_path)]
    assert main(["--mode", "analysis"] + argv[2:]) == 0
    assert main(argv) == 0
    first = capsys.readouterr().out
    assert "s more at this run's pace: raise --profile-budget" in first
    assert "resumed" not in first and "compiled in this run: 0" not in first
    assert main(argv) == 0
    second = capsys.readouterr().out
    assert "resumed from the work dir" in second and "compiled in this run: 0" not in second


def test_a_refused_run_creates_no_work_dir(tmp_path, capsys):
    """``--mode search`` (or profile) on a work dir that does not exist is refused and leaves
    none behind. Control: ``--mode analysis`` creates it."""
    for mode in ("search", "profile"):
        assert main(["--mode", mode, "--model", "mlp", "--mesh", "4", "--memory-budget", "1",
                     "--workdir", str(tmp_path / "w")]) == 2
        assert "no work dir" in _one_line(capsys)
        assert not (tmp_path / "w").exists()
    assert main(["--mode", "analysis", "--model", "mlp", "--mesh", "4",
                 "--workdir", str(tmp_path / "w")]) == 0
    assert (tmp_path / "w" / "analysis.pkl").exists()


def test_a_long_analysis_says_which_stage_it_is_in(capsys):
    """The analysis names each stage as it starts, and while a stage runs long a line says
    which it is. Control: a stage shorter than the interval prints nothing."""
    import time
    from cfp import report
    from cfp.passes.analysis import run_analysis
    stages = []
    run_analysis(WorkloadSpec("mlp", "tiny", None, "float32", ()).resolved(), (4,),
                 on_stage=stages.append)
    assert [s.split()[0] for s in stages] == ["tracing", "grouping", "finding"]
    with report.ticking("analysis", every_s=0.05) as on_stage:
        on_stage("grouping 7 operators into ParallelBlocks")
        time.sleep(0.3)
    assert "analysis: grouping 7 operators into ParallelBlocks (0 s so far)" in capsys.readouterr().out
    with report.ticking("analysis", every_s=10):
        time.sleep(0.1)
    assert capsys.readouterr().out == ""
