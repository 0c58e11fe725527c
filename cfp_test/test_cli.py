import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest

from cfp.cli import main
from cfp.errors import CfpError
from cfp.records import read_record, write_record

REPO = Path(__file__).resolve().parents[1]


def _run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("argv,needle", [
    (["--model", "resnet"], "unknown model"),
    (["--config", "huge"], "unknown preset"),
    (["--mesh", "2x3", "--num-devices", "8"], "mesh 2x3 has 6 devices"),
    (["--mesh", "banana"], "not a mesh shape"),
    (["--num-heads", "5"], "does not divide"),
    (["--model", "moe", "--batch-size", "1", "--seq-len", "8"], "expert_group_size"),
    (["--batch-size", "0"], "positive"),
    (["--workdir", "/proc/cfp-cannot-write-here"], "cannot write to the work dir"),
    (["--num-processes", "2"], "need --coordinator"),
    (["--num-processes", "2", "--coordinator", "hostA"], "HOST:PORT"),
    (["--num-processes", "2", "--coordinator", "hostA:1234", "--process-id", "2"],
     "--process-id must be in 0..1"),
    (["--num-processes", "3", "--coordinator", "hostA:1234"], "do not split evenly"),
    (["--num-processes", "2", "--coordinator", "hostA:1234", "--cluster", "a100-8"],
     "run it in one process"),
    (["--mode", "stages", "--step", "forward"], "leave out --step forward"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    rc, out, err = _run(capsys, "--mode", "analysis", *argv)
    assert rc == 2
    assert needle in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_an_unwritable_work_dir_is_refused_before_meshes_are_ranked(capsys, monkeypatch,
                                                                     tmp_path):
    """``--mesh auto`` traces the step and solves every logical mesh before it knows the work
    dir's name; one the user named is checked first. Control: a writable one gets as far as
    the trace (stopped there)."""
    import cfp.tracing
    traced = []

    def trace_step(*args, **kwargs):
        traced.append(1)
        raise ZeroDivisionError
    monkeypatch.setattr(cfp.tracing, "trace_step", trace_step)
    argv = ["--mode", "analysis", "--model", "mlp", "--cluster", "a100-8", "--mesh", "auto"]
    rc, _, err = _run(capsys, *argv, "--workdir", "/proc/cfp-cannot-write-here")
    assert rc == 2 and "cannot write to the work dir" in err and traced == []
    with pytest.raises(ZeroDivisionError):
        main(argv + ["--workdir", str(tmp_path / "w")])
    assert traced == [1]


def test_argparse_errors_are_one_line_too(capsys):
    assert main(["--mode", "bogus"]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_analysis_writes_its_files(capsys, tmp_path):
    rc, out, err = _run(capsys, "--mode", "analysis", "--model", "gpt", "--mesh", "2x2",
                        "--workdir", str(tmp_path))
    assert rc == 0, err
    assert out.startswith("analysis: ") and len(out.splitlines()) == 2  # and "wrote ..."
    rc, out, err = _run(capsys, "--mode", "analysis", "--model", "gpt", "--mesh", "2x2",
                        "--workdir", str(tmp_path), "-v")
    assert "segment instance: blocks 0..7, type 0" in out
    assert "segment type 0: search space [" in out
    assert "  ParallelBlock 16: " in out
    dbg = tmp_path / "debug_analysis_global"
    strategy_map = (dbg / "strategy_map.txt").read_text()
    assert strategy_map.startswith("Instruction ") and "Strategy SSRR = " in strategy_map
    assert "Parallel Block 0:" in (dbg / "parallel_blocks.txt").read_text()
    assert "mapped to" in (dbg / "segments.txt").read_text()
    rec = read_record(tmp_path / "analysis.pkl", "cfp-analysis", None, hint="rerun")
    assert rec.mesh_shape == (2, 2) and len(rec.blocks.blocks) == 17


def test_user_step_through_the_cli(capsys, tmp_path):
    rc, out, err = _run(capsys, "--mode", "analysis", "--model", "zoo_extra:convnet",
                        "--mesh", "4", "--workdir", str(tmp_path))
    assert rc == 0, err
    assert "3 ParallelBlocks" in out


def test_fresh_process_default_run(tmp_path):
    """The README's first command, in a fresh process (virtual devices set before JAX)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-m", "cfp", "--mode", "analysis", "--workdir",
                           str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("analysis: ")


class _Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned > /dev/null",))


def test_crafted_pickle_is_refused(tmp_path):
    path = tmp_path / "analysis.pkl"
    with open(path, "wb") as f:
        pickle.dump(_Evil(), f)
    with pytest.raises(CfpError, match="not a readable cfp"):
        read_record(path, "cfp-analysis", None, hint="rerun the analysis")


def test_truncated_foreign_and_mismatched_files_are_refused(tmp_path):
    path = tmp_path / "x.pkl"
    write_record(path, "cfp-analysis", (("mesh", "4"),), {"blocks": [1, 2]})
    assert read_record(path, "cfp-analysis", (("mesh", "4"),), hint="h") == {"blocks": [1, 2]}
    with pytest.raises(CfpError, match="another run"):
        read_record(path, "cfp-analysis", (("mesh", "8"),), hint="h")
    with pytest.raises(CfpError, match="not cfp-profile"):
        read_record(path, "cfp-profile", None, hint="h")
    path.write_bytes(path.read_bytes()[:20])
    with pytest.raises(CfpError, match="not a readable"):
        read_record(path, "cfp-analysis", None, hint="h")
    with pytest.raises(CfpError, match="does not exist"):
        read_record(tmp_path / "nope.pkl", "cfp-analysis", None, hint="h")


def test_progress_counts_reshardings_while_they_are_timed(capsys):
    """While reshardings are timed, the progress line counts them, not the combinations
    already done (which read as finished, ETA 0 s, for the whole resharding phase)."""
    import time
    from cfp import report
    progress = report.ProfileProgress(interval_s=0.05)
    try:
        progress("start", total=3, num_types=1, known=0)
        progress("reshards", boundaries=4, needed=40, known=8)
        progress("reshards_timed", done=16)
        time.sleep(0.2)
    finally:
        progress.close()
    lines = capsys.readouterr().out.splitlines()
    assert any("[16/32 reshardings] timing reshardings" in x for x in lines), lines
    assert not any("[0/3" in x or "combinations] timing" in x for x in lines), lines


def test_progress_total_is_known_from_its_first_line_and_nothing_is_said_twice(capsys):
    """Off a terminal, a progress line is printed when the count or the window type moved
    (else one a minute). The profile search drives counts the most it can measure from its
    first line; the reshardings count on their own, and the rounds of search asking go on
    from the combinations' count, under the same total. Control: the count moved, a line is
    printed."""
    import re
    import time
    from cfp import report
    from cfp.measure import Measurement
    progress = report.ProfileProgress(interval_s=0.05)
    try:
        progress("start", total=10, num_types=1, known=0, at_most=True)
        time.sleep(0.25)  # several ticks with nothing new
        progress("result", k=0, combo=(0,), measurement=Measurement("ok", 1.0))
        time.sleep(0.1)
        progress("reshards", boundaries=2, needed=3, known=0)
        time.sleep(0.1)
        progress("round", round=1, count=2)
        time.sleep(0.1)
    finally:
        progress.close()
    lines = [x for x in capsys.readouterr().out.splitlines() if x.startswith("[")]
    counts = [re.match(r"\[(\d+)/(\d+) (\w+)\]", x).groups() for x in lines]
    assert counts == [("0", "10", "combinations"), ("1", "10", "combinations"),
                      ("0", "3", "reshardings"), ("1", "10", "combinations")], lines
    assert "round 1" in lines[-1]


@pytest.mark.slow  # the whole default job, about 100 s on 2 cores
def test_the_default_job_answers_in_at_most_15_lines(tmp_path):
    """``python -m cfp --memory-budget 2`` in a fresh process: at most 15 lines besides the
    progress lines, the answer among them, no line only benchmark drivers read, and no
    progress total above the first; the same job with -v (the control) prints its
    blocks, segments and candidates too, well over 15."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("XLA_FLAGS", None)
    argv = [sys.executable, "-m", "cfp", "--memory-budget", "2", "--workdir", str(tmp_path)]
    proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr
    lines = [x for x in proc.stdout.splitlines() if not x.startswith("[")]
    assert len(lines) <= 15, proc.stdout
    assert lines[0].startswith("analysis: ") and lines[-1].startswith("use it: plan = cfp.Plan")
    assert any(x.startswith("plan on mesh 8: ") for x in lines)
    assert not any(x.startswith(("searched ParallelBlock Strategies solution", "TFLOP_COUNT"))
                   for x in lines)
    totals = [int(x.split("/")[1].split()[0]) for x in proc.stdout.splitlines()
              if x.startswith("[") and "combinations]" in x]
    assert totals == sorted(totals, reverse=True), proc.stdout  # never grows
    verbose = subprocess.run(argv + ["--mode", "search", "-v"], cwd=REPO, env=env,
                             capture_output=True, text=True, timeout=900)
    assert verbose.returncode == 0 and len(verbose.stdout.splitlines()) > 15
    assert "candidate 0 (" in verbose.stdout


def test_the_usage_line_calls_the_planned_step_with_its_arguments(capsys, tmp_path):
    """The line printed after search calls a training plan's step with the optimizer state,
    a forward plan's without it (``step_shardings`` refuses three arguments there); a step on
    one state (a TrainState, NNX's model and optimizer) takes the shardings of its parts."""
    from cfp.report import usage_console
    usage_console(tmp_path, "train")
    usage_console(tmp_path, "forward")
    usage_console(tmp_path, "train", whole_state=True)
    train, forward, state = capsys.readouterr().out.splitlines()
    assert "step = plan.jit(train_step, params, opt_state, batch);" in train
    assert "step = plan.jit(forward, params, batch);" in forward
    assert "plan.shardings(params, opt_state, batch) of your state's parts" in state


def test_the_step_time_line_says_why_no_hand_plan_ran():
    """Where no hand plan is a plan of the step on the mesh (a Flax model of batch 4 and 4
    heads on mesh 8), the step-time line says so; where they are (gpt, the control), none
    having run means none fitted the budget."""
    from cfp.passes.analysis import run_analysis
    from cfp.report import against_hand_plans
    from cfp.workloads import WorkloadSpec
    none_split = run_analysis(WorkloadSpec("users_models:flax_train_state").resolved(), (8,))
    assert (against_hand_plans({}, none_split, 2**30)
            == "; no hand plan splits this step on this mesh")
    gpt = run_analysis(WorkloadSpec("gpt", "tiny").resolved(), (8,))
    assert against_hand_plans({}, gpt, 2**30) == "; no hand plan that fits was run"
    assert against_hand_plans({"dp": 0.002, "fsdp": 0.003}, gpt, None).startswith(
        "; best hand plan run: dp ")
