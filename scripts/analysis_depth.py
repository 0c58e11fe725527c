"""Analysis time of a tiny GPT at 20, 40 and 80 layers (mesh 8), and the seed comparisons per
contraction, which do not grow with depth. Prints a CSV line per depth."""
import time

from cfp.passes.analysis import run_analysis
from cfp.workloads import WorkloadSpec

print("layers,analysis_s,contractions,seed_comparisons_per_contraction")
for layers in (20, 40, 80):
    start = time.perf_counter()
    a = run_analysis(WorkloadSpec("gpt", "tiny", None, "float32",
                                  (("num_layers", layers),)).resolved(), (8,))
    n = sum(op.is_contraction for op in a.graph.ops)
    print(f"{layers},{time.perf_counter() - start:.1f},{n},{a.blocks.seed_comparisons / n:.3f}")
