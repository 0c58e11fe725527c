"""Building, compiling and measuring window programs on the mesh.

Everything here runs inside a worker process (``cfp.worker``) so that an XLA abort or the
kernel's OOM killer ends the worker, not the pass.

- ``WindowProgram``: a window's operators as a program; per combination its shardings and
  constraints (``compile``), checked against the compiled HLO (``check_compiled``).
- ``Measurement``: one combination as measured (or priced), with its compiled memory
  (``memory_of``).
- ``valid_inputs``: random live-ins valid for their role (ids in range, no zeros, no inf).

Timing lives in ``cfp.timing``, pricing in ``cfp.cost_model``.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

import numpy as np

from cfp import dims as dimrules
from cfp.collectives import COLLECTIVE_KINDS, HLO_BYTES, op_name, tagged_op, unnamed_collectives
from cfp.errors import CfpError
from cfp.jax_compat import compiler_options, is_key, random_keys, to_dtype
from cfp.sharding import SubProgram, state_updates, sub_function, sub_program, update_statistics
from cfp.timing import BUSY_SHARE
from cfp.window_memory import held_for_backward, option_memory, param_values
from cfp.windows import Window, apply_state, held_state, state_layout, window_layouts, window_ops

_FLOAT_LOW, _FLOAT_HIGH = 0.5, 1.5  # positive, away from zero: safe for log, sqrt, division


OVER_BUDGET = "over the budget"  # the end of an ``oom`` note: refused, not run


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One combination of one window (or one resharding) as measured."""

    # ok | oom | compile_error | run_error | mismatch | unexpected_collective | worker_died |
    # not_measured | estimated (priced by the profile search drives, not measured)
    status: str
    time_s: float = float("nan")  # median, launch overhead subtracted
    time_min_s: float = float("nan")
    time_max_s: float = float("nan")
    runs: int = 0
    compile_s: float = 0.0
    peak_bytes: int = 0  # per device: arguments + outputs + temporaries - aliased
    argument_bytes: int = 0
    output_bytes: int = 0
    temp_bytes: int = 0
    # of the temporaries, the weight copies a whole step holds from its start (weight_copy_bytes)
    weight_copy_bytes: int = 0
    collectives: tuple = ()  # ((kind, axes, bytes), ...)
    note: str = ""
    unnamed_collectives: tuple = ()  # described; see WindowProgram.unnamed_collectives
    same_program_as: tuple | None = None  # an earlier combination compiled to this program
    program_sha1: str = ""  # of the compiled program, normalised (normalized_hlo)
    # share of the machine's CPU time that other processes (or the hypervisor) took while
    # this was timed (``CpuShare``; NaN where unknown): over ``BUSY_SHARE`` the time reads high
    others_cpu_share: float = float("nan")
    # the share the hypervisor stole for other machines (steal): this process's own CPU time
    # counts stolen time as its own, so ``others_cpu_share`` sees only part of it
    stolen_cpu_share: float = float("nan")
    # median seconds of ``speed_anchor`` over the rounds of this one's batch (NaN: none ran):
    # the profile pass rescales every batch's times to the anchor's median over the profile
    anchor_s: float = float("nan")
    # of ``time_s``, the seconds priced rather than measured: under mocked GPUs (``--cost
    # mock``) the program's collectives, which the one GPU here skips
    priced_s: float = 0.0

    def over_budget(self) -> bool:
        """Whether this was refused for a compiled peak over the profile's memory budget (not
        run): a profile under a larger budget measures it again."""
        return self.status == "oom" and self.note.endswith(OVER_BUDGET)

    def busy(self) -> bool:
        """Whether this was timed while other work ran on the machine's cores."""
        return self.others_cpu_share > BUSY_SHARE or self.stolen_cpu_share > BUSY_SHARE


def normalized_hlo(compiled) -> str:
    """The compiled program with names, metadata and ids taken out: two programs that differ
    only there are the same program."""
    text = compiled.as_text()
    # the source locations behind the metadata: a program loaded from the compilation cache
    # lists fewer of them than the same program compiled afresh
    text = re.sub(r"^(FileNames|FunctionNames|FileLocations|StackFrames)\n(?:.+\n)*\n?", "",
                  text, flags=re.M)
    text = re.sub(r", metadata=\{[^}]*\}", "", text)
    text = re.sub(r"%[\w.\-]+", "%v", text)
    text = re.sub(r"^HloModule \S+", "HloModule", text, flags=re.M)
    text = re.sub(r"\b[\w\-]+\.\d+\b", "n", text)
    return text


class WindowProgram:
    """A window of blocks as a runnable program (see ``cfp.windows``)."""

    def __init__(self, program, analysis, window: Window, mesh):
        self.program, self.analysis, self.window, self.mesh = program, analysis, window, mesh
        self.graph = analysis.graph
        self.blocks = [analysis.blocks.blocks[b] for b in range(window.start, window.end)]
        self.sub: SubProgram = sub_program(self.graph, window_ops(analysis, window))
        self.names = mesh.axis_names
        self.mesh_shape = tuple(mesh.devices.shape)

    def strategies(self, combo: Sequence[int]):
        return [b.strategies[k] for b, k in zip(self.blocks, combo)]

    def layouts(self, combo) -> tuple[list, list, dict]:
        """Live-in specs (first reader's want, or the state layout's), live-out specs
        (producer's; the state the window holds as it came in), constraints."""
        ins, outs, constraints = window_layouts(self.graph, self.blocks, self.strategies(combo),
                                                self.sub, self.names)
        apply_state(self.analysis, self.window, combo, self.sub, ins, outs, constraints,
                    self.names)
        return ins, outs, constraints

    def donated(self, combo) -> tuple[int, ...]:
        """Positions of the live-ins the window donates, as the step does: training state
        whose new value the window computes, in the layout it came in (so XLA can update it
        in place, and holds the gradient elsewhere)."""
        ins, outs, _ = self.layouts(combo)
        new_of = dict(self.graph.state_pairs())
        out_spec = dict(zip(self.sub.live_outs, outs))
        return tuple(k for k, (v, s) in enumerate(zip(self.sub.live_ins, ins))
                     if out_spec.get(new_of.get(v)) == s)

    def compile(self, combo):
        import jax
        from jax.sharding import NamedSharding, PartitionSpec
        ins, outs, constraints = self.layouts(combo)
        shard = lambda s: NamedSharding(self.mesh, PartitionSpec(*s))  # noqa: E731
        fn = sub_function(self.program, self.sub, constraints=constraints, mesh=self.mesh,
                          tagged=True)
        args = [jax.ShapeDtypeStruct(self.graph.values[v].shape, to_dtype(self.graph.values[v].dtype),
                                     sharding=shard(s)) for v, s in zip(self.sub.live_ins, ins)]
        jitted = jax.jit(fn, in_shardings=[shard(s) for s in ins],
                         out_shardings=[shard(s) for s in outs],
                         donate_argnums=self.donated(combo), keep_unused=True)
        return (jitted.lower(*args).compile(compiler_options(self.mesh)),
                [shard(s) for s in ins])

    def memory(self, compiled, hlo_text: str | None = None) -> dict:
        """The memory fields of a compiled combination's ``Measurement``: ``memory_of`` and
        the ``weight_copy_bytes`` of its HLO text (``hlo_text`` when the caller has it), whose
        weights are the step's parameters among the live-ins (``compile`` keeps every
        live-in, so the entry parameters are numbered as the live-ins)."""
        params = param_values(self.graph)
        weights = [k for k, v in enumerate(self.sub.live_ins) if v in params]
        return dict(memory_of(compiled), weight_copy_bytes=weight_copy_bytes(
            compiled.as_text() if hlo_text is None else hlo_text, weights))

    def option_memory(self, combo, read_earlier: frozenset[int] = frozenset(),
                      held: frozenset[int] | None = None) -> tuple[int, int, int, int, int]:
        """``cfp.window_memory.option_memory`` of ``combo`` compiled here (nothing run): what a
        measured profile composes for it; ``held`` by default as the mesh's platform holds
        it (``cfp.window_memory.held_for_backward``)."""
        compiled, _ = self.compile(combo)
        if held is None:
            held = held_for_backward(self.graph, platform=self.mesh.devices.flat[0].platform)
        return option_memory(self.analysis, self.window, combo,
                             Measurement("ok", **self.memory(compiled)), self.names,
                             read_earlier, held)

    def expected_contractions(self, combo) -> list[tuple[int, tuple[int, ...]]]:
        """(op index, per-device result dims) of each contraction under ``combo`` (outer
        products, which contract nothing, are left out: XLA turns them into multiplies)."""
        out = []
        for block, strat in zip(self.blocks, self.strategies(combo)):
            for m in block.contractions:
                if not m.reduces and not any(d.kind == "contract" for d in block.loop_dims):
                    continue  # an outer product: XLA rewrites it as a broadcast multiply
                dims = list(self.graph.values[self.graph.ops[m.op].outputs[0]].shape)
                for k, lab in enumerate(m.outs[0]):
                    for a, d in enumerate(strat.axes):
                        if lab is not None and d == lab:
                            dims[k] //= self.mesh_shape[a]
                out.append((m.op, tuple(dims)))
        return out

    def check_compiled(self, compiled, combo) -> str:
        """'' when every contraction computes the per-device result the combination implies;
        otherwise what differs (the combination then counts as a mismatch).

        Each contraction is traced in a named scope of its own, so its compiled counterparts
        are the instructions whose metadata carries that tag: one of them must have the
        expected per-device element count, and where a tagged dot or convolution keeps the
        contraction's rank, its dims must be the expected ones up to order (so a split of
        the batch is not taken for a split of the features of equal size). On GPU, XLA
        merges GEMMs that share an operand into one carrying one tag and may emit a
        contraction transposed: there a tagged contraction of k times the expected size
        also counts, and its dims are not compared. A contraction whose tag no instruction
        carries cannot be checked and is passed over; on CPU every contraction keeps its
        tag."""
        differs = self._boundary_differs(compiled, combo)
        if differs:
            return differs
        merged_ok = self.mesh.devices.flat[0].platform != "cpu"
        tagged = tagged_results(compiled.as_text(), self.sub.ops)
        for i, dims in self.expected_contractions(combo):
            if i not in tagged:
                continue
            n = math.prod(dims)
            results = tagged[i]
            sizes = {math.prod(r) for _, r in results}
            merged = merged_ok and any(kind == "contraction" and math.prod(r) % n == 0
                                       and math.prod(r) > n for kind, r in results)
            if n not in sizes and not merged:
                return (f"op {i}: no compiled instruction of per-device size {n} "
                        f"(expected dims {list(dims)}, found {[list(r) for _, r in results][:4]})")
            same_rank = [tuple(sorted(r)) for kind, r in results
                         if kind == "contraction" and len(r) == len(dims) and math.prod(r) == n]
            if same_rank and tuple(sorted(dims)) not in same_rank:
                return (f"op {i}: per-device dims {[list(r) for r in same_rank][:3]}, "
                        f"expected {list(dims)} (in any order)")
        return ""

    def unnamed_collectives(self, compiled, combo) -> list[str]:
        """The compiled window's collectives that its strategies do not name, described.

        Named: an all-reduce of a contraction over the mesh axes of its split contracting
        dims; any collective of a member the strategy leaves out of its block (it needs one);
        a resharding where an operator reads a value another block of the window produced
        (the plan's own resharding between blocks, on either side of the edge), or reads a
        window input in another layout than the one it arrives in (its first reader's).
        Every operator is traced in its own named scope (``op_tag``), so a collective is
        tied to the operator it serves by its metadata; one without a tag is unnamed."""
        mesh_shape, g = self.mesh_shape, self.graph
        owner = {m.op: k for k, b in enumerate(self.blocks) for m in b.members}
        allreduce_axes, excused = {}, set()
        for b, st in zip(self.blocks, self.strategies(combo)):
            allreduce_axes.update(b.named_allreduces(st))
            kept = {m.op for m in b.members_under(st, mesh_shape)}
            excused |= {m.op for m in b.members if m.op not in kept}
        for i in self.sub.ops:  # a resharding between blocks: XLA puts it on either side
            for v in g.ops[i].inputs:
                p = g.values[v].producer if v in g.values else None
                if p in owner and owner[p] != owner.get(i):
                    excused |= {p, i}
        held, untagged = held_state(self.analysis, self.window), frozenset()
        if held:  # the state returned as it came in: gathered there, with no operator's tag
            untagged = frozenset({"all-gather"})
        if held:  # the update's own statistics, under any layout (a norm, Adafactor's)
            excused |= {r for r, k in update_statistics(g).items() if k in set(held)}
        if held and state_layout(self.analysis, self.window, combo) != "plan":
            # split state: gathers and reduce-scatters at its update
            pairs = set(held)
            excused |= {g.values[u].producer for u, k in state_updates(g).items() if k in pairs}
        ins, _, _ = self.layouts(combo)
        arrives = dict(zip(self.sub.live_ins, ins))
        for b, st in zip(self.blocks, self.strategies(combo)):
            for m in b.members:
                if any(v in arrives and dimrules.spec_axes(lab, st.axes, self.names) != arrives[v]
                       for v, lab in zip(g.ops[m.op].inputs, m.ins)):
                    excused.add(m.op)
        # A reduction over a dim of one element per device, XLA folds into the op computing
        # its operand, whose tag its collective then carries: that op is named as it is.
        readers: dict[int, int] = {}
        for i in self.sub.ops:
            for v in g.ops[i].inputs:
                readers[v] = readers.get(v, 0) + 1
        for i in [*allreduce_axes, *excused]:
            for v in g.ops[i].inputs:
                p = g.values[v].producer if v in g.values else None
                if p in owner and readers.get(v) == 1:
                    if i in excused:
                        excused.add(p)
                    else:
                        allreduce_axes.setdefault(p, allreduce_axes[i])
        out = []
        for c in unnamed_collectives(compiled.as_text(), mesh_shape, self.sub.ops,
                                     allreduce_axes, frozenset(excused), untagged):
            out.append(f"{c.kind} over axes {c.axes} "
                       + ("with no operator's tag" if c.op is None
                          else f"at op {c.op} ({g.ops[c.op].primitive})"))
        return out

    def _boundary_differs(self, compiled, combo) -> str:
        """'' when the compiled program takes and gives its values laid out over the mesh
        axes the combination names; per-device shapes alone cannot tell two mesh axes of
        equal size apart, layouts can."""
        from jax.sharding import NamedSharding, PartitionSpec
        ins, outs, _ = self.layouts(combo)
        got_ins, got_outs = compiled.input_shardings[0], compiled.output_shardings
        for role, values, wants, gots in (("input", self.sub.live_ins, ins, got_ins),
                                          ("output", self.sub.live_outs, outs, got_outs)):
            for v, want, got in zip(values, wants, gots):
                ndim = len(self.graph.values[v].shape)
                if not got.is_equivalent_to(NamedSharding(self.mesh, PartitionSpec(*want)), ndim):
                    return (f"{role} value {v}: compiled as {got.spec}, the combination names "
                            f"{PartitionSpec(*want)}")
        return ""


_RESULT_RE = re.compile(r"=\s*\(?([a-z]+\d*)\[([\d,]*)\]")
# Library calls XLA lowers contractions to on GPU (cuBLAS GEMMs, cuDNN convolutions); their
# result is a tuple whose first element is the contraction's result (then a workspace).
_LIBRARY_CONTRACTION = re.compile(r'custom_call_target="__(cublas|cudnn)\$')


def tagged_results(hlo_text: str, ops: Sequence[int]) -> dict[int, list[tuple[str, tuple]]]:
    """Per operator of the tagged sub-program of ``ops``, the (kind, result dims) of every
    compiled instruction whose metadata carries its tag, the layout changes of its sharding
    constraints left out; kind is "contraction" for dots, convolutions and cuBLAS/cuDNN calls."""
    out: dict = {}
    for line in hlo_text.splitlines():
        op, res = tagged_op(line, ops), _RESULT_RE.search(line)
        if op is None or not res or "/sharding_constraint" in op_name(line):
            continue
        kind = ("contraction" if " dot(" in line or " convolution(" in line
                or (" custom-call(" in line and _LIBRARY_CONTRACTION.search(line)) else "other")
        dims = tuple(int(d) for d in res.group(2).split(",") if d)
        out.setdefault(op, []).append((kind, dims))
    return out


def memory_of(compiled) -> dict:
    ma = compiled.memory_analysis()
    if ma is None:
        raise CfpError("this JAX backend gives no memory analysis of compiled programs, which "
                       "cfp needs to keep plans within the memory budget")
    get = lambda k: int(getattr(ma, k, 0) or 0)  # noqa: E731
    arg, out, tmp, alias = (get("argument_size_in_bytes"), get("output_size_in_bytes"),
                            get("temp_size_in_bytes"), get("alias_size_in_bytes"))
    return {"peak_bytes": arg + out + tmp - alias, "argument_bytes": arg,
            "output_bytes": out, "temp_bytes": tmp}


_INSTRUCTION_RE = re.compile(
    r"^\s*(ROOT )?%([\w.\-]+) = ([a-z][a-z0-9]*)\[([\d,]*)\](\{[^}]*\})? ([\w\-]+)\(([^)]*)\)")
_FREE_OPERANDS = ("constant", "iota", "partition-id", "replica-id")  # made from no buffer


def weight_copy_bytes(hlo_text: str, weights: Sequence[int]) -> int:
    """Bytes of a compiled program's weight copies: the temporaries its entry computation
    makes from one weight alone (an entry parameter whose number is in ``weights``) that
    change the weight's layout, shape or type (a transposing copy, a convert; a copy that
    only duplicates the weight is left out, and so is an output), through no collective (a
    gathered weight counts as gathered: ``cfp.windows.gathered_params``). Per weight the
    largest counts. These depend on nothing the step computes, so the whole step makes them
    early and holds them to their last reader, often in the backward pass
    (``scripts/composed_memory.py --peak-top`` lists them live at the compiled peak): XLA on
    CPU copies a weight whose contraction wants its dimensions in another order, and converts
    a bfloat16 weight to float32. What an instruction made from constants alone feeds (an
    offset computed from the partition id, say) is not followed."""
    start = hlo_text.find("\nENTRY")
    source, shape, made, outputs = {}, {}, [], set()
    for line in hlo_text[start:].splitlines()[1:] if start >= 0 else ():
        m = _INSTRUCTION_RE.match(line)
        if not m:
            continue
        root, name, dtype, dims, layout, opcode, operands = m.groups()
        names = re.findall(r"%([\w.\-]+)", operands)
        if root:
            outputs.update(names if opcode == "tuple" else [name])
        shape[name] = (dtype, dims, layout)
        if opcode == "parameter":
            if int(operands) in weights:
                source[name] = int(operands)
            continue
        if opcode in _FREE_OPERANDS:
            source[name] = None
            continue
        found = {source.get(n, -1) for n in names} - {None}
        if len(found) != 1 or -1 in found or opcode.removesuffix("-start") in COLLECTIVE_KINDS:
            continue
        source[name] = weight = found.pop()
        if opcode == "bitcast" or (opcode == "copy" and shape.get(names[0]) == shape[name]):
            continue  # no new buffer, or the same weight again (to donate its buffer)
        nbytes = HLO_BYTES.get(dtype, 4) * math.prod(int(d) for d in dims.split(",") if d)
        made.append((weight, name, nbytes))
    largest = {}
    for weight, name, nbytes in made:
        if name not in outputs:
            largest[weight] = max(largest.get(weight, 0), nbytes)
    return sum(largest.values())


def valid_inputs(graph, sub: SubProgram, seed: int = 0) -> list[np.ndarray]:
    """Random live-ins valid for their role: floats in [0.5, 1.5) (no zeros, no inf), integer
    ids below the size they index (a gather's table rows, a one-hot comparison's classes),
    other integers in [1, 3), booleans all true (no fully masked rows)."""
    rng = np.random.default_rng(seed)
    out = []
    for v in sub.live_ins:
        val = graph.values[v]
        dtype = np.dtype(val.dtype) if val.dtype != "bfloat16" and not is_key(val.dtype) else None
        if is_key(val.dtype):
            out.append(random_keys(val.dtype, val.shape, seed + v))
        elif val.dtype == "bool":
            out.append(np.ones(val.shape, bool))
        elif dtype is not None and np.issubdtype(dtype, np.integer):
            high = _index_bound(graph, v)
            low = 0 if high else 1
            out.append(rng.integers(low, high or 3, size=val.shape).astype(dtype))
        else:
            x = rng.uniform(_FLOAT_LOW, _FLOAT_HIGH, size=val.shape).astype(np.float32)
            out.append(x if val.dtype == "float32" else _cast(x, val.dtype))
    return out


def _cast(x, dtype: str):
    import jax.numpy as jnp
    return np.asarray(jnp.asarray(x, dtype=dtype))


def _index_bound(graph, v: int, depth: int = 0) -> int | None:
    """The size an integer tensor indexes, found through its readers."""
    bound = None
    for u in graph.users.get(v, ()):
        op = graph.ops[u]
        size = None
        if op.primitive == "gather" and op.inputs[1] == v:
            table = graph.values[op.inputs[0]].shape
            size = min(table[d] for d in op.attr("start_index_map", (0,)))
        elif op.primitive in ("eq", "ne", "lt", "le", "gt", "ge"):
            other = [graph.producer_op(w) for w in op.inputs if w != v]
            if other and other[0] is not None and other[0].primitive == "iota":
                size = graph.values[other[0].outputs[0]].shape[other[0].attr("dimension", 0)]
        elif depth < 4 and op.primitive in ("broadcast_in_dim", "reshape", "convert_element_type",
                                            "select_n", "add", "squeeze"):
            size = _index_bound(graph, op.outputs[0], depth + 1)
        if size:
            bound = size if bound is None else min(bound, size)
    return bound
