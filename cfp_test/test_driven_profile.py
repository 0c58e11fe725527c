"""The profile search drives (``passes/profile.py``, ``_search_driven``): what it measures and
why. Programs are compiled for the 8 CPU devices and priced by a fixed cost model
(``cost="model"``), as the measured profile times them: the rules, not the timings, are
under test."""
import dataclasses

import pytest

from cfp.cost_model import CostModel
from cfp.passes.analysis import run_analysis
from cfp.passes.profile import (MemoryCheckpoint, ProfileOptions, hand_combinations,
                                run_profile)
from cfp.problem import build_problem, top_plans
from cfp.workloads import WorkloadSpec

COST = CostModel((1e-5,), (1e-9,), 1e11, 1e10)


@pytest.fixture(scope="module")
def analysis():
    return run_analysis(WorkloadSpec("gpt", "tiny", None, "float32", ()).resolved(), (8,))


@pytest.fixture(scope="module")
def profiled(analysis):
    """The profile search drives, with no memory budget."""
    return run_profile(analysis, ProfileOptions(cost="model", cost_model=COST))


@pytest.fixture(scope="module")
def tight(analysis, profiled):
    """(budget, profile) under 0.6 of what the plan with no budget composes to: only plans
    keeping some state split fit."""
    problem, _ = build_problem(analysis, profiled, None)
    budget = int(top_plans(problem, 1, 10.0)[0].memory * 0.6)
    return budget, _profile(analysis, budget)


class _Kept(MemoryCheckpoint):
    """A checkpoint holding what ``rec`` measured (of each window type, those ``keep``
    takes), as a work dir would: a profile run from it measures only what it lacks."""

    def __init__(self, rec, keep=lambda k, combo: True):
        self.results = {k: {c: m for c, m in p.results.items()
                            if m.status != "estimated" and keep(k, c)}
                        for k, p in rec.window_profiles.items()}
        self.reshards = {key: (t, t, t) for key, t in rec.reshard_s.items()}

    def load_window(self, k):
        return dict(self.results.get(k, {}))

    def load_reshards(self):
        return dict(self.reshards)


def _profile(analysis, budget_bytes: int = 2**62, checkpoint=None, **options):
    return run_profile(analysis, ProfileOptions(cost="model", cost_model=COST,
                                                memory_budget_bytes=budget_bytes, **options),
                       checkpoint)


def _optimistic(rec):
    """``rec`` with every combination it did not measure taken at the low end of its price."""
    ok = lambda m: dataclasses.replace(m, status="ok") if m.status == "estimated" else m  # noqa
    return dataclasses.replace(rec, window_profiles={
        k: dataclasses.replace(p, results={c: ok(m) for c, m in p.results.items()})
        for k, p in rec.window_profiles.items()})


def _used(rec, analysis, budget_bytes=None) -> list:
    """(window type, combination) of each window of the top plan of ``rec``'s problem."""
    problem, combos = build_problem(analysis, rec, budget_bytes)
    sol = top_plans(problem, 1, 10.0)[0]
    return [(w.type, combos[g][c]) for g, (w, c) in enumerate(zip(rec.windows, sol.choices))]


def _status(rec, k, combo) -> str:
    return rec.window_profiles[k].results[combo].status


def test_a_combination_the_solver_picks_is_measured_before_its_plan_is_kept(analysis, tight,
                                                                            monkeypatch):
    """Under a budget that only plans keeping some state split fit, the profile measures
    part of the space, and the plan solved with every combination it did not measure at the
    least it may take uses measured combinations only: the plan kept from what was measured
    is that plan. Control: with no round of solving (every combination under ``plan``
    measured only), that plan uses combinations not measured."""
    from cfp.passes import profile
    budget, rec = tight
    statuses = [m.status for p in rec.window_profiles.values() for m in p.results.values()]
    assert 0 < statuses.count("ok") < len(statuses) and "estimated" in statuses
    used = _used(_optimistic(rec), analysis, budget)
    assert all(_status(rec, k, c) == "ok" for k, c in used)
    assert used == _used(rec, analysis, budget)
    monkeypatch.setattr(profile, "PLAN_ROUNDS", 0)
    monkeypatch.setattr(profile, "hand_combinations", lambda *a: [])
    n = {k: rec.windows[r].end - rec.windows[r].start for k, r in enumerate(rec.representatives)}
    plain = lambda k, c: len(c) == n[k] or c[-1] == 0  # noqa: E731
    seeded = _profile(analysis, budget, _Kept(rec, plain))
    assert any(_status(seeded, k, c) == "estimated"
               for k, c in _used(_optimistic(seeded), analysis, budget))


def test_an_unmeasured_combination_priced_below_the_plan_gets_measured(analysis, profiled,
                                                                       monkeypatch):
    """A combination the profile left unmeasured, its low end priced at nothing, is measured
    by a profile run so (and then what it measures decides). Control: the run as it is
    leaves it unmeasured."""
    from cfp.passes import profile
    rec = profiled
    k, combo = next((k, c) for k, p in rec.window_profiles.items()
                    for c, m in p.results.items() if m.status == "estimated")
    low_ends = profile._low_ends

    def cheaper(results, priced, parts, held):
        out = low_ends(results, priced, parts, held)
        if combo in out[k]:
            out[k][combo] = dataclasses.replace(out[k][combo], time_s=0.0)
        return out
    monkeypatch.setattr(profile, "_low_ends", cheaper)
    again = _profile(analysis, checkpoint=_Kept(rec))
    assert again.compiled >= 1
    assert _status(again, k, combo) == "ok" and _status(rec, k, combo) == "estimated"


def test_a_split_state_layout_is_measured_where_search_asks_for_it(analysis, profiled, tight,
                                                                   monkeypatch):
    """Under a memory budget only plans keeping some state split fit, with no hand plan's
    combination measured first: the profile measures split layouts as the solves ask, with
    no count fixed, and the plan kept splits state. Control: with no budget it measures
    fewer."""
    from cfp.passes import profile
    monkeypatch.setattr(profile, "hand_combinations", lambda *a: [])
    budget, reps = tight[0], enumerate(profiled.representatives)
    n = {k: profiled.windows[r].end - profiled.windows[r].start for k, r in reps}
    split = lambda rec: {(k, c) for k, p in rec.window_profiles.items()  # noqa: E731
                         for c, m in p.results.items()
                         if len(c) > n[k] and c[-1] != 0 and m.status != "estimated"}
    plain = lambda: _Kept(profiled, lambda k, c: len(c) == n[k] or c[-1] == 0)  # noqa: E731
    rec = _profile(analysis, budget, plain())  # what profiled measured under plan is known
    assert any(len(c) > n[k] and c[-1] != 0 for k, c in _used(rec, analysis, budget))
    assert len(split(rec)) > len(split(_profile(analysis, checkpoint=plain())))


def test_search_under_another_budget_measures_what_its_plans_use(tmp_path, capsys,
                                                                 mlp_profiled):
    """The profile chose what to measure with no memory budget; ``--mode search`` under
    1 GiB first resumes it under that budget (the console says so, the profile records it)
    and searches from what it measured. Control: searched again under 1 GiB it resumes
    nothing, and under the budget of a profile measured whole (``--profile-all``) neither."""
    import shutil
    from cfp.cli import main
    from cfp.records import read_record
    from cfp.workdir import PROFILE_FORMAT
    from helpers import MLP_PROFILED
    wd = tmp_path / "wd"
    shutil.copytree(mlp_profiled, wd)
    args = MLP_PROFILED + ["--workdir", str(wd), "--mode", "search", "--memory-budget", "1",
                           "--validate-top", "1", "--iters", "1"]
    read = lambda: read_record(wd / "profile.pkl", PROFILE_FORMAT, None, hint="")  # noqa
    assert read().driven_budget_bytes == 2**62
    assert main(args) == 0
    assert "measuring what plans under 1 GiB use" in capsys.readouterr().out
    assert read().driven_budget_bytes == 2**30
    assert main(args) == 0
    assert "measuring what plans" not in capsys.readouterr().out
    assert not dataclasses.replace(read(), driven_budget_bytes=None).asks_under(2**29)


def test_a_tensor_moved_between_a_windows_blocks_is_priced(analysis, monkeypatch):
    """A window whose blocks want a tensor in another layout than the block before makes it
    is priced with the collectives that move it, as its compiled program holds them. Control:
    under the dp plan (every block splits the batch) nothing moves inside a window."""
    import itertools
    from cfp import analytic
    from cfp.baselines import baseline_strategy_indices
    from cfp.mesh import AXIS_NAMES
    from cfp.windows import split_windows
    names = AXIS_NAMES[:1]
    dp = baseline_strategy_indices(analysis)["dp"]
    windows, _ = split_windows(analysis, 32, False)
    moved = 0
    for w in windows:
        blocks = analysis.blocks.blocks[w.start:w.end]
        assert analytic._resharded_inside(analysis, w, [b.strategies[dp[b.index]]
                                                        for b in blocks], names) == []
        for combo in itertools.product(*(range(len(b.strategies)) for b in blocks)):
            inside = analytic._resharded_inside(
                analysis, w, [b.strategies[i] for b, i in zip(blocks, combo)], names)
            if not inside:
                continue
            moved += 1
            priced = analytic.window_measurement(analysis, w, combo, COST, names)
            assert set(inside) <= set(priced.collectives)
            with monkeypatch.context() as m:
                m.setattr(analytic, "_resharded_inside", lambda *a: [])
                assert analytic.window_measurement(analysis, w, combo, COST, names
                                                   ).time_s < priced.time_s
    assert moved > 0
