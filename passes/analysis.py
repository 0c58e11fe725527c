"""The analysis pass: trace -> graph -> ParallelBlocks -> segments.

``run_analysis(spec, mesh_shape)`` traces the workload's step with abstract inputs (a 13B
configuration is analysed without allocating it), builds the operator graph, groups it into
ParallelBlocks with their strategies on the mesh, finds the repeated segments, and returns an
``AnalysisRecord``.
"""
from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable

from cfp.blocks import BlockAnalysis, with_strategies
from cfp.errors import CfpError
from cfp.graph import Graph
from cfp.grouping import build_blocks
from cfp.mesh import AXIS_NAMES, make_mesh
from cfp.segments import SegmentAnalysis, find_segments
from cfp.tracing import trace_step
from cfp.workloads import WorkloadSpec

@dataclasses.dataclass(frozen=True)
class AnalysisStats:
    time_s: float
    flops_total: float
    flops_in_blocks: float
    num_layers: int | None  # the workload's layer count, when it has one

    @property
    def flops_share(self) -> float:
        return self.flops_in_blocks / self.flops_total if self.flops_total else 1.0


@dataclasses.dataclass(frozen=True)
class AnalysisRecord:
    """Everything later passes need from analysis: plain data only."""

    spec: WorkloadSpec
    mesh_shape: tuple[int, ...]
    graph: Graph
    blocks: BlockAnalysis
    segments: SegmentAnalysis
    stats: AnalysisStats
    mesh_axes: tuple[str, ...]  # the user's names of the mesh axes, m0, m1, ... if none given
    # the user's mesh's device ids in its order, which cfp measures on (cfp.mesh.device_order);
    # None: JAX's first devices in order
    device_ids: tuple[int, ...] | None = None

    def mesh(self):
        """The mesh cfp measures and validates on: ``mesh_shape`` over ``device_ids`` (JAX's
        first devices when None), axes m0, m1, ..."""
        return make_mesh(self.mesh_shape, device_ids=self.device_ids)

    def segment_space(self, seg_type: int) -> list[int]:
        """Strategies per block of a unique segment (its representative instance)."""
        seg = self.segments.instances[self.segments.representatives[seg_type]]
        return [len(self.blocks.blocks[b].strategies) for b in range(seg.start, seg.end)]

    def plan_space_log10(self) -> float:
        """log10 of the number of whole-model plans (one strategy per block)."""
        return sum(math.log10(max(1, len(b.strategies))) for b in self.blocks.blocks)


def run_analysis(spec: WorkloadSpec, mesh_shape: tuple[int, ...], graph: Graph | None = None,
                 grouping: BlockAnalysis | None = None, *,
                 axis_names: tuple[str, ...] | None = None,
                 device_ids: tuple[int, ...] | None = None,
                 on_stage: Callable[[str], None] = lambda stage: None) -> AnalysisRecord:
    """Analyse ``spec``'s training step for a mesh of ``mesh_shape``. ``graph`` and
    ``grouping``: the step's graph and blocks found earlier (for another mesh: comparing
    meshes), so only the strategies and segments are found again. ``axis_names``: the
    user's names of the mesh axes, which the plan speaks (None: m0, m1, ...); cfp itself
    measures on axes m0, m1, ... of the same shape. ``device_ids``: the user's mesh's devices
    in its order (``cfp.mesh.device_order``), which the later passes measure on.
    ``on_stage(text)`` is told each stage as it starts (a long analysis's progress)."""
    start = time.perf_counter()
    on_stage("tracing the step")
    workload = spec.build()
    graph = graph or trace_step(workload).graph()
    on_stage(f"grouping {len(graph.ops)} operators into ParallelBlocks")
    blocks = (with_strategies(grouping, graph, mesh_shape) if grouping is not None
              else build_blocks(graph, mesh_shape))
    if math.prod(mesh_shape) > 1 and all(
            all(a is None for a in st.axes) for b in blocks.blocks for st in b.strategies):
        raise CfpError(f"no contraction of the step has a dim that mesh "
                       f"{'x'.join(map(str, mesh_shape))} divides, so every block would stay "
                       f"replicated: choose mesh axes that divide the batch or model sizes")
    on_stage(f"finding the repeated layers among {len(blocks.blocks)} ParallelBlocks")
    segments = find_segments(graph, blocks)
    total = sum(op.flops for op in graph.ops)
    inside = sum(graph.ops[i].flops for i in blocks.owner)
    stats = AnalysisStats(time.perf_counter() - start, total, inside,
                          getattr(workload.config, "num_layers", None))
    names = AXIS_NAMES[:len(mesh_shape)] if axis_names is None else tuple(axis_names)
    if len(names) != len(mesh_shape):
        raise CfpError(f"axis names {names} for a mesh of {len(mesh_shape)} axes")
    if device_ids is not None and len(device_ids) != math.prod(mesh_shape):
        raise CfpError(f"{len(device_ids)} device ids for a mesh of {math.prod(mesh_shape)}")
    return AnalysisRecord(spec, tuple(mesh_shape), graph, blocks, segments, stats, names,
                          None if device_ids is None else tuple(device_ids))
