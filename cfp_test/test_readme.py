"""The README's Python quick start, as a reader would paste it: ``train.py`` from its code
block, one file with no factory and no ``__main__`` guard, run in a fresh process (its own 8
virtual CPU devices), then piped through ``python -`` into the same work dir; each of the
three steps of its own-jit loop must match the single-device loop from the same state."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
from helpers import assert_loop_matches, run_loop
p0 = {"w1": jax.random.normal(k1, (32, 64)) * 0.1, "w2": jax.random.normal(k2, (64, 32)) * 0.1}
want = run_loop(jax.jit(train_step), p0, tx.init(p0), batch, 3)
print("ONE DEVICE", *want[0])
assert_loop_matches(([want[0][-1]], params, opt_state), ([want[0][-1]], want[1], want[2]))
print("README STATE MATCHES")

def halved(params, opt_state, batch):  # the control: half the learning rate
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    updates = jax.tree_util.tree_map(lambda u: u / 2, updates)
    return optax.apply_updates(params, updates), opt_state, loss
other = run_loop(jax.jit(halved), p0, tx.init(p0), batch, 3)
try:
    assert_loop_matches(([0.0], params, opt_state), ([0.0], other[1], other[2]))
except AssertionError:
    print("THE CONTROL FAILS")
"""


def readme_blocks() -> dict[str, str]:
    """The README's fenced python blocks, by the file name their first line gives."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return {b.splitlines()[0].lstrip("# ").strip(): b for b in blocks
            if b.startswith("# ") and b.splitlines()[0].endswith(".py")}


def _losses(stdout: str) -> tuple[list[float], list[float]]:
    """(the three losses the loop printed, the single-device loop's)."""
    lines = stdout.splitlines()
    one = next(line for line in lines if line.startswith("ONE DEVICE")).split()[2:]
    k = lines.index(next(line for line in lines if line.startswith("ONE DEVICE")))
    return [float(x) for x in lines[k - 3:k]], [float(x) for x in one]


def test_the_readme_quick_start_runs_from_a_file_and_from_stdin(tmp_path):
    """Its loop's losses within 1e-5 relative of one device's, from a file and piped through
    ``python -``; the second run finds the first's profile and plan, and compiles and runs
    nothing (its loop still checked). Control: the
    same state check against a loop at half the learning rate fails."""
    import numpy as np
    text = readme_blocks()["train.py"]
    assert "__main__" not in text and "def make" not in text
    (tmp_path / "train.py").write_text(text + CHECK)
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()  # the file asks for its own
             if not f.startswith("--xla_force_host_platform_device_count")]
    env = dict(os.environ, XLA_FLAGS=" ".join(flags),
               PYTHONPATH=os.pathsep.join([str(ROOT / "cfp_test"), str(ROOT)]))
    runs = [subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=900),
            subprocess.run([sys.executable, "-"], input=text + CHECK, cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=900)]
    for done in runs:
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        assert "README STATE MATCHES" in done.stdout and "THE CONTROL FAILS" in done.stdout
        got, want = _losses(done.stdout)
        np.testing.assert_allclose(got, want, rtol=1e-5)
        assert abs(got[1] - want[0]) > 1e-5 * abs(want[0])  # control: the steps differ
    compiled = [re.search(r"compiled in this run: (\d+)", d.stdout) for d in runs]
    assert int(compiled[0].group(1)) > 0 and int(compiled[1].group(1)) == 0
    assert ["nothing run again" in d.stdout for d in runs] == [False, True]
    assert (tmp_path / "profiles" / "mine" / "plan.json").exists()
