"""What people read: console lines and the text dumps of each pass.

Library code logs; the lines users read come from here.
"""
from __future__ import annotations

import collections
import math
import sys
from pathlib import Path

from cfp.jax_compat import is_key


def say(line: str = "") -> None:
    print(line, flush=True)


def silence() -> None:
    """Print nothing from here on (a process other than 0 of several: process 0 reports)."""
    import os
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the rest of the process


# ---------------------------------------------------------------------------------------------
# analysis


def analysis_console(rec) -> None:
    g, ba, sa, st = rec.graph, rec.blocks, rec.segments, rec.stats
    keys = sum(bool(g.ops[i].outputs) and all(is_key(g.values[v].dtype) for v in g.ops[i].outputs)
               for i in ba.unclaimed)
    say(f"traced {len(g.ops)} operators ({g.dead_ops} dead ones dropped), "
        f"{len(ba.blocks)} ParallelBlocks, {len(ba.unclaimed)} unclaimed operators"
        + (f" ({keys} of them only make PRNG keys)" if keys else ""))
    before = sum(b.strategies_before_pruning for b in ba.blocks)
    after = sum(len(b.strategies) for b in ba.blocks)
    say(f"strategies over all blocks: {before} before pruning, {after} after "
        f"(dominated and non-dividing ones dropped)")
    for b in ba.blocks:
        roles = collections.Counter(m.role for m in b.members)
        say(f"  ParallelBlock {b.index}: {len(b.members)} ops "
            f"({roles['seed'] + roles['input-grad'] + roles['weight-grad']} contractions), "
            f"{len(b.strategies)} strategies  {_short(g.ops[b.seed].hlo)}")
    for seg in sa.instances:
        rep = sa.instances[sa.representatives[seg.type]]
        say(f"ParallelBlocks sequence: ({seg.start}, {seg.end}) mapped to "
            f"({rep.start}, {rep.end})")
    for t in range(sa.num_types):
        say(f"unique segment {t}: search space {rec.segment_space(t)}")
    say(f"FLOPs inside blocks: {100 * st.flops_share:.2f}% of {st.flops_total:.3e}")
    if st.num_layers:
        say(f"blocks per layer: {len(ba.blocks) / st.num_layers:.2f}; "
            f"operators per layer: {len(g.ops) / st.num_layers:.0f}; "
            f"operators in segment type 0: {segment_op_count(rec, 0)}")
    say(f"whole-model plan space: 10^{rec.plan_space_log10():.1f} plans")
    say(f"global analysis time: {st.time_s:.3f}")


def segment_op_count(rec, seg_type: int) -> int:
    seg = rec.segments.instances[rec.segments.representatives[seg_type]]
    return sum(len(rec.blocks.blocks[b].members) for b in range(seg.start, seg.end))


def _short(text: str, width: int = 110) -> str:
    return text if len(text) <= width else text[:width - 3] + "..."


def write_analysis_dumps(rec, directory: Path) -> None:
    """``parallel_blocks.txt``, ``strategy_map.txt`` and ``segments.txt``."""
    directory.mkdir(parents=True, exist_ok=True)
    g, ba = rec.graph, rec.blocks
    paths = input_paths(rec.spec)
    lines = []
    for b in ba.blocks:
        lines.append(f"Parallel Block {b.index}:")
        for m in b.members:
            op = g.ops[m.op]
            lines.append(f"    {m.op} {_with_paths(op.hlo, paths)}")
            lines.append(f"    role: {m.role}; plan: {_plan_text(m.outs)}"
                         + (f"; collective-free unless split: {_reqs_text(m.reqs)}"
                            if m.reqs else ""))
    lines.append("")
    lines.append(f"Unclaimed operators ({len(ba.unclaimed)}):")
    lines += [f"    {i} {g.ops[i].hlo}" for i in ba.unclaimed]
    (directory / "parallel_blocks.txt").write_text("\n".join(lines) + "\n")

    lines = []
    for b in ba.blocks:
        lines.append(f"Instruction {b.seed}: {_with_paths(g.ops[b.seed].hlo, paths)}")
        lines += [f"Strategy {s.name}" for s in b.strategies]
        lines.append(f"({b.strategies_before_pruning} valid before pruning, "
                     f"{len(b.strategies)} kept)")
    (directory / "strategy_map.txt").write_text("\n".join(lines) + "\n")

    sa = rec.segments
    lines = [f"cut widths between consecutive blocks: {list(sa.cut_widths)}",
             f"pieces start at blocks: {list(sa.piece_starts)}"]
    for seg in sa.instances:
        rep = sa.instances[sa.representatives[seg.type]]
        lines.append(f"ParallelBlocks sequence: ({seg.start}, {seg.end}) mapped to "
                     f"({rep.start}, {rep.end})  type {seg.type}")
    for t in range(sa.num_types):
        lines.append(f"segment type {t}: search space {rec.segment_space(t)}, "
                     f"{segment_op_count(rec, t)} operators")
    (directory / "segments.txt").write_text("\n".join(lines) + "\n")


def _plan_text(outs) -> str:
    return "; ".join(",".join("-" if l is None else str(l) for l in lab) for lab in outs)


def _reqs_text(reqs) -> str:
    return ", ".join(f"loop dim {l}" if d == 0 else f"loop dim {l} (unless it divides {d})"
                     for l, d in reqs)


# ---------------------------------------------------------------------------------------------
# profile


class ProfileProgress:
    """The profile pass's ``on_result``: one progress line for the whole pass (combinations
    done of all window types, the current one, an ETA from the measured rate), redrawn at
    least every 5 s on a terminal; elsewhere one line per combination, and a line every 5 s
    while none comes. ``close()`` when the pass ends."""

    def __init__(self, interval_s: float = 5.0):
        import sys
        import threading
        self.tty = sys.stdout.isatty()
        self.total = self.n = 0
        self.unit = "combinations"
        self.where = "starting the worker"
        self.t0 = self.t_first = None
        self.last_line_s = 0.0
        self.interval_s = interval_s
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._tick, daemon=True)
        self.thread.start()

    def __call__(self, event: str, **f) -> None:
        import time
        with self.lock:
            if event == "start":
                self.total, self.t0 = f["total"], time.perf_counter()
                self._line(f"window types to profile: {f['num_types']}; combinations to "
                           f"measure: {f['total']} ({f['known']} measured before)")
            elif event == "window":
                w = f["window"]
                self.where = f"window type {f['k']}"
                self._line(f"window type {f['k']} (blocks {w.start}..{w.end - 1}): search "
                           f"space {list(f['space'])}, {f['todo']} to measure"
                           + (f", {f['known']} measured before" if f["known"] else ""))
            elif event == "state_variants":
                self.total += f["count"]
            elif event == "result":
                self.n += 1
                if self.t_first is None:
                    self.t_first = time.perf_counter()
                m = f["measurement"]
                text = (f"window type {f['k']} combination {list(f['combo'])}: "
                        + (f"{m.time_s * 1e3:.4g} ms, {m.peak_bytes / 2**30:.4g} GB"
                           if m.status == "ok" else f"{m.status} {m.note}"))
                if self.tty:
                    self._bar()
                else:
                    self._line(f"[{self.n}/{self.total}] {text}")
            elif event == "not_measured":
                what = ("reshardings" if f["k"] is None
                        else f"combinations of window type {f['k']}")
                self._line(f"profile budget spent: {f['count']} {what} not measured "
                           f"(profile again to measure them)")
            elif event == "ranked":
                self._line(f"window type {f['k']}: {f['space']} combinations; measuring the "
                           f"{f['cheapest']} cheapest by the additive analytic price"
                           + (f" and {f['baselines']} more that baselines use"
                              if f["baselines"] else ""))
            elif event == "reshards":
                self.where = "timing reshardings"
                self._line(f"boundaries between window instances: {f['boundaries']}; distinct "
                           f"reshardings to time: {f['needed']} ({f['known']} known)")
                if f["needed"] > f["known"]:  # the progress counts reshardings from here
                    self.unit, self.n, self.t_first = "reshardings", 0, time.perf_counter()
                    self.total = f["needed"] - f["known"]
            elif event == "reshards_timed":
                self.n = f["done"]
                if self.tty:
                    self._bar()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=1)
        if self.tty and self.total:
            print(flush=True)

    def _eta(self) -> str:
        import time
        if self.t_first is None or self.n < 2:
            return "ETA --"
        rate = (self.n - 1) / max(1e-9, time.perf_counter() - self.t_first)
        return f"ETA {(self.total - self.n) / rate:.0f} s"

    def _bar(self) -> None:
        import time
        bar = "#" * int(30 * self.n / max(1, self.total))
        print(f"\r[{bar:<30}] {self.n}/{self.total} {self.unit}, {self.where}, "
              f"{self._eta()}   ", end="", flush=True)
        self.last_line_s = time.perf_counter()

    def _line(self, text: str) -> None:
        import time
        if self.tty and self.total:
            print("\r" + " " * 100 + "\r", end="")
        say(text)
        self.last_line_s = time.perf_counter()

    def _tick(self) -> None:
        import time
        while not self.stop.wait(self.interval_s / 5):
            with self.lock:
                if time.perf_counter() - self.last_line_s < self.interval_s or not self.total:
                    continue
                if self.tty:
                    self._bar()
                else:
                    self._line(f"[{self.n}/{self.total} {self.unit}] {self.where}, "
                               f"{self._eta()}")


def profile_console(rec, model_space_log10: float) -> None:
    counts = collections.Counter(m.status for seg in rec.window_profiles.values()
                                 for m in seg.results.values())
    say(f"combinations: {sum(counts.values())} ({', '.join(f'{k} {v}' for k, v in sorted(counts.items()))}); "
        f"compiled in this run: {rec.compiled}")
    if rec.cost != "analytic":
        say(f"launch overhead subtracted: {rec.launch_overhead_s * 1e3:.3f} ms per program")
    busy = rec.busy_window_types()
    if busy:
        marked = [m for seg in rec.window_profiles.values() for m in seg.results.values()
                  if m.busy()]
        worst = max(m.others_cpu_share for m in marked)
        stolen = [m.stolen_cpu_share for m in marked if math.isfinite(m.stolen_cpu_share)]
        by_host = (f"; the hypervisor stole up to {max(stolen):.0%} for other machines"
                   if stolen else "")
        say(f"warning: {sum(busy.values())} combinations of window types "
            f"{', '.join(map(str, sorted(busy)))} were timed on a busy machine (other work "
            f"took up to {worst:.0%} of its cores{by_host}): their times read high; delete those "
            f"window_<type>.pkl files from the work dir and profile again on an idle machine")
    if rec.reshard_interval_s:
        say(f"reshardings timed after the op producing their value: "
            f"{len(rec.reshard_interval_s)}; {rec.reshards_counted_zero()} of them add "
            f"nothing measurable (95% interval not above 0) and count as 0")
    say(f"whole-model plan space: 10^{model_space_log10:.1f} plans, covered by "
        f"{len(rec.windows)} window instances of {len(rec.window_profiles)} types")
    phases_console("profile", rec.time_s, rec.phase_s)


def phases_console(name: str, total_s: float, phase_s: dict) -> None:
    parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(phase_s.items(), key=lambda kv: -kv[1]))
    say(f"{name} pass: {total_s:.1f} s" + (f" ({parts})" if parts else ""))


# ---------------------------------------------------------------------------------------------
# search


def search_console(rec, devices: int) -> None:
    say(f"solver: {rec.solver_status} in {rec.solve_s:.2f} s; {len(rec.candidates)} "
        f"candidate plans run end to end")
    for i, c in enumerate(rec.candidates):
        say(f"candidate {i} ({c.source}): predicted {c.predicted_s:.6f} s, "
            f"measured {c.median_s:.6f} s; memory {c.composed_memory_bytes / 2**30:.4f} GB "
            f"composed, {c.compiled_peak_bytes / 2**30:.4f} GB compiled"
            + ("  <- kept" if i == rec.kept else ""))
    if rec.numerics is not None:
        say(f"numerical check against one device: loss rel. error "
            f"{rec.numerics['loss_rel_err']:.2e}, gradients match")
    plan = rec.plan
    own = plan.source.startswith("predicted")  # "predicted" or "predicted without reshardings"
    source = ("cfp's own prediction" + plan.source.removeprefix("predicted") if own
              else f"the {plan.source.split()[-1]} baseline")
    say(f"searched ParallelBlock Strategies solution ({source}): {list(plan.strategies)}")
    say(f"searched training cost (s per step, one per round): "
        f"{[round(t, 6) for t in plan.measured_s]}, memory_cost (GB per device): "
        f"{rec.memory['peak_bytes'] / 2**30:.4f}")
    say(f"TFLOP_COUNT: {rec.step_flops / 1e12:.6g}")
    phases_console("search", rec.time_s, rec.phase_s)
    say(f"plan kept: {source}, the measured fastest of {len(rec.candidates)} candidates")
    say(f"step time: median {plan.median_s * 1e3:.3f} ms (min {min(plan.measured_s) * 1e3:.3f},"
        f" max {max(plan.measured_s) * 1e3:.3f}) over {len(plan.measured_s)} rounds; "
        f"predicted {plan.predicted_s * 1e3:.3f} ms; "
        f"{rec.step_flops / plan.median_s / devices / 1e12:.4g} TFLOP/s per device")
    say(f"memory per device: {rec.memory['peak_bytes'] / 2**30:.4f} GB compiled, "
        f"{plan.composed_memory_bytes / 2**30:.4f} GB composed from the profiles")
    if rec.scans == "rolled":
        say("scans run as lax.scan: one strategy per scan body")
    elif rec.scans == "unrolled":
        say("scans run unrolled: this plan gives a scan's iterations different strategies")


def input_paths(spec) -> list[str]:
    """The pytree path of every step input, ``Arg_<k>`` in the dumps' HLO lines: parameters,
    optimizer state and batch, as ``jax.tree_util.keystr`` writes them."""
    import jax
    w = spec.build()
    leaves = jax.tree_util.tree_flatten_with_path(
        {"params": w.abstract_params(), "opt_state": w.abstract_opt_state(),
         "batch": w.abstract_batch()})[0]
    order = {"params": 0, "opt_state": 1, "batch": 2}  # the step's argument order
    leaves.sort(key=lambda pl: order[pl[0][0].key])
    return [jax.tree_util.keystr(p) for p, _ in leaves]


def _with_paths(hlo: str, paths: list[str]) -> str:
    """``hlo`` followed by the path of every step input it reads."""
    import re
    args = sorted({int(k) for k in re.findall(r"%Arg_(\d+)\.", hlo)})
    return hlo + ("  # " + ", ".join(f"Arg_{k} = {paths[k]}" for k in args if k < len(paths))
                  if args else "")


def write_search_dumps(workdir, analysis, profile, rec) -> None:
    """debug_search/: after_ir.txt, input/output_placement_specs.txt, mem_usage.txt,
    report.json, strategy.png, predicted_vs_measured.png; and plan.json in the work dir."""
    import json
    import math
    import jax
    from cfp.dims import spec_axes
    from cfp.plan import make_plan, write_plan
    from cfp.sharding import collectives
    out = Path(workdir) / "debug_search"
    out.mkdir(parents=True, exist_ok=True)
    axis_names = analysis.mesh_axes
    g, blocks = analysis.graph, analysis.blocks.blocks
    plan = rec.plan
    paths = input_paths(analysis.spec)
    rows = []
    member = {m.op: (b, m) for b in blocks for m in b.members}
    for op in g.ops:
        if op.index in member:
            b, m = member[op.index]
            st = b.strategies[plan.strategies[b.index]]
            specs = [spec_axes(l, st.axes, axis_names) for l in m.outs]
            where = f"block {b.index} ({m.role})"
        else:
            specs, where = ["(XLA decides)"], "unclaimed"
        rows.append(f"{op.index:6d} {where:28s} {specs}  {_with_paths(op.hlo, paths)}")
    (out / "after_ir.txt").write_text(
        "# Per operator: block, sharding of its result(s) under the plan, HLO line\n"
        + "\n".join(rows) + "\n\n# Compiled HLO after partitioning\n" + rec.compiled_text)
    workload = analysis.spec.build()
    params_abs = workload.abstract_params()
    leaves = jax.tree_util.tree_flatten_with_path(
        (params_abs, workload.abstract_opt_state(), workload.abstract_batch()))[0]
    in_lines = [f"{jax.tree_util.keystr(p)}: {s}" for (p, _), s in zip(leaves, rec.in_specs)]
    (out / "input_placement_specs.txt").write_text("\n".join(in_lines) + "\n")
    (out / "output_placement_specs.txt").write_text(
        "\n".join(f"output {i}: {s}" for i, s in enumerate(rec.out_specs)) + "\n")
    mem = rec.memory
    (out / "mem_usage.txt").write_text("\n".join(
        [f"{k}: {v} B ({v / 2**30:.4f} GB)" for k, v in mem.items()]
        + [f"composed from the profiles: {plan.composed_memory_bytes} B "
           f"({plan.composed_memory_bytes / 2**30:.4f} GB)"]) + "\n")
    write_plan(Path(workdir) / "plan.json",
               make_plan(analysis, plan.strategies, in_specs=rec.in_specs,
                         out_specs=rec.out_specs, source=plan.source, storage=plan.storage))
    by_kind: dict = {}
    for c in collectives(rec.compiled_text, analysis.mesh_shape):
        k = by_kind.setdefault(c.kind, {"count": 0, "bytes": 0})
        k["count"] += 1
        k["bytes"] += c.bytes
    devices = math.prod(analysis.mesh_shape)
    report = {
        "backend": jax.devices()[0].platform, "devices": devices,
        "mesh": list(analysis.mesh_shape),
        "solution": list(plan.strategies), "source": plan.source,
        "solver_status": rec.solver_status, "solve_s": rec.solve_s,
        "predicted_step_s": plan.predicted_s, "measured_step_s": list(plan.measured_s),
        "measured_median_s": plan.median_s, "memory_gb": mem["peak_bytes"] / 2**30,
        "composed_memory_gb": plan.composed_memory_bytes / 2**30,
        "tflop_count": rec.step_flops / 1e12,
        "tflops_per_device": [rec.step_flops / t / devices / 1e12 for t in plan.measured_s],
        "collectives": by_kind, "numerics": rec.numerics,
        "candidates": [{"source": c.source, "solution": list(c.strategies),
                        "predicted_s": c.predicted_s, "measured_s": c.median_s,
                        "composed_memory_gb": c.composed_memory_bytes / 2**30,
                        "compiled_memory_gb": c.compiled_peak_bytes / 2**30}
                       for c in rec.candidates],
        "pass_times_s": {"analysis": analysis.stats.time_s, "profile": profile.time_s,
                         "search": rec.time_s},
        "phase_times_s": {"profile": profile.phase_s, "search": rec.phase_s},
    }
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str))
    names = [b.strategies[i].name for b, i in zip(blocks, plan.strategies)]
    strategy_figure(names, plan.source).savefig(out / "strategy.png", dpi=100)
    _plots(out, rec)


def strategy_figure(names: list[str], source: str):
    """One labelled row per block: its index and the name of its strategy under the plan
    (a replicated block too), coloured by the mesh axes it splits."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    kinds = sorted(set(names))
    fig, ax = plt.subplots(figsize=(7, 0.8 + 0.28 * len(names)))
    for i, name in enumerate(names):
        ax.barh(i, 1, color=plt.cm.tab20(kinds.index(name) % 20), edgecolor="white")
        ax.text(0.02, i, f"block {i}: {name}", va="center", fontsize=8)
    ax.set_ylim(len(names) - 0.5, -0.5)
    ax.set_xlim(0, 1)
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_title(f"strategy per ParallelBlock ({source})", fontsize=9)
    fig.tight_layout()
    return fig


def _plots(out, rec) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(4, 4))
    pred = [c.predicted_s for c in rec.candidates]
    meas = [c.median_s for c in rec.candidates]
    ax.scatter(pred, meas)
    for i, (p, m) in enumerate(zip(pred, meas)):
        ax.annotate(str(i), (p, m))
    lim = [0, max(pred + meas) * 1.1]
    ax.plot(lim, lim, "k--", lw=0.5)
    ax.set_xlabel("predicted step s")
    ax.set_ylabel("measured step s")
    ax.set_title("validated candidates")
    fig.tight_layout()
    fig.savefig(out / "predicted_vs_measured.png", dpi=100)
    plt.close(fig)


def prediction_console(rec, cluster) -> None:
    """A plan predicted for a described cluster: nothing of it ran."""
    how = {"model": "compile-only programs priced by the cost model",
           "analytic": "priced from the analysis, nothing compiled"}[rec.pricing]
    say(f"cluster {cluster.describe()}")
    say(f"mesh {'x'.join(map(str, rec.mesh_shape))}; profile {how}")
    say(f"solver: {rec.solver_status} in {rec.solve_s:.2f} s")
    say(f"searched ParallelBlock Strategies solution (predicted): {list(rec.strategies)}")
    say(f"predicted step time: {rec.predicted_s * 1e3:.3f} ms; "
        f"{rec.step_flops / rec.predicted_s / math.prod(rec.mesh_shape) / 1e12:.4g} TFLOP/s "
        f"per device")
    budget = rec.memory_budget_bytes or cluster.memory_per_device_bytes
    say(f"memory per device: {rec.memory_bytes / 2**30:.3f} GB composed (budget "
        f"{budget / 2**30:g} GB); state: {rec.storage.describe()}")
    if rec.hand_plans:
        say(f"hand plans priced the same way ({how}):")
        for name, seconds, nbytes in sorted(rec.hand_plans, key=lambda h: h[1]):
            say(f"  {name:<10} predicted {seconds * 1e3:10.3f} ms, {nbytes / 2**30:8.3f} GB "
                f"per device, {'fits' if nbytes <= budget else 'does not fit'}")


def meshes_console(ranked, cluster) -> None:
    """Every logical mesh priced for the cluster, best first."""
    say(f"logical meshes of {cluster.num_devices} devices, planned analytically (each axis "
        f"priced at the slowest network level it spans):")
    for c in ranked:
        levels = " ".join(
            "/".join(cluster.levels[lv].name for lv in cluster.levels_of_axis(c.mesh_shape, a))
            or "-" for a in range(len(c.mesh_shape)))
        shape = "x".join(map(str, c.mesh_shape))
        if c.prediction is None:
            say(f"  mesh {shape} (axes over {levels}): no plan: {c.note}")
        else:
            say(f"  mesh {shape} (axes over {levels}): predicted "
                f"{c.prediction.predicted_s * 1e3:.3f} ms, "
                f"{c.prediction.memory_bytes / 2**30:.3f} GB per device")
    say(f"mesh chosen: {'x'.join(map(str, ranked[0].mesh_shape))}")


def stages_console(rec, cluster) -> None:
    """Pipeline stages: layers, submesh, intra-op plan, predicted times and memory."""
    plan = rec.plan
    say(f"cluster {cluster.describe()}")
    say(f"{rec.num_layers} layers, {rec.micro_batches} micro-batches of "
        f"{rec.spec.batch_size // rec.micro_batches}; {len(plan.stages)} stages:")
    for k, st in enumerate(rec.stages):
        say(f"  stage {k}: layers {st.first_layer}-{st.last_layer} (blocks {st.blocks[0]}-"
            f"{st.blocks[1] - 1}) on submesh {st.submesh[0]}x{st.submesh[1]} (mesh "
            f"{'x'.join(map(str, st.mesh_shape))}): {st.time_s * 1e3:.3f} ms per micro-batch, "
            f"{st.memory_bytes / 2**30:.3f} GB per device with {st.in_flight} in flight")
        say(f"    strategies: {list(st.strategies)}")
    say(f"predicted latency (1F1B: sum of stages + {rec.micro_batches - 1} x the slowest "
        f"{plan.slowest_s * 1e3:.3f} ms): {plan.latency_s * 1e3:.3f} ms")
    say(f"stage DP: {plan.t_max_tried} of {plan.t_max_candidates} slowest-stage bounds tried, "
        f"{plan.dp_states} states, {rec.dp_s:.2f} s; {rec.priced} (stage, submesh) pairs "
        f"priced on {rec.submeshes_analysed} submeshes in {rec.pricing_s:.1f} s; stages pass "
        f"{rec.time_s:.1f} s")


def staged_run_console(seconds: float, programs: int, loss_err: float, stages: int) -> None:
    say(f"staged run here: {stages} stages as {programs} programs on their submeshes, "
        f"micro-batches in GPipe order; loss and gradients match one device (loss rel. "
        f"error {loss_err:.1e}); {seconds * 1e3:.1f} ms per step (median of 5; one program "
        f"at a time here, so stages do not overlap and the 1F1B latency is not checked)")


def stages_json(rec) -> dict:
    """``stages/plan.json``: per stage its layers, submesh and shardings."""
    return {"format": "cfp-stage-plan", "version": 1, "cluster": rec.cluster,
            "micro_batches": rec.micro_batches, "predicted_latency_s": rec.plan.latency_s,
            "stages": [{"layers": [st.first_layer, st.last_layer], "blocks": list(st.blocks),
                        "submesh": list(st.submesh), "predicted_s": st.time_s,
                        "memory_bytes": st.memory_bytes, "in_flight": st.in_flight, **st.plan}
                       for st in rec.stages]}
