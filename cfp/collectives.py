"""The collectives of a compiled program, read from its HLO text: their kind, the mesh axes
they run over, their bytes, and the operators they serve (through the ``cfp_op`` tags the
step's constraints leave in the op names), so that a combination's collectives can be checked
against what its strategies name."""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Sequence

import numpy as np


COLLECTIVE_KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
                    "collective-permute")


@dataclasses.dataclass(frozen=True)
class Collective:
    kind: str  # one of COLLECTIVE_KINDS
    bytes: int  # bytes of the result on one device
    axes: tuple[int, ...] | None  # mesh axes its groups run along; None if they match none
    line: str
    op: int | None = None  # the operator it serves, where a check attributed it


_COLL_RE = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s+(" +
                      "|".join(COLLECTIVE_KINDS) + r")(-start)?\(")


_TYPE_RE = re.compile(r"(pred|[a-z]+\d+)\[([\d,]*)\]")


HLO_BYTES = {"pred": 1, "s8": 1, "u8": 1, "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4,
             "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def collectives(hlo_text: str, mesh_shape: tuple[int, ...]) -> list[Collective]:
    """Every collective of a compiled HLO module (``-done`` halves of async pairs skipped)."""
    found = []
    for line in hlo_text.splitlines():
        m = _COLL_RE.match(line)
        if not m:
            continue
        types, kind, start = m.group(1), m.group(2), m.group(3)
        shapes = [(t, [int(d) for d in dims.split(",") if d]) for t, dims in _TYPE_RE.findall(types)]
        if start and len(shapes) > 1:  # async start: (operands..., results...)
            shapes = shapes[len(shapes) // 2:]
        nbytes = sum(HLO_BYTES.get(t, 4) * math.prod(d) for t, d in shapes)
        found.append(Collective(kind, nbytes, _axes_of(line, kind, mesh_shape), line.strip()))
    return found


def _parse_groups(line: str, n: int) -> list[list[int]] | None:
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:<=\[([\d,]+)\](?:T\(([\d,]+)\))?|"
                  r", device_ids=\(\[([\d,]+)\](?:T\(([\d,]+)\))?\))?\s*\{([^}]*)\}", line)
    if m:  # Shardy's form: mesh['a'=4,'b'=2] {'a'}: groups run along the named axes
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        sizes = [int(x) for _, x in axes]
        ids = np.arange(math.prod(sizes))
        shape, perm = (m.group(2), m.group(3)) if m.group(2) else (m.group(4), m.group(5))
        if shape:
            ids = ids.reshape([int(x) for x in shape.split(",")])
            if perm:
                ids = ids.transpose([int(x) for x in perm.split(",")])
        ids = ids.reshape(sizes)
        chosen = [i for i, (name, _) in enumerate(axes) if f"'{name}'" in m.group(6)]
        others = [i for i in range(len(sizes)) if i not in chosen]
        moved = np.transpose(ids, others + chosen)
        return moved.reshape(-1, math.prod(sizes[i] for i in chosen) if chosen else 1).tolist()
    m = re.search(r"replica_groups=\[([\d,]+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", line)
    if m:
        shape = [int(x) for x in m.group(1).split(",")]
        base = np.arange(math.prod(int(x) for x in m.group(2).split(","))).reshape(
            [int(x) for x in m.group(2).split(",")])
        if m.group(3):
            base = base.transpose([int(x) for x in m.group(3).split(",")])
        return base.reshape(shape).reshape(shape[0], -1).tolist()
    m = re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", line)
    if m:
        groups = [[int(x) for x in g.split(",") if x] for g in re.findall(r"\{([\d,]*)\}",
                                                                            m.group(1))]
        return groups if groups and groups[0] else [list(range(n))]
    m = re.search(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}", line)
    if m:
        pairs = [tuple(int(x) for x in p.split(",")) for p in re.findall(r"\{(\d+,\d+)\}",
                                                                         m.group(1))]
        return [list(p) for p in pairs]
    return None


def _axes_of(line: str, kind: str, mesh_shape) -> tuple[int, ...] | None:
    n = math.prod(mesh_shape)
    groups = _parse_groups(line, n)
    if groups is None:
        return None
    coords = np.array(np.unravel_index(np.arange(n), mesh_shape)).T  # device -> mesh coords
    if kind == "collective-permute":
        axes = set()
        for a, b in groups:
            axes |= {i for i in range(len(mesh_shape)) if coords[a][i] != coords[b][i]}
        return tuple(sorted(axes))
    wanted = {frozenset(g) for g in groups}
    for r in range(1, len(mesh_shape) + 1):
        for axes in _subsets(len(mesh_shape), r):
            others = [i for i in range(len(mesh_shape)) if i not in axes]
            part: dict[tuple, set] = {}
            for d in range(n):
                part.setdefault(tuple(coords[d][others]), set()).add(d)
            if {frozenset(s) for s in part.values()} == wanted:
                return axes
    return None


def _subsets(n: int, r: int):
    import itertools
    return [tuple(c) for c in itertools.combinations(range(n), r)]


_TAG_RE = re.compile(r'op_name="[^"]*?\b(cfp_op\d+)/')


def tagged_op(line: str, ops: Sequence[int]) -> int | None:
    """The operator (a step operator index) a compiled instruction of the tagged sub-program
    of operators ``ops`` serves, by its ``op_tag`` (None: no tag)."""
    m = _TAG_RE.search(line)
    k = None if m is None else int(m.group(1)[len("cfp_op"):])
    return ops[k] if k is not None and k < len(ops) else None


def unnamed_collectives(hlo_text: str, mesh_shape, ops: Sequence[int],
                        allreduce_axes: dict[int, tuple],
                        excused: frozenset[int] = frozenset(),
                        untagged: frozenset[str] = frozenset()) -> list[Collective]:
    """The collectives of a compiled sub-program of operators ``ops``, traced with every
    operator in its own named scope (``sub_function(tagged=True)``), that are not named: an
    all-reduce (or a reduce-scatter: for GPUs, XLA's all-reduce whose result is then split)
    tagged with operator ``i`` over a subset of ``allreduce_axes[i]``, and any
    collective tagged with an operator in ``excused``, are named; one without a tag is named
    only when its kind is in ``untagged`` (XLA's gather of split state into the layout the
    program returns it in carries none).
    XLA combines several collectives into one over a tuple, carrying the first one's tag:
    each of its operands is then checked by the operator it serves (``served_ops``)."""
    out = []
    defs = _definitions(hlo_text)
    for c in collectives(hlo_text, mesh_shape):
        for i in served_ops(c, defs, ops):
            named = c.kind in untagged if i is None else i in excused or (
                c.kind in ("all-reduce", "reduce-scatter") and c.axes is not None
                and set(c.axes) <= set(allreduce_axes.get(i, ())))
            if not named:
                out.append(dataclasses.replace(c, op=i))
                break
    return out


_DEF_RE = re.compile(r"^\s*(?:ROOT\s+)?(%[\w.\-]+)\s*=")


_OPERANDS_RE = re.compile(r"\b(?:" + "|".join(COLLECTIVE_KINDS) + r")(?:-start)?\(([^)]*)\)")


_COMPUTATION_RE = re.compile(r"^(?:ENTRY\s+)?(%[\w.\-]+)\s.*\{\s*$")


_REDUCING = (" reduce(", " dot(", " convolution(", " scatter(", " reduce-window(")


def _definitions(hlo_text: str) -> tuple[dict[str, str], dict[str, list[str]]]:
    """(instruction name -> its line, computation name -> its instructions' lines), over every
    computation of a compiled module."""
    lines: dict[str, str] = {}
    bodies: dict[str, list[str]] = {}
    current = None
    for line in hlo_text.splitlines():
        m = _COMPUTATION_RE.match(line)
        if m:
            current = bodies.setdefault(m.group(1), [])
            continue
        d = _DEF_RE.match(line)
        if d:
            lines[d.group(1)] = line
            if current is not None:
                current.append(line)
    return lines, bodies


def _called(line: str, bodies: dict, depth: int = 0) -> list[str]:
    """The lines of the computations an instruction calls (a fusion's body), nested."""
    out = []
    for name in re.findall(r"(?:calls|to_apply)=(%[\w.\-]+)", line) if depth < 4 else ():
        for inner in bodies.get(name, ()):
            out += [inner] + _called(inner, bodies, depth + 1)
    return out


def served_ops(c: Collective, defs: tuple, ops: Sequence[int]) -> list[int | None]:
    """The operators a collective serves: its own tag's, or for one XLA combined over a
    tuple of operands, each operand's. Where the combined collective's metadata names one
    operator per operand (``op_name="(a:b:...)"``), those; else for a reduction's collective
    (all-reduce, reduce-scatter) the tag of the reduction (reduce, dot, convolution, scatter)
    whose partial sums it adds, found inside the fusion computing the operand or up through
    the elementwise instructions after it; otherwise the tag of the instruction computing the
    operand; else the collective's own. A reduction's collective that XLA made without a
    tag (for GPUs, a reduce-scatter from an all-reduce and its slice) serves the reduction
    whose partial sums it adds."""
    own = tagged_op(c.line, ops)
    m = _OPERANDS_RE.search(c.line)
    names = re.findall(r"%[\w.\-]+", m.group(1)) if m else []
    reduces = c.kind in ("all-reduce", "reduce-scatter")
    if own is None and reduces and len(names) == 1:
        return [_nearest_tag(n, defs, ops) for n in _concatenated(names[0], defs) or names]
    if len(names) < 2 or c.kind == "all-to-all":  # an all-to-all's operands are its pieces
        return [own]
    listed = listed_ops(c.line, ops)
    if len(listed) == len(names):
        return listed
    found = []
    for n in names:
        i = (_reduction_of(n, defs, ops) if reduces else tagged_op(defs[0].get(n, ""), ops))
        found.append(own if i is None else i)
    return found


def listed_ops(line: str, ops: Sequence[int]) -> list[int]:
    """The operators a combined collective's metadata names, in its operands' order: XLA's
    combiner joins the combined instructions' names, ``op_name="(cfp_op3/dot:cfp_op9/...)"``."""
    listed = [int(k) for k in re.findall(r"\bcfp_op(\d+)/", op_name(line))]
    return [ops[k] for k in listed] if all(k < len(ops) for k in listed) else []


def op_name(line: str) -> str:
    """A compiled instruction's ``op_name`` metadata ("" where it has none)."""
    m = re.search(r'op_name="([^"]*)"', line)
    return m.group(1) if m else ""


def _fusion_output(line: str, defs: tuple, index: int) -> str | None:
    """The instruction inside a multi-output fusion ``line`` that computes its output
    ``index`` (the operand ``index`` of its computation's root tuple); None if not one."""
    m = re.search(r" fusion\(.*calls=(%[\w.\-]+)", line)
    root = next((x for x in defs[1].get(m.group(1), ()) if x.lstrip().startswith("ROOT ")
                 and " tuple(" in x), None) if m else None
    if root is None:
        return None
    parts = re.findall(r"%[\w.\-]+", root.split(" tuple(", 1)[1])
    return parts[index] if index < len(parts) else None


_MOVES = (" bitcast(", " copy(", " reshape(", " transpose(")


def _nearest_tag(name: str, defs: tuple, ops: Sequence[int], depth: int = 0) -> int | None:
    """The tag of the instruction computing ``name``: up through instructions that only move
    its elements, and for an output of a multi-output fusion, the tag of what computes that
    output inside it (the fusion itself carries its root's)."""
    line = defs[0].get(name, "")
    k = re.search(r" get-tuple-element\((%[\w.\-]+)\), index=(\d+)", line)
    inner = k and _fusion_output(defs[0].get(k.group(1), ""), defs, int(k.group(2)))
    if inner and depth < 6:
        return _nearest_tag(inner, defs, ops, depth + 1)
    i = tagged_op(line, ops)
    if i is not None or depth >= 6 or not any(m in line for m in _MOVES):
        return i
    m = re.search(r"\w\((%[\w.\-]+)", line.split("=", 1)[-1])
    return _nearest_tag(m.group(1), defs, ops, depth + 1) if m else None


def _concatenated(name: str, defs: tuple) -> list[str]:
    """The operands of ``name`` where it is an untagged fusion that concatenates them (for
    GPUs, XLA reduces several values as one flat buffer); else none."""
    line = defs[0].get(name, "")
    if " fusion(" not in line or op_name(line) or not any(
            " concatenate(" in x for x in _called(line, defs[1])):
        return []
    m = re.search(r" fusion\(([^)]*)\)", line)
    return re.findall(r"%[\w.\-]+", m.group(1))


def _reduction_of(name: str, defs: tuple, ops: Sequence[int], depth: int = 0) -> int | None:
    """The operator whose reduction computes the value ``name`` (up through elementwise
    instructions XLA put after it, such as a negation), else ``name``'s own tag."""
    line = defs[0].get(name, "")
    reducing = [i for x in [line] + _called(line, defs[1]) if any(k in x for k in _REDUCING)
                if (i := tagged_op(x, ops)) is not None]
    if reducing:
        return reducing[-1]
    m = re.search(r"\w\((%[^)]*)\)", line.split("=", 1)[-1])
    if depth < 3 and m:
        names = re.findall(r"%[\w.\-]+", m.group(1))
        k = re.search(r" get-tuple-element\(%[\w.\-]+\), index=(\d+)", line)
        if k:  # an element of a tuple another collective returns: that element's operand
            tm = _OPERANDS_RE.search(defs[0].get(names[0], ""))
            parts = re.findall(r"%[\w.\-]+", tm.group(1)) if tm else []
            names = parts[int(k.group(1)):int(k.group(1)) + 1] or names
        for n in names:
            i = _reduction_of(n, defs, ops, depth + 1)
            if i is not None:
                return i
    return tagged_op(line, ops)
