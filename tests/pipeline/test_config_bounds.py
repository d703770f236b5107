"""Hostile config texts through the real `dp-fedemb` command (issue 37, item 7): an alias
bomb, deep nesting, huge integers and huge values are each refused with one short stderr
line naming the key, and a non-zero exit, in bounded time and memory.

Every command runs in a child process under an address-space limit and a timeout, so
code without the bounds fails these tests fast (MemoryError traceback or timeout)
instead of eating the machine.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pipeline import config as config_lib
from tff_algorithms.base import bounded_load
from tff_algorithms.privacy import budget
from tff_algorithms.privacy.ledger import PrivacyLedger

CONSOLE_SCRIPT = os.path.join(os.path.dirname(sys.executable), "dp-fedemb")
# 1.5 GiB of address space: above what a refused config needs (it runs in 0.8), far
# below what expanding the bomb takes (gigabytes).
ADDRESS_SPACE_BYTES = 3 << 29
# Generous: a loaded 2-core CI machine starts the CLI slowly; the memory limit stops a bomb.
TIMEOUT_S = 240
# An error line that shows a value or key path capped at bounded_load.SHOWN_CHARS.
MAX_LINE_CHARS = 400


# Sets the limit, then becomes the command: the limit is set after the exec, not in a
# `preexec_fn`, which makes Python fork and run its after-fork hooks in the child. With
# the session's TFF runtime's gRPC threads busy in this process, gRPC once printed a
# "Kick failed" line into such a child's stderr.
_LIMITED_EXEC = (
    "import os, resource, sys; "
    "resource.setrlimit(resource.RLIMIT_AS, (int(sys.argv[1]),) * 2); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)


def refused(*args: str) -> str:
    """Runs `dp-fedemb run --print-config ARGS` under the limits; asserts a non-zero
    exit and exactly one short stderr line, and returns it."""
    done = subprocess.run(
        [sys.executable, "-c", _LIMITED_EXEC, str(ADDRESS_SPACE_BYTES)]
        + [CONSOLE_SCRIPT, "run", "--print-config", *args],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert done.returncode != 0, done.stdout[-2000:]
    assert done.stderr.count("\n") == 1, done.stderr[-3000:]
    line = done.stderr.strip()
    assert line.startswith("dp-fedemb run: error: "), line[:3000]
    assert len(line) <= MAX_LINE_CHARS, line[:3000]
    return line


def alias_bomb(levels: int, repeats: int) -> str:
    """split.seed: a list of anchors, each a list of `repeats` aliases of the one before:
    repeats**levels values once expanded, a few hundred bytes of YAML."""
    items = ["&a0 [x]"] + [
        f"&a{i} [{', '.join([f'*a{i - 1}'] * repeats)}]" for i in range(1, levels + 1)
    ]
    return f"split:\n  seed: [{', '.join(items)}]\n"


def test_an_alias_bomb_is_refused_before_it_is_expanded(tmp_path):
    # 9**10 = 3.5e9 values: the error message's repr grew to 6.5 GB in a minute.
    path = tmp_path / "bomb.yaml"
    path.write_text(alias_bomb(levels=10, repeats=9))
    line = refused("--config", str(path))
    assert "split.seed[" in line and f"more than {bounded_load.MAX_VALUES} values" in line


def test_aliases_within_the_limits_load_as_written_out(tmp_path):
    aliased = tmp_path / "aliased.yaml"
    aliased.write_text(
        "pipeline:\n  beam_args: &args [--runner=DirectRunner, --direct_num_workers=1]\n"
        "data:\n  synthetic: &data {identities: 50, seed: 3}\n"
        "  synthetic_public:\n    <<: *data\n    style: sketch\n"
    )
    plain = tmp_path / "plain.yaml"
    plain.write_text(
        "pipeline:\n  beam_args: [--runner=DirectRunner, --direct_num_workers=1]\n"
        "data:\n  synthetic: {identities: 50, seed: 3}\n"
        "  synthetic_public: {identities: 50, seed: 3, style: sketch}\n"
    )
    # The light check (no TensorFlow): the same reading, typing and defaults as a run.
    read = [config_lib.check_config(str(path)) for path in (aliased, plain)]
    assert read[0] == read[1] and read[0].data.synthetic_public.identities == 50


@pytest.mark.parametrize(
    "name, text",
    [
        ("deep.yaml", "train:\n  rounds: " + "[" * 500 + "]" * 500 + "\n"),
        ("deep_mapping.yaml", "train:\n  rounds: " + "{a: " * 500 + "1" + "}" * 500 + "\n"),
        # json.loads itself recurses past Python's limit at about 1000 levels.
        ("deep.json", '{"train": {"rounds": ' + "[" * 2000 + "]" * 2000 + "}}"),
    ],
    ids=["yaml_lists", "yaml_mappings", "json_lists"],
)
def test_deep_nesting_in_a_file_is_one_line_naming_the_key(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    line = refused("--config", str(path))
    assert f"{name}: train.rounds" in line
    assert f"nests deeper than {bounded_load.MAX_DEPTH} levels" in line


def test_deep_nesting_in_an_override_is_one_line_naming_the_key():
    line = refused("--set", "train.rounds=" + "[" * 500 + "]" * 500)
    assert "override train.rounds" in line and "nests deeper than" in line
    line = refused("--set", "train" + ".a" * 500 + "=1")
    assert "override train.a.a" in line and "nests deeper than" in line


@pytest.mark.parametrize("suffix", [".yaml", ".json"])
def test_an_integer_of_too_many_digits_names_its_key(tmp_path, suffix):
    # Over Python's own limit of 4300 digits, whose message named no key.
    digits = "9" * 100_000
    path = tmp_path / f"big{suffix}"
    path.write_text(
        f'{{"train": {{"rounds": {digits}}}}}'
        if suffix == ".json"
        else f"train:\n  rounds: {digits}\n"
    )
    line = refused("--config", str(path))
    assert "train.rounds is an integer of 100000 digits" in line
    assert f"at most {bounded_load.MAX_INTEGER_DIGITS}" in line
    line = refused("--set", "split.seed=" + "9" * 1000)
    assert "override split.seed is an integer of 1000 digits" in line


def test_a_file_over_the_size_limit_is_refused_unread(tmp_path):
    # The 5-million-digit integer: longer than any config may be.
    path = tmp_path / "huge.yaml"
    path.write_text("train:\n  rounds: " + "9" * 5_000_000 + "\n")
    line = refused("--config", str(path))
    assert f"huge.yaml is longer than {bounded_load.MAX_TEXT_CHARS} characters" in line


def test_a_huge_wrong_value_is_shown_capped_on_one_line():
    # Error messages printed the whole value: 50,000 characters on the "one" line.
    line = refused("--set", "pipeline.enable_cache=" + "y" * 50_000)
    assert "pipeline.enable_cache must be true or false, got 'yyy" in line
    line = refused("--set", "split.seed=[" + '"a\\nb", ' * 5_000 + "]")
    assert "split.seed must be an integer, got ['a\\nb'" in line


def test_a_value_that_contains_itself_is_refused():
    line = refused("--set", "split.seed=&loop [1, *loop]")
    assert "override split.seed: [1] contains itself through a YAML alias" in line


def test_ledgers_nested_too_deep_are_one_line_errors(tmp_path):
    # json.loads raised RecursionError (a traceback) on both ledgers a run reads.
    deep = "[" * 5000 + "]" * 5000
    with pytest.raises(
        ValueError, match=r"privacy ledger: \[0\]\[0\].* nests deeper than"
    ) as raised:
        PrivacyLedger.from_json(deep)
    assert "\n" not in str(raised.value)
    path = tmp_path / "ledger.json"
    path.write_text(f'{{"format": "{budget.BUDGET_LEDGER_FORMAT}", "datasets": {deep}}}')
    with pytest.raises(
        ValueError, match=r"ledger.json: datasets\[0\]\[0\].* nests deeper than"
    ) as raised:
        budget.dataset_spent(str(path), "fingerprint", 1e-6)
    assert "\n" not in str(raised.value)


def test_shown_is_bounded_and_one_line():
    nested: list = ["x"]
    for _ in range(200):
        nested = [nested] * 9
    text = bounded_load.shown(nested)
    assert len(text) <= bounded_load.SHOWN_CHARS and text.endswith("...")
    assert bounded_load.shown("a\nb\u2028c") == "'a\\nb\\u2028c'"
