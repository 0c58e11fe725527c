"""What people read on the console: each pass's lines, through one ``say``.

Library code logs; the lines users read come from here.
"""
from __future__ import annotations

import collections
import contextlib
import logging
import math
import sys
from pathlib import Path

from cfp.jax_compat import is_key

_log = logging.getLogger(__name__)


_silent = False  # a process other than 0 of several: process 0 reports


def say(line: str = "") -> None:
    _print(line, flush=True)


@contextlib.contextmanager
def ticking(pass_name: str, every_s: float = 15.0):
    """While a long pass runs, a line every ``every_s`` seconds saying which stage it is in;
    yields the function that names the stage (``run_analysis``'s ``on_stage``)."""
    import threading
    import time
    state = {"stage": "starting", "t0": time.perf_counter()}
    stop = threading.Event()

    def tick():
        while not stop.wait(every_s):
            say(f"{pass_name}: {state['stage']} ({time.perf_counter() - state['t0']:.0f} s so "
                f"far)")
    thread = threading.Thread(target=tick, name=f"cfp {pass_name} progress", daemon=True)
    thread.start()
    try:
        yield lambda stage: state.__setitem__("stage", stage)
    finally:
        stop.set()
        thread.join()


@contextlib.contextmanager
def silenced(silent: bool = True):
    """Print nothing inside (``silent``: a process other than 0 of several, where process 0
    reports); what the caller prints is left alone."""
    global _silent
    before, _silent = _silent, _silent or silent
    try:
        yield
    finally:
        _silent = before


def _print(*args, **kwargs) -> None:
    if not _silent:
        print(*args, **kwargs)


def made_inputs_console() -> None:
    """A step handed in with ``ShapeDtypeStruct``s among its example arguments."""
    say("the example arguments hold shapes: cfp checks the step against one device on inputs "
        "it makes (floats from N(0, 0.1^2), integers 0, the optimizer state 0)")


# ---------------------------------------------------------------------------------------------
# analysis


def analysis_console(rec, verbose: bool = False) -> None:
    """One line (``verbose``: blocks, segments and their spaces first)."""
    g, ba, sa, st = rec.graph, rec.blocks, rec.segments, rec.stats
    if verbose:
        _analysis_details(rec)
    say(f"analysis: {len(g.ops)} operators in {len(ba.blocks)} ParallelBlocks, "
        f"{sa.num_types} segment type{'s' if sa.num_types > 1 else ''}, "
        f"10^{rec.plan_space_log10():.1f} plans ({st.time_s:.1f} s)")


def _analysis_details(rec) -> None:
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
            f"{len(b.strategies)} strategies  {g.ops[b.seed].hlo}")
    for seg in sa.instances:
        rep = sa.instances[sa.representatives[seg.type]]
        say(f"segment instance: blocks {seg.start}..{seg.end - 1}, type {seg.type} "
            f"(profiled as blocks {rep.start}..{rep.end - 1})")
    for t in range(sa.num_types):
        say(f"segment type {t}: search space {rec.segment_space(t)}")
    say(f"FLOPs inside blocks: {100 * st.flops_share:.2f}% of {st.flops_total:.3e}")
    if st.num_layers:
        say(f"blocks per layer: {len(ba.blocks) / st.num_layers:.2f}; "
            f"operators per layer: {len(g.ops) / st.num_layers:.0f}; "
            f"operators in segment type 0: {segment_op_count(rec, 0)}")


def segment_op_count(rec, seg_type: int) -> int:
    seg = rec.segments.instances[rec.segments.representatives[seg_type]]
    return sum(len(rec.blocks.blocks[b].members) for b in range(seg.start, seg.end))


# ---------------------------------------------------------------------------------------------
# profile


class ProfileProgress:
    """The profile pass's ``on_result``: one progress line for the whole pass (combinations
    done of all window types, the current one, an ETA from the measured rate), redrawn in
    place at least every ``interval_s`` on a terminal; elsewhere a line every ``interval_s``
    when the count or the window type moved, else one a minute.
    Each combination's result goes to the log (and to ``profile.csv``); ``verbose`` prints
    each window type's and the reshardings' lines too. ``close()`` when the pass ends."""

    def __init__(self, interval_s: float | None = None, verbose: bool = False):
        import threading
        self.tty = sys.stdout.isatty()
        self.verbose = verbose
        self.total = self.n = 0
        self.at_most, self.combinations = False, (0, 0)  # (done, total) of the combinations
        self.unit = "combinations"
        self.where = "starting the worker"
        self.t0 = self.t_first = None
        self.last_line_s = 0.0
        self.last_said = None  # (done, total, unit, where) of the last progress line
        self.interval_s = interval_s or (5.0 if self.tty else 10.0)
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._tick, daemon=True)
        self.thread.start()

    def __call__(self, event: str, **f) -> None:
        import time
        with self.lock:
            if event == "start":  # the total is the most the profile can measure
                self.total, self.t0 = f["total"], time.perf_counter()
                self.at_most, self.combinations = f.get("at_most", False), (0, f["total"])
                if self.at_most:
                    self.where = "the combinations under plan and the hand plans'"
                self._detail(f"window types to profile: {f['num_types']}; combinations to "
                             f"measure: {'at most ' if self.at_most else ''}{f['total']} "
                             f"({f['known']} measured before)")
            elif event == "window":
                w = f["window"]
                self.where = f"window type {f['k']}"
                self._detail(f"window type {f['k']} (blocks {w.start}..{w.end - 1}): search "
                             f"space {list(f['space'])}, {f['todo']} to measure"
                             + (f", {f['known']} measured before" if f["known"] else ""))
            elif event == "round":  # the profile search drives asks for more
                if self.unit != "combinations":  # back from the reshardings
                    self.unit, self.t_first = "combinations", None
                    self.n, self.total = self.combinations
                self.where = f"round {f['round']} of search asking"
                self._detail(f"round {f['round']}: the top plans use {f['count']} "
                             f"combinations not measured yet")
            elif event == "result":
                self.n += 1
                self.combinations = (self.n, self.total)
                if self.t_first is None:
                    self.t_first = time.perf_counter()
                m = f["measurement"]
                _log.debug("window type %s combination %s: %s", f["k"], list(f["combo"]),
                           f"{m.time_s * 1e3:.4g} ms, {m.peak_bytes / 2**30:.4g} GiB"
                           if m.status == "ok" else f"{m.status} {m.note}")
                if self.tty:
                    self._bar()
            elif event == "not_measured":
                what = ("reshardings" if f["k"] is None
                        else f"combinations of window type {f['k']}")
                pace = (f"about {f['count'] * self._pass_pace_s():.0f} s more at this "
                        f"run's pace: raise --profile-budget, or " if self.n else "")
                self._line(f"profile budget spent: {f['count']} {what} not measured "
                           f"({pace}profile again to measure them)")
            elif event == "ranked":
                self._detail(f"window type {f['k']}: {f['space']} combinations; measuring "
                             f"the {f['cheapest']} cheapest by the additive analytic price"
                             + (f" and {f['baselines']} more that baselines use"
                                if f["baselines"] else ""))
            elif event == "reshards":
                self.where = "timing reshardings"
                self._detail(f"boundaries between window instances: {f['boundaries']}; "
                             f"distinct reshardings to time: {f['needed']} ({f['known']} "
                             f"known)")
                if f["needed"] > f["known"]:  # the progress counts reshardings from here
                    self.unit, self.n, self.t_first = "reshardings", 0, time.perf_counter()
                    self.total = f["needed"] - f["known"]
            elif event == "reshards_timed":
                self.n = f["done"]
                if self.tty:
                    self._bar()

    def _detail(self, text: str) -> None:
        """A line of ``-v``; otherwise the log's."""
        if self.verbose:
            self._line(text)
        else:
            _log.info("%s", text)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=1)
        if self.tty and self.total:
            _print(flush=True)

    def _pace_s(self) -> float:
        """Seconds per result since the first (two results at least)."""
        import time
        return max(1e-9, time.perf_counter() - self.t_first) / (self.n - 1)

    def _pass_pace_s(self) -> float:
        """Seconds per result since the pass started, its worker's start included."""
        import time
        return (time.perf_counter() - self.t0) / max(1, self.n)

    def _eta(self) -> str:
        if self.t_first is None or self.n < 2:
            return "ETA --"
        if self.at_most and self.unit == "combinations":
            return f"at most {(self.total - self.n) * self._pace_s():.0f} s more"
        return f"ETA {(self.total - self.n) * self._pace_s():.0f} s"

    def _bar(self) -> None:
        import time
        bar = "#" * int(30 * self.n / max(1, self.total))
        _print(f"\r[{bar:<30}] {self.n}/{self.total} {self.unit}, {self.where}, "
               f"{self._eta()}   ", end="", flush=True)
        self.last_line_s = time.perf_counter()

    def _line(self, text: str) -> None:
        import time
        if self.tty and self.total:
            _print("\r" + " " * 100 + "\r", end="")
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
                    continue
                now = (self.n, self.total, self.unit, self.where)
                if now == self.last_said and (time.perf_counter() - self.last_line_s
                                              < 6 * self.interval_s):
                    continue  # nothing new: a line a minute says it still runs
                self.last_said = now
                self._line(f"[{self.n}/{self.total} {self.unit}] {self.where}, "
                           f"{self._eta()}")


def profile_console(rec, model_space_log10: float, verbose: bool = False) -> None:
    """One line, and a warning when the machine was busy (``verbose``: the launch overhead,
    the reshardings, the windows and the phases too)."""
    counts = collections.Counter(m.status for seg in rec.window_profiles.values()
                                 for m in seg.results.values())
    if verbose:
        if rec.cost != "analytic":
            say(f"launch overhead subtracted: {rec.launch_overhead_s * 1e3:.3f} ms per program")
        if rec.reshard_interval_s:
            say(f"reshardings timed after the op producing their value: "
                f"{len(rec.reshard_interval_s)}; {rec.reshards_counted_zero()} of them add "
                f"nothing measurable (95% interval not above 0) and count as 0")
        say(f"whole-model plan space: 10^{model_space_log10:.1f} plans, covered by "
            f"{len(rec.windows)} window instances of {len(rec.window_profiles)} types")
        phases_console("profile", rec.time_s, rec.phase_s)
    estimated = counts.pop("estimated", 0)
    by_status = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    resumed = (sum(counts.values()) - counts["not_measured"] - rec.compiled
               if rec.cost != "analytic" else 0)  # priced anew each run
    done = "compiled and priced" if rec.cost == "model" else "measured"
    what = (f"{sum(counts.values())} of {sum(counts.values()) + estimated} combinations "
            f"{done} ({by_status}): every one under plan, the hand plans', and the split state "
            f"layouts search's top plans use; the other {estimated} priced at the least those "
            f"say they may take"
            if estimated else f"{sum(counts.values())} combinations ({by_status})")
    say(f"profile: {what}, of {len(rec.window_profiles)} window types; "
        f"{len(rec.reshard_s)} reshardings; compiled in this "
        f"run: {rec.compiled}" + (f", {resumed} resumed from the work dir" if resumed > 0
                                  else "") + f" ({rec.time_s:.1f} s)")
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


def phases_console(name: str, total_s: float, phase_s: dict) -> None:
    parts = ", ".join(f"{k} {v:.1f}" for k, v in sorted(phase_s.items(), key=lambda kv: -kv[1]))
    say(f"{name} pass: {total_s:.1f} s" + (f" ({parts})" if parts else ""))


# ---------------------------------------------------------------------------------------------
# search


def ms_text(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def gb_text(nbytes: float) -> str:
    """Bytes in GiB, or in MiB under a tenth of a GiB."""
    return (f"{nbytes / 2**30:.3g} GiB" if nbytes >= 2**30 / 10 else
            f"{nbytes / 2**20:.3g} MiB")


def hand_plan_times(analysis, rec, memory_budget_bytes: int | None = None
                    ) -> dict[str, float]:
    """Median seconds per step of every hand plan search ran whose compiled peak fits the
    budget: a baseline candidate, or a candidate of cfp's that is the same program as a hand
    plan."""
    from cfp.describe import same_programs
    out: dict[str, float] = {}
    for c in rec.candidates:
        if memory_budget_bytes is not None and c.compiled_peak_bytes > memory_budget_bytes:
            continue
        names = ([c.source.removeprefix("baseline ")] if c.source.startswith("baseline ")
                 else same_programs(analysis, c.strategies, c.storage))
        for name in names:
            out[name] = min(out.get(name, math.inf), c.median_s)
    return out


def search_console(rec, analysis, devices: int, memory_budget_bytes: int | None,
                   verbose: bool = False, driver_lines: bool = False,
                   found_before: bool = False) -> None:
    """The answer: the plan in words, its step time against the best hand plan run, its
    memory and the numerical check; with ``driver_lines``, then the lines benchmark drivers
    read (``searched ParallelBlock Strategies solution``, ``searched training cost``,
    ``TFLOP_COUNT``). ``verbose``: every candidate and the phases first."""
    from cfp.describe import plan_words
    plan = rec.plan
    if verbose:
        say(f"solver: {rec.solver_status} in {rec.solve_s:.2f} s")
        for i, c in enumerate(rec.candidates):
            say(f"candidate {i} ({c.source}): predicted {ms_text(c.predicted_s)}, measured "
                f"{ms_text(c.median_s)}; memory {gb_text(c.composed_memory_bytes)} composed, "
                f"{gb_text(c.compiled_peak_bytes)} compiled" + ("  <- kept" if i == rec.kept else ""))
        phases_console("search", rec.time_s, rec.phase_s)
    if found_before:
        say("search: the plan found before for this step, from the same profile and options "
            "(nothing run again)")
    else:
        say(f"search: {len(rec.candidates)} candidate plans run end to end; solver "
            f"{rec.solver_status} in {rec.solve_s:.1f} s ({rec.time_s:.1f} s)")
    own = plan.source.startswith("predicted")  # "predicted" or "predicted without reshardings"
    source = ("cfp's own prediction" + plan.source.removeprefix("predicted") if own
              else f"the {plan.source.split()[-1]} baseline")
    words = plan_words(analysis, plan.strategies, plan.storage, rec.recompute)
    mesh = "x".join(map(str, analysis.mesh_shape))
    same = [n for n in (words.pop(0).removeprefix("same program as ").split(" and ")
                        if words[0].startswith("same program as") else [])
            if own or n != plan.source.split()[-1]]
    kept = (("cfp's own plan" + (" (the fastest predicted with no resharding between "
                                 "blocks)" if "without reshardings" in plan.source else ""))
            if own else f"the {plan.source.split()[-1]} hand plan")
    say(f"plan on mesh {mesh}: {kept}"
        + (f", which compiles to the same program as the {' and '.join(same)} hand plan"
           f"{'s' if len(same) > 1 else ''}" if same
           else ", unlike every hand plan" if own else ""))
    shown = words if len(words) <= 3 else words[:2] + [
        f"and {len(words) - 2} more groups of segments (debug_search/plan.png draws them all)"]
    for line in shown:
        say(f"  {line}")
    vs = against_hand_plans(hand_plan_times(analysis, rec, memory_budget_bytes), analysis,
                            memory_budget_bytes)
    achieved = rec.step_flops / plan.median_s / devices / 1e12
    say(f"step time: {ms_text(plan.median_s)}, {achieved:.3g} TFLOP/s per device (predicted "
        f"{ms_text(plan.predicted_s)}){vs}{race_text(rec, memory_budget_bytes)}")
    budget = f", budget {gb_text(memory_budget_bytes)}" if memory_budget_bytes else ""
    import jax
    here = jax.devices()[0].platform.upper()
    say(f"memory per device: {gb_text(rec.memory['peak_bytes'])} compiled on {here} "
        f"({gb_text(plan.composed_memory_bytes)} composed from the profiled windows{budget})")
    if rec.numerics is not None:
        say(f"numerical check against one device: loss and gradients match (loss rel. error "
            f"{rec.numerics['loss_rel_err']:.1e})")
    if rec.scans == "rolled":
        say("scans run as lax.scan: one strategy per scan body")
    elif rec.scans == "unrolled":
        say("scans run unrolled: this plan gives a scan's iterations different strategies")
    if not driver_lines:
        return
    say(f"searched ParallelBlock Strategies solution ({source}): {list(plan.strategies)}")
    say(f"searched training cost (s per step, one per round): "
        f"{[round(t, 6) for t in plan.measured_s]}, memory_cost (GiB per device): "
        f"{rec.memory['peak_bytes'] / 2**30:.4f}")
    say(f"TFLOP_COUNT: {rec.step_flops / 1e12:.6g}")


def race_text(rec, memory_budget_bytes: int | None) -> str:
    """Where the rounds tell cfp's fastest own plan and the fastest hand plan that fits (two
    programs) apart in neither direction as ``slower``: that it is a tie, over how many."""
    from cfp.timing import RACE_LEVEL, slower
    fits = [c for c in rec.candidates if memory_budget_bytes is None
            or c.compiled_peak_bytes <= memory_budget_bytes]
    own = [c for c in fits if not c.source.startswith("baseline")]
    rivals = [c for c in fits if c.source.startswith("baseline")]
    if not own or not rivals:
        return ""
    plan, rival = (min(cs, key=lambda c: c.median_s) for cs in (own, rivals))
    if rival.measured_s == plan.measured_s:  # the same program, run once
        return ""
    n = min(len(rival.measured_s), len(plan.measured_s))
    a, b = plan.measured_s[-n:], rival.measured_s[-n:]
    if slower(a, b, RACE_LEVEL) or slower(b, a, RACE_LEVEL):
        return ""
    return f" (a tie: {n} rounds do not tell the two apart)"


def against_hand_plans(hand: dict, analysis, memory_budget_bytes: int | None) -> str:
    """The step-time line's end: the fastest of the hand plans run (name -> seconds), or why
    none ran: none fits the budget, or none is a plan of this step on this mesh (a batch the
    mesh does not divide, heads it does not)."""
    from cfp.baselines import baseline_strategy_indices
    fitting = " that fits" if memory_budget_bytes else ""
    if hand:
        best = min(hand, key=hand.get)
        return f"; best hand plan run{fitting}: {best} {ms_text(hand[best])}"
    if all(None in idx for idx, _ in baseline_strategy_indices(analysis, storage=True).values()):
        return "; no hand plan splits this step on this mesh"
    return f"; no hand plan{fitting} was run"


def usage_console(workdir: Path, step: str = "train", whole_state: bool = False) -> None:
    """The Python line that uses ``plan.json`` (for ``step``, ``cfp.models.STEPS``; a step
    on one state, ``whole_state``: a TrainState, NNX's model and optimizer), and where the
    plan is drawn."""
    path = Path(workdir) / "plan.json"
    call = ("plan.jit(forward, params, batch)" if step == "forward"
            else "plan.shardings(params, opt_state, batch) of your state's parts (README: the "
                 "step as you write it)" if whole_state
            else "plan.jit(train_step, params, opt_state, batch)")
    say(f"use it: plan = cfp.Plan.load({str(path)!r}); "
        f"{'' if whole_state else 'step = '}{call}; drawn in "
        f"{Path(workdir) / 'debug_search' / 'plan.png'}")


def prediction_console(rec, cluster, driver_lines: bool = False, analysis=None) -> None:
    """A plan predicted for a described cluster: nothing of it ran."""
    how = {"model": "compile-only programs priced by the cost model",
           "analytic": "priced from the analysis, no window compiled",
           "mock": "compiled for the cluster's GPUs on the GPU here, one GPU's share of "
                   "each program timed on it, collectives priced"}[rec.pricing]
    say(f"cluster {cluster.describe()}")
    say(f"mesh {'x'.join(map(str, rec.mesh_shape))}; profile {how}")
    say(f"solver: {rec.solver_status} in {rec.solve_s:.2f} s")
    if driver_lines:
        say(f"searched ParallelBlock Strategies solution (predicted): {list(rec.strategies)}")
    say(f"predicted step time: {rec.predicted_s * 1e3:.3f} ms; "
        f"{rec.step_flops / rec.predicted_s / math.prod(rec.mesh_shape) / 1e12:.4g} TFLOP/s "
        f"per device")
    if getattr(rec, "recompute", None) and analysis is not None:
        from cfp.describe import recompute_words
        for line in recompute_words(analysis, rec.recompute):
            say(f"  {line}")
        say(f"  recomputing: {rec.recompute_s * 1e3:.3f} ms of the step (the contractions' "
            f"FLOPs, the other operators' bytes at the GPU's memory bandwidth)")
    if rec.pricing == "mock":
        say(f"  of it measured on the GPU here (one GPU's share of each window): "
            f"{(rec.predicted_s - rec.priced_s) * 1e3:.3f} ms; priced (collectives and "
            f"reshardings, by the cluster's alpha-beta): {rec.priced_s * 1e3:.3f} ms")
    budget = rec.memory_budget_bytes or cluster.memory_per_device_bytes
    composed = f"{rec.memory_bytes / 2**30:.3f} GiB composed from {rec.memory_source}"
    if rec.compiled_peak_bytes is not None:
        from cfp.gpu_compile import label
        figure = (f"{rec.compiled_peak_bytes / 2**30:.3f} GiB compiled for "
                  f"{label(rec.compiled_for)}, XLA's own rematerialization off ({composed}; "
                  f"budget {budget / 2**30:g} GiB)")
    else:
        figure = f"{composed} (budget {budget / 2**30:g} GiB)"
    say(f"memory per device: {figure}; state: {rec.storage.describe()}")
    if rec.hand_plans:
        from cfp.gpu_compile import label
        from cfp.recompute import RECOMPUTING_EVERY_LAYER
        from cfp.problem import compiled_fits
        say(f"hand plans priced the same way ({how}):")
        for name, seconds, nbytes, peak in sorted(rec.hand_plans, key=lambda h: h[1]):
            if peak is None and name.endswith(RECOMPUTING_EVERY_LAYER):
                memory = (f"{nbytes / 2**30:8.3f} GiB per device composed, not compiled "
                          f"(slower than the plan kept)")
            elif peak is None:
                memory = (f"{nbytes / 2**30:8.3f} GiB per device composed, "
                          f"{'fits' if nbytes <= budget else 'does not fit'}")
            else:
                memory = (f"{peak / 2**30:8.3f} GiB per device, its whole step compiled for "
                          f"{label(rec.compiled_for)} ({nbytes / 2**30:.3f} composed), "
                          f"{'fits' if compiled_fits(peak, budget, 'gpu') else 'does not fit'}")
            say(f"  {name:<10} predicted {seconds * 1e3:10.3f} ms, {memory}")


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
                f"{c.prediction.memory_bytes / 2**30:.3f} GiB per device")
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
            f"{st.memory_bytes / 2**30:.3f} GiB per device with {st.in_flight} in flight")
        say(f"    strategies: {list(st.strategies)}")
    say(f"predicted latency (1F1B: sum of stages + {rec.micro_batches - 1} x the slowest "
        f"{plan.slowest_s * 1e3:.3f} ms): {plan.latency_s * 1e3:.3f} ms")
    say(f"stage DP: {plan.t_max_tried} of {plan.t_max_candidates} slowest-stage bounds tried, "
        f"{plan.dp_states} states, {rec.dp_s:.2f} s; {rec.priced} (stage, submesh) pairs "
        f"priced on {rec.submeshes_analysed} submeshes in {rec.pricing_s:.1f} s; stages pass "
        f"{rec.time_s:.1f} s (tracing {rec.tracing_s:.1f} s)")


def staged_run_console(seconds: float, programs: int, loss_err: float, stages: int) -> None:
    say(f"staged run here: {stages} stages as {programs} programs on their submeshes, "
        f"micro-batches in GPipe order; loss and gradients match one device (loss rel. "
        f"error {loss_err:.1e}); {seconds * 1e3:.1f} ms per step (median of 5; one program "
        f"at a time here, so stages do not overlap and the 1F1B latency is not checked)")


