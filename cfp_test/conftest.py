"""Test set-up: 8 virtual CPU devices, configured once before JAX starts."""
import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))  # helpers and test-only models
