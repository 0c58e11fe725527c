"""Several processes, one mesh: JAX's multi-controller runtime (``jax.distributed``).

With ``--num-processes N`` one ``python -m cfp`` runs per host (or per group of devices),
all with the same flags but ``--process-id``. Those processes never join a runtime
themselves: the runtime lives in the processes that use the devices (``cfp.worker``), because
a process cannot join twice and a runtime one of whose processes died is lost for all. Each
*generation* of workers joins on its own port above the coordinator's; when a worker dies,
every other worker's next collective fails, they all leave, and every process starts the
next generation on the next port. A process that never joins ends the others' join (JAX
aborts it after ``join_timeout_s``), which their CLI reports in one line.

Inside a runtime, every decision that changes which programs run or how often is made once
and shared: ``share`` hands process 0's value to all, ``gather`` gives every process's,
``slowest`` the largest of a time (a sharded program takes as long as its slowest process).
A collective that fails means a peer has gone: ``RuntimeLost``. With one process all of
these are the identity and run nothing.
"""
from __future__ import annotations

import dataclasses
import itertools
import pickle

from cfp.errors import CfpError

HEARTBEAT_TIMEOUT_S = 15  # a worker silent this long is dead for the others (JAX's default: 100)
PEER_LOST_EXIT = 75  # a worker whose runtime lost a peer exits with this status
RUN_FAILED_EXIT = 76  # a worker whose program failed running while peers wait on it


@dataclasses.dataclass(frozen=True)
class Runtime:
    """Where and as whom this process joins: ``coordinator`` is ``host:port``; generation
    ``g`` of the workers joins on ``port + 1 + g``."""

    coordinator: str
    num_processes: int
    process_id: int
    join_timeout_s: int = 30

    def __post_init__(self):
        host, _, port = self.coordinator.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65000:
            raise CfpError(f"--coordinator must be HOST:PORT, got {self.coordinator!r}")
        if not 0 <= self.process_id < self.num_processes:
            raise CfpError(f"--process-id must be in 0..{self.num_processes - 1}, got "
                           f"{self.process_id}")

    def address(self, generation: int) -> str:
        host, _, port = self.coordinator.rpartition(":")
        return f"{host}:{int(port) + 1 + generation}"


_generations = itertools.count()  # this process's worker starts, alike on every process


def next_generation() -> int:
    return next(_generations)


class RuntimeLost(Exception):
    """A collective across processes failed: a peer has left the runtime."""


def join(runtime: Runtime, generation: int) -> None:
    from cfp.jax_compat import join_runtime
    join_runtime(runtime.address(generation), runtime.num_processes, runtime.process_id,
                 join_timeout_s=runtime.join_timeout_s, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)


def processes() -> int:
    """The processes of the runtime; 1 under mocked GPUs, whose other hosts are not there."""
    import jax
    from cfp.jax_compat import mocked_gpus
    return 1 if mocked_gpus() else jax.process_count()


def _collective(fn, *args):
    from cfp.jax_compat import JAX_ERRORS
    try:
        return fn(*args)
    except JAX_ERRORS as e:
        raise RuntimeLost(str(e)[:300]) from None


def share(value):
    """Process 0's ``value``, on every process."""
    if processes() == 1:
        return value
    import numpy as np
    from jax.experimental import multihost_utils as mh
    data = np.frombuffer(pickle.dumps(value), np.uint8)
    size = int(_collective(mh.broadcast_one_to_all, np.int64(data.size)))
    buf = data if data.size == size else np.zeros(size, np.uint8)
    return pickle.loads(np.asarray(_collective(mh.broadcast_one_to_all, buf)).tobytes())


def gather(value) -> list:
    """Every process's ``value``, in process order."""
    if processes() == 1:
        return [value]
    import numpy as np
    from jax.experimental import multihost_utils as mh
    data = np.frombuffer(pickle.dumps(value), np.uint8)
    sizes = np.asarray(_collective(mh.process_allgather, np.int64(data.size))).ravel()
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[:data.size] = data
    rows = np.asarray(_collective(mh.process_allgather, padded))
    return [pickle.loads(rows[i, :int(n)].tobytes()) for i, n in enumerate(sizes)]


def slowest(seconds: float) -> float:
    """The largest of every process's ``seconds``."""
    return seconds if processes() == 1 else max(gather(float(seconds)))


def put(host_value, sharding):
    """A global array laid out by ``sharding`` from a value every process holds whole: each
    process places the shards of its own devices (``jax.make_array_from_callback``), as one
    process under mocked GPUs places those of its one GPU."""
    import jax
    import numpy as np
    if sharding.is_fully_addressable:
        return jax.device_put(host_value, sharding)
    return jax.make_array_from_callback(np.shape(host_value), sharding,
                                        lambda idx: host_value[idx])


def to_host(array):
    """A global array's whole value as NumPy, on every process."""
    import numpy as np
    if getattr(array, "is_fully_addressable", True):
        return np.asarray(array)
    from jax.experimental import multihost_utils as mh
    return np.asarray(_collective(mh.process_allgather, array, True))
