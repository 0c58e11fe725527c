"""Hostile input: a work dir's files never choose what runs, numbers are checked as numbers, and
every refusal is one line with status 2 before any work."""
import dataclasses

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
