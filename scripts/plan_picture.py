"""The picture and the console answer of a plan search kept in a work dir, redrawn from its
records (nothing runs): ``debug_search/plan.png`` and the lines ``python -m cfp`` printed.

    python scripts/plan_picture.py --model gpt --mesh 2x4 --memory-budget 2 \\
        --workdir profiles/gpt-tiny-2x4 --out scripts/results/<date>-plan-gpt-tiny-2x4.png

Takes the flags of ``python -m cfp`` that name the run, and ``--out`` for the picture.
"""
import argparse
import math
import os
import sys


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="where to write the picture (PNG)")
    own, rest = parser.parse_known_args()
    from cfp.api import workdir_of
    from cfp.cli import parse
    options = parse(rest)
    wd = workdir_of(options)
    os.environ["XLA_FLAGS"] = (f"--xla_force_host_platform_device_count="
                               f"{options.num_devices or 8}")
    from cfp import dumps, report
    analysis, search = wd.read_analysis(), wd.read_search()
    budget = None if options.memory_budget_gb is None else int(options.memory_budget_gb * 2**30)
    report.search_console(search, analysis, math.prod(analysis.mesh_shape), budget)
    rows, candidates = dumps.plan_figure_data(analysis, search)
    fig = dumps.plan_figure(rows, candidates, title=(
        f"{analysis.spec.label} on mesh {'x'.join(map(str, analysis.mesh_shape))}: "
        f"{search.plan.source}"))
    fig.savefig(own.out, dpi=110)
    print(f"wrote {own.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
