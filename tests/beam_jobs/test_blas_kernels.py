"""Dedup decides the same under every BLAS kernel (issue 67 item 1).

numpy's OpenBLAS picks its matrix-product kernel for the CPU (or `OPENBLAS_CORETYPE`),
and kernels sum in different orders. Dedup's thresholds must not sit on those last
bits: the removed pairs of real photo and digit copies and of rendered characters
(bench/bench_dedup.py's sets, every sixth original) are the same, pair for pair, under
the Haswell kernel (AVX2, what an AMD EPYC or a host setting `OPENBLAS_CORETYPE=Haswell`
runs) and the Prescott kernel (SSE3, a different summation), each in a fresh process.
"""

import json
import os
import subprocess
import sys

import pytest

from tests import paths

pytestmark = pytest.mark.slow


def removed_pairs() -> dict[str, list[list[str]]]:
    """Set name -> sorted [candidate, reference] pairs dedup removes (run in the child)."""
    from beam_jobs import dedup
    from bench import bench_dedup, real_images, rendered_images

    sets = {
        "photos_and_digits": real_images.originals(28, digits_per_class=2)[::6],
        "characters": rendered_images.originals(28, "by_identity", 1, "characters")[::6],
    }
    out = {}
    for name, originals in sets.items():
        references, candidates = bench_dedup.benchmark_set(originals)
        removed = bench_dedup.run_dedup(references, candidates, dedup.DedupConfig())
        out[name] = sorted([k, v["reference"]["user_id"]] for k, v in removed.items())
    return out


def _removed_under(kernel: str) -> dict:
    code = "import json; from tests.beam_jobs import test_blas_kernels as t; "
    code += "print(json.dumps(t.removed_pairs()))"
    env = {**os.environ, "OPENBLAS_CORETYPE": kernel, "OPENBLAS_VERBOSE": "2"}
    done = subprocess.run(
        [sys.executable, "-c", code],
        cwd=str(paths.REPO),
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert f"Core: {kernel}" in done.stdout + done.stderr  # OpenBLAS took the kernel asked for
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_dedup_removes_the_same_pairs_under_two_blas_kernels():
    haswell, prescott = _removed_under("Haswell"), _removed_under("Prescott")
    assert haswell == prescott
    assert all(haswell.values())  # each set has copies removed: the comparison means something
