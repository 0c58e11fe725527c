"""Two processes of four virtual devices each, run as two hosts would run them: the passes
match one process of eight devices; a process killed mid-profile stops the other in one line,
and a relaunch (through ``cfp.autoshard``) resumes and hands every process the plan."""
import os
import pickle
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cfp.cost_model import CostModel
from cfp.passes.analysis import run_analysis
from cfp.passes.profile import ProfileOptions, run_profile
from cfp.workloads import WorkloadSpec

FLAGS = ["--model", "mlp", "--num-layers", "2", "--max-combinations", "4",
         "--memory-budget", "1", "--workdir", "wd", "--compilation-cache", "none",
         "--join-timeout", "10", "--num-processes", "2"]
SPEC = WorkloadSpec("mlp", "tiny", None, "float32", (("num_layers", 2),)).resolved()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(dirs, port, *extra):
    """One ``python -m cfp`` per process, each in its own directory (its own session, so
    that it can be killed with its worker)."""
    return [subprocess.Popen(
        [sys.executable, "-m", "cfp", *FLAGS, "--coordinator", f"127.0.0.1:{port}",
         "--process-id", str(i), *extra], cwd=d, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True) for i, d in enumerate(dirs)]


# The same job through the Python API in each process: every process gets process 0's plan.
API = """import sys
import cfp
plan = cfp.autoshard("mlp", num_layers=2, max_combinations=4, memory_budget_gb=1, workdir="wd",
                     compilation_cache=None, join_timeout=10, num_processes=2,
                     coordinator=sys.argv[1], process_id=int(sys.argv[2]), validate_top=2,
                     validate_baselines=False, verbose=True)
print("plan:", plan.data["source"], plan.data["blocks"])
"""


def _launch_api(dirs, port):
    return [subprocess.Popen(
        [sys.executable, "-c", API, f"127.0.0.1:{port}", str(i)], cwd=d,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        for i, d in enumerate(dirs)]


def _finish(procs, timeout_s=240):
    outs = [p.communicate(timeout=timeout_s) for p in procs]
    return [(p.returncode, *out) for p, out in zip(procs, outs)]


def _measured(workdir: Path) -> int:
    return sum(len(_record(f).results) for f in workdir.glob("window_*.pkl"))


def _record(path: Path):
    with open(path, "rb") as f:
        pickle.load(f)  # the header
        return pickle.load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The whole job, whose process 1 is killed after two profile results; then the whole
    job again, which resumes the profile and searches."""
    root = tmp_path_factory.mktemp("multihost")
    dirs = [root / "p0", root / "p1"]
    for d in dirs:
        d.mkdir()
    port = _free_port()
    procs = _launch(dirs, port)
    window = dirs[0] / "wd" / "window_0.pkl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and procs[0].poll() is None:
        if window.exists() and len(_record(window).results) >= 2:
            break
        time.sleep(0.1)
    os.killpg(procs[1].pid, signal.SIGKILL)
    killed_at = time.monotonic()
    survivor = procs[0].wait(timeout=120)
    stop_s = time.monotonic() - killed_at
    survivor_err = procs[0].stderr.read()
    procs[1].wait()
    known = _measured(dirs[0] / "wd")
    # two candidates, each timed for 0.1 s: the processes agree on the steps and the rounds
    whole = _finish(_launch_api(dirs, port + 20))
    return {"dirs": dirs, "survivor": (survivor, survivor_err, stop_s),
            "known": known, "whole": whole}


def test_killed_process_stops_the_other_and_a_relaunch_resumes(runs):
    code, err, stop_s = runs["survivor"]
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and stop_s < 60, (code, stop_s, err)
    assert len(lines) == 1 and "relaunch every process to resume" in lines[0], err
    measured = _measured(runs["dirs"][0] / "wd")  # once the whole job ran again
    assert 2 <= runs["known"] < measured <= _combinations()  # the kill came mid-profile
    (code0, out0, err0), (code1, out1, _) = runs["whole"]
    assert code0 == 0 and code1 == 0, err0
    assert f"({runs['known']} measured before)" in out0
    assert f"compiled in this run: {measured - runs['known']}" in out0
    # process 1 reports nothing, and its plan is process 0's, which only process 0 wrote
    plan_line = out0.splitlines()[-1]
    assert plan_line.startswith("plan: ") and out1 == plan_line + "\n", (out0, out1)


def _combinations() -> int:
    """How many combinations the profile of ``FLAGS`` can measure."""
    import math
    from cfp.windows import split_windows, window_space
    a = run_analysis(SPEC, (8,))
    windows, reps = split_windows(a, 4)
    return sum(math.prod(window_space(a, windows[k])) for k in reps)


def test_two_processes_match_one(runs):
    p0, p1 = runs["dirs"]
    assert list(p1.iterdir()) == []  # process 1 writes nothing
    # compiled alone: the same programs, their hashes and statuses, without timing them
    one = run_profile(run_analysis(SPEC, (8,)), ProfileOptions(
        cost="model", cost_model=CostModel((1e-5,), (1e-9,), 1e11, 1e10), max_combinations=4,
        memory_budget_bytes=2**30, exhaustive=True))
    two = _record(p0 / "wd" / "profile.pkl")
    # the control: the compared hashes tell a window's block combinations apart (a split
    # state layout may compile to its plain twin's program, where it splits nothing more)
    plain = [[m for c, m in wp.results.items() if len(c) == len(wp.blocks) or c[-1] == 0]
             for wp in one.window_profiles.values()]
    assert all(len({m.program_sha1 for m in ms}) == len(ms) for ms in plain)
    for k, wp in one.window_profiles.items():  # what the two measured, the one compiled too
        got = {c: m for c, m in two.window_profiles[k].results.items()
               if m.status != "estimated"}
        assert got and set(two.window_profiles[k].results) == set(wp.results)
        for combo, m in got.items():
            assert (m.status, m.program_sha1) == (wp.results[combo].status,
                                                  wp.results[combo].program_sha1)
    search = _record(p0 / "wd" / "search.pkl")
    assert search.numerics["loss_rel_err"] < 1e-6 and search.numerics["grad_excess_over_tol"] == 0
    assert any(any(spec) for spec in search.in_specs)  # the kept plan splits something
