"""The training recipes and their layering rule, shared by the pipeline and `dp-fedemb train`."""

import dataclasses

import pytest
from absl import flags

from pipeline import config as config_lib
from pipeline.commands import train as train_command
from pipeline.commands import train_config
from tff_algorithms.algorithms import registry
from tff_algorithms.config import job_config, recipes


def _train_flags(*argv: str) -> dict:
    flag_values = flags.FlagValues()
    train_command.define_flags(flag_values)
    flag_values(["dp-fedemb train", *argv])
    return {name: flag_values[name].value for name in flag_values}


def test_overlay_is_key_by_key_and_null_means_the_library_default():
    base = {"rounds": 20, "batch_size": 8, "target_epsilon": 8.0}
    layered = recipes.overlay(base, {"rounds": 5, "batch_size": None})
    assert layered == {"rounds": 5, "batch_size": None, "target_epsilon": 8.0}
    assert recipes.job_fields(layered) == {"rounds": 5, "target_epsilon": 8.0}


@pytest.mark.parametrize("choice", recipes.NOISE_CHOICES)
def test_either_noise_setting_drops_the_recipes_other(choice):
    layered = recipes.overlay({"target_epsilon": 8.0, "noise_multiplier": None}, {choice: 2.0})
    assert layered == {choice: 2.0}


def test_pretraining_layers_over_the_private_recipe_without_noise():
    values = recipes.pretrain_values(recipes.DEFAULT, {"rounds": 3})
    assert values["rounds"] == 3
    assert values["evaluate_every"] == recipes.PRETRAIN["evaluate_every"]
    assert values["head_loss"] == recipes.DEFAULT["head_loss"]
    assert values["trainable_layers"] == ["*"]
    assert (values["algorithm"], values["noise_multiplier"], values["target_epsilon"]) == (
        "centralized",
        None,
        None,
    )


def test_unknown_recipe_is_one_line():
    with pytest.raises(ValueError, match="unknown recipe 'fast'; have default, paper"):
        recipes.recipe("fast")


def test_pipeline_and_train_command_start_from_the_same_recipe():
    # The pipeline's private training starts from its pretrained backbone.
    pipeline_job = config_lib.load_config().train_job_dict()
    command_job = train_config.job_config(_train_flags("--pretrained=backbone")).to_dict()
    assert command_job == pipeline_job == job_config.TrainJobConfig(**recipes.DEFAULT).to_dict()


def test_without_a_pretrained_backbone_every_layer_trains_or_the_run_is_refused():
    """The recipe's trainable_layers fine-tune a pretrained backbone: from a random one
    the frozen layers would stay random."""
    assert recipes.DEFAULT["trainable_layers"] != recipes.EVERY_LAYER
    command_job = train_config.job_config(_train_flags())
    assert list(command_job.trainable_layers) == recipes.EVERY_LAYER
    with pytest.raises(ValueError, match=r"config train.trainable_layers \['conv\*', 'gn\*'\] "):
        config_lib.check_config(None, ["pretrain.source=none"])
    config = config_lib.check_config(None, ["pretrain.source=none", 'train.trainable_layers=["*"]'])
    assert config.train["trainable_layers"] == ["*"]


def test_train_command_paper_recipe_is_the_library_default():
    job = train_config.job_config(_train_flags("--recipe=paper", "--rounds=7"))
    assert job == dataclasses.replace(job_config.TrainJobConfig(), rounds=7)


def test_train_command_flags_layer_like_pipeline_overrides():
    command_job = train_config.job_config(
        _train_flags("--pretrained=backbone", "--noise-multiplier=1.5", "--rounds=9")
    )
    pipeline_job = config_lib.load_config(
        None, ["train.noise_multiplier=1.5", "train.rounds=9"]
    ).train_job_dict()
    assert command_job.to_dict() == pipeline_job


def test_train_command_centralized_takes_the_pretraining_recipe():
    command_job = train_config.job_config(_train_flags("--algorithm=centralized"))
    pipeline_job = config_lib.load_config().pretrain_job_dict()
    assert command_job.to_dict() == pipeline_job


def test_training_benchmark_builds_its_jobs_from_the_default_recipe():
    from bench import bench_training

    base = bench_training.base_config(bench_training.QUICK)
    assert (base.head_loss, base.noise_multiplier, base.target_epsilon) == ("cosface", 0.0, None)
    assert bench_training.centralized_config(bench_training.QUICK, 2).trainable_layers == ("*",)


@pytest.mark.slow  # builds MobileNetV2 to check its layer names (about 40 s)
def test_training_benchmark_trunk_entry_changes_only_the_model_and_trained_layers():
    from bench import bench_training

    small = bench_training.base_config(bench_training.QUICK)
    assert (small.architecture, small.image_size) == ("small_cnn", 28)
    assert small.trainable_layers == ("conv*", "gn*")
    assert bench_training.image_size(bench_training.QUICK) == 28
    sizes = {**bench_training.QUICK, "trunk": bench_training.MOBILENET_V2_TRUNK}
    larger = bench_training.base_config(sizes)
    assert (larger.architecture, larger.image_size) == ("mobilenet_v2", 32)
    assert larger.trainable_layers == ("Conv_1", "Conv_1_bn", "embedding")
    # Everything else is the small CNN's job: the same recipe, schedule and seeds.
    model_fields = {"architecture": "small_cnn", "image_size": 28}
    assert (
        dataclasses.replace(larger, **model_fields, trainable_layers=small.trainable_layers)
        == small
    )
    pretraining = bench_training.centralized_config(sizes, 2)
    assert (pretraining.architecture, pretraining.image_size) == ("mobilenet_v2", 32)
    assert pretraining.trainable_layers == ("*",)
    assert pretraining.gradient_clip_norm == 1.0
    assert bench_training.centralized_config(bench_training.QUICK, 2).gradient_clip_norm is None
    assert bench_training.image_size(sizes) == 32


def test_pretraining_a_large_trunk_clips_its_gradient_and_the_small_cnn_does_not():
    assert "gradient_clip_norm" not in recipes.pretrain_values(recipes.DEFAULT, {})
    mobilenet = {**recipes.DEFAULT, "architecture": "mobilenet_v2", "image_size": 32}
    assert recipes.pretrain_values(mobilenet, {})["gradient_clip_norm"] == 1.0
    resnet = recipes.pretrain_values(recipes.DEFAULT, {"architecture": "resnet50"})
    assert resnet["gradient_clip_norm"] == 1.0
    # The job's own value wins; null means the library default, no clip.
    assert (
        recipes.pretrain_values(mobilenet, {"gradient_clip_norm": 5.0})["gradient_clip_norm"] == 5
    )
    unclipped = recipes.job_fields(recipes.pretrain_values(mobilenet, {"gradient_clip_norm": None}))
    assert job_config.TrainJobConfig(**unclipped).gradient_clip_norm is None
    with pytest.raises(ValueError, match="gradient_clip_norm"):
        job_config.TrainJobConfig(algorithm="centralized", gradient_clip_norm=0.0)
    # A private algorithm clips each user's update (clip_norm): the step clip would be
    # taken and never applied, so it is refused in one line naming where it belongs.
    for algorithm in registry.names(lambda spec: spec.private):
        with pytest.raises(ValueError, match=r"leave gradient_clip_norm unset \(pretrain\.job"):
            job_config.TrainJobConfig(algorithm=algorithm, gradient_clip_norm=1.0)
    assert job_config.TrainJobConfig(algorithm="centralized", gradient_clip_norm=1.0)
    # Private training's recipe is untouched.
    assert "gradient_clip_norm" not in recipes.DEFAULT
