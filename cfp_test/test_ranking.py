"""Whole segments measured in part: the ranking that chooses which combinations run."""
import itertools
import random

import numpy as np

from cfp import ranking
from cfp.cost_model import CostModel
from cfp.passes.analysis import run_analysis
from cfp.passes.profile import ProfileOptions, run_profile
from cfp.problem import baseline_candidates, build_problem
from cfp.workloads import WorkloadSpec

COST = CostModel((1e-5, 1e-5), (1e-9, 1e-9), 1e11, 1e10)


def _brute_force(prices, edges):
    out = []
    for combo in itertools.product(*[range(len(p)) for p in prices]):
        cost = sum(p[s] for p, s in zip(prices, combo))
        cost += sum(t[combo[i], combo[j]] for (i, j), t in edges.items())
        out.append((cost, combo))
    return sorted(out)


def test_k_cheapest_is_exact():
    """Against every combination priced: the same k cheapest, in order, with edges between
    blocks that are not neighbours too. Control: the same search without the edges picks
    other combinations, so the edges are what the comparison tests."""
    rng = random.Random(0)
    prices = [[rng.uniform(1, 10) for _ in range(rng.randint(2, 4))] for _ in range(5)]
    edges = {(i, j): np.array([[rng.uniform(0, 8) for _ in prices[j]] for _ in prices[i]])
             for i, j in [(0, 1), (1, 2), (2, 3), (3, 4), (0, 3), (1, 4)]}
    want = _brute_force(prices, edges)[:20]
    got = ranking.k_cheapest(prices, edges, 20)
    assert [c for _, c in got] == [c for _, c in want]
    assert np.allclose([p for p, _ in got], [p for p, _ in want])
    blind = ranking.k_cheapest(prices, {}, 20)
    assert [c for _, c in blind] != [c for _, c in want]


def test_a_whole_segment_profile_measures_the_ranked_and_the_baselines():
    """gpt on 2x2 with whole segments and 8 combinations per window: a layer's window spans
    far more than 8, so 8 ranked combinations plus the baselines' are priced; search then
    finds every baseline that the split profile finds a plan of. Control: without the
    baselines' combinations added, some baseline is no longer a plan of the problem."""
    spec = WorkloadSpec("gpt", "tiny", None, "float32", ()).resolved()
    analysis = run_analysis(spec, (2, 2))
    options = ProfileOptions(cost="analytic", cost_model=COST, max_combinations=8,
                             whole_segments=True)
    whole = run_profile(analysis, options)
    layer = max(whole.window_profiles.values(), key=lambda p: np.prod(p.space))
    assert np.prod(layer.space) > 1000
    blocks = len(layer.blocks)
    measured = {c[:blocks] for c in layer.results}  # each under every state layout (analytic)
    assert 8 < len(measured) < 8 + 10
    problem, _ = build_problem(analysis, whole, None)
    split = run_profile(analysis, ProfileOptions(cost="analytic", cost_model=COST))
    split_problem, _ = build_problem(analysis, split, None)
    names = lambda problem: {n for n, _ in baseline_candidates(analysis, problem, ())}  # noqa
    assert names(problem) == names(split_problem) and len(names(problem)) >= 2
    # The control: the same profile keeping only the ranked 8.
    for p in whole.window_profiles.values():
        if len(p.results) > 8:
            ranked = set(ranking.ranked_combinations(
                analysis, whole.windows[whole.representatives[p.window_type]], 8, COST,
                ("m0", "m1")))
            for c in list(p.results):
                if c[:len(p.blocks)] not in ranked:
                    del p.results[c]
    assert names(build_problem(analysis, whole, None)[0]) < names(problem)


def test_a_resumed_profile_measures_what_the_first_run_chose(tmp_path):
    """The cost model that ranks a whole segment's combinations is fitted on the mesh, so it
    differs from run to run: the first run's choice is kept in the checkpoint, and a resumed
    run whose fit comes out different still chooses the same combinations. Control: the same
    different fit with nothing kept chooses other combinations."""
    from cfp.passes import profile as profile_pass
    from cfp.windows import split_windows
    from cfp.workdir import ProfileCheckpoint
    spec = WorkloadSpec("gpt", "tiny", None, "float32", ()).resolved()
    analysis = run_analysis(spec, (2, 2))
    windows, reps = split_windows(analysis, 8, whole_segments=True)
    options = ProfileOptions(max_combinations=8, whole_segments=True)

    class Worker:  # the calls _chosen makes of cfp.worker.Worker, in one process
        def __init__(self, cost):
            self.cost = cost

        def share(self, value):
            return value

        def call(self, fn, *args):
            return self.cost

    other = CostModel((1e-3, 1e-6), (1e-8, 1e-10), 1e9, 1e12)
    quiet = lambda event, **f: None  # noqa: E731
    first = profile_pass._chosen(analysis, windows, reps, options, Worker(COST), quiet,
                                 ProfileCheckpoint(tmp_path, ("fp",)))
    assert first and all(len(c) > 8 for c in first.values())
    resumed = profile_pass._chosen(analysis, windows, reps, options, Worker(other), quiet,
                                   ProfileCheckpoint(tmp_path, ("fp",)))
    assert resumed == first
    fresh = profile_pass._chosen(analysis, windows, reps, options, Worker(other), quiet,
                                 ProfileCheckpoint(tmp_path / "fresh", ("fp",)))
    assert fresh != first


def test_the_model_profile_prices_what_the_measured_profile_chose(tmp_path):
    """The combinations a whole segment measures are the work dir's: ``--cost model`` run
    after the measured profile prices the same ones, though its cost model ranks others
    first, so the cost model's top plan is one search can compose from measurements.
    Control: the model profile of another work dir chooses by its own model, differently."""
    from cfp.passes import profile as profile_pass
    from cfp.windows import split_windows
    from cfp.workdir import WorkDir
    spec = WorkloadSpec("gpt", "tiny", None, "float32", ()).resolved()
    analysis = run_analysis(spec, (2, 2))
    windows, reps = split_windows(analysis, 8, whole_segments=True)
    other = CostModel((1e-3, 1e-6), (1e-8, 1e-10), 1e9, 1e12)
    quiet = lambda event, **f: None  # noqa: E731

    class Worker:  # the calls _chosen makes of cfp.worker.Worker, in one process
        def share(self, value):
            return value

        def call(self, fn, *args):
            return COST

    def chosen(workdir, cost, model):
        checkpoint = WorkDir(workdir, ("fp",)).profile_checkpoint(analysis, cost, 8, True)
        options = ProfileOptions(cost=cost, max_combinations=8, whole_segments=True,
                                 cost_model=model)
        return profile_pass._chosen(analysis, windows, reps, options, Worker(), quiet,
                                    checkpoint)

    measured = chosen(tmp_path, "measure", None)
    assert measured and all(len(c) > 8 for c in measured.values())
    assert chosen(tmp_path, "model", other) == measured
    assert chosen(tmp_path / "alone", "model", other) != measured


def test_an_all_reduce_is_priced_as_a_reduce_scatter_only_where_every_use_slices_it():
    """CPU's reduce-scatter is an all-reduce whose every use is a dynamic-slice; an all-reduce
    that another op also reads moves its whole result (the control)."""
    from cfp.cost_model import _sliced_allreduces
    text = """
  %all-reduce.1 = f32[8,4]{1,0} all-reduce(%param.0), replica_groups={}, to_apply=%add
  %all-reduce.2 = f32[8,4]{1,0} all-reduce(%param.0), replica_groups={}, to_apply=%add
  %dynamic-slice.3 = f32[1,4]{1,0} dynamic-slice(%all-reduce.1, %c, %c), dynamic_slice_sizes={1,4}
  %dynamic-slice.4 = f32[1,4]{1,0} dynamic-slice(%all-reduce.2, %c, %c), dynamic_slice_sizes={1,4}
  ROOT %tuple.5 = (f32[1,4]{1,0}, f32[1,4]{1,0}, f32[8,4]{1,0}) tuple(%dynamic-slice.3, \
%dynamic-slice.4, %all-reduce.2)
"""  # the backslash joins the ROOT line, as XLA prints it
    assert _sliced_allreduces(text) == {"all-reduce.1"}
