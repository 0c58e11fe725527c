"""Python API: a user's own training step through the same three passes.

    >>> import cfp.api  # doctest: +SKIP
    >>> mesh = jax.make_mesh((2, 4), ("data", "model"))  # doctest: +SKIP
    >>> plan = cfp.api.autoshard("mypkg.train:make_workload", mesh=mesh,
    ...                          workdir="profiles/mine", memory_budget_gb=4)  # doctest: +SKIP

``make_workload`` returns a ``cfp.models.Workload``, most simply through
``cfp.models.user_workload(loss_fn, init_params, make_batch, optimizer=tx)``; it gets only the
keyword arguments it declares (``batch_size``, ``dtype``, size overrides). It is named by import
path because measurement runs in worker processes that build it afresh. The result is the
parsed ``plan.json``: ``cfp.plan.step_shardings`` and ``cfp.plan.jit`` put it into the user's
own ``jax.jit``. With JAX already started, the devices JAX has are used.
"""
from __future__ import annotations

from pathlib import Path


def autoshard(factory: str, *, mesh="8", workdir: str | Path | None = None,
              batch_size: int | None = None, dtype: str = "float32",
              memory_budget_gb: float | None = None, max_combinations: int = 32,
              validate_top: int = 3, extra_args=()) -> dict:
    """Run analysis, profile and search on ``factory``'s step; return the plan.

    ``mesh``: the user's ``jax.sharding.Mesh`` (any axis names and types; the plan speaks its
    names and applies to it) or ``--mesh`` text (``2x4``, ``data=2,model=4``).
    ``workdir`` None: the command line's default (``profiles/<factory>-<mesh>/``). Bad input
    raises ``CfpError`` with its one-line reason, before any work; Ctrl-C raises
    ``KeyboardInterrupt`` (everything measured is kept in the work dir)."""
    from cfp.cli import run
    from cfp.plan import load_plan
    from cfp.workloads import mesh_from, mesh_text
    args = ["--model", factory, "--mesh", mesh_text(*mesh_from(mesh)), "--dtype", dtype,
            "--max-combinations", str(max_combinations), "--validate-top", str(validate_top)]
    if workdir is not None:
        args += ["--workdir", str(workdir)]
    if batch_size is not None:
        args += ["--batch-size", str(batch_size)]
    if memory_budget_gb is not None:
        args += ["--memory-budget", str(memory_budget_gb)]
    return load_plan(run(args + list(extra_args)) / "plan.json")
