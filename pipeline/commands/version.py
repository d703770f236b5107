"""Print the versions of the validated stack (docs/design.md section 1) this install runs."""

from collections.abc import Sequence
from importlib import metadata

from absl import flags

STACK = (
    "dp-fedemb",
    "tensorflow",
    "tensorflow-federated",
    "tensorflow-privacy",
    "dp-accounting",
    "tfx",
    "apache-beam",
    "protobuf",
)


def define_flags(flag_values: flags.FlagValues) -> None:
    del flag_values  # no flags


def run(flag_values: flags.FlagValues, args: Sequence[str]) -> int:
    del flag_values
    if args:
        raise ValueError(f"unexpected arguments: {' '.join(args)}")
    for name in STACK:
        print(f"{name} {metadata.version(name)}")
    return 0
