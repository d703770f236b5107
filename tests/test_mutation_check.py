"""scripts/mutation_check.py's mutants still match the source (the check itself, which
runs the tests under each fault, is `make mutation-check`, run by CI)."""

import importlib.util
import os
import re
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SPEC = importlib.util.spec_from_file_location(
    "mutation_check", os.path.join(REPO, "scripts", "mutation_check.py")
)
mutation_check = importlib.util.module_from_spec(_SPEC)
sys.modules["mutation_check"] = mutation_check  # dataclasses look their module up there
_SPEC.loader.exec_module(mutation_check)


@pytest.mark.parametrize("mutant", mutation_check.MUTANTS, ids=lambda m: m.name)
def test_each_mutant_changes_one_exact_snippet_of_its_file(mutant):
    with open(os.path.join(REPO, mutant.path)) as f:
        source = f.read()
    assert source.count(mutant.original) == 1, f"{mutant.name}: update its snippet"
    assert mutant.replacement != mutant.original
    # The faulty file still compiles: a mutant must be caught by a test, not by a
    # syntax error at import.
    compile(source.replace(mutant.original, mutant.replacement), mutant.path, "exec")
    assert all(re.fullmatch(r"tests/test_\w+\.py::\w+(\[[^\]]+\])?", t) for t in mutant.tests)


def test_mutants_have_unique_names_and_cover_every_invariant_family():
    names = [m.name for m in mutation_check.MUTANTS]
    assert len(names) == len(set(names))
    # The list: clip of every mechanism, noise scale, accounting sensitivity,
    # budget refusal, dedup verification and its copy evidence.
    for family in (
        "aggregator-gaussian-clip",
        "aggregator-tree-clip",
        "user-dp-sgd-clip-per-user-tape",
        "logit-dp-pair-clip",
        "fdml-row-clip",
        "fdml-gradient-clip",
        "dplc-centers-clip",
        "aggregator-gaussian-noise-scale",
        "accounting-substitute-one-sensitivity",
        "tree-sensitivity-single-tree",
        "budget-refusal",
        "dedup-verification",
        "dedup-shared-noise",
        "dedup-jpeg-reencode",
    ):
        assert family in names, family
