"""Runs every benchmark module `bench/bench_*.py` and writes JSON results.

Each module provides `run(out_dir: str, quick: bool) -> dict`. Results go to
`bench/results/<module>.json` plus `bench/results/summary.json` with the machine
they ran on; BENCHMARKS.md records the latest figures.

usage: python -m bench.run_all [--quick] [--only NAME ...] [--results-dir DIR]
"""

import argparse
import importlib
import json
import os
import pkgutil
import platform
import sys
import time

import bench

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def machine() -> dict:
    cpu_model = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu_model = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), ""
            )
    except OSError:
        pass
    memory_gib = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model,
        "memory_gib": round(memory_gib, 1),
        # Other jobs on a shared machine slow every figure; the ratios are what to compare.
        "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--only", nargs="*", default=None, help="module names, e.g. bench_beam")
    parser.add_argument("--results-dir", default=RESULTS_DIR, help="where the JSON goes")
    args = parser.parse_args(argv)
    results_dir = args.results_dir
    names = sorted(
        m.name for m in pkgutil.iter_modules(bench.__path__) if m.name.startswith("bench_")
    )
    if args.only:
        unknown = set(args.only) - set(names)
        if unknown:
            print(
                f"bench: error: unknown benchmark(s) {sorted(unknown)}; have {names}",
                file=sys.stderr,
            )
            return 2
        names = [n for n in names if n in args.only]
    os.makedirs(results_dir, exist_ok=True)
    summary = {"machine": machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "results": {}}
    for name in names:
        print(f"bench: running {name}", flush=True)
        start = time.perf_counter()
        result = importlib.import_module(f"bench.{name}").run(results_dir, args.quick)
        result = {
            "wall_seconds": time.perf_counter() - start,
            # Long runs on a shared machine: the load at the end as well as at the start.
            "load_average_end_1_5_15": [round(x, 2) for x in os.getloadavg()],
            **result,
        }
        with open(os.path.join(results_dir, f"{name}.json"), "w") as f:
            json.dump({"machine": summary["machine"], **result}, f, indent=2)
        summary["results"][name] = result
    with open(os.path.join(results_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"bench: wrote {results_dir}/summary.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
