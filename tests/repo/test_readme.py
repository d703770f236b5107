"""README.md is the user's path (issue 67 item 5): the two commands first, then install,
run, their data, results, serving and scheduling, in at most 200 lines; measured advice
lives in docs/recipes.md, which the README points to."""

import re

from tests import paths

README = (paths.REPO / "README.md").read_text()


def test_readme_starts_with_the_two_commands_and_stays_short():
    first_block = README.split("```")[1]
    assert re.search(r"^make run\b", first_block, re.M)
    assert re.search(r"^make test\b", first_block, re.M)
    assert len(README.splitlines()) <= 200


def test_measured_advice_is_in_the_recipes_not_the_readme():
    recipes = (paths.REPO / "docs" / "recipes.md").read_text()
    assert "## Choosing an algorithm and a start" in recipes
    assert "Choosing an algorithm and a start" in README
    assert "recall@FAR 0.01" not in README  # benchmark figures belong in docs and BENCHMARKS
