"""`dp-fedemb train`'s flags of each algorithm's own settings, read from the registry.

Each registered section (`tff_algorithms.algorithms.registry.Section`) gives one flag a
key, `--<section>-<key>` in kebab case (`--fdml-groups-per-round` sets
`fdml.groups_per_round`, `--logit-dp-users-per-step` sets `logit_dp.users_per_step`).
The flat flags of the release before that a section replaced (`--samples-per-user`,
`--logit-scale`, `--restart-every-epoch`; `--virtual-clients-per-round` of an fdml,
logit-dp or DP-SGD job) are
still accepted, each with one deprecation line on stderr naming the new flag
(`registry.user_layer`), until the release after `registry.LEGACY_UNTIL`. No
TensorFlow: `check` reads them before anything heavy is imported.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from typing import Any

from absl import flags

from tff_algorithms import algorithms
from tff_algorithms.algorithms import registry
from tff_algorithms.config import job_config

# absl flag kinds of the settings' annotations (as written: `from __future__` keeps them
# strings).
_KINDS = {
    "int": "integer",
    "float": "float",
    "str": "string",
    "bool": "boolean",
    "int | None": "integer",
    "float | None": "float",
}
# The schedule field a shape key sets -> its flag kind: a count of units may be `auto`.
_SHAPE_KINDS = {"users_per_virtual_client": "integer", "virtual_clients_per_round": "string"}


def flag_name(key: str) -> str:
    """The flag of a flat TrainJobConfig key (`virtual_clients_per_round`)."""
    return key.replace("_", "-")


def section_flag(section: str, key: str) -> str:
    """The flag of a section's key (`fdml`, `groups_per_round` -> `fdml-groups-per-round`)."""
    return f"{section}-{key}".replace("_", "-")


def _kinds(section: registry.Section) -> dict[str, str]:
    """Each key of `section` -> its absl flag kind."""
    kinds = {key: _SHAPE_KINDS[field] for key, field in section.shape.items()}
    for field in dataclasses.fields(section.settings):
        kinds[field.name] = _KINDS[str(field.type)]
    return kinds


def section_flags() -> dict[str, tuple[str, str]]:
    """Flag -> (section, key), for every registered section."""
    return {
        section_flag(name, key): (name, key)
        for name, section in registry.sections().items()
        for key in section.keys()
    }


def legacy_flags() -> dict[str, str]:
    """The flags of the release before that no TrainJobConfig field keeps
    (`--samples-per-user`) -> their key."""
    fields = {field.name for field in dataclasses.fields(job_config.TrainJobConfig)}
    return {
        flag_name(old): old
        for section in registry.sections().values()
        for old in section.legacy
        if old not in fields
    }


def define(flag_values: flags.FlagValues) -> None:
    """Defines the section flags and the deprecated flat ones they replaced."""
    for name, section in registry.sections().items():
        users = " and ".join(registry.section_users(name))
        kinds = _kinds(section)
        for key in section.keys():
            getattr(flags, f"DEFINE_{kinds[key]}")(
                section_flag(name, key),
                None,
                f"{users}: {section.describe.get(key, key)} ({name}.{key})",
                flag_values=flag_values,
            )
    kinds = {}
    for name, section in registry.sections().items():
        for old, new in section.legacy.items():
            kinds.setdefault(old, (_kinds(section)[new], section_flag(name, new)))
    for flag, old in legacy_flags().items():
        kind, new = kinds[old]
        getattr(flags, f"DEFINE_{kind}")(
            flag,
            None,
            f"deprecated: use --{new} (refused after release {registry.LEGACY_UNTIL})",
            flag_values=flag_values,
        )


def _count(flag: str, text: Any) -> int | str:
    """A flag's count of units: an integer, or `auto`."""
    if text == "auto" or not isinstance(text, str):
        return text
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"--{flag} must be a count or auto, got {text!r}") from None


def user_values(
    value: Mapping[str, Any],
    flat: dict[str, Any],
    algorithm: registry.Algorithm,
    warn: Callable[[str], None] | None,
) -> dict[str, Any]:
    """The TrainJobConfig values the flags give: `flat` (the flat flags' fields), the
    deprecated flat flags and the section flags, in the layout of `algorithm`
    (`registry.user_layer`; `warn`: where the deprecation lines go, None: silently)."""
    given = dict(flat)
    for flag, old in legacy_flags().items():
        if value.get(flag) is not None:
            given[old] = value[flag]
    sections = registry.sections()
    for flag, (name, key) in section_flags().items():
        if value.get(flag) is None:
            continue
        setting = value[flag]
        if sections[name].shape.get(key) == "virtual_clients_per_round":
            setting = _count(flag, setting)
        given.setdefault(name, {})[key] = setting
    return registry.user_layer(
        given,
        algorithm,
        lambda key: f"--{flag_name(key)}",
        lambda name, key: f"--{section_flag(name, key)}",
        warn,
    )


def warn_deprecated(message: str) -> None:
    """One deprecation line on stderr."""
    print(f"dp-fedemb train: warning: {message}", file=sys.stderr)


def help_defaults(recipe_names: Mapping[str, Mapping[str, Any]]) -> dict[str, str]:
    """Section flag -> its effective default: what each algorithm of the section starts
    from under each recipe (`Algorithm.starting_values`), else the setting's default."""
    shown = {}
    for flag, (name, key) in section_flags().items():
        section = registry.sections()[name]
        texts: dict[str, list[str]] = {}
        for algorithm_name in registry.section_users(name):
            algorithm = algorithms.get(algorithm_name)
            for recipe_name, recipe in recipe_names.items():
                start = registry.product_layer(algorithm.starting_values(recipe), algorithm)
                setting = start[name].get(key)
                if setting is None:
                    setting = _library_default(section, key)
                texts.setdefault(str(setting), []).append(
                    f"{algorithm_name} --recipe={recipe_name}"
                )
        if len(texts) == 1:
            shown[flag] = next(iter(texts))
        else:
            shown[flag] = ", ".join(f"{text} ({'; '.join(where)})" for text, where in texts.items())
    return shown


def _library_default(section: registry.Section, key: str) -> Any:
    if key in section.shape:
        return getattr(job_config.TrainJobConfig, section.shape[key])
    return getattr(section.settings(), key)
