"""The `dp-fedemb` command line (DESIGN.md section 6).

Each subcommand lives in `pipeline.commands.<module>` and provides
`define_flags(flag_values)` and `run(flag_values, args) -> int`. Flags are parsed
into a fresh `absl.flags.FlagValues` per invocation, so subcommands may reuse
flag names and can be called in-process by tests.

Input errors (`ValueError`, `FileNotFoundError`, bad flags) end with one line on
stderr and a non-zero exit; anything else is a bug and keeps its traceback.
"""

import importlib
import os
import sys
from collections.abc import Sequence

from absl import flags

# Subcommand name -> module implementing it.
COMMANDS: dict[str, str] = {
    "version": "pipeline.commands.version",
    "data": "pipeline.commands.data",
    "privacy": "pipeline.commands.privacy",
    "train": "pipeline.commands.train",
    "evaluate": "pipeline.commands.evaluate",
    "run": "pipeline.commands.run",
    "compile": "pipeline.commands.compile",
}

EXIT_USAGE = 2
EXIT_INPUT_ERROR = 1


def _usage() -> str:
    names = "|".join(sorted(COMMANDS))
    return f"usage: dp-fedemb {{{names}}} [--flags]   (dp-fedemb COMMAND --help for its flags)"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2 or argv[1] in ("-h", "--help", "help"):
        print(_usage(), file=sys.stdout if len(argv) >= 2 else sys.stderr)
        return 0 if len(argv) >= 2 else EXIT_USAGE
    name = argv[1]
    if name not in COMMANDS:
        print(f"dp-fedemb: error: unknown command {name!r}; {_usage()}", file=sys.stderr)
        return EXIT_USAGE
    # TensorFlow's C++ INFO lines (one per graph optimisation) drown the progress
    # output; set before TF is imported, and only when the user has not chosen.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    command = importlib.import_module(COMMANDS[name])
    flag_values = flags.FlagValues()
    command.define_flags(flag_values)
    if any(a in ("-h", "--help", "--helpfull") for a in argv[2:]):
        print(f"dp-fedemb {name}: {(command.__doc__ or '').strip().splitlines()[0]}")
        print(flag_values.get_help())
        return 0
    try:
        rest = flag_values([f"dp-fedemb {name}", *argv[2:]])
        flag_values.validate_all_flags()
    except flags.Error as e:
        # absl reports several bad flags on several lines; keep to one error line.
        message = "; ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"dp-fedemb {name}: error: {message}", file=sys.stderr)
        return EXIT_USAGE
    try:
        return int(command.run(flag_values, rest[1:]) or 0)
    except (ValueError, FileNotFoundError, NotADirectoryError, PermissionError) as e:
        message = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"dp-fedemb {name}: error: {message}", file=sys.stderr)
        return EXIT_INPUT_ERROR


def console_main() -> None:
    sys.exit(main())
