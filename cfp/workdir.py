"""The work dir: the files each pass's record lives in.

Passes take records and return records; reading and writing them is done here, for the CLI,
the Python API and the scripts. The profile pass saves every result as it comes through the
``ProfileCheckpoint`` it is given (``WorkDir.profile_checkpoint``: ``window_<k>.pkl`` per
window type and ``reshard.pkl``, rewritten atomically), so an interrupted run resumes and
measures nothing twice.

Layout of ``<workdir>``: ``analysis.pkl``; ``window_<k>.pkl``, ``reshard.pkl``,
``profile.pkl`` and ``profile.csv`` (in ``model/``, ``analytic/`` or ``mock/`` for a profile
priced so, ``--cost model``, analytic pricing or ``--cost mock``); ``chosen.pkl``, the
combinations every profile of the work dir measures of a window too large to measure whole
(whichever profile ran first chose them); ``search.pkl``, ``plan.json`` and ``debug_*/`` text
dumps.
"""
from __future__ import annotations

import contextlib
import csv
import os
import socket
import time
from pathlib import Path

from cfp.errors import CfpError
from cfp.records import read_record, write_record

ANALYSIS_FORMAT = "cfp-analysis"
WINDOW_FORMAT = "cfp-window-profile"
PROFILE_FORMAT = "cfp-profile"
RESHARD_FORMAT = "cfp-reshard-profile"
CHOSEN_FORMAT = "cfp-chosen-combinations"
PRICES_FORMAT = "cfp-profile-prices"
SEARCH_FORMAT = "cfp-search"


class WorkDir:
    """``path`` for the run identified by ``run_fp`` (``cfp.workloads.run_fingerprint``)."""

    def __init__(self, path, run_fp: tuple):
        self.path, self.run_fp = Path(path), run_fp

    # analysis
    def write_analysis(self, rec) -> Path:
        write_record(self.path / "analysis.pkl", ANALYSIS_FORMAT, self.run_fp, rec)
        return self.path / "analysis.pkl"

    def read_analysis(self):
        return read_record(self.path / "analysis.pkl", ANALYSIS_FORMAT, self.run_fp,
                           hint="run python -m cfp --mode analysis with the same flags first")

    # profile
    def profile_dir(self, cost: str) -> Path:
        return self.path if cost == "measure" else self.path / cost

    def profile_fingerprint(self, analysis, cost: str, max_combinations: int,
                            whole_segments: bool = False, compiled_for: str | None = None
                            ) -> tuple:
        from cfp.windows import split_windows
        windows = split_windows(analysis, max_combinations, whole_segments)
        return self.run_fp + (("graph", analysis.graph.fingerprint()),
                              ("blocks", blocks_fingerprint(analysis)), ("cost", cost),
                              ("max_combinations", max_combinations),
                              ("whole_segments", whole_segments),
                              ("windows", _digest(windows))) + (
            (("compiled_for", compiled_for),) if compiled_for else ())

    def profile_checkpoint(self, analysis, cost: str, max_combinations: int,
                           whole_segments: bool = False, compiled_for: str | None = None
                           ) -> "ProfileCheckpoint":
        """The checkpoint of one profile; its chosen combinations are the work dir's, shared
        by the profiles of every cost, so that ``--cost model`` prices what was measured."""
        from cfp.windows import split_windows
        windows, reps = split_windows(analysis, max_combinations, whole_segments)
        return ProfileCheckpoint(
            self.profile_dir(cost),
            self.profile_fingerprint(analysis, cost, max_combinations, whole_segments,
                                     compiled_for),
            chosen=(self.profile_dir("measure") / "chosen.pkl", self.profile_fingerprint(
                analysis, "measure", max_combinations, whole_segments)),
            window_fps={k: window_fingerprint(analysis, windows[rep])
                        for k, rep in enumerate(reps)})

    def write_profile(self, rec, analysis) -> Path:
        out = self.profile_dir(rec.cost)
        fp = self.profile_fingerprint(analysis, rec.cost, rec.max_combinations,
                                      rec.whole_segments, rec.compiled_for)
        write_record(out / "profile.pkl", PROFILE_FORMAT, fp, rec)
        write_profile_csv(out / "profile.csv", rec)
        return out

    def read_profile(self, analysis, cost: str = "measure", max_combinations: int = 32,
                     whole_segments: bool = False, compiled_for: str | None = None):
        fp = self.profile_fingerprint(analysis, cost, max_combinations, whole_segments,
                                      compiled_for)
        return read_record(self.profile_dir(cost) / "profile.pkl", PROFILE_FORMAT, fp,
                           hint="run --mode profile first (with the same flags)")

    # search
    def write_search(self, rec) -> Path:
        write_record(self.path / "search.pkl", SEARCH_FORMAT, self.run_fp, rec)
        return self.path / "search.pkl"

    def read_search(self):
        return read_record(self.path / "search.pkl", SEARCH_FORMAT, self.run_fp,
                           hint="run python -m cfp --mode search with the same flags first")


def search_inputs(search_options, profile) -> str:
    """A digest of what a search is run from: its options (the memory budget, the solver's
    time limit, what it validates and how long) and the profile's measurements."""
    o = search_options
    windows = [(k, sorted(wp.results.items(), key=repr))
               for k, wp in sorted(profile.window_profiles.items())]
    return _digest((o.memory_budget_bytes, o.time_limit_s, o.validate_top,
                    o.validate_baselines, o.iters, o.rounds, o.min_rounds, windows,
                    sorted(profile.reshard_s.items(), key=repr)))


def _digest(obj) -> str:
    import hashlib
    return hashlib.sha1(repr(obj).encode()).hexdigest()[:16]


def blocks_fingerprint(analysis) -> str:
    """What the profile's combinations mean: every block's members and strategies (an analysis
    of the same graph by another cfp can group or prune differently)."""
    return _digest([(b.seed, tuple(m.op for m in b.members), tuple(s.axes for s in b.strategies))
                    for b in analysis.blocks.blocks])


def window_fingerprint(analysis, window) -> str:
    """What a window type's measurements are of: each block of its representative instance,
    with its members, their result shapes and its strategies."""
    graph = analysis.graph
    return _digest([(tuple(m.op for m in b.members), tuple(s.axes for s in b.strategies),
                     tuple(graph.values[v].shape for m in b.members
                           for v in graph.ops[m.op].outputs))
                    for b in analysis.blocks.blocks[window.start:window.end]])


class ProfileCheckpoint:
    """Per-result saves of the profile pass in ``directory``, and what an earlier,
    interrupted run of the same profile left there. ``window_fps``: per window type its
    ``window_fingerprint``, which its file's header carries, so that a file renamed or swapped
    with another type's is refused (None: any window file of the profile is read)."""

    def __init__(self, directory: Path, fingerprint: tuple,
                 chosen: tuple[Path, tuple] | None = None,
                 window_fps: dict[int, str] | None = None):
        self.dir, self.fp, self.window_fps = Path(directory), fingerprint, window_fps
        self.dir.mkdir(parents=True, exist_ok=True)
        # (path, fingerprint) of the chosen combinations; by default this profile's own
        self.chosen_path, self.chosen_fp = chosen or (self.dir / "chosen.pkl", fingerprint)
        # A file another run left is refused now, before the pass does any work.
        for path in sorted(self.dir.glob("window_*.pkl")):
            k = path.stem.removeprefix("window_")
            if window_fps is not None and not (k.isdigit() and int(k) in window_fps):
                raise CfpError(f"{path} is no window type of this profile (it has "
                               f"{len(window_fps)}): delete it to profile afresh")
            read_record(path, WINDOW_FORMAT, self._window_fp(int(k) if k.isdigit() else k),
                        hint=f"delete {path} to profile afresh")
        self.load_reshards()
        self.load_chosen()

    def _window_fp(self, k) -> tuple:
        if self.window_fps is None:
            return self.fp
        return self.fp + (("window", f"type {k}: {self.window_fps[k]}"),)

    def load_window(self, k: int) -> dict:
        path = self.dir / f"window_{k}.pkl"
        if not path.exists():
            return {}
        return read_record(path, WINDOW_FORMAT, self._window_fp(k),
                           hint=f"delete {path} to profile afresh").results

    def save_window(self, k: int, window_profile) -> None:
        write_record(self.dir / f"window_{k}.pkl", WINDOW_FORMAT, self._window_fp(k),
                     window_profile)

    def load_reshards(self) -> dict:
        path = self.dir / "reshard.pkl"
        return (read_record(path, RESHARD_FORMAT, self.fp, hint=f"delete {path}")
                if path.exists() else {})

    def save_reshards(self, known: dict) -> None:
        write_record(self.dir / "reshard.pkl", RESHARD_FORMAT, self.fp, known)

    def load_chosen(self) -> dict | None:
        """The combinations an earlier run chose to measure per window type, or None."""
        path = self.chosen_path
        return (read_record(path, CHOSEN_FORMAT, self.chosen_fp, hint=f"delete {path}")
                if path.exists() else None)

    def save_chosen(self, chosen: dict) -> None:
        write_record(self.chosen_path, CHOSEN_FORMAT, self.chosen_fp, chosen)

    def load_prices(self):
        """The cost model an earlier run of this profile priced the combinations it did not
        measure with (``cfp.cost_model.CostModel``), or None (none, or another run's: it is
        fitted again): a resumed profile prices as it did, so it asks for nothing it did
        not ask for then."""
        from cfp.cost_model import CostModel
        path = self.dir / "prices.pkl"
        try:
            return CostModel(*read_record(path, PRICES_FORMAT, self.fp, hint=""))
        except (CfpError, TypeError):  # absent, unreadable, another run's: fitted again
            return None

    def save_prices(self, cost_model) -> None:
        import dataclasses
        write_record(self.dir / "prices.pkl", PRICES_FORMAT, self.fp,
                     dataclasses.astuple(cost_model))


LOCK_NAME = ".cfp-lock"


@contextlib.contextmanager
def locked(workdir: Path):
    """Hold ``workdir``'s lock while a run writes it: a file naming the holder's host, pid and
    start time, created only where none exists (``O_EXCL``, which shared file systems honour
    where ``flock`` may not). A lock left by a process of this host that is gone is taken
    over; one held by a live process, or by another host's, refuses the run in one line. Of a
    run over several processes, process 0 alone writes the work dir and holds its lock."""
    path = Path(workdir) / LOCK_NAME
    me = _holder_text(socket.gethostname(), os.getpid())
    for _ in range(3):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            if not path.is_file() or path.is_symlink():
                raise CfpError(f"{path} is not a lock cfp wrote: delete it") from None
            try:
                holder = path.read_text()
            except FileNotFoundError:  # released meanwhile
                continue
            if _stale(holder, path):
                path.unlink(missing_ok=True)
                continue
            host, pid = (holder.split() + ["?", "?"])[:2]
            raise CfpError(f"the work dir {workdir} is in use by process {pid} on {host} (its "
                           f"lock {path}): let that run finish, or choose another --workdir; "
                           f"if that process is gone, delete the lock") from None
        try:
            with os.fdopen(fd, "w") as f:
                f.write(me)
        except BaseException:  # a full disk: no empty lock is left behind
            path.unlink(missing_ok=True)
            raise
        break
    else:
        raise CfpError(f"cannot take the lock {path}: other runs keep taking it")
    try:
        yield
    finally:
        if path.is_file() and path.read_text() == me:
            path.unlink(missing_ok=True)


def _holder_text(host: str, pid: int) -> str:
    return f"{host} {pid} {_start_time(pid)}\n"


def _start_time(pid: int) -> str:
    """When process ``pid`` started (clock ticks after boot), telling a reused pid apart."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "-"


def _stale(holder: str, path: Path) -> bool:
    """Whether the lock text ``holder`` names a process of this host that no longer runs."""
    parts = holder.split()
    if len(parts) != 3 or not parts[1].isdigit():  # being written, or not cfp's
        return time.time() - path.stat().st_mtime > 60 if path.exists() else True
    host, pid, started = parts[0], int(parts[1]), parts[2]
    if host != socket.gethostname():
        return False  # its liveness cannot be told from here
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    return started != "-" and _start_time(pid) != started


PRICED_COSTS = ("model", "analytic", "mock")  # profiles kept in <workdir>/<cost>/


def clear_other_handed_step(workdir: Path, model: str) -> bool:
    """Before a step handed to ``cfp.autoshard`` (``model``, ``<name>@<fingerprint>``) is
    analysed in ``workdir``: the records of another handed step there (an earlier version of
    it, whose traced program differed) are deleted, so that the changed step is profiled
    afresh. Records of a run of the command line are left, and refuse the run as before.
    Returns whether any were deleted."""
    from cfp.records import read_fingerprint
    theirs = str(read_fingerprint(Path(workdir) / "analysis.pkl").get("model", ""))
    if "@" not in theirs or theirs == model:
        return False
    for path in record_files(workdir):
        path.unlink()
    return True


def record_files(workdir: Path) -> list[Path]:
    """The records and plan in ``workdir`` and its priced profiles' directories, in order."""
    workdir = Path(workdir)
    return sorted(p for d in (workdir, *(workdir / c for c in PRICED_COSTS)) if d.is_dir()
                  for p in d.iterdir() if p.is_file() and not p.name.startswith(".")
                  and (p.suffix == ".pkl" or p.name == "plan.json"))


def write_profile_csv(path: Path, rec) -> None:
    """One row per measured combination of every window type; times on the profile's one
    scale (``ProfileRecord.anchor_s``), ``batch_anchor_s`` the anchor's time in its batch;
    ``priced_s`` the part of the time priced, not timed (``--cost mock``'s collectives)."""
    rows = []
    for k, seg in sorted(rec.window_profiles.items()):
        for combo, m in sorted(seg.results.items()):
            rows.append({"window_type": k, "combination": " ".join(map(str, combo)),
                         "status": m.status, "time_median_s": m.time_s,
                         "time_min_s": m.time_min_s, "time_max_s": m.time_max_s,
                         "priced_s": m.priced_s, "runs": m.runs, "others_cpu_share": m.others_cpu_share,
                         "stolen_cpu_share": m.stolen_cpu_share,
                         "busy": m.busy(), "batch_anchor_s": m.anchor_s,
                         "memory_gb": m.peak_bytes / 2**30,
                         "compile_s": m.compile_s,
                         "unnamed_collectives": len(m.unnamed_collectives),
                         "same_program_as": " ".join(map(str, m.same_program_as or ())),
                         "note": m.note})
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["window_type"])
            w.writeheader()
            w.writerows(rows)
        tmp.replace(path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
