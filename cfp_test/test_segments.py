import collections
import functools
import math

import pytest

from cfp import segments
from cfp.passes.analysis import run_analysis
from cfp.passes.profile import ProfileOptions
from cfp.segments import find_segments
from cfp.windows import boundaries, split_windows, window_space
from cfp.workloads import WorkloadSpec
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


@functools.lru_cache(maxsize=None)
def _analysis(model, layers, mesh_shape=(2, 4)):
    spec = WorkloadSpec(model, None, None, "float32", (("num_layers", layers),)).resolved()
    return run_analysis(spec, mesh_shape)


def _profiled(a):
    """(instances per segment type, window types, combinations the profile measures)."""
    windows, reps = split_windows(a, ProfileOptions().max_combinations)
    per_type = collections.Counter(s.type for s in a.segments.instances)
    return ([per_type[t] for t in range(a.segments.num_types)], len(reps),
            sum(math.prod(window_space(a, windows[r])) for r in reps))


def test_layers_that_read_shared_values_repeat(monkeypatch):
    """An encoder-decoder whose layers read values no layer owns (each stack's position
    bias, made in its first layer; the encoder's output, in every decoder layer): the encoder
    and the decoder each form a segment type with one instance per layer, and the profile's
    window types and combinations are constant from 3 layers on. A stack has a first layer
    (it makes the bias), a last one (its backward pass starts summing the bias's gradient)
    and, from 3 layers on, middle ones; at 2 layers the windows of a middle layer that match
    neither the first's nor the last's at their offset have no instance, so there are that
    many window types fewer (one per stack), and their combinations."""
    counts = {layers: _profiled(_analysis("users_models:t5_shared", layers))
              for layers in (2, 3, 4, 8)}
    for layers, (instances, _, _) in counts.items():
        assert instances == [layers, layers, 1]  # encoder layers, decoder layers, the head
    assert counts[3][1:] == counts[4][1:] == counts[8][1:]
    middle_only = _middle_only_windows(_analysis("users_models:t5_shared", 3))
    assert len(middle_only) == 2  # one per stack: the 2-layer count differs (the control)
    a3 = _analysis("users_models:t5_shared", 3)
    assert counts[2][1] == counts[3][1] - len(middle_only)
    assert counts[2][2] == counts[3][2] - sum(math.prod(window_space(a3, w))
                                              for w in middle_only)
    # negative control: without common values the whole model is one segment, and what the
    # profile measures grows with depth
    monkeypatch.setattr(segments, "common_values",
                        lambda graph, ba: (frozenset(), frozenset()))
    a2, a4 = (_analysis.__wrapped__("users_models:t5_shared", n) for n in (2, 4))
    assert _profiled(a2)[0] == _profiled(a4)[0] == [1]
    assert _profiled(a4)[1:] > _profiled(a2)[1:]


def _middle_only_windows(a):
    """The windows of a 3-layer model's middle layers whose operators match neither the
    first layer's nor the last layer's window at the same offset of the layer."""
    windows, _ = split_windows(a, ProfileOptions().max_combinations)
    out = []
    for t in range(a.segments.num_types):
        layers = [s for s in a.segments.instances if s.type == t]
        if len(layers) < 3:
            continue
        per_layer = [[w for w in windows if s.start <= w.start < s.end] for s in layers]
        first, middle, last = per_layer[0], per_layer[1], per_layer[-1]
        out += [w for w, f, z in zip(middle, first, last) if w.type not in (f.type, z.type)]
    return out


def test_the_reshardings_to_time_do_not_grow_with_depth():
    """The profile times each (shape, dtype, source layout, destination layout) once, however
    many boundaries need it: the encoder-decoder's boundaries grow with depth (every layer
    reads the shared values across one), the reshardings to time do not. Control: the
    boundaries do grow, so timing per boundary (per layer, per reader) would grow too."""
    from cfp.passes.profile import needed_reshards
    got = {}
    for layers in (2, 4, 8):
        a = _analysis("users_models:t5_shared", layers)
        bounds = boundaries(a, split_windows(a, ProfileOptions().max_combinations)[0])
        got[layers] = (len(bounds), needed_reshards(bounds, a.blocks.blocks, ("m0", "m1")))
    assert got[2][1] == got[4][1] == got[8][1]
    assert got[2][0] < got[4][0] < got[8][0]


@pytest.mark.parametrize("model", ["gpt", "moe", "users_models:flax_dropout",
                                   "scanned_models:jax_stack", "scanned_models:jax_checkpoint"])
def test_models_without_shared_values_keep_their_segments(monkeypatch, model):
    """Models whose layers share no computed value: the same segments, window types and
    combinations with common values as without them (so as before them)."""
    got = [(_analysis(model, n).segments.instances, _profiled(_analysis(model, n)))
           for n in (2, 4)]
    monkeypatch.setattr(segments, "common_values",
                        lambda graph, ba: (frozenset(), frozenset()))
    assert got == [(_analysis.__wrapped__(model, n).segments.instances,
                    _profiled(_analysis.__wrapped__(model, n))) for n in (2, 4)]


def test_a_shared_value_and_its_gradient_are_priced_in_every_layer():
    """Every decoder layer reads the encoder's output from a boundary that starts in the
    encoder and sends its part of that output's gradient back across one, and every encoder
    layer after the first does the same with the position bias the first made: search adds
    the resharding of each, so a shared value's cost is summed over the layers."""
    a = _analysis("users_models:t5_shared", 4)
    common, _ = segments.common_values(a.graph, a.blocks)
    bounds = boundaries(a, split_windows(a, ProfileOptions().max_combinations)[0])

    def priced(seg, shape):  # read from before the layer, its gradient sent back there
        return (any(b.value in common and b.shape == shape and b.src < seg.start
                    and seg.start <= b.dst < seg.end for b in bounds),
                any(b.shape == shape and seg.start <= b.src < seg.end and b.dst < seg.start
                    for b in bounds))

    encoder, decoder, _ = ([s for s in a.segments.instances if s.type == t] for t in range(3))
    for seg in decoder:
        assert priced(seg, (4, 16, 32)) == (True, True)  # batch, source length, hidden
    for seg in encoder[1:]:
        assert priced(seg, (1, 4, 16, 16)) == (True, True)  # heads, source length twice
    # negative control: the first encoder layer makes the bias; it reads nothing before it
    assert priced(encoder[0], (1, 4, 16, 16)) == (False, False)


@pytest.mark.parametrize("model", ["zoo_extra:rotary_angles", "zoo_extra:rotary_cosines"])
def test_a_rotary_table_made_by_a_contraction_leaves_layers_repeating(monkeypatch, model):
    """Layers that rotate queries and keys by one table of angles, an einsum of positions and
    frequencies made once (``zoo_extra.rotary_angles``; ``rotary_cosines``: its cosines and
    sines made once too, in the first layer that reads them): the einsum, computed from
    constants alone, seeds no block, the constants link no layer to another, and each layer
    is a segment, as in the same model without the table. Controls: where the einsum seeds a
    block, that block takes in what every layer computes from the table, and the whole model
    is one segment; where constants link, the first layer, which makes the cosines and sines
    read by all, differs from the others, and segments no longer start at layers."""
    from cfp import grouping
    for layers in (2, 4):
        a = _analysis(model, layers, (4,))
        plain = _analysis("zoo_extra:reshape_attention", layers, (4,))
        assert _profiled(a)[0] == _profiled(plain)[0] == [layers, 1]
        assert [(s.start, s.end) for s in a.segments.instances] == [
            (s.start, s.end) for s in plain.segments.instances]
        assert sum(a.graph.ops[i].is_contraction for i in a.blocks.unclaimed) == 1
    every = lambda graph: set(graph.values)  # noqa: E731
    monkeypatch.setattr(grouping, "computed_from_inputs", every)
    assert _profiled(_analysis.__wrapped__(model, 4, (4,)))[0] == [1]
    monkeypatch.undo()
    monkeypatch.setattr(segments, "computed_from_inputs", every)
    linked = _analysis.__wrapped__(model, 4, (4,)).segments.instances
    assert (linked == plain.segments.instances) == (model == "zoo_extra:rotary_angles")
