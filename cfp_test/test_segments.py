from cfp.segments import find_segments
from helpers import blocks_of


def _segments(model, layers):
    _, g, ba = blocks_of(model, (4,), layers)
    return g, ba, find_segments(g, ba)


def _type_spaces(ba, sa):
    return [[len(ba.blocks[b].strategies) for b in range(
        sa.instances[r].start, sa.instances[r].end)] for r in sa.representatives]


def test_unique_segments_do_not_grow_with_layers():
    _, ba2, sa2 = _segments("gpt", 2)
    _, ba8, sa8 = _segments("gpt", 8)
    assert sa2.num_types == sa8.num_types == 2  # a layer, and the LM head
    assert _type_spaces(ba2, sa2) == _type_spaces(ba8, sa8)
    assert len(sa8.instances) == 9
    assert [s.type for s in sa8.instances] == [0] * 8 + [1]


def test_alternating_moe_gets_two_layer_types():
    _, ba, sa = _segments("moe", 4)
    types = [s.type for s in sa.instances]
    assert types == [0, 1, 0, 1, 2]  # dense layer, MoE layer, ..., head
    lengths = {s.type: s.end - s.start for s in sa.instances}
    assert lengths[0] != lengths[1]


def test_segments_tile_the_block_sequence():
    for model in ("llama", "bert", "mlp"):
        _, ba, sa = _segments(model, None)
        assert sa.instances[0].start == 0 and sa.instances[-1].end == len(ba.blocks)
        for a, b in zip(sa.instances, sa.instances[1:]):
            assert a.end == b.start
