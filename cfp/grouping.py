"""Group a step's operators into communication-free ParallelBlocks.

Built from the graph alone, with no knowledge of any model:

1. **Seeds.** Contractions are visited in program order. One that is the backward of an earlier
   block's seed joins that block; any other seeds a new block. A contraction ``C`` is the
   backward of seed ``F = F(X, Y)`` when one of its operands is ``X`` (or a reshape, transpose or
   convert of the same tensor), its other operand ``G`` has the shape of ``F``'s result (the
   cotangent), its contracting dims are ``F``'s free dims of ``X``, and its result holds ``Y``'s
   dims: ``dY = X^T . G``. In a jaxpr of a ``jax.grad`` step these reuse the forward's variables.
   When several seeds fit (``q``, ``k``, ``v`` all read ``x``), the one whose cotangent ``G`` is
   also read by another backward contraction of that seed (its input gradient) wins.
   A contraction computed from constants alone (a rotary table, the outer product of
   positions and frequencies) seeds nothing: it is the same every step, and as a block it
   would take in what every layer computes from it (step 3), joining the layers.
2. **Labels.** Every tensor dim inside a block is labelled with the seed loop dim it follows, so
   each seed strategy fixes the layout of every member (see ``cfp.dims``).
3. **Forward flow.** In program order, an unclaimed operator that reads a block's result joins
   that block, its labels derived by ``cfp.dims.forward``. *Rule for operators fed by several
   blocks: the block of the operand computed last takes it* (the nearest upstream one, which in
   the backward pass is the gradient just computed); the other operands enter it as boundary
   values. *Shared scalars:* an operator whose operands and results are all scalars, fed by
   several blocks or by a shared scalar (a global norm's sum over every layer's gradient, the
   clip factor made from it, a ``cond``'s predicate), joins no block, nor does a scalar member
   read only by shared ones (the sum's first term): every layer reads such a value, and it
   must not pull the layers' update work into one block. Rules speak of sizes and
   dependencies, not of optimizers.
4. **Backward attach.** In reverse program order, an unclaimed operator all of whose results are
   read by block members joins the block of its readers, labelled by ``cfp.dims.backward``. *Rule
   for operators read by several blocks: the block of the first reader in program order takes
   it.*
5. **Refinement.** Non-contraction members are re-labelled forwards, so a dim that backward inference
   could not label (a reduced one) takes its operands' label, with the requirement that goes
   with it.
6. Whatever is left (nothing reachable from a contraction, e.g. step-counter arithmetic, shared
   scalars, or opaque operators between blocks) is listed as *unclaimed*. Operators that only
   make PRNG keys (wrap, split, fold in) are always left: a key is replicated data, and the
   data drawn from it (``random_bits``) joins the block that reads it like any operand.

A member whose requirements a strategy breaks (a reduction over a split dim, a merge of a split
minor dim, an opaque operator reading a split dim) needs a collective under that strategy, so
membership is decided per (block, strategy): ``Block.members_under``. Seed strategies whose
splits do not divide every labelled dim of every member are dropped (a dim a reshape made from
heads and head size can be smaller than the dim the seed splits), so no pass builds a layout
that does not exist."""
from __future__ import annotations

import dataclasses
import math

from cfp import dims as dimrules
from cfp.blocks import LAYOUT_OPS, Block, BlockAnalysis, Member, with_strategies
from cfp.errors import CfpError
from cfp.graph import Graph, Op, computed_from_inputs, repeats
from cfp.jax_compat import is_key
from cfp.strategies import LoopDim, op_loop_dims


def build_blocks(graph: Graph, mesh_shape: tuple[int, ...]) -> BlockAnalysis:
    """Group ``graph``'s operators into ParallelBlocks for a mesh of ``mesh_shape``."""
    return with_strategies(group_blocks(graph), graph, mesh_shape)


def group_blocks(graph: Graph) -> BlockAnalysis:
    """The ParallelBlocks of ``graph``, without strategies: the grouping does not depend on
    the mesh (``with_strategies`` adds a mesh's)."""
    b = _Builder(graph)
    b.seed_and_match()
    b.forward_flow()
    b.share_scalar_feeders()
    b.backward_attach()
    b.refine()
    return b.finish()


class _Builder:
    def __init__(self, graph: Graph):
        self.g = graph
        self.owner: dict[int, int] = {}  # op -> block
        self.members: list[dict[int, Member]] = []
        self.labels: list[dict[int, tuple]] = []  # block -> value -> labels
        self.seeds: list[int] = []
        self.forwards: list[list[int]] = []  # per block: its seed and the seed's repeats
        self._sources: dict[int, frozenset | None] = {}
        self._state_inputs: set[int] | None = None
        self.loop_dims: list[tuple[LoopDim, ...]] = []
        self._chains: dict[int, list[Op]] = {}
        self.repeats = repeats(graph)
        self.varying = computed_from_inputs(graph)
        self.comparisons = 0
        self.shared: set[int] = set()  # scalar operators several blocks feed (no owner)
        self._flows: dict[tuple, dimrules.Flow] = {}
        self._signatures: dict[int, tuple] = {}

    def forward(self, op: Op, in_labels) -> dimrules.Flow:
        """``cfp.dims.forward`` of ``op`` on operands labelled ``in_labels``, derived once per
        (operator, shapes, labels): a deep model's layers repeat them."""
        key = (op.primitive, op.attrs, tuple(self.shape(v) for v in op.inputs),
               tuple(self.shape(v) for v in op.outputs), tuple(in_labels))
        if key not in self._flows:
            self._flows[key] = dimrules.forward(op.primitive, dict(op.attrs), list(key[2]),
                                                list(key[3]), list(in_labels))
        return self._flows[key]

    # -- helpers ------------------------------------------------------------------------------
    def shape(self, v):
        return self.g.values[v].shape

    def chain(self, v) -> list[Op]:
        """Layout ops from the root tensor of ``v`` down to ``v`` (root first)."""
        if v not in self._chains:
            self._chains[v] = self._walk_chain(v)
        return self._chains[v]

    def _walk_chain(self, v) -> list[Op]:
        ops = []
        while True:
            op = self.g.producer_op(v)
            if op is None or op.primitive not in LAYOUT_OPS:
                break
            ops.append(op)
            v = op.inputs[0]
        ops.reverse()
        return ops

    def moves_keys(self, op: Op) -> bool:
        """Whether ``op`` only makes PRNG keys (wraps, splits, folds in): keys are replicated
        data that no strategy splits, so such operators join no block."""
        return bool(op.outputs) and all(is_key(self.g.values[v].dtype) for v in op.outputs)

    def root(self, v) -> int:
        while True:
            v = self.original(v)
            ch = self.chain(v)
            if not ch:
                return v
            v = ch[0].inputs[0]

    def original(self, v) -> int:
        """The value a remat recomputation of ``v`` repeats (``v`` itself if none)."""
        return self.repeats.get(v, v)

    def add(self, block: int, member: Member):
        self.members[block][member.op] = member
        self.owner[member.op] = block
        for v, lab in zip(self.g.ops[member.op].outputs, member.outs):
            self.labels[block][v] = lab

    def _carry_down(self, src: int, src_labels, dst: int):
        """Labels of ``dst`` given those of ``src``, both layout chains of the same root: back
        up ``src``'s chain to the last value the two chains share, then down ``dst``'s. Going
        no higher than needed keeps labels a reshape round trip would lose (a dim split into
        heads and head size, each labelled, merges into one dim that holds one label)."""
        shared = {self.original(x) for x in self._chain_values(dst)}
        lab, v = src_labels, src
        for op in reversed(self.chain(src)):
            if self.original(v) in shared:
                break
            lab = dimrules.backward(op.primitive, dict(op.attrs), [self.shape(op.inputs[0])],
                                    [self.shape(op.outputs[0])], [lab]).ins[0]
            v = op.inputs[0]
        return self._forward_chain(v, lab, dst)

    def _chain_values(self, v) -> list[int]:
        """The values of ``v``'s layout chain, root first, ``v`` last."""
        ch = self.chain(v)
        return ([ch[0].inputs[0]] + [op.outputs[0] for op in ch]) if ch else [v]

    def _forward_chain(self, start: int, labels, end: int):
        """Labels of ``end``, reached from ``start`` down ``end``'s layout chain."""
        chain = self.chain(end)
        start = self.original(start)
        if start == self.original(end):
            chain = []
        else:
            at = [i for i, op in enumerate(chain) if self.original(op.inputs[0]) == start]
            if not at:  # the chains meet only through a remat barrier's other side
                return None, []
            chain = chain[at[0]:]
        steps = []
        for op in chain:
            flow = dimrules.forward(op.primitive, dict(op.attrs), [self.shape(op.inputs[0])],
                                    [self.shape(op.outputs[0])], [labels])
            steps.append((op, flow))
            labels = flow.outs[0]
        return labels, steps

    # -- 1. seeds and backward contractions --------------------------------------------------
    def seed_and_match(self):
        contractions = [op for op in self.g.ops if op.is_contraction]
        candidates = {}
        by_root: dict[int, list[int]] = {}  # root of a seed's operand -> its blocks
        by_signature: dict[tuple, list[int]] = {}  # what a seed computes -> its blocks
        for c in contractions:
            repeated = self.g.values[self.original(c.outputs[0])].producer
            if repeated != c.index:  # a remat recomputation joins the block it repeats
                bi = self.owner[repeated]
                self.add(bi, dataclasses.replace(self.members[bi][repeated], op=c.index,
                                                 role="recompute"))
                continue
            if not any(v in self.varying for v in c.inputs):
                continue  # computed from constants alone (a rotary table): the same each step
            found = []
            # A backward reads one of its seed's operands: only seeds sharing a root can match,
            # so the comparisons per contraction do not grow with depth.
            near = sorted({bi for v in c.inputs[:2] for bi in by_root.get(self.root(v), ())})
            for bi in near:
                for f in self.forwards[bi]:
                    self.comparisons += 1
                    m = self.match_backward(c, self.g.ops[f], bi)
                    if m is not None:
                        found.append((bi, m))
                        break
            if not found:
                alike = near + by_signature.get(self.signature(c), [])
                bi = next((bi for bi in alike if self.repeats_seed(c, bi)), None)
                if bi is None:
                    self.new_block(c)
                    bi = len(self.seeds) - 1
                    by_signature.setdefault(self.signature(c), []).append(bi)
                else:  # the same weight, another micro-batch: the seed's layer, its labels
                    seed = self.members[bi][self.seeds[bi]]
                    self.add(bi, dataclasses.replace(seed, op=c.index, role="repeat"))
                    self.forwards[bi].append(c.index)
                for v in c.inputs[:2]:
                    by_root.setdefault(self.root(v), []).append(bi)
            else:
                candidates[c.index] = found
                if len(found) == 1:
                    self.attach_backward(c, *found[0])
        # Ambiguous ones: prefer the seed whose cotangent another of its backward ops reads.
        for ci, found in candidates.items():
            if len(found) == 1:
                continue
            c = self.g.ops[ci]

            def paired(item):
                bi, m = item
                g_root = self.root(m["g"])
                return any(self.root(v) == g_root for mem in self.members[bi].values()
                           if mem.role != "seed" for v in self.g.ops[mem.op].inputs)

            best = [it for it in found if paired(it)] or found
            self.attach_backward(c, *best[0])

    def signature(self, op: Op) -> tuple:
        if op.index not in self._signatures:
            self._signatures[op.index] = (op.primitive, op.attrs,
                                          tuple(self.shape(v) for v in op.inputs))
        return self._signatures[op.index]

    def repeats_seed(self, c: Op, bi: int) -> bool:
        """Whether ``c`` computes what block ``bi``'s seed computes, for another micro-batch:
        the same operator on operands of the same shapes, not computed from the seed's result,
        one of them a layout change of the same parameter (and the other no other parameter),
        or each computed from contractions of the same blocks as the seed's (attention's
        scores, from the layer's projections). Gradient accumulation
        runs each layer's forward pass once per micro-batch; each run is the layer's, under
        its strategy."""
        f = self.g.ops[self.seeds[bi]]
        if self.signature(c) != self.signature(f):
            return False  # another operator
        roots = [(self.root(a), self.root(b)) for a, b in zip(c.inputs[:2], f.inputs[:2])]
        if any(x == y and x in self.state_inputs for x, y in roots):
            alike = not any(x != y and {x, y} <= self.state_inputs for x, y in roots)
        else:
            sources = [(self.source_blocks(a), self.source_blocks(b))
                       for a, b in zip(c.inputs[:2], f.inputs[:2])]
            alike = all(x is not None and x == y and x for x, y in sources)
        # Last, as the walk back is the costly test: a later layer of a stack sharing weights
        # computes from the seed's result.
        return alike and not self.computed_from(c, f)

    @property
    def state_inputs(self) -> set[int]:
        """The step's training state inputs (parameters, optimizer state); none for a
        program that is not a training step (a pipeline stage's)."""
        if self._state_inputs is None:
            try:
                self._state_inputs = {v for v, _ in self.g.state_pairs()}
            except CfpError:
                self._state_inputs = set()
        return self._state_inputs

    def computed_from(self, c: Op, f: Op) -> bool:
        """Whether ``c`` reads, through any chain, a result of ``f`` (an earlier operator)."""
        seen, stack = set(), list(c.inputs)
        while stack:
            op = self.g.producer_op(stack.pop())
            if op is None or op.index < f.index or op.index in seen:
                continue
            if op.index == f.index:
                return True
            seen.add(op.index)
            stack += op.inputs
        return False

    def source_blocks(self, v: int, most: int = 64) -> frozenset | None:
        """The blocks of the nearest contractions ``v`` is computed from (None when they
        are farther than ``most`` operators, or one belongs to no block yet)."""
        if v in self._sources:
            return self._sources[v]
        found, seen, stack = set(), set(), [v]
        while stack and found is not None:
            op = self.g.producer_op(stack.pop())
            if op is None or op.index in seen:
                continue
            seen.add(op.index)
            if op.is_contraction:
                if op.index not in self.owner:
                    found = None
                else:
                    found.add(self.owner[op.index])
            elif len(seen) > most:
                found = None
            else:
                stack += op.inputs
        self._sources[v] = None if found is None else frozenset(found)
        return self._sources[v]

    def new_block(self, op: Op):
        dims = op_loop_dims(op, self.g.values)
        bi = len(self.seeds)
        self.seeds.append(op.index)
        self.forwards.append([op.index])
        self.loop_dims.append(dims)
        self.members.append({})
        self.labels.append({})
        lhs = tuple(next((i for i, d in enumerate(dims) if d.lhs == p), None)
                    for p in range(len(self.shape(op.inputs[0]))))
        rhs = tuple(next((i for i, d in enumerate(dims) if d.rhs == p), None)
                    for p in range(len(self.shape(op.inputs[1]))))
        out = tuple(next((i for i, d in enumerate(dims) if d.out == p), None)
                    for p in range(len(self.shape(op.outputs[0]))))
        reduces = tuple(i for i, d in enumerate(dims) if d.kind == "contract")
        self.add(bi, Member(op.index, "seed", (out,), (lhs, rhs), (), reduces))

    def match_backward(self, c: Op, f: Op, bi: int):
        """How contraction ``c`` is a backward of seed ``f`` (block ``bi``; or a repeat of
        its seed), or None."""
        seed_member = self.members[bi][f.index]
        f_out = self.shape(f.outputs[0])
        for a_pos in (0, 1):
            a, g = c.inputs[a_pos], c.inputs[1 - a_pos]
            for x_pos in (0, 1):
                x = f.inputs[x_pos]
                if self.root(a) != self.root(x) or a == g:
                    continue
                g0 = next((v for v in [g] + [op.inputs[0] for op in reversed(self.chain(g))]
                           if self.shape(v) == f_out), None)
                if g0 is None or g0 == f.outputs[0]:
                    continue
                a_lab, a_steps = self._carry_down(x, seed_member.ins[x_pos], a)
                g_lab, g_steps = self._forward_chain(g0, seed_member.outs[0], g)
                if a_lab is None or g_lab is None:
                    continue
                lab = [None, None]
                lab[a_pos], lab[1 - a_pos] = a_lab, g_lab
                member = self.contraction_member(c, lab)
                if member is None:
                    continue
                y_labels = [l for l in seed_member.ins[1 - x_pos] if l is not None]
                out_labels = [l for l in member.outs[0] if l is not None]
                if sorted(out_labels) != sorted(y_labels):
                    continue
                f_free = {i for i, d in enumerate(self.loop_dims[bi])
                          if (d.lhs if x_pos == 0 else d.rhs) is not None
                          and d.kind in ("lhs", "rhs")}
                if set(member.reduces) != f_free:
                    continue
                role = "weight-grad" if self.g.producer_op(self.root(
                    f.inputs[1 - x_pos])) is None else "input-grad"
                return {"member": member, "steps": a_steps + g_steps, "g": g, "role": role}
        return None

    def contraction_member(self, c: Op, in_labels) -> Member | None:
        dims = op_loop_dims(c, self.g.values)
        reqs = []
        loop_label = []
        for d in dims:
            found = [in_labels[0][d.lhs] if d.lhs is not None else None,
                     in_labels[1][d.rhs] if d.rhs is not None else None]
            loop_label.append(dimrules.merge_labels(found, reqs))
        out = [None] * len(self.shape(c.outputs[0]))
        for d, l in zip(dims, loop_label):
            if d.out is not None:
                out[d.out] = l
        reduces = tuple(l for d, l in zip(dims, loop_label) if d.kind == "contract"
                        and l is not None)
        ins = []
        for pos, where in ((0, "lhs"), (1, "rhs")):
            lab = [None] * len(self.shape(c.inputs[pos]))
            for d, l in zip(dims, loop_label):
                if getattr(d, where) is not None:
                    lab[getattr(d, where)] = l
            ins.append(tuple(lab))
        return Member(c.index, "flow", (tuple(out),), tuple(ins), tuple(reqs), reduces)

    def attach_backward(self, c: Op, bi: int, m: dict):
        self.add(bi, dataclasses.replace(m["member"], role=m["role"]))
        for op, flow in m["steps"]:
            if op.index not in self.owner:
                self.add(bi, Member(op.index, "flow", flow.outs, flow.ins, flow.reqs))

    # -- 3. forward flow --------------------------------------------------------------------
    def scalar_only(self, op: Op) -> bool:
        """Whether every operand and result of ``op`` is a scalar (one element)."""
        return all(math.prod(self.shape(v)) <= 1 for v in (*op.inputs, *op.outputs))

    def shared_scalar(self, op: Op, producers: list[int]) -> bool:
        """Whether ``op`` computes a scalar that several blocks feed (a global norm's sum over
        every layer's gradient, the clip factor made from it), or from such a scalar: every
        layer reads it, and no block owns it, so it neither pulls the layers' update work
        into one block nor widens the cuts between them."""
        return self.scalar_only(op) and (
            len({self.owner[p] for p in producers}) > 1
            or any(self.g.values[v].producer in self.shared for v in op.inputs))

    def forward_flow(self):
        for op in self.g.ops:
            if op.index in self.owner or op.is_contraction or self.moves_keys(op):
                continue
            producers = [p for v in op.inputs
                         if (p := self.g.values[v].producer) is not None and p in self.owner]
            if self.shared_scalar(op, producers):
                self.shared.add(op.index)
                continue
            if not producers:
                continue
            bi = self.owner[max(producers)]
            flow = self.forward(op, [self.labels[bi].get(v) for v in op.inputs])
            self.add(bi, Member(op.index, "flow", flow.outs, flow.ins, flow.reqs))

    def share_scalar_feeders(self):
        """A scalar-only member whose every reader is a shared scalar (the first term of a sum
        over all layers' gradients) is shared too: it is the sum's, not its block's."""
        for op in reversed(self.g.ops):
            k = op.index
            readers = [u for v in op.outputs for u in self.g.users.get(v, ())]
            if (k in self.owner and self.scalar_only(op) and readers
                    and all(u in self.shared for u in readers)
                    and self.members[self.owner[k]][k].role == "flow"):
                bi = self.owner.pop(k)
                del self.members[bi][k]
                for v in op.outputs:
                    self.labels[bi].pop(v, None)
                self.shared.add(k)

    # -- 4. backward attach -----------------------------------------------------------------
    def backward_attach(self):
        for op in reversed(self.g.ops):
            if (op.index in self.owner or op.is_contraction or self.moves_keys(op)
                    or op.index in self.shared):
                continue
            readers = [u for v in op.outputs for u in self.g.users.get(v, ())]
            if not readers or any(u not in self.owner for u in readers):
                continue
            bi = self.owner[min(readers)]
            wanted, reqs = [], []
            for v in op.outputs:
                asks = [self.members[bi][u].ins[self.g.ops[u].inputs.index(v)]
                        for u in self.g.users.get(v, ()) if self.owner[u] == bi]
                wanted.append(tuple(dimrules.merge_labels(list(d), reqs) for d in zip(*asks))
                              if asks and asks[0] else None)
            flow = dimrules.backward(op.primitive, dict(op.attrs),
                                     [self.shape(v) for v in op.inputs],
                                     [self.shape(v) for v in op.outputs], wanted)
            self.add(bi, Member(op.index, "attached", flow.outs, flow.ins,
                                flow.reqs + tuple(reqs)))

    def refine(self):
        """Re-derive non-contraction members' labels forwards, in program order: a dim that
        backward inference left unlabelled (a reduced dim, say) takes the label its operands
        carry, and the forward rule's requirements are added (a reduction over a split dim
        needs one)."""
        for bi, members in enumerate(self.members):
            for k in sorted(members):
                m = members[k]
                if m.role not in ("attached", "flow"):
                    continue
                op = self.g.ops[k]
                fwd = self.forward(op, [self.labels[bi].get(v) for v in op.inputs])
                outs = tuple(tuple(o if o is not None else f for o, f in zip(old, new))
                             for old, new in zip(m.outs, fwd.outs))
                ins = tuple(tuple(o if o is not None else f for o, f in zip(old, new))
                            for old, new in zip(m.ins, fwd.ins))
                reqs = tuple(dict.fromkeys(m.reqs + fwd.reqs))
                self.add(bi, dataclasses.replace(m, outs=outs, ins=ins, reqs=reqs))

    # -- 5. the record ------------------------------------------------------------------------
    def finish(self) -> BlockAnalysis:
        """The blocks, without strategies yet (``with_strategies``)."""
        blocks = tuple(Block(bi, seed, self.loop_dims[bi],
                             tuple(self.members[bi][k] for k in sorted(self.members[bi])), (), 0)
                       for bi, seed in enumerate(self.seeds))
        unclaimed = tuple(op.index for op in self.g.ops if op.index not in self.owner)
        return BlockAnalysis(blocks, tuple(self.labels), dict(self.owner), unclaimed,
                             self.comparisons)


