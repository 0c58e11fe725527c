"""Whether ranking a whole segment's combinations keeps the best one (``cfp.ranking``).

For a work dir profiled with windows split to fit ``--max-combinations`` (every combination
of every window measured), composes each whole segment's joint combinations from that profile
(measured window times plus measured reshardings between its windows) and finds the ``--top``
cheapest exactly (``ranking.k_cheapest``). Then ranks the same segment as a whole-segment
profile would (the additive analytic price, a cost model fitted on these devices, the
``--ranked`` cheapest plus the baselines' combinations) and reports, per segment
type, whether the measured best is among the ranked (recall@1) and how many of the measured
``--top`` are (recall@top).

    python scripts/diagnostics/ranking_recall.py --model gpt --num-layers 2 --hidden-size 256 \\
        --seq-len 128 --num-heads 8 --mesh 2x4 --ranked 128

Appends to ``scripts/results/<date>-ranking-recall-<backend>.csv``.
"""
from __future__ import annotations

import datetime
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def main() -> None:
    from composition_check import plan_arguments, plan_setup
    ap = plan_arguments()
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--ranked", type=int, default=128,
                    help="combinations a whole-segment window measures (its --max-combinations)")
    args = ap.parse_args()
    mesh_shape, label, workdir = plan_setup(args)
    import jax
    import numpy as np
    from cfp import ranking
    from cfp.measure import fit_cost_model
    from cfp.records import read_record
    from cfp.windows import boundaries, layouts, split_windows
    from cfp.workdir import ANALYSIS_FORMAT, WorkDir
    from cfp.workloads import AXIS_NAMES, make_mesh, run_fingerprint

    analysis = read_record(workdir / "analysis.pkl", ANALYSIS_FORMAT, None,
                           hint="run scripts/composition_check.py with these flags first")
    profile = WorkDir(workdir, run_fingerprint(analysis.spec, mesh_shape)).read_profile(
        analysis, max_combinations=args.max_combinations)
    names = AXIS_NAMES[:len(mesh_shape)]
    blocks = analysis.blocks.blocks
    cost = fit_cost_model(make_mesh(mesh_shape))
    whole, whole_reps = split_windows(analysis, args.max_combinations, whole_segments=True)
    backend = jax.devices()[0].platform
    out = ROOT / "scripts" / "results" / f"{datetime.date.today()}-ranking-recall-{backend}.csv"
    print(f"{label} mesh {args.mesh}: a cost model fitted here (alpha {cost.alpha}, beta "
          f"{cost.beta}, {cost.device_flops:.3g} FLOP/s, {cost.device_bandwidth:.3g} B/s)")
    new = not out.exists()
    with open(out, "a") as f:
        if new:
            f.write("workload,mesh,backend,segment_type,blocks,space,measured,ranked,"
                    "recall_at_1,top,recall_at_top\n")
        for t, rep in enumerate(whole_reps):
            seg = whole[rep]
            space = ranking.space_size(analysis, seg)
            if space <= args.ranked:
                continue  # measured whole either way
            parts = [w for w in profile.windows if seg.start <= w.start < seg.end]
            # The segment's measured combinations as a chain of its windows: prices are the
            # measured window times, edges the measured reshardings between them.
            options = [[c for c, m in sorted(profile.window_profiles[w.type].results.items())
                        if m.status == "ok"] for w in parts]
            prices = [[profile.window_profiles[w.type].results[c].time_s for c in opts]
                      for w, opts in zip(parts, options)]
            part_of = {b: i for i, w in enumerate(parts) for b in range(w.start, w.end)}
            edges: dict = {}
            for bd in boundaries(analysis, profile.windows):
                if bd.src not in part_of or bd.dst not in part_of:
                    continue
                i, j = part_of[bd.src], part_of[bd.dst]
                src, src_of = layouts(bd.src_labels, blocks[bd.src].strategies, names)
                dst, dst_of = layouts(bd.dst_labels, blocks[bd.dst].strategies, names)
                table = np.zeros((len(options[i]), len(options[j])))
                for a, ca in enumerate(options[i]):
                    for b, cb in enumerate(options[j]):
                        s = src[src_of[ca[bd.src - parts[i].start]]]
                        d = dst[dst_of[cb[bd.dst - parts[j].start]]]
                        if s != d:
                            table[a, b] = profile.reshard_s.get(
                                (bd.shape, bd.dtype, s, d)) or 0.0
                lo, hi = sorted((i, j))
                edges[(lo, hi)] = edges.get((lo, hi), 0) + (table if i == lo else table.T)
            best = [sum((options[i][k] for i, k in enumerate(pick)), ())
                    for _, pick in ranking.k_cheapest(prices, edges, args.top)]
            also = ranking.baseline_combinations(analysis, seg, whole)
            ranked = set(ranking.ranked_combinations(analysis, seg, args.ranked, cost, names,
                                                     also))
            kept = sum(c in ranked for c in best)
            f.write(f"{label},{args.mesh},{backend},{t},{seg.end - seg.start},{space},"
                    f"{len(parts)} windows,{len(ranked)},{int(best[0] in ranked)},"
                    f"{len(best)},{kept / len(best):.2f}\n")
            print(f"{label} mesh {args.mesh}, segment type {t} ({seg.end - seg.start} blocks, "
                  f"{space:.3g} combinations): the measured best is "
                  f"{'among' if best[0] in ranked else 'NOT among'} the {len(ranked)} ranked; "
                  f"{kept} of the measured {len(best)} cheapest are")
    print(f"rows appended to {out.relative_to(ROOT)}")


if __name__ == "__main__":
    from cfp.host_memory import run_pooled
    run_pooled()  # timing measures programs, not the host allocator
    main()
