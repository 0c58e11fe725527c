"""Generated bad input: cluster files and mesh strings mutated from valid ones (numbers at the
edges of float64, wrong types, missing and extra keys, other scripts' digits, path characters).
Each is refused in one ``CfpError`` line or taken with every value within its bounds, and the
default work dir stays one folder under ``profiles/``; nothing else is raised."""
import copy
import json
import math
import sys

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from cfp.cli import parse
from cfp.cluster import FIGURES, LEVEL_FIGURES, MAX_DEVICES, SAFE_NAME
from cfp.errors import CfpError
from cfp.mesh import AXIS_NAMES, parse_mesh
from cfp.options import check_options, default_workdir

GOOD = {"name": "c", "memory_per_device_GB": 80, "peak_TFLOPs": 312,
        "memory_bandwidth_GBps": 2039, "gpu": "a100", "assumed": ["alpha_s"],
        "levels": [{"name": "node", "size": 2, "alpha_s": 1e-5, "bandwidth_GBps": 25},
                   {"name": "gpu", "size": 4, "alpha_s": 5e-6, "bandwidth_GBps": 150}]}
EDGES = [0, -0.0, 5e-324, 1e-320, 2.2e-308, 1e-9, 1e300, sys.float_info.max, -1, 2**63,
         10**400, float("inf"), float("-inf"), float("nan"), True, None, "80", "1e3", [],
         {}, "../../x", "/abs", "a/b", "..", ".", "\u540d", "x\u00b2", "", " ", "\x00"]
VALUES = st.one_of(st.sampled_from(EDGES), st.floats(allow_nan=True, allow_infinity=True),
                   st.integers(min_value=-2**70, max_value=2**70), st.text(max_size=12))


@st.composite
def clusters(draw):
    d = copy.deepcopy(GOOD)
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from(["top", "level"]))
        target = d if where == "top" else draw(st.sampled_from(d["levels"])) \
            if isinstance(d.get("levels"), list) and d["levels"] else d
        if not isinstance(target, dict):
            continue
        keys = sorted(target) + ["extra_key"]
        key = draw(st.sampled_from(keys))
        how = draw(st.sampled_from(["set", "delete"]))
        if how == "delete":
            target.pop(key, None)
        else:
            target[key] = draw(VALUES)
    return d


def _check(tmp_path, d) -> None:
    path = tmp_path / "cluster.json"
    try:
        path.write_text(json.dumps(d))
    except ValueError:  # JSON has no such value (10**400 as a float): nothing to read
        return
    try:
        opts = check_options(parse(["--model", "mlp", "--cluster", str(path)]))
    except CfpError as e:
        assert "\n" not in str(e)
        return
    c = opts.cluster  # taken: every figure within its bounds, and a name that is no path
    assert SAFE_NAME.fullmatch(c.name)
    low, high = FIGURES["memory_per_device_GB"]
    assert low * 2**30 - 1 <= c.memory_per_device_bytes <= high * 2**30
    assert 1e6 <= c.device_flops <= 1e18 and 1e3 <= c.device_bandwidth <= 1e16
    assert 1 <= c.num_devices <= MAX_DEVICES
    model = c.cost_model(c.mesh_shape)
    assert all(math.isfinite(x) and 0 <= x <= 1 for x in model.alpha + model.beta)
    workdir = default_workdir(opts)
    assert workdir.parts[0] == "profiles" and len(workdir.parts) == 2
    assert workdir.parts[1] not in (".", "..")


@settings(max_examples=200, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(d=clusters())
def test_generated_cluster_files(tmp_path, d):
    _check(tmp_path, d)


def test_the_generated_cluster_files_are_checked_as_they_claim(tmp_path):
    """The controls: the unmutated file is taken, and a figure out of its bounds slips past
    no property the fuzz test asserts (a cluster of 1e300 TFLOP/s, taken, would fail it)."""
    _check(tmp_path, GOOD)
    assert check_options(parse(["--model", "mlp", "--cluster", _write(tmp_path, GOOD)]))
    from cfp.cluster import _cluster
    huge = _cluster("c", [("gpu", 8, 0, 150)], 80, 1e300, 2039)
    assert not 1e6 <= huge.device_flops <= 1e18
    assert LEVEL_FIGURES["alpha_s"] == (0.0, 1.0)


def _write(tmp_path, d) -> str:
    path = tmp_path / "good.json"
    path.write_text(json.dumps(d))
    return str(path)


MESH_CHARS = st.sampled_from(list("0123456789x=,") + ["\u00b2", "\uff18", "\u0968", "-", "+",
                                                      " ", "X", "/", "..", "a", "data", "_"])


@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=st.one_of(st.lists(MESH_CHARS, max_size=10).map("".join),
                      st.sampled_from(["8", "2x4", "data=2,model=4", "1x8", "2x2x2x2",
                                       "9" * 5000, "2x\u00b2", "data=2,data=4"])))
def test_generated_mesh_strings(text):
    """A mesh string is refused in one ``CfpError`` line, or read as at most 3 axes of
    positive sizes, each written in ASCII digits in the text."""
    try:
        shape, names = parse_mesh(text)
    except CfpError as e:
        assert "\n" not in str(e)
        return
    assert 1 <= len(shape) <= len(AXIS_NAMES) and all(n >= 1 for n in shape)
    assert text.isascii() and len(names) == len(shape)


@pytest.mark.parametrize("text,shape", [("8", (8,)), ("2x4", (2, 4)),
                                        ("data=2,model=4", (2, 4))])
def test_the_valid_mesh_strings_are_read(text, shape):
    """The control: the valid strings the mutations start from are read as their shapes."""
    assert parse_mesh(text)[0] == shape
