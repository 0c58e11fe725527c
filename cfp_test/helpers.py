"""Shared test helpers: traced tiny workloads, cached per process (tracing costs ~0.2 s)."""
import functools

from cfp.blocks import build_blocks
from cfp.models import get_workload
from cfp.workloads import trace_step


@functools.lru_cache(maxsize=None)
def traced(model: str, num_layers: int | None = None, **kw):
    """(program, graph) of a zoo model's tiny preset."""
    extra = {} if num_layers is None else {"num_layers": num_layers}
    program = trace_step(get_workload(model, "tiny", **extra, **kw))
    return program, program.graph()


@functools.lru_cache(maxsize=None)
def blocks_of(model: str, mesh_shape: tuple, num_layers: int | None = None):
    program, graph = traced(model, num_layers)
    return program, graph, build_blocks(graph, mesh_shape)
