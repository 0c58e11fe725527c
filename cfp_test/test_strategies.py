import pytest

from cfp.strategies import dot_loop_dims, enumerate_strategies

PLAIN = dot_loop_dims((8, 4), (4, 8), ((1,), (0,)), ((), ()))  # [8,4] x [4,8]
BATCHED = dot_loop_dims((4, 8, 4), (4, 4, 8), ((2,), (1,)), ((0,), (0,)))  # b x [8,4] x [4,8]


@pytest.mark.parametrize("dims,mesh,before,after", [
    (PLAIN, (4,), 4, 3),      # rows, columns, contracted (+ all-reduce); replicated pruned
    (BATCHED, (4,), 5, 4),    # ... plus the batch dim
    (PLAIN, (2, 2), 16, 9),   # 6 two-dim splits + 3 S01 splits of one dim over both axes
    (BATCHED, (2, 2), 25, 16),
])
def test_known_strategy_counts(dims, mesh, before, after):
    kept, valid = enumerate_strategies(dims, mesh)
    assert (valid, len(kept)) == (before, after)


def test_names_follow_alpa_notation():
    names = [s.name for s in enumerate_strategies(PLAIN, (2, 2))[0]]
    assert "SS = SR x RS @ {0,1}" in names
    assert "SS = SR x RS @ {1,0}" in names
    assert "RS = RS x SS @ {0,1} (allreduce @ 1)" in names
    assert "SR = SR x RR @ {01}" in names  # data parallel over all four devices
    assert "RR = RS x SR @ {01} (allreduce @ 01)" in names


def test_non_dividing_splits_are_left_out():
    dims = dot_loop_dims((6, 4), (4, 8), ((1,), (0,)), ((), ()))
    names = [s.name for s in enumerate_strategies(dims, (4,))[0]]
    assert names == ["RS = RR x RS @ {0}", "RR = RS x SR @ {0} (allreduce @ 0)"]


def test_pure_data_parallel_is_in_the_2d_space():
    dims = dot_loop_dims((8, 8, 4), (8, 4, 8), ((2,), (1,)), ((0,), (0,)))
    kept, _ = enumerate_strategies(dims, (2, 4))
    assert any(s.axes == (0, 0) for s in kept)  # the batch dim over both axes
