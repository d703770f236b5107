"""Runs every benchmark module `bench/bench_*.py` and writes JSON results.

Each module provides `run(out_dir: str, quick: bool) -> dict`. Results go to
`bench/results/<module>.json` plus `bench/results/summary.json` with the machine
they ran on; BENCHMARKS.md records the latest figures.

usage: python -m bench.run_all [--quick] [--only NAME ...]
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
    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    parser.add_argument("--only", nargs="*", default=None, help="module names, e.g. bench_beam")
    args = parser.parse_args(argv)
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
    os.makedirs(RESULTS_DIR, exist_ok=True)
    summary = {"machine": machine(), "started": time.strftime("%Y-%m-%dT%H:%M:%S"), "results": {}}
    for name in names:
        print(f"bench: running {name}", flush=True)
        start = time.perf_counter()
        result = importlib.import_module(f"bench.{name}").run(RESULTS_DIR, args.quick)
        result = {"wall_seconds": time.perf_counter() - start, **result}
        with open(os.path.join(RESULTS_DIR, f"{name}.json"), "w") as f:
            json.dump({"machine": summary["machine"], **result}, f, indent=2)
        summary["results"][name] = result
    with open(os.path.join(RESULTS_DIR, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print(f"bench: wrote {RESULTS_DIR}/summary.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
