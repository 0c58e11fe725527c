"""Honest failures: bad input refused before any compile, cfp bugs surface as bugs, worker deaths
charged to their own combination, Ctrl-C loses nothing, budget-cut work is measured later."""
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest

from cfp.cli import main
from cfp.errors import CfpError
from cfp.passes.analysis import run_analysis
from cfp.passes.profile import ProfileOptions, run_profile
from cfp.windows import split_windows
from cfp.workdir import WorkDir
from cfp.worker import Worker, WorkerBug, WorkerOptions
from cfp.workloads import WorkloadSpec, run_fingerprint
from helpers import MLP_PROFILED

ROOT = Path(__file__).resolve().parent.parent
MLP = WorkloadSpec("mlp", "tiny", None, "float32", ()).resolved()


BAD_INPUTS = [
    (["--num-devices", "0"], "--num-devices must be positive"),
    (["--batch-size", "0"], "--batch-size must be positive"),
    (["--num-layers", "-1"], "--num-layers must be positive"),
    (["--max-combinations", "0"], "--max-combinations must be positive"),
    (["--memory-budget", "-2"], "--memory-budget must be positive"),
    (["--profile-budget", "0"], "--profile-budget must be positive"),
    (["--iters", "0"], "--iters must be positive"),
    (["--mesh", "3x3"], "needs 9 devices but JAX sees 8"),
    (["--mesh", "2x4", "--num-devices", "4"], "has 8 devices but 4 are used"),
    (["--mesh", "2xx"], "is not a mesh shape"),
    (["--model", "nosuch"], "unknown model"),
    (["--config", "huge"], "unknown preset"),
    (["--num-heads", "3"], "num_heads"),
    (["--mode", "search"], "give --memory-budget"),
    (["--model", "nosuch.module:make"], "cannot load the user step"),
]


@pytest.mark.parametrize("argv,expected", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_before_any_compile(tmp_path, capsys, compiles, argv, expected):
    assert main(argv + ["--workdir", str(tmp_path / "w")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cfp: error:") and expected in err[0], err
    assert compiles == []
    assert not (tmp_path / "w" / "analysis.pkl").exists()


def test_a_mesh_that_splits_nothing_is_refused_by_analysis(compiles):
    with pytest.raises(CfpError, match="every block would stay replicated"):
        run_analysis(MLP, (3, 3))
    run_analysis(MLP, (4,))  # the control: a mesh that divides the sizes is analysed
    assert compiles == []
    jax.jit(lambda x: x * 3 + 1)(2.0)  # and the listener does see a compile
    assert compiles


def test_a_bug_in_the_worker_surfaces_with_its_traceback():
    """A cost model missing where one is needed fails inside the worker's pricing code: that
    is cfp's bug, not a combination XLA cannot compile."""
    analysis = run_analysis(MLP, (4,))
    with pytest.raises(WorkerBug, match="(?s)Traceback.*AttributeError"):
        run_profile(analysis, ProfileOptions(cost="model", cost_model=None))


class _KillingWorker(Worker):
    """The real worker, killed (SIGKILL) whenever the planted combination is in flight."""

    culprit = None

    def _recv(self):
        msg = super()._recv()
        if msg[0] in ("compiling", "timing"):
            if self.culprit in msg[1]:
                os.kill(self.proc.pid, signal.SIGKILL)
        return msg


def test_a_worker_death_is_charged_to_its_own_combination():
    analysis = run_analysis(MLP, (4,))
    windows, reps = split_windows(analysis, 32)
    window = windows[reps[0]]
    combos = [(0,), (1,), (2,)]
    worker = _KillingWorker(analysis, WorkerOptions("measure", 2**62, 16))
    worker.culprit = (1,)
    try:
        got = dict(worker.measure_window(window, combos, None))
    finally:
        worker.close()
    assert got[(1,)].status == "worker_died"
    assert got[(0,)].status == "ok" and got[(2,)].status == "ok"


def test_ctrl_c_prints_one_line_and_a_rerun_repeats_nothing(tmp_path, python_sigint,
                                                            mlp_profiled):
    workdir = tmp_path / "w"
    base = [sys.executable, "-m", "cfp", *MLP_PROFILED, "--workdir", str(workdir),
            "--compilation-cache", "none"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    workdir.mkdir()
    shutil.copy(mlp_profiled / "analysis.pkl", workdir)  # analysed, not yet profiled
    proc = subprocess.Popen(base + ["--mode", "profile"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    deadline = time.time() + 120
    while not (workdir / "window_1.pkl").exists() and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGINT)  # as a terminal sends it: to the whole group
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130
    assert err.strip().splitlines() == [
        "cfp: interrupted; everything measured so far is kept in the work dir"]
    saved = _saved_results(workdir)
    assert saved, "nothing was measured before the interrupt"
    # The rerun, with a budget too small to measure more than one batch, keeps every saved
    # result and says it resumed them.
    out = subprocess.run(base + ["--mode", "profile", "--profile-budget", "1e-9"],
                         capture_output=True, text=True, env=env).stdout
    assert re.search(r"compiled in this run: \d+, \d+ resumed from the work dir", out), out
    after = _saved_results(workdir)
    assert {k: v for k, v in after.items() if k in saved} == saved


def _saved_results(workdir) -> dict:
    from cfp.records import read_record
    from cfp.workdir import WINDOW_FORMAT
    out = {}
    for path in sorted(Path(workdir).glob("window_*.pkl")):
        rec = read_record(path, WINDOW_FORMAT, None, hint="")
        out.update({(path.name, c): (m.status, m.time_s) for c, m in rec.results.items()
                    if m.status != "not_measured"})
    return out


@pytest.mark.slow
def test_a_budget_cut_profile_is_finished_by_the_next_run(tmp_path):
    """A profile whose budget is spent from its start measures one batch (the next run goes
    on from there) and leaves the rest not measured; the next run measures what it left and
    nothing twice."""
    analysis = run_analysis(MLP, (4,))
    wd = WorkDir(tmp_path, run_fingerprint(MLP, (4,)))
    checkpoint = wd.profile_checkpoint(analysis, "measure", 32)
    cut = run_profile(analysis, ProfileOptions(budget_s=1e-9), checkpoint)

    def measured(rec):
        return {(k, c) for k, p in rec.window_profiles.items() for c, m in p.results.items()
                if m.status not in ("estimated", "not_measured")}
    statuses = {m.status for p in cut.window_profiles.values() for m in p.results.values()}
    assert "not_measured" in statuses
    assert 0 < cut.compiled == len(measured(cut)) <= ProfileOptions().batch
    full = run_profile(analysis, ProfileOptions(), checkpoint)
    assert measured(cut) < measured(full)
    assert full.compiled == len(measured(full)) - len(measured(cut))  # nothing twice
    assert not any(m.status == "not_measured" for p in full.window_profiles.values()
                   for m in p.results.values())
    assert len(full.reshard_s) > 0


def test_batches_timed_at_other_speeds_land_on_one_scale():
    """Each batch is timed in its own stretch of time; the speed anchor timed in its rounds
    puts it on the profile's one scale. A window type timed while the machine ran 1.3x slower
    (its combinations and the anchor alike) reads as fast as the others once rescaled; the
    same slow stretch without an anchor time (the control) keeps its 1.3x."""
    import dataclasses
    from cfp.measure import Measurement
    from cfp.passes.profile import WindowProfile, on_one_scale

    def profile(k, times_s, anchor_s):
        return WindowProfile(k, (k,), (len(times_s),), {
            (i,): Measurement("ok", t, 0.9 * t, 1.1 * t, 10, anchor_s=anchor_s)
            for i, t in enumerate(times_s)})
    fast = {0: profile(0, [0.050, 0.060], 0.010), 1: profile(1, [0.040], 0.010),
            2: profile(2, [0.030], 0.010)}
    slow = {**fast, 1: profile(1, [0.040 * 1.3], 0.010 * 1.3)}
    scaled, scale_s = on_one_scale(slow)
    assert scale_s == pytest.approx(0.010)
    assert scaled[1].results[(0,)].time_s == pytest.approx(0.040)
    assert scaled[1].results[(0,)].time_max_s == pytest.approx(1.1 * 0.040)
    assert scaled[0].results[(1,)].time_s == pytest.approx(0.060)  # already on the scale
    unanchored = {**slow, 1: dataclasses.replace(slow[1], results={
        c: dataclasses.replace(m, anchor_s=float("nan")) for c, m in slow[1].results.items()})}
    assert on_one_scale(unanchored)[0][1].results[(0,)].time_s == pytest.approx(0.040 * 1.3)


def test_a_window_type_is_timed_in_batches_of_even_size():
    from cfp.passes.profile import even_batches
    sizes = lambda n, most: [len(b) for _, b in even_batches(list(range(n)), most)]  # noqa
    assert sizes(34, 16) == [12, 12, 10]  # not 16, 16 and a last 2 timed nearly alone
    assert sizes(32, 16) == [16, 16] and sizes(5, 16) == [5] and sizes(0, 16) == []
    assert [i for i, _ in even_batches(list(range(34)), 16)] == [0, 12, 24]


@pytest.mark.slow
def test_timings_taken_on_a_busy_machine_are_told(capsys):
    """Every timed combination carries the share of the cores other processes took while it
    was timed; one over ``BUSY_SHARE`` is reported as timed on a busy machine, naming its
    window type (the same record under the threshold reports nothing)."""
    import dataclasses
    import math
    from cfp import report
    from cfp.timing import BUSY_SHARE
    rec = run_profile(run_analysis(MLP, (4,)), ProfileOptions())
    timed = [m for p in rec.window_profiles.values() for m in p.results.values()
             if m.status != "estimated"]  # priced, not timed: no share
    shares = [m.others_cpu_share for m in timed]
    assert shares and all(math.isfinite(x) and 0 <= x <= 1 for x in shares), shares
    assert all(0 <= m.stolen_cpu_share <= 1 for m in timed)
    # every batch timed the speed anchor too, and the record's scale is its median
    anchors = [m.anchor_s for p in rec.window_profiles.values() for m in p.results.values()
               if m.status == "ok" and not m.same_program_as]
    assert anchors and all(a > 0 for a in anchors) and rec.anchor_s > 0

    def with_share(share_of, stolen_of=lambda k, c: 0.0):
        profiles = {k: dataclasses.replace(p, results={
            c: dataclasses.replace(m, others_cpu_share=share_of(k, c),
                                   stolen_cpu_share=stolen_of(k, c))
            for c, m in p.results.items()}) for k, p in rec.window_profiles.items()}
        return dataclasses.replace(rec, window_profiles=profiles)

    last = max(rec.window_profiles)
    busy = with_share(lambda k, c: 0.5 if k == last and c == (0,) * len(c) else 0.0)
    stolen = with_share(lambda k, c: 0.0, lambda k, c: 0.3 if k == last else 0.0)
    idle = with_share(lambda k, c: BUSY_SHARE, lambda k, c: BUSY_SHARE)
    assert busy.busy_window_types() == {last: 1} and idle.busy_window_types() == {}
    assert stolen.busy_window_types() == {last: len(rec.window_profiles[last].results)}
    report.profile_console(busy, 1.0)
    warned = [x for x in capsys.readouterr().out.splitlines() if "busy" in x]
    assert len(warned) == 1 and f"window types {last} were timed" in warned[0], warned
    report.profile_console(idle, 1.0)
    assert "busy" not in capsys.readouterr().out


def test_timing_processes_keep_their_heap_blocks(monkeypatch):
    """The measurement worker starts under the pooled allocator settings whatever its parent
    runs under, and ``python -m cfp``'s process re-executes itself under them. Negative
    control: this test process started without them, and the parent's environment is left as
    it was."""
    from cfp import host_memory
    for k in host_memory.POOLED:
        monkeypatch.delenv(k, raising=False)
    assert not host_memory.pooled()
    worker = Worker(run_analysis(MLP, (4,)), WorkerOptions("measure", 2**62, 16))
    try:
        assert worker.call(host_memory.pooled)
    finally:
        worker.close()
    assert not host_memory.pooled()
    code = ("from cfp.host_memory import run_pooled, pooled; print(pooled()); run_pooled(); "
            "print(pooled())")
    env = {k: v for k, v in os.environ.items() if k not in host_memory.POOLED}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         check=True).stdout.split()
    assert out == ["False", "True", "True"]  # before the re-execution, then twice after it


def test_identical_programs_are_measured_once():
    """A combination that compiles to a program measured before shares that measurement (here
    the same combination sent twice); different programs are measured apart."""
    analysis = run_analysis(MLP, (4,))
    windows, reps = split_windows(analysis, 32)
    worker = Worker(analysis, WorkerOptions("measure", 2**62, 16))
    try:
        got = list(worker.measure_window(windows[reps[0]], [(0,), (1,), (0,)], None))
    finally:
        worker.close()
    (c0, m0), (c1, m1), (c2, m2) = got
    assert m0.same_program_as is None and m1.same_program_as is None
    assert c2 == (0,) and m2.same_program_as == (0,) and m2.time_s == m0.time_s
