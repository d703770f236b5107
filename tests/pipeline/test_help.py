"""The help screens (issue 67 item 2): `dp-fedemb --help` lists the commands with their
purpose; a command's `--help` starts with the flags a user needs first, groups the
algorithm-specific ones under their algorithm and puts the deprecated ones last."""

import re

from absl import flags

from pipeline import cli, help_screen
from pipeline.commands import train
from tff_algorithms.algorithms import registry


def _help(capsys, *argv: str) -> str:
    assert cli.main(["dp-fedemb", *argv]) == 0
    return capsys.readouterr().out


def _titles(text: str) -> list[str]:
    return [line[:-1] for line in text.splitlines() if re.fullmatch(r"[A-Za-z].*:", line)]


def _flags(text: str) -> list[str]:
    return re.findall(r"^  --(?:\[no\])?([\w-]+):", text, flags=re.M)


def test_the_command_list_gives_each_command_its_purpose(capsys):
    out = _help(capsys, "--help")
    for name, module in cli.COMMANDS.items():
        line = next(line for line in out.splitlines() if line.startswith(f"  {name} "))
        assert help_screen.purpose(module)[:30] in " ".join(out.split()), name
        assert len(line.split()) > 2, line  # the name and its purpose


def test_train_help_starts_with_what_a_user_needs_and_ends_with_the_deprecated(capsys):
    out = _help(capsys, "train", "--help")
    titles = _titles(out)
    assert out.startswith("dp-fedemb train: ") and titles[0] == "Start here"
    assert _flags(out)[:4] == ["data", "output", "algorithm", "recipe"]
    assert titles[-1] == help_screen.DEPRECATED_TITLE
    assert help_screen.OTHER not in titles  # every flag of train sits in a named group
    deprecated = out.split(help_screen.DEPRECATED_TITLE)[1]
    assert _flags(deprecated) and all(
        "deprecated" in block.lower() for block in deprecated.split("\n  --")[1:]
    )
    # Each algorithm section's flags under a title naming the algorithms that read it.
    for section in registry.sections():
        users = registry.section_users(section)
        title = next(t for t in titles if t.startswith(f"{section} settings"))
        assert all(user in title for user in users), title


def test_every_train_flag_is_listed_once(capsys):
    out = _help(capsys, "train", "--help")
    flag_values = flags.FlagValues()
    train.define_flags(flag_values)
    own = [f.name for f in flag_values.flags_by_module_dict()["pipeline.commands.train"]]
    listed = _flags(out)
    assert len(listed) == len(set(listed))
    assert set(own) <= set(listed)
    assert "flagfile" not in listed  # absl's own: --helpfull


def test_data_help_groups_flags_by_the_job_that_reads_them(capsys):
    out = _help(capsys, "data", "--help")
    titles = _titles(out)
    verbs = ("synth", "ingest", "split", "dedup", "partition")
    assert titles[:6] == ["Start here"] + [f"{verb} only" for verb in verbs]
    assert _flags(out)[0] == "input"
    dedup_part = out.split("dedup only:")[1].split("partition only:")[0]
    assert set(_flags(dedup_part)) == {"hamming-threshold", "max-shift", "max-removed-fraction"}


def test_helpfull_is_absls_complete_listing(capsys):
    out = _help(capsys, "evaluate", "--helpfull")
    assert "--flagfile" in out and "--model" in out


def test_missing_required_flags_are_named_in_one_line(capsys):
    """absl says "Flag --delta must have a value other than None." once per flag."""
    assert cli.main(["dp-fedemb", "privacy", "--users=100", "--rounds=2"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err.strip()
    assert err == (
        "dp-fedemb privacy: error: missing required flags --users-per-round, --delta (see --help)"
    )


def test_no_command_lists_the_commands_and_fails(capsys):
    assert cli.main(["dp-fedemb"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert all(f"  {name} " in err for name in cli.COMMANDS)
