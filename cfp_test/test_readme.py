"""The README's Python quick start, as a reader would paste it: ``train.py`` and ``run.py``
from its code blocks, run in a fresh process on 8 virtual CPU devices; the three steps of its
own-jit loop must match the single-device loop from the same state."""
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHECK = """
    import optax
    from helpers import assert_loop_matches, run_loop
    got = ([float(loss)], params, opt_state)
    p0, b0 = train.init(jax.random.key(0)), train.batch(jax.random.key(1))
    want = run_loop(jax.jit(train.train_step), p0, train.tx.init(p0), b0, 3)
    assert_loop_matches(got, ([want[0][-1]], want[1], want[2]))
    print("README LOOP MATCHES")

    def halved(params, opt_state, batch):  # the control: half the learning rate
        loss, grads = jax.value_and_grad(train.loss_fn)(params, batch)
        updates, opt_state = train.tx.update(grads, opt_state, params)
        updates = jax.tree_util.tree_map(lambda u: u / 2, updates)
        return optax.apply_updates(params, updates), opt_state, loss
    other = run_loop(jax.jit(halved), p0, train.tx.init(p0), b0, 3)
    try:
        assert_loop_matches(got, ([other[0][-1]], other[1], other[2]))
    except AssertionError:
        print("THE CONTROL FAILS")
"""


def readme_blocks() -> dict[str, str]:
    """The README's fenced python blocks, by the file name their first line gives."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    return {b.splitlines()[0].lstrip("# ").strip(): b for b in blocks
            if b.startswith("# ") and b.splitlines()[0].endswith(".py")}


def test_the_readme_python_quick_start_runs_and_matches_one_device(tmp_path):
    """Control: the same check against a loop at half the learning rate fails."""
    blocks = readme_blocks()
    assert {"train.py", "run.py"} <= set(blocks)
    (tmp_path / "train.py").write_text(blocks["train.py"])
    (tmp_path / "run.py").write_text(blocks["run.py"] + CHECK)
    env = dict(os.environ,  # the suite's XLA_FLAGS: 8 devices, as the README says
               PYTHONPATH=os.pathsep.join([str(tmp_path), str(ROOT / "cfp_test"), str(ROOT)]))
    done = subprocess.run([sys.executable, "run.py"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    assert "README LOOP MATCHES" in done.stdout and "THE CONTROL FAILS" in done.stdout
    assert (tmp_path / "profiles" / "mine" / "plan.json").exists()
