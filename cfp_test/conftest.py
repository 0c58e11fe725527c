"""Test set-up: 8 virtual CPU devices, compiled without LLVM's optimizations or XLA's CPU
fusion emitters, configured once before JAX starts, and a fresh compilation cache."""
import os
import subprocess
import sys

# LLVM's optimizations off: what the tests check (the programs, their shardings, memory and
# numerics) is fixed before XLA's CPU backend hands a program to LLVM, and the suite spends
# most of its time compiling small programs. XLA's CPU fusion emitters off too, where this
# XLA has the flag: the suite then takes about a third less time, the partitioned program and its
# collectives are the same, and a scatter runs as a loop (tests that count loops count those
# over the layers). Speed figures come from scripts/, which compile as users do.
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
NO_FUSION_EMITTERS = "--xla_cpu_use_fusion_emitters=false"


def _xla_knows(flag: str) -> bool:
    """Whether this XLA accepts ``flag`` (an unknown flag ends the process that starts XLA)."""
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "-c", "import jax; jax.devices()"], env=env,
                          capture_output=True, timeout=120).returncode == 0


os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_force_host_platform_device_count=8", *FAST_COMPILE]
    + ([NO_FUSION_EMITTERS] if _xla_knows(NO_FUSION_EMITTERS) else [])).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import atexit
import shutil
import tempfile

# One persistent compilation cache for the whole run, empty at its start: the measurement
# workers the tests start (fresh processes) share compiled programs within the run, and no
# run sees another's.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="cfp-test-cache-")
atexit.register(shutil.rmtree, os.environ["XDG_CACHE_HOME"], ignore_errors=True)

from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # helpers and test-only models

import pytest  # noqa: E402


@pytest.fixture
def compiles():
    """Names of the XLA compile events JAX reports while the test runs."""
    import jax
    seen = []

    def listener(name, *args, **kwargs):
        if "backend_compile" in name:
            seen.append(name)

    jax.monitoring.register_event_duration_secs_listener(listener)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listener)


@pytest.fixture
def python_sigint():
    """SIGINT at Python's default handler for the test, as a run from a terminal starts,
    whatever the suite started with (ignored under ``nohup``, and then by cfp too); a
    process the test starts begins with SIGINT at its default. The suite's handler after."""
    import signal
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture(scope="session")
def mlp_profiled(tmp_path_factory):
    """A work dir holding the analysis and profile of ``MLP_PROFILED``, made once for the
    run; a test copies it (``shutil.copytree``) before it changes anything there."""
    from cfp.cli import main
    from helpers import MLP_PROFILED
    wd = tmp_path_factory.mktemp("mlp-profiled")
    assert main(MLP_PROFILED + ["--mode", "analysis", "--workdir", str(wd)]) == 0
    assert main(MLP_PROFILED + ["--mode", "profile", "--workdir", str(wd)]) == 0
    return wd
