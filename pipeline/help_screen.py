"""The `dp-fedemb` help screens: the command list, and one command's flags in groups.

`dp-fedemb --help` lists each command with the first line of its module docstring.
`dp-fedemb COMMAND --help` prints the command's flags in the groups its module gives
(`help_groups(flag_values)`: ordered (title, flag names), the first group being the flags
a user needs first), then any flag no group names ("Other flags"), then the deprecated
ones (a help text starting "deprecated"). absl's own flags (--flagfile, --undefok) are
left to `--helpfull`, which prints absl's complete listing. No TensorFlow is imported.
"""

from __future__ import annotations

import importlib
import re
import textwrap
from collections.abc import Mapping, Sequence
from types import ModuleType

from absl import flags

WIDTH = 88
DEPRECATED = "deprecated"
OTHER = "Other flags"
DEPRECATED_TITLE = "Deprecated (still accepted; each use prints the flag that replaces it)"


def purpose(module_name: str) -> str:
    """The first line of a command module's docstring."""
    module = importlib.import_module(module_name)
    return (module.__doc__ or "").strip().splitlines()[0]


def command_list(commands: Mapping[str, str]) -> str:
    """`dp-fedemb --help`: usage, then each command with its purpose."""
    width = max(len(name) for name in commands)
    lines = ["usage: dp-fedemb COMMAND [--flags]   (dp-fedemb COMMAND --help for its flags)", ""]
    lines.append("commands:")
    for name in sorted(commands):
        wrapped = textwrap.wrap(purpose(commands[name]), WIDTH - width - 4)
        lines.append(f"  {name.ljust(width)}  {wrapped[0]}")
        lines += [" " * (width + 4) + more for more in wrapped[1:]]
    return "\n".join(lines)


def _own_flags(flag_values: flags.FlagValues) -> dict[str, flags.Flag]:
    """The command's flags by name (absl's own, registered under absl.flags, left out)."""
    return {
        flag.name: flag
        for module, defined in flag_values.flags_by_module_dict().items()
        if not module.startswith("absl.")
        for flag in defined
    }


def groups(command: ModuleType, flag_values: flags.FlagValues) -> list[tuple[str, list[str]]]:
    """The command's flags in help order: its groups, the ungrouped ones (in the order the
    command defines them: a command without groups lists its flags as written), the
    deprecated ones. A flag in no group and not deprecated lands in "Other flags"."""
    own = _own_flags(flag_values)
    deprecated = sorted(n for n, f in own.items() if f.help.lower().startswith(DEPRECATED))
    given = getattr(command, "help_groups", lambda _: [])(flag_values)
    placed: set[str] = set(deprecated)
    ordered: list[tuple[str, list[str]]] = []
    for title, names in given:
        names = [n for n in names if n in own and n not in placed]
        placed.update(names)
        if names:
            ordered.append((title, names))
    rest = [n for n in own if n not in placed]  # in the order the command defines them
    if rest:
        ordered.append((OTHER if ordered else "Flags", rest))
    if deprecated:
        ordered.append((DEPRECATED_TITLE, deprecated))
    return ordered


def _flag_text(flag: flags.Flag) -> str:
    name = f"--[no]{flag.name}" if flag.boolean else f"--{flag.name}"
    text = f"{name}: {' '.join(flag.help.split())}"
    if flag.default is not None:
        text += f" (default: {flag.default_as_str})"
    syntax = flag.parser.syntactic_help
    if syntax and not flag.boolean:
        text += f" ({syntax})"
    return textwrap.fill(text, WIDTH, initial_indent="  ", subsequent_indent="      ")


def command_help(
    name: str, command: ModuleType, flag_values: flags.FlagValues, full: bool = False
) -> str:
    """`dp-fedemb NAME --help` (`full`: absl's own complete listing instead of groups)."""
    head = f"dp-fedemb {name}: {(command.__doc__ or '').strip().splitlines()[0]}"
    if full:
        return f"{head}\n{flag_values.get_help()}"
    own = _own_flags(flag_values)
    parts = [head]
    for title, names in groups(command, flag_values):
        parts.append("")
        parts.append(f"{title}:")
        parts += [_flag_text(own[n]) for n in names]
    parts.append("")
    parts.append("--helpfull lists every flag as absl defines it, absl's own included.")
    return "\n".join(parts)


def prefixed_groups(
    flag_values: flags.FlagValues, first: Sequence[str], titles: Mapping[str, str]
) -> list[tuple[str, list[str]]]:
    """Groups by the "<subcommand>: " that starts a flag's help (`titles`: prefix ->
    group title, in order), after the `first` flags."""
    own = _own_flags(flag_values)
    out: list[tuple[str, list[str]]] = [("Start here", list(first))]
    for prefix, title in titles.items():
        # absl starts an enum's help with its choices: "<photo|sketch>: synth: ...".
        names = [
            n for n, f in own.items() if _ENUM_CHOICES.sub("", f.help).startswith(f"{prefix}:")
        ]
        out.append((title, names))
    return out


_ENUM_CHOICES = re.compile(r"^<[^>]*>: ")
