"""The harness's event timer against triton.testing's timers on the same cases of one commit:
do_bench (its own L2 flush) on the core cases of row softmax, softmax(x) @ V and softmax(x @ W)
(torch and ours), and CUDA graphs (do_bench_cudagraph) on the core attention cases (cuDNN and
ours). Reads the runs' JSONs in outputs/ (no GPU): the median of each timer's rounds, in ms.
From the repository root: python3 outputs/profiles/timer_crosscheck.py"""
import json
import statistics
from pathlib import Path

OUT = Path(__file__).resolve().parents[1]


def medians(path):
    runs = json.loads(path.read_text())["benchmarks"]
    return {b["name"]: b["stats"]["median"] * 1e3 for b in runs}


def main():
    events = medians(OUT / "benchmark_shape_grid_aa7a5f8.json")
    for timer in ("do_bench", "cudagraph"):
        other = medians(OUT / f"benchmark_timer_crosscheck_{timer}_aa7a5f8.json")
        print(f"{timer} against the event timer (aa7a5f8, H100), median ms of each:")
        ratios = []
        for name in sorted(other):
            if name in events:
                ratio = other[name] / events[name]
                ratios.append(ratio)
                print(f"  {name}: events {events[name]:.4f} {timer} {other[name]:.4f} ({ratio:.3f})")
        print(f"  {len(ratios)} cases: {timer} / events median {statistics.median(ratios):.3f}, "
              f"from {min(ratios):.3f} to {max(ratios):.3f}\n")


if __name__ == "__main__":
    main()
