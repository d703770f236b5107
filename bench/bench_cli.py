"""CLI responsiveness (issue 29 item 4): seconds to `--help` and to a flag error per command.

Each figure is the wall time of a fresh `dp-fedemb ...` process (the console script of
this interpreter's environment), from start to exit: interpreter start, imports, flag
parsing, the command's checks, and the one-line answer. Flag checks come before
TensorFlow, TFF, Beam and TFX are imported, so every answer here should take about the
interpreter's own start plus absl (target: about 2 s on 2 cores). `privacy` also
computes: its error cases include the issue's accountant inputs (an overflowing noise
multiplier, 10^8 DP-FTRL rounds, a target epsilon of 1e300), each answered in one line.

Median of 5 runs per case (1 in quick mode). Every case also records its exit status
and stderr line count: a flag error must exit non-zero with exactly one line.

`run(out_dir, quick)` is called by bench.run_all, which writes bench/results/bench_cli.json.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time

_REPEATS = 5
_TIMEOUT_S = 300
_PRIVACY = ["privacy", "--users=1000", "--users-per-round=100", "--delta=1e-5"]


def _entry() -> list[str]:
    script = os.path.join(os.path.dirname(sys.executable), "dp-fedemb")
    if os.path.exists(script):
        return [script]
    return [sys.executable, "-c", "from pipeline.cli import console_main; console_main()"]


def _cases(work: str) -> dict[str, dict[str, list[str]]]:
    """command -> {"help": argv, "flag_error": argv, ...more error cases}."""
    existing_file = os.path.join(work, "a_file")
    with open(existing_file, "w") as f:
        f.write("x\n")
    data_dir = os.path.join(work, "data")
    os.makedirs(data_dir, exist_ok=True)
    return {
        "version": {"help": ["version", "--help"], "flag_error": ["version", "stray"]},
        "data": {
            "help": ["data", "--help"],
            "flag_error": ["data", "synth", f"--out={existing_file}"],
        },
        "privacy": {
            "help": ["privacy", "--help"],
            "flag_error": [*_PRIVACY, "--rounds=10", "--noise-multiplier=1e308"],
            "target_epsilon_1e300": [*_PRIVACY, "--rounds=10", "--target-epsilon=1e300"],
            "dpftrl_1e8_rounds": [
                *_PRIVACY,
                "--rounds=100000000",
                "--mechanism=dpftrl",
                "--noise-multiplier=1",
            ],
        },
        "train": {
            "help": ["train", "--help"],
            "flag_error": [
                "train",
                f"--data={data_dir}",
                f"--output={os.path.join(work, 'out')}",
                "--override-budget",
            ],
            "output_is_a_file": ["train", f"--data={data_dir}", f"--output={existing_file}"],
        },
        "evaluate": {
            "help": ["evaluate", "--help"],
            "flag_error": ["evaluate", f"--model={work}/missing", f"--data={data_dir}"],
        },
        "run": {
            "help": ["run", "--help"],
            "flag_error": ["run", "--set=train.roundz=3"],
        },
        "compile": {
            "help": ["compile", "--help"],
            "flag_error": ["compile", "--target=kubflow", f"--out={work}/p.json"],
        },
    }


def _env() -> dict[str, str]:
    """This checkout first on the path: the processes run in a scratch directory."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root if not path else f"{root}{os.pathsep}{path}"}


def _time(argv: list[str], repeats: int, cwd: str) -> dict:
    seconds, codes, lines = [], set(), set()
    for _ in range(repeats):
        start = time.perf_counter()
        done = subprocess.run(
            _entry() + argv,
            capture_output=True,
            text=True,
            timeout=_TIMEOUT_S,
            cwd=cwd,
            env=_env(),
        )
        seconds.append(time.perf_counter() - start)
        codes.add(done.returncode)
        lines.add(done.stderr.count("\n"))
    return {
        "argv": argv,
        "median_seconds": round(statistics.median(seconds), 3),
        "max_seconds": round(max(seconds), 3),
        "exit_codes": sorted(codes),
        "stderr_lines": sorted(lines),
    }


def run(out_dir: str, quick: bool) -> dict:
    del out_dir  # bench.run_all writes the returned dict
    repeats = 1 if quick else _REPEATS
    results: dict = {"quick": quick, "repeats": repeats, "entry": _entry(), "commands": {}}
    with tempfile.TemporaryDirectory(prefix="bench_cli_") as work:
        for command, cases in _cases(work).items():
            results["commands"][command] = {
                name: _time(argv, repeats, work) for name, argv in cases.items()
            }
    every = [
        case["median_seconds"] for cases in results["commands"].values() for case in cases.values()
    ]
    results["slowest_median_seconds"] = max(every)
    return results


if __name__ == "__main__":
    import json

    print(json.dumps(run("", quick="--quick" in sys.argv), indent=2))
