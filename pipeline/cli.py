"""The `dp-fedemb` command line (docs/design.md section 6).

Each subcommand lives in `pipeline.commands.<module>` and provides
`define_flags(flag_values)` and `run(flag_values, args) -> int`. Flags are parsed
into a fresh `absl.flags.FlagValues` per invocation, so subcommands may reuse
flag names and can be called in-process by tests.

A subcommand may also provide `check(flag_values, args)`: the checks of its flags,
config and paths that need no TensorFlow, TFF, Beam or TFX (`pipeline.commands.checks`),
run before `run` imports anything heavy, so a refusal comes within about a second
(issue 29), `help_defaults()`: flag name -> its effective default, appended to the
flag's `--help` line where the flag's own default is None (e.g. `train`'s recipe values),
and `RENAMED_FLAGS`: old flag name -> new, for flags renamed within the last release: the
old spelling still works and prints one deprecation line on stderr.

Input errors (`ValueError`, `OSError` such as a missing or unwritable path, bad flags)
end with one line on stderr and a non-zero exit; anything else is a bug and keeps its
traceback. An unknown command, flag or enum value names the closest valid one.
"""

import errno
import gc
import importlib
import os
import re
import sys
from collections.abc import Mapping, Sequence

from absl import flags

from pipeline import console, help_screen
from pipeline.commands import checks

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


def _one_line(text: str) -> str:
    return "; ".join(line.strip() for line in str(text).splitlines() if line.strip())


# OS errors that a user fixes outside the product (space, quota, a read-only disk).
_STORAGE_ERRORS = {
    errno.ENOSPC: "No space left on device",
    errno.EDQUOT: "Disk quota exceeded",
    errno.EROFS: "Read-only file system",
}
_RERUN = "re-run the same command: it continues where it stopped"
_STORAGE_HINTS = {
    errno.ENOSPC: f"free space (or write to a larger disk) and {_RERUN}",
    errno.EDQUOT: f"free space within your quota (or write to another disk) and {_RERUN}",
    errno.EROFS: f"the file system is read-only: make it writable (or write to another disk) and {_RERUN}",
}
# Bytes a library put in its message (Beam's TFRecord reader prints a record with a
# bad checksum: user names, images): never on the console or in a log line. A
# SHA-256 (64 hex digits) is not data, nor a "b" ending a word before a quote.
_DATA_IN_MESSAGE = re.compile(
    r"""(?<![\w\\'"])(?:b'(?:[^'\\]|\\.)*'|b"(?:[^"\\]|\\.)*")|[0-9a-fA-F]{65,}"""
)


def _without_data(text: str) -> str:
    """`text` with byte literals and long hex runs replaced by their length."""
    return _DATA_IN_MESSAGE.sub(lambda m: f"<{len(m.group(0))} characters of data not shown>", text)


def _storage_error(error: BaseException) -> str | None:
    """One line for a full disk, an exceeded quota or a read-only filesystem anywhere
    in `error`'s chain (an OSError from Python or Beam, or TensorFlow's error naming
    the file it was writing); None for anything else."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in _STORAGE_ERRORS:
            where = f" writing {current.filename}" if current.filename else ""
            return f"{_STORAGE_ERRORS[current.errno]}{where}; {_STORAGE_HINTS[current.errno]}"
        text = str(current)
        for number, reason in _STORAGE_ERRORS.items():
            if reason in text and type(current).__module__.startswith("tensorflow"):
                first = _one_line(text)[:300]
                return f"{reason} ({first}); {_STORAGE_HINTS[number]}"
        current = current.__cause__ or current.__context__
    return None


def _flag_error(flag_values: flags.FlagValues, error: flags.Error) -> str:
    """absl's message of a bad flag, on one line, naming the closest valid flag or value."""
    if isinstance(error, flags.UnrecognizedFlagError):
        name = error.flagname
        hint = checks.did_you_mean(name, list(flag_values), "--")
        return f"unknown flag --{checks.shown(name)}{hint} (see --help)"
    message = _one_line(str(error))
    # absl's required-flag check reads "flag --delta=None: Flag --delta must have a value
    # other than None." once per missing flag: one line naming them all instead.
    missing = re.findall(r"Flag --([\w-]+) must have a value other than None", message)
    if missing:
        names = ", ".join(f"--{name}" for name in missing)
        return f"missing required flag{'s' if len(missing) > 1 else ''} {names} (see --help)"
    match = re.match(r"flag --([\w-]+)=(.*): value should be one of <", message)
    if match and match.group(1) in flag_values:
        parser = flag_values[match.group(1)].parser
        choices = getattr(parser, "enum_values", None) or []
        message = checks.shown(message) + checks.did_you_mean(match.group(2), choices)
    return checks.shown(message)


def renamed_flags(
    command_name: str,
    renamed: Mapping[str, str],
    flag_values: flags.FlagValues,
    args: Sequence[str],
) -> list[str]:
    """`args` with each renamed flag spelled by its new name; one stderr line for each old
    name used. A flag's separate value (`--server-lr 0.1`) is never taken for a flag."""
    out: list[str] = []
    warned: set[str] = set()
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg == "--":  # absl parses no flag after it
            out.extend(args[i - 1 :])
            break
        if not arg.startswith("-") or arg == "-":
            out.append(arg)
            continue
        dashes = "--" if arg.startswith("--") else "-"
        name, sep, value = arg[len(dashes) :].partition("=")
        if name in renamed:
            if name not in warned:
                warned.add(name)
                print(
                    f"dp-fedemb {command_name}: warning: {dashes}{name} is deprecated; "
                    f"use {dashes}{renamed[name]}",
                    file=sys.stderr,
                )
            name = renamed[name]
            arg = f"{dashes}{name}{sep}{value}"
        out.append(arg)
        if not sep and name in flag_values and not flag_values[name].boolean and i < len(args):
            out.append(args[i])
            i += 1
    return out


def _print_help(name: str, command, flag_values: flags.FlagValues, full: bool) -> None:
    defaults = getattr(command, "help_defaults", dict)()
    for flag_name, text in defaults.items():
        if flag_name in flag_values and flag_values[flag_name].default is None:
            flag_values[flag_name].help += f" (effective default: {text})"
    print(help_screen.command_help(name, command, flag_values, full))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv if argv is None else argv)
    if len(argv) < 2:
        print(help_screen.command_list(COMMANDS), file=sys.stderr)
        return EXIT_USAGE
    if argv[1] in ("-h", "--help", "help"):
        print(help_screen.command_list(COMMANDS))
        return 0
    name = argv[1]
    if name not in COMMANDS:
        hint = checks.did_you_mean(name, COMMANDS)
        print(
            f"dp-fedemb: error: unknown command {checks.shown(repr(name))}{hint} {_usage()}",
            file=sys.stderr,
        )
        return EXIT_USAGE
    # TensorFlow's C++ INFO lines (one per graph optimisation) drown the progress
    # output; set before TF is imported, and only when the user has not chosen.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
    # gRPC's C core writes races at interpreter exit ("Kick failed: eventfd_write") to
    # stderr after the command's one error line; its real failures still raise in Python.
    # GRPC_VERBOSITY=ERROR brings its log back (docs/cli.md).
    os.environ.setdefault("GRPC_VERBOSITY", "NONE")
    command = importlib.import_module(COMMANDS[name])
    flag_values = flags.FlagValues()
    command.define_flags(flag_values)
    if any(a in ("-h", "--help", "--helpfull") for a in argv[2:]):
        _print_help(name, command, flag_values, full="--helpfull" in argv[2:])
        return 0
    args = renamed_flags(name, getattr(command, "RENAMED_FLAGS", {}), flag_values, argv[2:])
    try:
        rest = flag_values([f"dp-fedemb {name}", *args])
        flag_values.validate_all_flags()
    except flags.Error as e:
        # absl reports several bad flags on several lines; keep to one error line.
        print(f"dp-fedemb {name}: error: {_flag_error(flag_values, e)}", file=sys.stderr)
        return EXIT_USAGE
    try:
        if hasattr(command, "check"):
            command.check(flag_values, rest[1:])
        with console.QuietStderr(), console.library_logs_to_file_only():
            return int(command.run(flag_values, rest[1:]) or 0)
    except Exception as e:  # noqa: BLE001 - sorted below: input errors, storage, bugs
        storage = _storage_error(e)
        if storage is None and not isinstance(e, (ValueError, OSError)):
            raise  # a bug: keep its traceback
        message = storage or (_without_data(_one_line(str(e))) if str(e) else type(e).__name__)
        print(f"dp-fedemb {name}: error: {checks.shown(message)}", file=sys.stderr)
        return EXIT_INPUT_ERROR


def console_main() -> None:
    code = main()
    # The command is done: skip the interpreter's last cyclic collection over TensorFlow's,
    # TFX's and Beam's heaps (2-4 s at the end of `dp-fedemb run`). atexit handlers still
    # run, and so does every destructor that reference counting reaches.
    gc.freeze()
    sys.exit(code)
