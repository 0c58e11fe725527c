"""Building, compiling and measuring window programs on the mesh.

Everything here runs inside a worker process (``cfp.worker``) so that an XLA abort or the
kernel's OOM killer ends the worker, not the pass.

- ``WindowProgram``: a window's operators as a program; per combination its shardings and
  constraints (``compile``), checked against the compiled HLO (``check_compiled``).
- ``valid_inputs``: random live-ins valid for their role (ids in range, no zeros, no inf).
- ``run_once_s``: one waited-for run (the slowest process's seconds on several hosts).
- ``time_runs``: warm-up, then repeated timed runs (median, min, max), stopping early once a
  combination is already 1.5x slower than the best so far; ``time_rounds`` does the same for
  several programs in interleaved rounds.
- ``time_in_context``: what a resharding adds to the op producing its value (paired,
  interleaved, with a bootstrap interval).
- ``launch_overhead``: the fixed cost of launching a program, subtracted from every window time.
- ``speed_anchor``: a fixed program run in every round of every batch (``time_rounds``), the
  machine's speed gauge, through which the profile pass puts every batch on one scale.
- ``model_cost``: the analytic backend: Alpa's alpha-beta collectives plus a roofline for compute.
"""
from __future__ import annotations

import dataclasses
import math
import re
import statistics
import time
from typing import Sequence

import numpy as np

from cfp import dims as dimrules
from cfp.errors import CfpError
from cfp.gpu_compile import hlo_cost
from cfp.jax_compat import cost_analysis, is_key, random_keys, to_dtype
from cfp.sharding import (COLLECTIVE_KINDS, HLO_BYTES, SubProgram, collectives, op_name,
                          state_updates, sub_function, sub_program, tagged_op,
                          unnamed_collectives, update_statistics)
from cfp.windows import (Window, apply_state, held_for_backward, held_state, option_memory,
                         param_values, state_layout, window_layouts, window_ops)

_FLOAT_LOW, _FLOAT_HIGH = 0.5, 1.5  # positive, away from zero: safe for log, sqrt, division


@dataclasses.dataclass(frozen=True)
class Measurement:
    """One combination of one window (or one resharding) as measured."""

    # ok | oom | compile_error | run_error | mismatch | unexpected_collective | worker_died |
    # not_measured
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

    def busy(self) -> bool:
        """Whether this was timed while other work ran on the machine's cores."""
        return self.others_cpu_share > BUSY_SHARE or self.stolen_cpu_share > BUSY_SHARE


# Over this share of the cores taken by others while a batch is timed, its times read high:
# one other JAX process on 8 virtual devices takes about half of 2 cores and slows a program
# 1.5x; an idle machine leaves a few percent to daemons.
BUSY_SHARE = 0.15


class CpuShare:
    """The share of the machine's CPU time (all its cores) that others took between
    ``start()`` and ``share()``: the cores' busy and stolen time from ``/proc/stat``, less this
    process's own CPU time, and the stolen part alone (the hypervisor ran another machine on
    these cores). NaN where ``/proc/stat`` cannot be read (not Linux) or several processes
    measure together (on one host each would count the others' device threads)."""

    def start(self) -> "CpuShare":
        self.before = _cpu_counters()
        return self

    def share(self) -> tuple[float, float]:
        """(others' share, the stolen part of it)."""
        after = _cpu_counters()
        if self.before is None or after is None:
            return float("nan"), float("nan")
        machine_s, stolen_s, own_s, wall_s = (a - b for a, b in zip(after[:4], self.before[:4]))
        capacity_s = max(1e-9, wall_s * after[4])
        return max(0.0, machine_s - own_s) / capacity_s, max(0.0, stolen_s) / capacity_s


def _cpu_counters() -> tuple[float, float, float, float, int] | None:
    """(seconds the machine's cores were busy or stolen, seconds stolen, this process's CPU
    seconds, wall seconds, cores), or None."""
    import os
    from cfp.multihost import processes
    if processes() > 1:
        return None
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    ticks = [int(x) for x in lines[0].split()[1:]] + [0] * 8
    user, nice, system, _idle, _iowait, irq, softirq, steal = ticks[:8]
    cores = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    own, tick_s = os.times(), 1 / os.sysconf("SC_CLK_TCK")
    return ((user + nice + system + irq + softirq + steal) * tick_s, steal * tick_s,
            own.user + own.system, time.perf_counter(), cores)


def normalized_hlo(compiled) -> str:
    """The compiled program with names, metadata and ids taken out: two programs that differ
    only there are the same program."""
    text = compiled.as_text()
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
        return jitted.lower(*args).compile(), [shard(s) for s in ins]

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
                      held: frozenset[int] | None = None) -> tuple[int, int, int, int]:
        """``cfp.windows.option_memory`` of ``combo`` compiled here (nothing run): what a
        measured profile composes for it; ``held`` by default as the mesh's platform holds
        it (``cfp.windows.held_for_backward``)."""
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


class Fresh:
    """Inputs for a program that donates some (``donated`` positions): each call gives
    ``args`` with fresh copies there, since a run deletes what it donates."""

    def __init__(self, args, donated: Sequence[int]):
        self.args, self.donated = list(args), set(donated)

    def __call__(self) -> list:
        return [x.copy() if k in self.donated else x for k, x in enumerate(self.args)]


def inputs(args) -> list:
    """``args``, or what a ``Fresh`` gives, made and waited for before any clock starts."""
    import jax
    return jax.block_until_ready(args()) if callable(args) else args


def run_once_s(fn, args) -> float:
    """Seconds of one run of ``fn(*args)``, waited for; on several hosts the slowest
    process's, so that every process takes the same decisions from it. ``args`` may be a
    ``Fresh``: its copies are made before the clock starts."""
    import jax
    from cfp.multihost import slowest
    args = inputs(args)
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    return slowest(time.perf_counter() - t0)


def time_runs(fn, args, *, best_s: float | None, warmup: int = 1, min_runs: int = 3,
              max_runs: int = 30, rel_error: float = 0.02) -> tuple[list[float], bool]:
    """Timed runs of ``fn(*args)`` (seconds each) and whether it stopped early because it was
    already 1.5x slower than ``best_s``.

    The number of runs follows the measured spread: after ``min_runs``, runs stop once the
    median's standard error (1.253 sigma / sqrt(n), sigma estimated as 1.4826 times the median
    absolute deviation) is within ``rel_error`` of the median, or at ``max_runs``. A steady
    program needs ``min_runs``; a noisy one gets more."""
    import jax
    for _ in range(warmup):
        jax.block_until_ready(fn(*inputs(args)))
    times: list[float] = []
    while len(times) < max_runs:
        times.append(run_once_s(fn, args))
        if best_s and len(times) >= 3 and statistics.median(times) > 1.5 * best_s:
            return times, True
        if len(times) >= min_runs and median_rel_error(times) <= rel_error:
            break
    return times, False


def time_rounds(programs: Sequence[tuple], *, best_s: float | None, warmup: int = 1,
                min_rounds: int = 7, max_rounds: int = 30, rel_error: float = 0.02,
                anchor: tuple | None = None,
                overhead_s: float = 0.0) -> tuple[list[tuple[list[float], bool]], list[float]]:
    """Timed runs of several ``(fn, args)`` in interleaved rounds: per program its times
    (seconds, ``overhead_s`` subtracted) and whether it stopped early because it was already
    1.5x slower than the best (``best_s`` or the best of these); and the times of ``anchor``
    (a ``(fn, args)`` run first in every round, launch included; none without one).

    Each round runs every program still being timed once, so a change of the machine's speed
    during the batch falls on all of them alike instead of on whichever ran then; the anchor
    tells how fast the machine ran during the batch, against other batches. Each timed run
    follows an untimed run of the same program: in the step a window reads what the window
    before it just wrote, while a program run right after another one (another combination,
    the anchor) finds the caches holding that one's data, so that a small model's windows
    add up to more than its step (``scripts/composed_memory.py --search``). The order
    rotates each round besides. A program leaves
    after ``min_rounds`` once its median's standard error is within ``rel_error`` (see
    ``time_runs``), or at ``max_rounds``."""
    import jax
    for fn, args in list(programs) + ([anchor] if anchor else []):
        for _ in range(warmup):
            jax.block_until_ready(fn(*inputs(args)))
    times: list[list[float]] = [[] for _ in programs]
    anchor_times: list[float] = []
    early = [False] * len(programs)
    live = list(range(len(programs)))
    rounds = 0
    while live:
        if anchor:
            anchor_times.append(run_once_s(*anchor))  # whole: a gauge, not a window
        for i in live[rounds % len(live):] + live[:rounds % len(live)]:
            fn, args = programs[i]
            jax.block_until_ready(fn(*inputs(args)))  # untimed: the caches as in the step
            times[i].append(max(0.0, run_once_s(fn, args) - overhead_s))
        rounds += 1
        best = min([statistics.median(t) for t, e in zip(times, early) if t and not e]
                   + ([best_s] if best_s else []))
        still = []
        for i in live:
            if rounds >= 3 and statistics.median(times[i]) > 1.5 * best:
                early[i] = True
            elif rounds < max_rounds and (rounds < min_rounds
                                          or median_rel_error(times[i]) > rel_error):
                still.append(i)
        live = still
    return list(zip(times, early)), anchor_times


def time_in_context(producer, with_reshard, args, *, min_rounds: int = 5,
                    max_rounds: int = 12, rel_width: float = 0.1,
                    warmup: int = 2) -> tuple[float, float, float]:
    """Seconds a resharding adds after the op producing its value: ``producer`` alone and
    ``with_reshard`` (the same op, its result resharded) timed interleaved. A round runs the
    pair in both orders (producer, resharded, resharded, producer, after one untimed run)
    and takes the mean of the two differences, so a steady drift, and what a run pays for
    following the other program, cancel within the round. Returns the median of the rounds'
    differences and its 95% bootstrap interval; where the interval does not lie above 0,
    the resharding counts as 0. Rounds stop after ``min_rounds`` once the interval is narrower than
    ``rel_width`` of the resharded program's median, or at ``max_rounds``.

    Both programs launch alike, so the launch cost drops out of the difference, and the
    resharding is timed on a value just written, as in the step."""
    import jax
    for _ in range(warmup):
        jax.block_until_ready(producer(*args)), jax.block_until_ready(with_reshard(*args))
    diffs, whole = [], []
    for _ in range(max(min_rounds, max_rounds)):
        seconds = {"p": [], "r": []}
        jax.block_until_ready(producer(*args))  # untimed: the first run after a pause is slow
        for name, fn in (("p", producer), ("r", with_reshard), ("r", with_reshard),
                         ("p", producer)):
            seconds[name].append(run_once_s(fn, args))
        diffs.append(statistics.fmean(seconds["r"]) - statistics.fmean(seconds["p"]))
        whole.extend(seconds["r"])
        if len(diffs) >= min_rounds:
            low, high = median_interval(diffs)
            if high - low <= rel_width * statistics.median(whole):
                break
    return (0.0 if low <= 0 else statistics.median(diffs)), low, high


def median_interval(samples: Sequence[float], *, resamples: int = 1000,
                    seed: int = 0) -> tuple[float, float]:
    """95% bootstrap interval of the median of ``samples`` (a fixed seed: the same samples
    give the same interval on every process)."""
    x = np.asarray(samples, float)
    rng = np.random.default_rng(seed)
    medians = np.median(x[rng.integers(0, len(x), size=(resamples, len(x)))], axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def median_rel_error(times: Sequence[float]) -> float:
    """Standard error of the median of ``times``, relative to the median."""
    med = statistics.median(times)
    mad = statistics.median(abs(t - med) for t in times)
    return 1.253 * 1.4826 * mad / math.sqrt(len(times)) / med if med > 0 else 0.0


def launch_overhead(mesh, repeats: int = 50) -> float:
    """Median wall time of launching a trivial sharded program on the mesh."""
    import jax
    from jax.sharding import NamedSharding, PartitionSpec
    from cfp.multihost import put
    n = math.prod(mesh.devices.shape)
    x = put(np.ones((n, 8), np.float32), NamedSharding(mesh, PartitionSpec(mesh.axis_names)))
    f = jax.jit(lambda a: a + 1)
    times, _ = time_runs(f, (x,), best_s=None, warmup=5, min_runs=repeats, max_runs=repeats)
    return statistics.median(times)


def speed_anchor(mesh, rows_per_device: int = 512, width: int = 256, layers: int = 6):
    """``(fn, args)``: a fixed program on the mesh, timed in every round of every batch as the
    machine's speed gauge (a data-parallel stack of ``tanh(x @ w)``: every device computes,
    as in a window). It depends on the mesh alone, so every window type, every batch and a
    resumed profile time against the same program. On a GPU it is launch-bound and gauges
    the launch path, which varies little there."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec
    from cfp.multihost import put
    n = math.prod(mesh.devices.shape)
    rng = np.random.default_rng(0)
    x = put(rng.uniform(-1, 1, (n * rows_per_device, width)).astype(np.float32),
            NamedSharding(mesh, PartitionSpec(mesh.axis_names)))
    w = put((rng.uniform(-1, 1, (width, width)) / math.sqrt(width)).astype(np.float32),
            NamedSharding(mesh, PartitionSpec()))

    def stack(x, w):
        for _ in range(layers):
            x = jnp.tanh(x @ w)
        return x
    fn = jax.jit(stack)
    jax.block_until_ready(fn(x, w))  # compiled here, not in the first round it is timed in
    return fn, (x, w)


# ---------------------------------------------------------------------------------------------
# The analytic backend


@dataclasses.dataclass(frozen=True)
class CostModel:
    """Alpa's alpha-beta model per mesh axis plus a compute roofline."""

    alpha: tuple[float, ...]  # seconds per collective, per mesh axis
    beta: tuple[float, ...]  # seconds per byte, per mesh axis
    device_flops: float  # FLOP/s of one device
    device_bandwidth: float  # bytes/s of one device's memory
    # the devices' XLA platform: which elementwise results its fusion recomputes
    # (``cfp.windows.expensive``) and so which the forward pass holds
    platform: str = "cpu"
    # the GPUs' description (``cfp.gpu_compile.GPUS``): where JAX's CUDA plugin is installed,
    # compile-only programs are compiled for them, not for the devices here
    gpu: str | None = None

    def collective_s(self, kind: str, axes: tuple[int, ...] | None, nbytes: int,
                     mesh_shape) -> float:
        axes = axes if axes else tuple(range(len(mesh_shape)))
        n = math.prod(mesh_shape[a] for a in axes)
        if n <= 1:
            return 0.0
        a = max(self.alpha[x] for x in axes)
        b = max(self.beta[x] for x in axes)
        if kind == "all-reduce":
            return a + b * 2 * (n - 1) / n * nbytes
        if kind in ("all-gather", "reduce-scatter"):
            return a + b * (n - 1) / n * nbytes
        if kind == "all-to-all":
            return a + b * (n - 1) / n / n * nbytes
        return a + b * nbytes  # collective-permute


# Documented presets (per device): peak dense bf16/fp32-TF32 FLOP/s, HBM bandwidth, and
# alpha-beta for NVLink inside a node (axis 1) and the network across nodes (axis 0).
DEVICE_PRESETS = {
    "a100": {"device_flops": 312e12, "device_bandwidth": 1.555e12,
             "alpha": (5e-6, 5e-6), "beta": (1 / 25e9, 1 / 150e9), "platform": "gpu",
             "gpu": "a100"},
    "h100": {"device_flops": 989e12, "device_bandwidth": 3.35e12,
             "alpha": (5e-6, 3e-6), "beta": (1 / 50e9, 1 / 450e9), "platform": "gpu",
             "gpu": "h100"},
    "h200": {"device_flops": 989e12, "device_bandwidth": 4.8e12,
             "alpha": (5e-6, 3e-6), "beta": (1 / 50e9, 1 / 450e9), "platform": "gpu",
             "gpu": "h200"},
}


def fit_cost_model(mesh, sizes=(2**12, 2**15, 2**18, 2**21)) -> CostModel:
    """Alpha-beta per mesh axis and a compute roofline, measured on the devices at hand.

    Per axis, all-reduces of ``sizes`` bytes (a sum over a dim split on that axis) are timed and
    ``t = alpha + beta * 2(n-1)/n * bytes`` is fitted by least squares; FLOP/s come from a
    matmul split over every device, bandwidth from an elementwise add."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec
    names, shape = mesh.axis_names, mesh.devices.shape
    alpha, beta = [], []
    for a, n in enumerate(shape):
        if n == 1:
            alpha.append(0.0), beta.append(0.0)
            continue
        xs, ys = [], []
        for nbytes in sizes:
            x = jax.device_put(jnp.ones((n, nbytes // 4), jnp.float32),
                               NamedSharding(mesh, PartitionSpec(names[a], None)))
            f = jax.jit(lambda v: v.sum(0), out_shardings=NamedSharding(mesh, PartitionSpec()))
            times, _ = time_runs(f, (x,), best_s=None, warmup=3, min_runs=20, max_runs=20)
            xs.append(2 * (n - 1) / n * nbytes)
            ys.append(statistics.median(times))
        slope, icept = np.polyfit(np.array(xs, float), np.array(ys, float), 1)
        alpha.append(max(float(icept), 1e-7)), beta.append(max(float(slope), 1e-13))
    n = math.prod(shape)
    k = 512
    a = jax.device_put(jnp.ones((n * k, k), jnp.float32),
                       NamedSharding(mesh, PartitionSpec(tuple(names), None)))
    w = jax.device_put(jnp.ones((k, k), jnp.float32), NamedSharding(mesh, PartitionSpec()))
    mm = jax.jit(lambda u, v: u @ v)
    t_mm = statistics.median(time_runs(mm, (a, w), best_s=None, warmup=3, min_runs=10,
                                       max_runs=10)[0])
    add = jax.jit(lambda u: u + 1.0)
    t_add = statistics.median(time_runs(add, (a,), best_s=None, warmup=3, min_runs=10,
                                        max_runs=10)[0])
    flops = 2 * k * k * k / t_mm  # per device: each holds k rows
    bandwidth = 2 * 4 * k * k / t_add
    return CostModel(tuple(alpha), tuple(beta), flops, bandwidth,
                     mesh.devices.flat[0].platform)


def model_cost(compiled, mesh_shape, cost: CostModel) -> tuple[float, tuple]:
    """Predicted seconds of a compiled program: roofline compute + alpha-beta collectives."""
    text = compiled.as_text()
    analysis = cost_analysis(compiled)
    if analysis:
        flops = float(analysis.get("flops", 0.0))
        nbytes = float(analysis.get("bytes accessed", 0.0))
    else:  # compiled for described GPUs: XLA gives no cost analysis there
        flops, nbytes = hlo_cost(text)
    compute = max(flops / cost.device_flops, nbytes / cost.device_bandwidth)
    if compute <= 0:
        raise RuntimeError("a compiled program priced at zero compute time: no FLOPs and no "
                           "bytes read from its HLO")
    comm, colls = collectives_cost(text, mesh_shape, cost)
    return compute + comm, colls


def collectives_cost(hlo_text: str, mesh_shape, cost: CostModel) -> tuple[float, tuple]:
    """Alpha-beta seconds of a compiled program's collectives, and those collectives
    ``((kind, mesh axes, bytes), ...)``. CPU's reduce-scatter (an all-reduce whose result is
    then sliced) is priced as one."""
    colls = collectives(hlo_text, mesh_shape)
    sliced = _sliced_allreduces(hlo_text)
    comm = 0.0
    for c in colls:
        kind = "reduce-scatter" if c.kind == "all-reduce" and c.line.split("=")[0].strip(
            " %") in sliced else c.kind
        comm += cost.collective_s(kind, c.axes, c.bytes, mesh_shape)
    return comm, tuple((c.kind, c.axes, c.bytes) for c in colls)


def _sliced_allreduces(text: str) -> set[str]:
    """Names of all-reduces whose only use is a dynamic-slice (CPU's reduce-scatter)."""
    names = set()
    for m in re.finditer(r"dynamic-slice\(%?([\w.\-]+)", text):
        if m.group(1).startswith("all-reduce"):
            names.add(m.group(1))
    return names


def fit_cost_model_for(mesh_shape, device_ids=None) -> CostModel:
    """``fit_cost_model`` on a mesh of this shape over JAX's devices, or those of
    ``device_ids`` in that order (run in the worker)."""
    from cfp.mesh import make_mesh
    return fit_cost_model(make_mesh(tuple(mesh_shape), device_ids=device_ids))


def slower(a_s: Sequence[float], b_s: Sequence[float]) -> bool:
    """Whether program ``a`` is measurably slower than ``b``, from their times in the same
    interleaved rounds (a round's drift hits both): the 95% interval of the median of the
    per-round ratios lies above 1."""
    return median_interval([a / b for a, b in zip(a_s, b_s)])[0] > 1
