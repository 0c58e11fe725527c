import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cfp.program import trace_program
from helpers import traced


def test_hlo_notation_of_a_dot():
    prog = trace_program(lambda x, w: x @ w, jnp.ones((4, 8)), jnp.ones((8, 2)))
    assert prog.graph().ops[0].hlo == (
        "%dot.2 = f32[4,2] dot(f32[4,8] %Arg_0.0, f32[8,2] %Arg_1.1), "
        "lhs_contracting_dims={1}, rhs_contracting_dims={0}")


def test_nested_jit_is_inlined_and_dead_code_dropped():
    inner = jax.jit(lambda y: jnp.tanh(y) * 2)

    def f(x):
        _unused = jnp.exp(x)
        return inner(x).sum()

    g = trace_program(f, jnp.ones(3)).graph()
    prims = [op.primitive for op in g.ops]
    assert "jit" not in prims and "pjit" not in prims
    assert "exp" not in prims and g.dead_ops >= 1
    assert prims == ["tanh", "mul", "reduce_sum"]


def test_graph_users_and_operands_are_consistent():
    _, g = traced("gpt")
    for op in g.ops:
        for v in op.inputs:
            assert v in g.values
        for v in op.outputs:
            assert g.values[v].producer == op.index
    for v, readers in g.users.items():
        for r in readers:
            assert v in g.ops[r].inputs


@pytest.mark.slow  # evaluate, jitted, against the step: test_the_cond_parts_compute_what_the_cond_computes
def test_evaluate_reproduces_the_step():
    from cfp.models import get_workload
    w = get_workload("mlp", "tiny")
    params = w.init_params(jax.random.key(0))
    from cfp.models import adam_init
    args = (params, adam_init(params), w.make_batch(jax.random.key(1)))
    prog = trace_program(w.train_step(), *args)
    env = prog.evaluate(jax.tree_util.tree_leaves(args))
    got = prog.output_values(env)
    want = jax.tree_util.tree_leaves(w.train_step()(*args))
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
