"""The algorithm registry: every training algorithm declared once, as an `Algorithm`.

What the rest of the product asks about an algorithm (is it private, which recipe it
starts from, its own settings and how it checks them, how its privacy is accounted,
how it samples users, which flags apply to it, which function trains it) is read from
its `Algorithm` here, never by comparing its name (docs/design.md, "How an algorithm
plugs in"). `register` adds one, `get` finds one by name, `names` lists them. An
algorithm's own settings are its `Section` (`fdml`, `logit_dp`, `dp_sgd`):
`user_layer` and `product_layer` put the values a user or the product gives in its
layout, the flat keys of the release before included (docs/config.md). No TensorFlow:
the trainer is a "module:function" string, imported only when a job trains
(`Algorithm.load_trainer`).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from beam_jobs import schedule
from tff_algorithms.config import recipes
from tff_algorithms.privacy import accounting_spec

# (config, num_users, delta) -> the accounting spec of the planned job.
AccountingRule = Callable[[Any, int, float], accounting_spec.AccountingSpec]
# (config) -> None, or one-line ValueError.
ConfigCheck = Callable[[Any], None]

# What a virtual-client average is over, in the out-of-reach line of a calibration.
VIRTUAL_CLIENTS = "virtual clients per round that average it"
# The job fields of the shared schedule's shape (`beam_jobs.schedule`): an algorithm
# with a section of its own names them in its own words (`Section.shape`).
SCHEDULE_FIELDS = ("users_per_virtual_client", "virtual_clients_per_round")


@dataclasses.dataclass(frozen=True)
class Section:
    """An algorithm's own settings: `train.<name>` in a pipeline config, `<name>` in a
    job record, `--<name>-<key>` flags (docs/config.md, "Each algorithm's section").

    Attributes:
      name: the section's key (`fdml`, `logit_dp`, `dp_sgd`).
      settings: a frozen dataclass of the settings only its algorithms read, with their
        defaults; its `__post_init__` checks them (one-line ValueError naming
        `<name>.<key>`). `TrainJobConfig.settings` holds one.
      shape: section key -> the schedule field (`SCHEDULE_FIELDS`) it sets: the
        algorithm's words for the shared schedule's counts (`groups_per_round`).
      implied: schedule field -> the value the algorithm fixes it to (one user per
        sampled unit); records and configs leave it out.
      legacy: the flat key of the release before (`virtual_clients_per_round`,
        `samples_per_user`) -> the section key that replaced it; accepted with one
        deprecation line until the release after 0.1.0 (`moved_into_section`).
      describe: section key -> one line for --help.
    """

    name: str
    settings: type
    shape: Mapping[str, str] = dataclasses.field(default_factory=dict)
    implied: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    legacy: Mapping[str, str] = dataclasses.field(default_factory=dict)
    describe: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        if not dataclasses.is_dataclass(self.settings):
            raise ValueError(f"section {self.name}: settings must be a dataclass")
        unknown = sorted(set(self.shape.values()) - set(SCHEDULE_FIELDS))
        if unknown:
            raise ValueError(f"section {self.name}: {unknown[0]} is not a schedule field")

    def keys(self) -> tuple[str, ...]:
        """Its keys: the schedule's counts first, then its settings' fields."""
        return (*self.shape, *(f.name for f in dataclasses.fields(self.settings)))

    def in_own_words(self, message: str) -> str:
        """`message` with each schedule field it names spelled as this section's key
        (`set virtual_clients_per_round to at most 9` -> `set dp_sgd.users_per_step ...`)."""
        for key, field in self.shape.items():
            message = message.replace(field, f"{self.name}.{key}")
        return message

    def build(self, value: Any) -> Any:
        """Its settings from None (the defaults), a settings object, or a mapping of its
        settings' fields (None values: their defaults); one line naming an unknown key."""
        if value is None:
            return self.settings()
        if isinstance(value, self.settings):
            return value
        if not isinstance(value, Mapping):
            raise ValueError(f"{self.name} must be a mapping of its settings, got {value!r}"[:200])
        names = [f.name for f in dataclasses.fields(self.settings)]
        unknown = sorted(set(value) - set(names), key=str)
        if unknown:
            close = difflib.get_close_matches(str(unknown[0]), [*self.shape, *names], n=1)
            hint = f"did you mean {self.name}.{close[0]}? " if close else ""
            raise ValueError(
                f"unknown setting {self.name}.{unknown[0]} ({hint}known: {', '.join(self.keys())})"
            )
        return self.settings(**{k: v for k, v in value.items() if v is not None})


@dataclasses.dataclass(frozen=True)
class Algorithm:
    """One training algorithm, as the job configuration, the job and the CLI see it.

    Attributes:
      name: what `TrainJobConfig.algorithm` and `--algorithm` say.
      summary: one line for `dp-fedemb train --help`, and the non-private guarantee
        metrics.json states for an algorithm that is not `private`.
      private: whether it has a privacy guarantee (clipping and noise).
      trainer: "module:function" of `(JobInputs, schedule_seed) -> JobOutcome`.
      accounting_rule: the accounting spec of a planned job (`rules`).
      mechanism: how its noise is added (`accounting_spec.Mechanism`); None: no noise.
      schedule_mode: how it samples users (`beam_jobs.schedule.SAMPLED` or `EPOCH`).
      recipe: its own recipe, overlaid on the private recipe when it is chosen
        (`recipes.own_recipe_values`), or None.
      start_values: the values its `dp-fedemb train` jobs start from, given the chosen
        recipe's (before what the user sets); None: its `recipe` over them, or them
        unchanged without one (`Algorithm.starting_values`).
      keeps_recipe_layers: trains its recipe's `trainable_layers` even without a
        pretrained backbone (where the others train every layer).
      section: its own settings (`Section`), or None: it reads the shared fields only.
        Checked for its jobs only; several algorithms may share one.
      check_job: its own checks of a job of it (run for its jobs only).
      without_inapplicable: (layered values, the user's given values) -> the values
        without the defaults its own chosen settings make inapplicable (a recipe's
        default that the user did not set and that would refuse the setting they chose);
        None: none. Run after the shared rule (`rules.without_inapplicable_defaults`).
      check_round_fill: (config, num_users): one line when the users cannot fill one
        of its rounds; None: any population fills one.
      eligible_users: (reader, user_ids, config) -> the users it trains on (lazily
        importing what it needs); None: every training user.
      round_groups: what the noise's denominator counts, for the out-of-reach line.
      rounds_are: what one of its rounds is, for metrics.json.
      default_head_lr_scale: the head learning-rate scale when the job sets none;
        None: `client_config.ClientConfig`'s.
      local_heads: its virtual clients train local heads (the head-capacity check
        applies, shared negatives may extend them).
      cacheable: it can train a suffix of the backbone on cached features.
      pipeline_trains: a pipeline's `train.algorithm` may name it (private training of
        the final model; pretraining-only algorithms run as a `pretrain.source`).
      canary_audit: the canary audit (`audit`) can train it.
      tff_runtime: it trains inside a TFF runtime session (`runtime.session`).
      server_optimizer: it applies its round's noised aggregate with the job's
        `server_optimizer` (sgd, adam or lamb); the others refuse adam and lamb there.
      paper_theorem: "module:function" of the privacy figure its paper states instead of
        a user-level epsilon, `(drop_rate, bound, noise_scale) -> (epsilon, label)`:
        what `dp-fedemb privacy --mechanism M --convention paper` prints for its
        mechanism, labelled as not user-level (its `Release.paper_figure`); None: none.
    """

    name: str
    summary: str
    private: bool
    trainer: str
    accounting_rule: AccountingRule
    mechanism: accounting_spec.Mechanism | None
    schedule_mode: str = schedule.SAMPLED
    recipe: Mapping[str, Any] | None = None
    start_values: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    keeps_recipe_layers: bool = False
    section: Section | None = None
    check_job: ConfigCheck | None = None
    without_inapplicable: (
        Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]] | None
    ) = None
    check_round_fill: Callable[[Any, int], Any] | None = None
    eligible_users: Callable[[Any, list[str], Any], list[str]] | None = None
    round_groups: str = VIRTUAL_CLIENTS
    rounds_are: str = "federated rounds"
    default_head_lr_scale: float | None = None
    local_heads: bool = False
    cacheable: bool = False
    pipeline_trains: bool = False
    canary_audit: bool = False
    tff_runtime: bool = False
    server_optimizer: bool = False
    paper_theorem: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"an algorithm's name must be a non-empty string, got {self.name!r}")
        module, _, function = self.trainer.partition(":")
        if not module or not function:
            raise ValueError(
                f"algorithm {self.name}: trainer must be 'module:function', got {self.trainer!r}"
            )
        if self.schedule_mode not in (schedule.SAMPLED, schedule.EPOCH):
            raise ValueError(
                f"algorithm {self.name}: schedule_mode must be {schedule.SAMPLED!r} or "
                f"{schedule.EPOCH!r}, got {self.schedule_mode!r}"
            )

    @property
    def noise(self) -> accounting_spec.Noise | None:
        """The shape of its release's noise (`accounting_spec.RELEASES`); None: no noise.
        What a rule that depends on the noise (tree restarts, a linear server step) reads,
        rather than which mechanism it is."""
        if self.mechanism is None:
            return None
        return accounting_spec.RELEASES[self.mechanism].noise

    def starting_values(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The values a job of it starts from, given the chosen recipe's `values`."""
        if self.start_values is not None:
            return self.start_values(values)
        if self.recipe is not None:
            return recipes.own_recipe_values(values, self.recipe)
        return dict(values)

    def load_trainer(self) -> Callable[..., Any]:
        """The trainer function, imported now (TensorFlow, for most)."""
        return _load(self.trainer)

    def load_paper_theorem(self) -> Callable[..., tuple[float, str]]:
        """Its `paper_theorem` function, imported now."""
        if self.paper_theorem is None:
            raise ValueError(f"algorithm {self.name} states no paper theorem")
        return _load(self.paper_theorem)


def _load(target: str) -> Callable[..., Any]:
    module, _, function = target.partition(":")
    return getattr(importlib.import_module(module), function)


_REGISTERED: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    """Adds `algorithm`; refuses, in one line, a name already registered or a section
    name another algorithm's different section has."""
    if algorithm.name in _REGISTERED:
        raise ValueError(f"algorithm {algorithm.name!r} is already registered; choose another name")
    section = algorithm.section
    if section is not None and sections().get(section.name, section) is not section:
        # One key means one set of settings (several algorithms share one Section).
        raise ValueError(
            f"algorithm {algorithm.name!r}: section {section.name!r} is another algorithm's; "
            "share its Section or choose another name"
        )
    _REGISTERED[algorithm.name] = algorithm
    return algorithm


def unregister(name: str) -> None:
    """Removes `name` (for an algorithm registered for a while: a test's)."""
    get(name)
    del _REGISTERED[name]


def names(where: Callable[[Algorithm], bool] | None = None) -> tuple[str, ...]:
    """The registered names, in registration order; `where`: only those it accepts."""
    return tuple(name for name, spec in _REGISTERED.items() if where is None or where(spec))


def sections() -> dict[str, Section]:
    """The registered sections by name (several algorithms may share one)."""
    found: dict[str, Section] = {}
    for spec in _REGISTERED.values():
        if spec.section is not None:
            found.setdefault(spec.section.name, spec.section)
    return found


def section_users(section_name: str) -> tuple[str, ...]:
    """The algorithms whose section is `section_name`."""
    return names(lambda spec: spec.section is not None and spec.section.name == section_name)


def find(name: Any) -> Algorithm | None:
    """The algorithm called `name`, or None (also for a `name` that is not a string)."""
    return _REGISTERED.get(name) if isinstance(name, str) else None


def get(name: Any) -> Algorithm:
    """The algorithm called `name`; one-line ValueError listing the known ones otherwise."""
    spec = find(name)
    if spec is None:
        known = names()
        close = difflib.get_close_matches(name, known, n=1) if isinstance(name, str) else []
        hint = f"; did you mean {close[0]}?" if close else ""
        raise ValueError(f"algorithm must be one of {known}, got {name!r}{hint}")
    return spec


# The release after which the flat keys a section replaced are refused.
LEGACY_UNTIL = "0.1.0"


def _foreign_setting(key: str, section: Section | None) -> str | None:
    """The section `key` belongs to when it is another algorithm's setting (a section's
    name, or a flat key of the release before that only a section took over)."""
    own = section.name if section is not None else None
    for name, other in sections().items():
        if name == own:
            continue
        if key == name:
            return name
        if key in other.legacy and key not in SCHEDULE_FIELDS:
            return name
    return None


def user_layer(
    values: Mapping[str, Any],
    algorithm: Algorithm,
    flat_name: Callable[[str], str],
    section_name: Callable[[str, str], str],
    warn: Callable[[str], None] | None,
) -> dict[str, Any]:
    """One layer the user gave (a config's `train` or `pretrain.job`, the flags), in the
    current layout for `algorithm`: each flat key of the release before that its section
    replaced moves into the section, with one line through `warn` (None: silently, when
    the caller has warned already); a key its section implies is dropped with one line.

    `flat_name(key)` / `section_name(section, key)` spell a key as the user wrote it
    (`train.virtual_clients_per_round`, `--fdml-groups-per-round`). One-line ValueError
    for another algorithm's setting, a section that is not a mapping, an implied key at
    another value, or an old and a new key given with different values.
    """
    values = dict(values)
    section = algorithm.section
    for key in list(values):
        owner = _foreign_setting(key, section)
        if owner is not None:
            users = " and ".join(section_users(owner))
            if key == owner:
                raise ValueError(
                    f"{flat_name(key)} holds the settings of {users}, not of "
                    f"{algorithm.name}: drop it"
                )
            raise ValueError(
                f"{flat_name(key)} is a setting of {users} (now "
                f"{section_name(owner, _new_key(owner, key))}), not of {algorithm.name}: "
                "drop it"
            )
    if section is None:
        return values
    given = values.get(section.name)
    if given is None:
        given = {}
    if not isinstance(given, Mapping):
        raise ValueError(
            f"{flat_name(section.name)} must be a mapping of {algorithm.name}'s settings "
            f"({', '.join(section.keys())})"
        )
    moved = dict(given)
    for old, new in section.legacy.items():
        if old not in values:
            continue
        value = values.pop(old)
        if new in moved and moved[new] is not None and moved[new] != value:
            raise ValueError(
                f"{flat_name(old)} {value!r} and {section_name(section.name, new)} "
                f"{moved[new]!r} disagree: give {section_name(section.name, new)} alone "
                f"({flat_name(old)} is its old name)"
            )
        moved[new] = value
        if warn is not None:
            warn(
                f"{flat_name(old)} is deprecated for {algorithm.name}: use "
                f"{section_name(section.name, new)} (the old name is refused after release "
                f"{LEGACY_UNTIL})"
            )
    for field, implied in section.implied.items():
        if field not in values:
            continue
        value = values.pop(field)
        if value is not None and value != implied:
            raise ValueError(
                f"{flat_name(field)} does not apply to {algorithm.name}, which samples "
                f"single users: drop it (got {value!r})"
            )
        if warn is not None and value is not None:
            warn(
                f"{flat_name(field)} is deprecated for {algorithm.name}, which samples single "
                f"users: drop it (refused after release {LEGACY_UNTIL})"
            )
    if moved or section.name in values:
        values[section.name] = moved
    return values


def _new_key(section_name: str, old: str) -> str:
    return sections()[section_name].legacy.get(old, old)


def product_layer(values: Mapping[str, Any], algorithm: Algorithm) -> dict[str, Any]:
    """Layered values the product assembled (recipes under what the user set, a job
    record of the release before) in the current layout for `algorithm`, silently: a
    flat key its section replaced moves into the section unless the section sets it (the
    section is the later layer), an implied key is dropped, and other algorithms'
    sections are dropped (a pretraining run derived from an fdml job's settings)."""
    values = dict(values)
    section = algorithm.section
    for name, other in sections().items():
        if section is None or name != section.name:
            values.pop(name, None)
            for old in other.legacy:
                if old not in SCHEDULE_FIELDS:
                    values.pop(old, None)
    if section is None:
        return values
    moved = dict(values.get(section.name) or {})
    for old, new in section.legacy.items():
        if old in values:
            value = values.pop(old)
            if moved.get(new) is None and value is not None:
                moved[new] = value
    for field in section.implied:
        values.pop(field, None)
    values[section.name] = moved
    return values
