"""ParallelBlocks: groups of a step's operators that one strategy runs with no collective
inside (``Block``, its members with their dim labels, ``BlockAnalysis`` for the whole step).
``cfp.grouping`` builds them from the graph."""
from __future__ import annotations

import dataclasses
from typing import Literal

from cfp import dims as dimrules
from cfp.graph import Graph
from cfp.strategies import LoopDim, Strategy, enumerate_strategies

Role = Literal["seed", "repeat", "input-grad", "weight-grad", "recompute", "flow", "attached"]
LAYOUT_OPS = ("reshape", "transpose", "convert_element_type", "copy", "copy_p", "squeeze", "rev")


@dataclasses.dataclass(frozen=True)
class Member:
    """An operator in a block, with the labels of its results and of the operands it wants."""

    op: int
    role: Role
    outs: tuple  # tuple[Labels, ...]
    ins: tuple  # tuple[Labels, ...]
    reqs: tuple  # requirements for being collective-free, see cfp.dims
    reduces: tuple = ()  # labels a contraction member sums over (a split one = all-reduce)


@dataclasses.dataclass(frozen=True)
class Block:
    """A ParallelBlock: a seed contraction, its backward contractions and the operators a
    partition flows through; ``strategies`` are the seed's (non-dominated, dividing) ones."""

    index: int
    seed: int
    loop_dims: tuple[LoopDim, ...]
    members: tuple[Member, ...]
    strategies: tuple[Strategy, ...]
    strategies_before_pruning: int

    @property
    def contractions(self) -> tuple[Member, ...]:
        return tuple(m for m in self.members
                     if m.role in ("seed", "repeat", "input-grad", "weight-grad", "recompute"))

    def members_under(self, strategy: Strategy, mesh_shape) -> tuple[Member, ...]:
        """The members that need no collective under ``strategy`` (contractions always stay;
        their all-reduces are the ones the strategy names)."""
        return tuple(m for m in self.members
                     if dimrules.satisfied(m.reqs, strategy.axes, mesh_shape))

    def named_allreduces(self, strategy: Strategy) -> list[tuple[int, tuple[int, ...]]]:
        """(op, mesh axes) of every all-reduce the strategy names: split contracting dims."""
        out = []
        for m in self.contractions:
            axes = tuple(sorted({a for l in m.reduces for a in strategy.loop_axes(l)}))
            if axes:
                out.append((m.op, axes))
        return out


@dataclasses.dataclass(frozen=True)
class BlockAnalysis:
    blocks: tuple[Block, ...]
    value_labels: tuple[dict, ...]  # per block: value id -> labels of values it produces
    owner: dict[int, int]  # op index -> block index
    unclaimed: tuple[int, ...]  # op indices no block claims
    seed_comparisons: int = 0  # contractions matched against a seed, over the whole step


def with_strategies(ba: BlockAnalysis, graph: Graph, mesh_shape: tuple[int, ...]
                    ) -> BlockAnalysis:
    """The same blocks with their strategies on a mesh of ``mesh_shape`` (the grouping does
    not depend on the mesh): those of the seed that divide every labelled dim of every
    member."""
    blocks = []
    for b in ba.blocks:
        divides = set()  # every labelled dim of every member: each layout must exist
        for m in b.members:
            op = graph.ops[m.op]
            for v, lab in list(zip(op.inputs, m.ins)) + list(zip(op.outputs, m.outs)):
                divides.update((l, s) for l, s in zip(lab, graph.values[v].shape)
                               if l is not None)
        seed = graph.ops[b.seed]
        ndims = tuple(len(graph.values[v].shape) for v in (seed.outputs[0], *seed.inputs[:2]))
        all_strats, before = enumerate_strategies(b.loop_dims, tuple(mesh_shape), ndims=ndims)
        strats = tuple(s for s in all_strats
                       if dimrules.satisfied(divides, s.axes, tuple(mesh_shape)))
        blocks.append(dataclasses.replace(b, strategies=strats, strategies_before_pruning=before))
    return dataclasses.replace(ba, blocks=tuple(blocks))
