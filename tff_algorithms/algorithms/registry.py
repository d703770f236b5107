"""The algorithm registry: every training algorithm declared once, as an `Algorithm`.

What the rest of the product asks about an algorithm (is it private, which recipe it
starts from, which of the job's fields it reads and how it checks them, how its
privacy is accounted, how it samples users, which flags apply to it, which function
trains it) is read from its `Algorithm` here, never by comparing its name
(docs/design.md, "How an algorithm plugs in"). `register` adds one, `get` finds one by
name, `names` lists them. No TensorFlow: the trainer is a "module:function" string,
imported only when a job trains (`Algorithm.load_trainer`).
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from beam_jobs import schedule
from tff_algorithms.config import recipes
from tff_algorithms.privacy import accounting

# (config, num_users, delta) -> the accounting spec of the planned job.
AccountingRule = Callable[[Any, int, float], accounting.AccountingSpec]
# (config) -> None, or one-line ValueError.
ConfigCheck = Callable[[Any], None]

# What a virtual-client average is over, in the out-of-reach line of a calibration.
VIRTUAL_CLIENTS = "virtual clients per round that average it"


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
      mechanism: how its noise is added (`accounting.Mechanism`); None: no noise.
      schedule_mode: how it samples users (`beam_jobs.schedule.SAMPLED` or `EPOCH`).
      recipe: its own recipe, overlaid on the private recipe when it is chosen
        (`recipes.own_recipe_values`), or None.
      start_values: the values its `dp-fedemb train` jobs start from, given the chosen
        recipe's (before what the user sets); None: its `recipe` over them, or them
        unchanged without one (`Algorithm.starting_values`).
      keeps_recipe_layers: trains its recipe's `trainable_layers` even without a
        pretrained backbone (where the others train every layer).
      fields: the `TrainJobConfig` fields only it reads; the records of other
        algorithms' jobs leave them out at their defaults.
      check_fields: validates `fields` (run for every job: they have defaults for all).
      check_job: its own checks of a job of it (run for its jobs only).
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
    """

    name: str
    summary: str
    private: bool
    trainer: str
    accounting_rule: AccountingRule
    mechanism: accounting.Mechanism | None
    schedule_mode: str = schedule.SAMPLED
    recipe: Mapping[str, Any] | None = None
    start_values: Callable[[Mapping[str, Any]], dict[str, Any]] | None = None
    keeps_recipe_layers: bool = False
    fields: tuple[str, ...] = ()
    check_fields: ConfigCheck | None = None
    check_job: ConfigCheck | None = None
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

    def starting_values(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """The values a job of it starts from, given the chosen recipe's `values`."""
        if self.start_values is not None:
            return self.start_values(values)
        if self.recipe is not None:
            return recipes.own_recipe_values(values, self.recipe)
        return dict(values)

    def load_trainer(self) -> Callable[..., Any]:
        """The trainer function, imported now (TensorFlow, for most)."""
        module, _, function = self.trainer.partition(":")
        return getattr(importlib.import_module(module), function)


_REGISTERED: dict[str, Algorithm] = {}


def register(algorithm: Algorithm) -> Algorithm:
    """Adds `algorithm`; refuses, in one line, a name already registered."""
    if algorithm.name in _REGISTERED:
        raise ValueError(f"algorithm {algorithm.name!r} is already registered; choose another name")
    _REGISTERED[algorithm.name] = algorithm
    return algorithm


def unregister(name: str) -> None:
    """Removes `name` (for an algorithm registered for a while: a test's)."""
    get(name)
    del _REGISTERED[name]


def names(where: Callable[[Algorithm], bool] | None = None) -> tuple[str, ...]:
    """The registered names, in registration order; `where`: only those it accepts."""
    return tuple(name for name, spec in _REGISTERED.items() if where is None or where(spec))


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
