"""Replay the adversarial cases of issue 47 against ``python -m cfp`` and the Python API.

Each case runs in a fresh process (the command line, or a small Python harness for the API and
for interrupts that need a hook) and is reported as one row: its exit status, whether any
traceback was printed, and its last line of output. Every case should end with status 2 (bad
input) or 130 (interrupted), one line and no traceback; where a case interrupts a profile, the
rerun's "compiled in this run" shows what was measured again (0: nothing measured was lost).
The 2 MB tmpfs cases need root (mount); they are reported as skipped otherwise.

Usage: python scripts/adversarial_replay.py [--out FILE] [--only SUBSTRING]
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MLP = ["--model", "mlp", "--mesh", "4", "--compilation-cache", "none"]


@dataclasses.dataclass
class Outcome:
    case: str
    status: int | str
    traceback: bool
    last_line: str
    note: str = ""
    expect: tuple = (2, 130)  # the statuses this case should end with

    @property
    def ok(self) -> bool:
        return self.status in self.expect and not self.traceback


def _env(extra_path: str | None = None) -> dict:
    paths = [str(ROOT)] + ([extra_path] if extra_path else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    env.pop("XLA_FLAGS", None)  # the command line sets its devices
    return env


def run(argv: list[str], *, python: str | None = None, cwd=None, extra_path=None,
        timeout_s: float = 300, interrupt_when=None, interrupt_delay_s: float = 0.0,
        on_output=None) -> tuple[int | str, str]:
    """Run ``python -m cfp argv`` (or ``python -c python argv``): (status, output).
    ``interrupt_when(output_so_far)`` true: SIGINT to the process group, as a terminal
    sends it. ``on_output(output_so_far)`` is called as output arrives."""
    cmd = ([sys.executable, "-c", python, *argv] if python is not None
           else [sys.executable, "-m", "cfp", *argv])
    proc = subprocess.Popen(cmd, cwd=cwd or ROOT, env=_env(extra_path), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    chunks: list[bytes] = []

    def read():
        for chunk in iter(lambda: proc.stdout.read1(4096), b""):
            chunks.append(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    sent, deadline = False, time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        text = b"".join(chunks).decode(errors="replace")
        if on_output is not None:
            on_output(text)
        if interrupt_when is not None and not sent and interrupt_when(text):
            time.sleep(interrupt_delay_s)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGINT)
            sent = True
        time.sleep(0.02)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        reader.join(timeout=5)
        return "timeout", b"".join(chunks).decode(errors="replace")
    reader.join(timeout=5)
    return proc.returncode, b"".join(chunks).decode(errors="replace")


def outcome(case: str, status, output: str, note: str = "", expect=(2, 130)) -> Outcome:
    lines = [x.strip() for x in re.split(r"[\r\n]", output) if x.strip()]
    return Outcome(case, status, "Traceback (most recent call last)" in output,
                   lines[-1] if lines else "", note, tuple(expect))


def compiled_again(workdir: Path, argv: list[str]) -> str:
    """The rerun after an interruption: the combinations and reshardings it found measured
    before, and what it compiled (no more than it had left to measure: nothing measured
    before was measured again)."""
    _, out = run(["--mode", "profile", "--workdir", str(workdir)] + argv)
    combos = re.search(r"combinations to measure: (\d+) \((\d+) measured before\)", out)
    reshards = re.search(r"reshardings to time: (\d+) \((\d+) known\)", out)
    compiled = re.search(r"compiled in this run: (\d+)", out)
    if not (combos and compiled):
        return f"rerun: {out.strip().splitlines()[-1:]}"
    todo, known = map(int, combos.groups())
    again = int(compiled.group(1)) > todo
    return (f"rerun: {known} combinations measured before, {todo} left, "
            f"{compiled.group(1)} compiled"
            + (f"; {reshards.group(2)} of {reshards.group(1)} reshardings known" if reshards
               else "") + (" (MEASURED AGAIN)" if again else " (nothing measured again)"))


def profiled(tmp: Path, name: str, argv: list[str]) -> Path:
    """A work dir holding the analysis and a finished profile of ``argv``'s step."""
    wd = tmp / name
    status, out = run(["--mode", "analysis", "--workdir", str(wd)] + argv)
    assert status == 0, out
    status, out = run(["--mode", "profile", "--workdir", str(wd)] + argv)
    assert status == 0, out
    return wd


# ---------------------------------------------------------------------------------- cases

CRAFT = """
import dataclasses, sys
from cfp.records import read_record, write_record
from cfp.workdir import ANALYSIS_FORMAT
from cfp.workloads import WorkloadSpec, run_fingerprint
path, marker = sys.argv[1], sys.argv[2]
rec = read_record(path, ANALYSIS_FORMAT, None, hint="")
fp = run_fingerprint(rec.spec, rec.mesh_shape)
evil = WorkloadSpec("os:system", overrides=(("command", f"touch {marker}"),))
write_record(path, ANALYSIS_FORMAT, fp, dataclasses.replace(rec, spec=evil))
"""


def crafted_spec(tmp: Path) -> list[Outcome]:
    out = []
    for mode in ("profile", "search"):
        wd, marker = tmp / f"crafted-{mode}", tmp / f"crafted-{mode}-ran"
        run(["--mode", "analysis", "--workdir", str(wd)] + MLP)
        run([str(wd / "analysis.pkl"), str(marker)], python=CRAFT)
        status, text = run(["--mode", mode, "--memory-budget", "1", "--workdir", str(wd)] + MLP)
        out.append(outcome(f"crafted os:system spec, --mode {mode}", status, text,
                           "the command ran" if marker.exists() else "no command ran"))
    return out


INTERRUPT_IMPORT = """
import importlib.abc, os, signal, sys
class Interrupt(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "ortools.sat.python.cp_model_helper":
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while OR-Tools starts
        return None
sys.meta_path.insert(0, Interrupt())
from cfp.cli import main
sys.exit(main(sys.argv[1:]))
"""

INTERRUPT_AUTOSHARD = """
import os, signal, sys
import cfp.solver
from cfp.api import autoshard
solve = cfp.solver._solve_interruptibly
def interrupted(solver, model):  # Ctrl-C as the search starts
    os.kill(os.getpid(), signal.SIGINT)
    return solve(solver, model)
cfp.solver._solve_interruptibly = interrupted
try:
    autoshard("mlp", mesh="4", workdir=sys.argv[1], memory_budget_gb=1, validate_top=1,
              mode="search", compilation_cache=None)
    print("autoshard returned a plan")
except KeyboardInterrupt:
    print("autoshard raised KeyboardInterrupt")
    sys.exit(130)
"""


def interrupts(tmp: Path, done: Path) -> list[Outcome]:
    out = []
    big = ["--model", "gpt", "--num-layers", "24", "--mesh", "4", "--compilation-cache", "none"]
    status, text = run(["--mode", "analysis", "--workdir", str(tmp / "int-analysis")] + big,
                       interrupt_when=lambda t: "Analysis Pass" in t, interrupt_delay_s=0.5)
    out.append(outcome("SIGINT in analysis", status, text))

    wd = tmp / "int-profile"
    run(["--mode", "analysis", "--workdir", str(wd)] + MLP)
    status, text = run(["--mode", "profile", "--workdir", str(wd)] + MLP,
                       interrupt_when=lambda t: (wd / "window_0.pkl").exists())
    out.append(outcome("SIGINT in profile (windows)", status, text, compiled_again(wd, MLP)))

    wd = tmp / "int-reshard"
    mesh = ["--model", "mlp", "--mesh", "2x2", "--compilation-cache", "none"]
    run(["--mode", "analysis", "--workdir", str(wd)] + mesh)
    status, text = run(["--mode", "profile", "--workdir", str(wd)] + mesh,
                       interrupt_when=lambda t: "reshardings to time" in t
                       and (wd / "reshard.pkl").exists())  # after their first batch
    out.append(outcome("SIGINT in profile (resharding timing)", status, text,
                       compiled_again(wd, mesh)))

    status, text = run(["--mode", "search", "--memory-budget", "1", "--workdir", str(done)]
                       + MLP, interrupt_when=lambda t: "Search Pass" in t)
    out.append(outcome("SIGINT in search", status, text))
    status, text = run(["--mode", "search", "--memory-budget", "1", "--workdir", str(done)]
                       + MLP, python=INTERRUPT_IMPORT)
    out.append(outcome("SIGINT while OR-Tools imports", status, text))
    status, text = run([str(done)], python=INTERRUPT_AUTOSHARD)
    out.append(outcome("SIGINT in autoshard (search)", status, text))
    return out


@contextlib.contextmanager
def tmpfs(path: Path, size: str = "2m"):
    path.mkdir(parents=True, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                      capture_output=True).returncode != 0:
        yield None
        return
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill(directory: Path, leave_bytes: int) -> Path:
    """A file filling ``directory``'s file system up to ``leave_bytes`` free."""
    st = os.statvfs(directory)
    filler = directory / "filler"
    with open(filler, "wb") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave_bytes))
    return filler


def disk_full(tmp: Path) -> list[Outcome]:
    out = []
    with tmpfs(tmp / "tmpfs-before") as mnt:
        if mnt is None:
            return [Outcome("2 MB tmpfs, full before the run", "skipped", False,
                            "cannot mount a tmpfs here (needs root)")]
        fill(mnt, 64 * 1024)
        status, text = run(["--workdir", str(mnt / "wd"), "--memory-budget", "1"] + MLP)
        out.append(outcome("2 MB tmpfs, full before the run", status, text))
    with tmpfs(tmp / "tmpfs-during") as mnt:
        wd, filled = mnt / "wd", []
        run(["--mode", "analysis", "--workdir", str(wd)] + MLP)

        def fill_once(_text):
            if not filled and (wd / "window_0.pkl").exists():
                filled.append(fill(mnt, 0))
        status, text = run(["--mode", "profile", "--workdir", str(wd)] + MLP,
                           on_output=fill_once)
        for f in filled:
            f.unlink()
        out.append(outcome("2 MB tmpfs, filled during the profile", status, text,
                           compiled_again(wd, MLP) if filled else "the profile ended first"))
    return out


def numbers(tmp: Path) -> list[Outcome]:
    out = []
    wd = ["--workdir", str(tmp / "numbers"), "--mode", "analysis"]
    for flag in ("--memory-budget", "--profile-budget", "--time-limit", "--device-flops",
                 "--device-bandwidth", "--alpha", "--beta"):
        for value in ("nan", "inf"):
            status, text = run([f"{flag}={value}"] + wd + MLP)
            out.append(outcome(f"{flag} {value}", status, text))
    for argv in (["--alpha", "-1", "--beta", "-1"], ["--batch-size", "1e23"],
                 ["--batch-size", str(10**23)], ["--hidden-size", "65536", "--num-heads", "1"],
                 ["--num-devices", "100000"], ["--num-layers", "1e6"],
                 ["--num-layers", str(10**6)], ["--iters", "1e20"], ["--iters", str(10**20)],
                 ["--validate-top", str(10**6)], ["--mesh", "1x8"], ["--mesh", "2X4"]):
        model = [] if "--num-devices" in argv or argv[0] == "--mesh" else ["--mesh", "4"]
        status, text = run(argv + wd + ["--model", "gpt", "--compilation-cache", "none"] + model)
        out.append(outcome(" ".join(argv), status, text))
    return out


def clusters(tmp: Path) -> list[Outcome]:
    out = []
    good = {"name": "c", "memory_per_device_GB": 80, "peak_TFLOPs": 312,
            "memory_bandwidth_GBps": 2039,
            "levels": [{"name": "gpu", "size": 8, "alpha_s": 5e-6, "bandwidth_GBps": 150}]}
    for name, change in (("negative memory", {"memory_per_device_GB": -80}),
                         ("zero TFLOP/s", {"peak_TFLOPs": 0}),
                         ("NaN bandwidth", {"memory_bandwidth_GBps": float("nan")}),
                         ("negative level alpha", {"levels": [dict(good["levels"][0],
                                                                   alpha_s=-1)]})):
        path = tmp / f"cluster-{re.sub(r'[^a-z]+', '-', name.lower())}.json"
        path.write_text(json.dumps({**good, **change}))
        status, text = run(["--cluster", str(path), "--workdir", str(tmp / "cl")] + MLP[:2])
        out.append(outcome(f"cluster file: {name}", status, text))
    (tmp / "cluster-dir.json").mkdir()
    status, text = run(["--cluster", str(tmp / "cluster-dir.json"), "--workdir",
                        str(tmp / "cl")] + MLP[:2])
    out.append(outcome("cluster file: a directory", status, text))
    return out


def files(tmp: Path, done: Path) -> list[Outcome]:
    out = []
    wd = tmp / "swapped"
    shutil.copytree(done, wd)
    windows = sorted(wd.glob("window_*.pkl"))
    if len(windows) >= 2:
        a, b = windows[:2]
        a.rename(wd / "swap"), b.rename(a), (wd / "swap").rename(b)
        what = f"{a.name} and {b.name} swapped"
    else:
        windows[0].rename(wd / "window_7.pkl")
        what = f"{windows[0].name} renamed window_7.pkl"
    for mode in (["--mode", "profile"], []):  # the whole job profiles again, then searches
        status, text = run(mode + ["--memory-budget", "1", "--workdir", str(wd)] + MLP)
        out.append(outcome(f"{what}, {' '.join(mode) or 'the three passes'}", status, text))
    wd = tmp / "odd-files"
    shutil.copytree(done, wd)
    (wd / "analysis.pkl").unlink()
    (wd / "analysis.pkl").mkdir()
    status, text = run(["--mode", "profile", "--workdir", str(wd)] + MLP)
    out.append(outcome("analysis.pkl a directory", status, text))
    (wd / "analysis.pkl").rmdir()
    shutil.copy(done / "analysis.pkl", wd / "analysis.pkl")
    (wd / "window_0.pkl").unlink()
    (wd / "window_0.pkl").symlink_to("/dev/zero")
    status, text = run(["--mode", "profile", "--workdir", str(wd)] + MLP, timeout_s=60)
    out.append(outcome("window_0.pkl a link to /dev/zero", status, text))
    return out


def two_runs(tmp: Path) -> list[Outcome]:
    """While a profile runs on a work dir, the same profile, and another model's analysis,
    on that dir."""
    wd = tmp / "two-runs"
    run(["--mode", "analysis", "--workdir", str(wd)] + MLP)
    others: list = []

    def start_others(text):
        if not others and "Profiling Pass" in text:
            others.append(run(["--mode", "profile", "--workdir", str(wd)] + MLP))
            others.append(run(["--mode", "analysis", "--model", "gpt", "--mesh", "4",
                               "--workdir", str(wd)]))
    status, text = run(["--mode", "profile", "--workdir", str(wd)] + MLP, on_output=start_others)
    if not others:
        return [Outcome("two runs on one dir", "not started", False, "")]
    return [outcome("two runs on one dir: the same profile again", *others[0]),
            outcome("two runs on one dir: another model's analysis", *others[1]),
            outcome("two runs on one dir: the first run", status, text, expect=(0,))]


USER_MODULES = {
    "raises in its factory": "def make():\n    raise ValueError('hidden size 64 is not a "
                             "multiple of 5 heads')\n",
    "fails to parse": "def make(:\n",
    "calls sys.exit(3) on import": "import sys\nsys.exit(3)\n",
    "passes optax.adamw uncalled": textwrap.dedent("""
        import jax.numpy as jnp, optax
        from cfp.models import user_workload
        def make():
            return user_workload(lambda p, b: jnp.mean((b @ p["w"]) ** 2),
                                 lambda k: {"w": jnp.ones((4, 2))}, lambda k: jnp.ones((8, 4)),
                                 optimizer=optax.adamw)
        """),
    "has integer parameters": textwrap.dedent("""
        import jax.numpy as jnp
        from cfp.models import user_workload
        def make():
            return user_workload(lambda p, b: jnp.mean((b @ p["w"]) ** 2),
                                 lambda k: {"w": jnp.ones((4, 2)), "n": jnp.ones(2, jnp.int32)},
                                 lambda k: jnp.ones((8, 4)))
        """),
}


def user_code(tmp: Path) -> list[Outcome]:
    out = []
    mods = tmp / "user-modules"
    mods.mkdir()
    for i, (what, body) in enumerate(USER_MODULES.items()):
        (mods / f"mod{i}.py").write_text(body)
        status, text = run(["--mode", "analysis", "--model", f"mod{i}:make", "--mesh", "4",
                            "--workdir", str(tmp / f"user{i}")], extra_path=str(mods))
        out.append(outcome(f"user module {what}", status, text))
    status, text = run(["--mode", "analysis", "--model", ":", "--workdir", str(tmp / "colon")])
    out.append(outcome("--model :", status, text))
    return out


API = """
import json, sys
from cfp.api import autoshard
from cfp.errors import CfpError
kwargs = json.loads(sys.argv[1])
try:
    autoshard("mlp", **kwargs)
    print("returned a plan")
except CfpError as e:
    print(f"CfpError: {e}")
    sys.exit(2)
"""


def api(tmp: Path) -> list[Outcome]:
    out = []
    for kwargs in ({"dtype": "float16", "workdir": str(tmp / "api")},
                   {"frobnicate": True, "workdir": str(tmp / "api")},
                   {"mesh": "4", "memory_budget_gb": float("nan"), "workdir": str(tmp / "api")},
                   {"mesh": "4", "mode": "analysis"}):
        status, text = run([json.dumps(kwargs)], python=API, cwd=tmp)
        out.append(outcome(f"autoshard({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})",
                           status, text))
    out[-1].note = ("./None exists" if (tmp / "None").exists()
                    else "default work dir used, no ./None")
    return out


def table(rows: list[Outcome]) -> str:
    lines = ["| case | exit (expected) | traceback | last line | note |",
             "|---|---|---|---|---|"]
    for r in rows:
        last = r.last_line if len(r.last_line) <= 260 else r.last_line[:257] + "..."
        lines.append(f"| {r.case} | {r.status} ({'/'.join(map(str, r.expect))}) | "
                     f"{'yes' if r.traceback else 'no'} | {last.replace('|', '/')} | {r.note} |")
    lines.append(f"\n{sum(r.ok for r in rows)} of {len(rows)} cases end as expected (2: "
                 f"refused, 130: interrupted, 0: a run that should finish), with no traceback")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="also write the table here")
    p.add_argument("--only", default="", help="run only the groups whose name contains this")
    a = p.parse_args()
    start = time.time()
    rows: list[Outcome] = []
    with tempfile.TemporaryDirectory(prefix="cfp-replay-") as d:
        tmp = Path(d)
        done = None
        groups = [("crafted", crafted_spec), ("numbers", numbers), ("clusters", clusters),
                  ("user", user_code), ("api", api), ("two-runs", two_runs),
                  ("disk", disk_full), ("interrupts", None), ("files", None)]
        for name, fn in groups:
            if a.only not in name:
                continue
            if fn is None:
                done = done or profiled(tmp, "profiled", MLP)
                fn = (lambda t, f=(interrupts if name == "interrupts" else files): f(t, done))
            got = fn(tmp)
            rows += got
            for r in got:
                print(f"{r.case}: {r.status}; {r.last_line[:120]} {r.note}", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip() or "unknown"
    text = (f"python scripts/adversarial_replay.py at {commit}, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores\n\n"
            + table(rows) + f"\n(replayed in {time.time() - start:.0f} s)\n")
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
