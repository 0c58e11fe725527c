"""``python -m cfp``: the three passes from the command line.

The CLI parses the flags into ``cfp.options.Options`` and calls ``cfp.api.run``, which checks
them, runs the requested pass (or all of them in order when ``--mode`` is left out) and prints
each pass's lines (``cfp.report``). A ``CfpError`` becomes one line on stderr and exit status
2, a Ctrl-C one line and status 130.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from cfp.errors import CfpError
from cfp.options import BOUNDS, DEFAULT_CACHE, MODES, Options, bounds_text


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default, where it has one (the help says what None means)."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, status 2, no usage dump (main prints it)
        raise CfpError(f"{message} (see python -m cfp --help)")

    def format_help(self):  # the presets are listed from the zoo, which imports JAX: only here
        self.epilog = f"size presets: {_presets_text()}"
        return super().format_help()


def _presets_text() -> str:
    from cfp.models.registry import PRESETS
    return "; ".join(f"{m}: {', '.join(p)}" for m, p in PRESETS.items())


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m cfp", description=__doc__.splitlines()[0],
                formatter_class=_Help)
    p.add_argument("--mode", choices=MODES + ("stages",), default=None,
                   help="the pass to run; all three in order when left out; 'stages' plans "
                        "pipeline stages (run here and checked when there is no --cluster)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="print the blocks, segments and candidates too, and log the "
                        "library's progress")
    p.add_argument("--driver-lines", action="store_true",
                   help="print the lines benchmark drivers read: the searched strategies "
                        "(searched ParallelBlock Strategies solution), the measured step "
                        "times and TFLOP_COUNT")
    w = p.add_argument_group(
        "workload", "a step run here (not priced with --cost model, nor planned with --cluster) "
        "may have no array of more than 2^31 elements, nor one larger than the host's memory")
    w.add_argument("--model", default="gpt",
                   help="mlp, gpt, llama, moe, bert, or package.module:factory for your own step")
    w.add_argument("--config", default=None,
                   help="size preset (tiny when left out; all presets listed below)")
    w.add_argument("--batch-size", type=int, default=None,
                   help="global batch size (the preset's when left out)")
    for name, what in (("num-layers", "layers"), ("seq-len", "sequence length"),
                       ("hidden-size", "hidden size"), ("num-heads", "attention heads"),
                       ("vocab-size", "vocabulary size"), ("num-experts", "MoE experts")):
        w.add_argument(f"--{name}", type=int, default=None,
                       help=f"{what}, overriding the preset's")
    w.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="parameter and activation type")
    w.add_argument("--compute-dtype", default=None, choices=("float32", "bfloat16"),
                   help="compute in this type over --dtype parameters and optimizer state "
                        "(each floating parameter cast in the loss, as mixed-precision "
                        "training does); the same as --dtype when left out")
    w.add_argument("--step", default="train", choices=("train", "forward"),
                   help="the step planned: train (value-and-grad plus the optimizer) or "
                        "forward (the loss alone, for inference or evaluation: no gradients "
                        "nor optimizer state)")
    m = p.add_argument_group("devices")
    m.add_argument("--num-devices", type=int, default=None,
                   help="devices to use; on CPU, this many virtual devices (the mesh's size, "
                        "or 8)")
    m.add_argument("--mesh", default=None,
                   help="mesh shape, e.g. 8 or 2x4 (axes m0, m1), or named axes, e.g. "
                        "data=2,model=4, which the plan speaks (one axis of all devices "
                        "when left out); with --cluster, 'auto' plans every logical mesh and "
                        "keeps the best")
    m.add_argument("--cluster", default=None,
                   help="plan for a described cluster instead of these devices: a preset "
                        "(a100-8, h100-8, h200-8, a100-64, h100-64, alpa-50x4) or a .json file (see "
                        "cfp/cluster.py); sets the mesh (its levels), the memory budget and "
                        "the prices; search predicts and runs nothing")
    p.add_argument("--workdir", default=None,
                   help="where the passes read and write (profiles/<model>-<config>-<mesh>/ "
                        "when left out)")
    p.add_argument("--compilation-cache", default=str(DEFAULT_CACHE),
                   help="JAX's persistent compilation cache, so reruns and resumed profiles "
                        "do not compile again ('none' turns it off)")
    f = p.add_argument_group("profile")
    f.add_argument("--cost", choices=("measure", "model", "mock"), default="measure",
                   help="measure on the devices, or price compiled programs analytically, "
                        "or (with --cluster, on a machine with one NVIDIA GPU) mock: compile "
                        "for the cluster's GPUs on this one, time one GPU's share of each "
                        "program here and price its collectives")
    f.add_argument("--max-combinations", type=int, default=32,
                   help="largest strategy space profiled as one window (with "
                        "--whole-segments: combinations measured per window)")
    f.add_argument("--whole-segments", action="store_true",
                   help="profile every segment as one window; where its space is over "
                        "--max-combinations, measure the combinations cheapest by an additive "
                        "analytic price and those the baselines use")
    f.add_argument("--profile-all", action="store_true",
                   help="measure every combination of every window under every state layout "
                        "(for benchmarks and research), not only those search asks for")
    f.add_argument("--profile-budget", type=float, default=None,
                   help="seconds for the whole profile pass; what it does not reach is "
                        "not_measured, and profiling again measures it")
    f.add_argument("--memory-budget", dest="memory_budget_gb", metavar="GiB", type=float,
                   default=None,
                   help="GiB per device (the GPU's memory when left out; required on CPU)")
    f.add_argument("--device-preset", choices=("a100", "h100", "h200", "here"), default=None,
                   help="--cost model: documented device and network figures (a100 when left "
                        "out), or 'here': alpha-beta and roofline fitted on these devices")
    f.add_argument("--alpha", default=None,
                   help="--cost model: seconds per collective, one per mesh axis, e.g. 5e-6,3e-6")
    f.add_argument("--beta", default=None,
                   help="--cost model: seconds per byte, one per mesh axis")
    f.add_argument("--device-flops", type=float, default=None,
                   help="--cost model: FLOP/s of one device (the preset's when left out)")
    f.add_argument("--device-bandwidth", type=float, default=None,
                   help="--cost model: memory bytes/s of one device (the preset's)")
    s = p.add_argument_group("search")
    s.add_argument("--time-limit", type=float, default=60.0, help="CP-SAT seconds per solve")
    s.add_argument("--validate-top", type=int, default=3,
                   help="run the K best predicted plans end to end and keep the fastest")
    s.add_argument("--recompute", choices=("none", "dots_saveable",
                                           "dots_with_no_batch_dims_saveable",
                                           "nothing_saveable"), default="none",
                   help="recompute every layer's forward pass in the backward pass under this "
                        "jax.checkpoint_policies policy, in every plan run (for tests and "
                        "benchmarks)")
    s.add_argument("--no-validate-baselines", dest="validate_baselines", action="store_false",
                   help="validate only the predicted plans, not the rule-file baselines too")
    s.add_argument("--iters", type=int, default=None,
                   help="steps per measurement (at least 5 steps and 0.1 s when left out)")
    h = p.add_argument_group(
        "several processes", "one python -m cfp per host, each with the same flags but "
        "--process-id; on a Slurm or Open MPI cluster the count and rank are read from it")
    h.add_argument("--coordinator", default=os.environ.get("JAX_COORDINATOR_ADDRESS"),
                   help="HOST:PORT of process 0; its workers' runtimes use the ports above it "
                        "(JAX_COORDINATOR_ADDRESS when left out)")
    h.add_argument("--num-processes", type=int, default=_env_int("SLURM_NTASKS",
                                                                 "OMPI_COMM_WORLD_SIZE") or 1,
                   help="processes taking part, one per host")
    h.add_argument("--process-id", type=int, default=_env_int("SLURM_PROCID",
                                                              "OMPI_COMM_WORLD_RANK") or 0,
                   help="this process's rank; process 0 writes the work dir and reports")
    h.add_argument("--join-timeout", type=int, default=30,
                   help="seconds every process's workers wait for the others to join; one "
                        "that does not join in time stops the run")
    st = p.add_argument_group("stages")
    st.add_argument("--micro-batches", type=int, default=8,
                    help="micro-batches per step; must divide the batch size")
    for action in p._actions:
        if action.dest in BOUNDS:
            action.help += f" [{bounds_text(action.dest)}]"
    return p


def _env_int(*names: str) -> int | None:
    for name in names:
        if os.environ.get(name, "").isdigit():
            return int(os.environ[name])
    return None


def parse(argv: list[str] | None = None) -> Options:
    """``argv`` as ``Options``; an argument error raises ``CfpError``."""
    return Options(**vars(build_parser().parse_args(argv)))


def main(argv: list[str] | None = None) -> int:
    """The command line: runs ``argv``'s passes; a ``CfpError`` is one line and status 2."""
    from cfp.api import run
    from cfp.interrupts import interrupted
    try:
        options = parse(argv)
        logging.basicConfig(level=logging.INFO if options.verbose else logging.WARNING,
                            format="%(name)s: %(message)s")
        run(options, own_process=True)
    except CfpError as e:
        print(f"cfp: error: {e}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, Exception) as e:
        if not interrupted(e):
            raise
        print("cfp: interrupted; everything measured so far is kept in the work dir",
              file=sys.stderr)
        return 130
    return 0
