"""Training recipes: named sets of TrainJobConfig values, and how settings layer on them.

The one source of the defaults every entry point trains with: the pipeline's `train`
and `pretrain.job` sections and `dp-fedemb train --recipe` all start here; an algorithm
with a recipe of its own declares it in its `Algorithm` (`tff_algorithms/algorithms/`),
layered by `own_recipe_values`. No TensorFlow import, so configuration and `--help` stay
fast.

Layering (the same rule everywhere): a recipe is overlaid key by key by what the user
sets; a key set to None (YAML null) is dropped, so the library default of
`TrainJobConfig` applies to it; and giving either of the two ways to set the noise
(`noise_multiplier`, `target_epsilon`) drops the recipe's other one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tff_algorithms.config.model_config import SMALL_CNN

# Measured on the default synthetic data (docs/recipes.md, "Population, trained
# parameters and noise"): 8 users per virtual client make the clients' updates agree; the convolutions
# and GroupNorm layers (52k parameters; the 401k of the dense embedding layer frozen)
# learn nearly as much as the whole backbone without noise and keep far more of it with
# noise; server lr 0.3 keeps the per-round noise on each weight small.
DEFAULT: Mapping[str, Any] = {
    "algorithm": "dp-fedemb",
    "rounds": 20,
    # The noise multiplier is calibrated when private training starts, from the real
    # training users after dedup and partition, to the smallest one whose 20 rounds cost
    # at most epsilon 8 at delta 1e-4 under the strict accounting convention and the
    # tight accountant (z ~1.39 for the default data's ~3,000 training users; RDP needed
    # ~1.77 for the same target).
    "target_epsilon": 8.0,
    "clip_norm": 1.0,
    "users_per_virtual_client": 8,
    "virtual_clients_per_round": 48,
    "client_learning_rate": 0.01,
    "local_epochs": 3,
    # A virtual client holds ~32 images: batches of 8 make 12 local steps, not 3, so the
    # fresh local head learns and the backbone update means something.
    "batch_size": 8,
    # Each local head starts at its identities' mean embeddings, so the first local
    # steps already pull the backbone towards separating them.
    "head_init": "class_means",
    # CosFace (scale 30, margin 0.35) trains the directions that verification compares:
    # measured above softmax with and without noise (docs/recipes.md, "Head loss").
    "head_loss": "cosface",
    "server_learning_rate": 0.3,
    "server_momentum": 0.0,
    "trainable_layers": ["conv*", "gn*"],
    "delta": 1e-4,
}

# TrainJobConfig's own defaults are the paper's EMNIST hyperparameters (appendix D:
# noise 0.62, 200 rounds, 8 users x 32 virtual clients, client lr 5e-3, server lr 0.02,
# momentum 0.9, clip 1, softmax head from random): the paper recipe adds nothing to them.
PAPER: Mapping[str, Any] = {}

RECIPES: Mapping[str, Mapping[str, Any]] = {"default": DEFAULT, "paper": PAPER}

# The public pretraining of the pipeline: centralized over every layer, momentum SGD in
# batches of 32, 12 epochs. Layered over the private recipe (same model and head).
PRETRAIN: Mapping[str, Any] = {
    "rounds": 12,
    "evaluate_every": 4,
    "server_learning_rate": 0.02,
    "server_momentum": 0.9,
    "batch_size": 32,
}

# What the pretraining of a Keras application trunk (MobileNetV2, ResNet-50) adds. Its
# deep GroupNorm stack at 2x2 and 1x1 maps turns the first steps' large gradients
# (norm ~360 on MobileNetV2, the small CNN's ~40) into image-independent offsets, and
# unclipped every image soon has the same features, for good (BENCHMARKS.md, "The same
# arms on MobileNetV2"). Clipped to 1 the features shrink less and separate again.
# The small CNN never collapsed, so its recipe is unchanged.
PRETRAIN_LARGE_TRUNK: Mapping[str, Any] = {"gradient_clip_norm": 1.0}

# Private contrastive pretraining on the training users themselves (issue 26; the
# pipeline's `pretrain.source: private_contrastive`, `dp-fedemb train --algorithm
# logit-dp`): Logit-DP over every layer, 32 users a step (its `logit_dp` section,
# tff_algorithms/algorithms/logit_dp/__init__.py; one positive pair each; at
# logit scale 1 a step needs at least 14 for the sensitivity to stay below n·B), a step
# costing 2·32² single-image passes (about 2 s on 2 CPU cores for the small CNN), and
# epsilon 2 of the users' budget, which the private training's composes with.
PRIVATE_CONTRASTIVE: Mapping[str, Any] = {
    "algorithm": "logit-dp",
    "rounds": 40,
    "target_epsilon": 2.0,
    "logit_dp": {"users_per_step": 32, "scale": 1.0},
    "clip_norm": 1.0,
    "server_learning_rate": 0.05,
    "server_momentum": 0.9,
    "evaluate_every": 10,
}

NOISE_CHOICES = ("noise_multiplier", "target_epsilon")
EVERY_LAYER = ["*"]


def check_start(values: Mapping[str, Any], pretrained: bool, where: str) -> None:
    """A job with no pretrained backbone must train every layer: a frozen layer would
    keep its random initial values (the recipe's trainable_layers fine-tune a pretrained
    backbone). One-line ValueError naming the setting otherwise."""
    layers = values.get("trainable_layers")
    if not pretrained and layers is not None and list(layers) != EVERY_LAYER:
        raise ValueError(
            f"{where}trainable_layers {list(layers)} would keep the other layers at their "
            f"random initial values: there is no pretrained backbone; set {where}"
            f'trainable_layers to ["*"], or start from a pretrained backbone'
        )


def for_architecture(values: Mapping[str, Any], architecture: str | None) -> dict[str, Any]:
    """A recipe's `values` for a job of `architecture`: the recipes' trainable_layers name
    the small CNN's layers, so another backbone (a built-in trunk, a user's model) trains
    every layer unless the user names its own."""
    values = dict(values)
    if architecture not in (None, SMALL_CNN) and values.get("trainable_layers") is not None:
        values["trainable_layers"] = list(EVERY_LAYER)
    return values


def recipe(name: str) -> dict[str, Any]:
    """A copy of the recipe called `name`."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; have {', '.join(RECIPES)}")
    return dict(RECIPES[name])


def overlay(base: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
    """`values` over `base`, key by key; None values are kept (they mean the library
    default, see `job_fields`) so that they also hide what lies below them. A mapping
    over a mapping (an algorithm's section, `shared_negatives`) overlays it key by key."""
    merged = dict(base)
    if any(name in values for name in NOISE_CHOICES):
        for name in NOISE_CHOICES:
            merged.pop(name, None)
    for key, value in values.items():
        below = merged.get(key)
        if isinstance(value, Mapping) and isinstance(below, Mapping):
            value = {**below, **value}
        merged[key] = value
    return merged


def job_fields(values: Mapping[str, Any]) -> dict[str, Any]:
    """The TrainJobConfig keyword arguments of layered `values`: None means the library
    default, so those keys are left out."""
    return {key: value for key, value in values.items() if value is not None}


def _pretraining_base(train: Mapping[str, Any]) -> dict[str, Any]:
    """The private `train` values a pretraining run starts from: every layer, and not
    the private run's server optimizer (dp-fedemb's and dp-fedavg's); `pretrain.job` may
    set either."""
    values = {**train, "trainable_layers": list(EVERY_LAYER)}
    values.pop("server_optimizer", None)
    return values


def private_contrastive_values(train: Mapping[str, Any], job: Mapping[str, Any]) -> dict[str, Any]:
    """The Logit-DP pretraining run: the private `train` values (model, delta), every
    layer, then PRIVATE_CONTRASTIVE, then `job`; a private run, charged to the users'
    budget like the training it precedes."""
    values = overlay(overlay(_pretraining_base(train), PRIVATE_CONTRASTIVE), job)
    # Fields of federated training that a contrastive step has no use for.
    values.update(algorithm="logit-dp", over_selection=0.0)
    values.pop("shared_negatives", None)
    return values


def own_recipe_values(values: Mapping[str, Any], own_recipe: Mapping[str, Any]) -> dict[str, Any]:
    """`values` with an algorithm's own recipe over them (`registry.Algorithm.recipe`:
    dp-sgd-centralized, dp-last-layer), and without what the federated rounds alone use."""
    values = overlay(values, own_recipe)
    values.update(over_selection=0.0)
    values.pop("shared_negatives", None)
    return values


def pretrain_values(train: Mapping[str, Any], job: Mapping[str, Any]) -> dict[str, Any]:
    """The centralized pretraining run: the private `train` values, every layer, then
    PRETRAIN, then PRETRAIN_LARGE_TRUNK for a trunk other than the small CNN, then `job`;
    no noise and no budget (public data costs none)."""
    values = overlay(_pretraining_base(train), PRETRAIN)
    if overlay(values, job).get("architecture", SMALL_CNN) != SMALL_CNN:
        values = overlay(values, PRETRAIN_LARGE_TRUNK)
    values = overlay(values, job)
    # Public pretraining releases nothing private: no shared negatives (issue 22).
    values.update(algorithm="centralized", max_epsilon=None, shared_negatives=None)
    for name in NOISE_CHOICES:
        values[name] = None
    return values
