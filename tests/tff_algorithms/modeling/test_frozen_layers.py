"""Parameter freezing (`trainable_layers`): frozen variables are never trained, aggregated,
noised or misplaced, and the noise covers exactly the trainable coordinates."""

import dataclasses

import numpy as np
import pytest
import tensorflow as tf

from pipeline import config as pipeline_config
from tff_algorithms.algorithms.dp_fedemb import aggregators, client_work, processes
from tff_algorithms.config import client_config, job_config, model_config
from tff_algorithms.modeling import export, models

FULL = model_config.BackboneConfig(model_config.SMALL_CNN, (28, 28, 1), embedding_size=8)
NORMS_ONLY = dataclasses.replace(FULL, trainable_layers=("gn*",))
CONFIG = client_config.ClientConfig(client_learning_rate=0.05, head_capacity=2, batch_size=4)


def _client_dataset(seed):
    images = np.random.default_rng(seed).random((4, 28, 28, 1), dtype=np.float32)
    examples = tf.data.Dataset.from_tensor_slices(
        {"image": images, "identity": np.array(["a", "b", "a", "b"])}
    )
    return client_work.make_client_dataset(examples, f"vc{seed}", CONFIG)


def _parameter_count(arrays):
    return sum(int(np.size(a)) for a in arrays)


def test_unknown_layer_pattern_is_a_one_line_config_error():
    with pytest.raises(ValueError, match="matches no layer of small_cnn; layers: conv0, gn0"):
        job_config.TrainJobConfig(trainable_layers=["gn*", "head"])
    with pytest.raises(ValueError, match="list of layer-name patterns"):
        job_config.TrainJobConfig(trainable_layers="gn*")


def test_json_round_trip_and_pretraining_trains_every_layer():
    config = job_config.TrainJobConfig(trainable_layers=["gn*", "conv0"])
    assert job_config.TrainJobConfig.from_dict(config.to_dict()) == config
    pipeline = pipeline_config.PipelineConfig(train={"trainable_layers": ["gn*"]})
    assert pipeline.train_job_dict()["trainable_layers"] == ("gn*",)
    assert pipeline.pretrain_job_dict()["trainable_layers"] == ("*",)


def test_frozen_layers_move_to_non_trainable_weights():
    backbone = models.build_backbone(NORMS_ONLY)
    assert [v.name for v in backbone.trainable_weights] == [
        "gn0/gamma:0",
        "gn0/beta:0",
        "gn1/gamma:0",
        "gn1/beta:0",
    ]
    assert _parameter_count(models.backbone_weights(backbone).trainable) == 2 * (32 + 64)
    # Same variables, same values, in the same layer order as the unfrozen model.
    full = models.build_backbone(FULL)
    assert [v.name for v in models.ordered_variables(backbone)] == [
        v.name for v in full.trainable_weights
    ]


def test_dp_round_changes_only_trainable_layers_and_noises_only_them(tff_runtime):
    z, clip, planned = 2.0, 0.5, 4
    process = processes.build_fedemb_process(
        NORMS_ONLY,
        CONFIG,
        aggregators.gaussian_fixed(
            noise_multiplier=z, clip_norm=clip, virtual_clients_per_round=planned, noise_seed=5
        ),
        processes.server_sgdm(1.0, 0.0),
    )
    # The aggregated (noised) update has the trainable structure only.
    assert process.get_model_weights.type_signature.result.is_equivalent_to(
        models.backbone_weights_type(NORMS_ONLY)
    )
    state = process.initialize()
    output = process.next(state, [_client_dataset(1), _client_dataset(2)])
    before = processes.backbone_model_weights(process.get_model_weights(state))
    after = processes.backbone_model_weights(process.get_model_weights(output.state))
    for a, b in zip(after.non_trainable, before.non_trainable):
        np.testing.assert_array_equal(a, b)
    step = np.concatenate([(a - b).ravel() for a, b in zip(after.trainable, before.trainable)])
    assert step.size == 192
    # 192 Gaussian coordinates of std z*clip/M (the clipped signal is <= clip/2 in norm
    # in total): the sample std is within 15% with probability > 0.999.
    assert step.std() / (z * clip / planned) == pytest.approx(1.0, abs=0.15)


def test_frozen_export_loads_back_by_position_under_any_freezing(tmp_path):
    trained = models.build_backbone(NORMS_ONLY, seed=3)
    for variable in trained.trainable_weights:
        variable.assign(variable + 0.25)
    export_dir = export.export_serving_model(
        NORMS_ONLY, models.backbone_weights(trained), str(tmp_path / "serving")
    )
    images = np.random.default_rng(0).random((3, 28, 28, 1), dtype=np.float32)
    expected = models.embed(trained, images).numpy()
    for config in (NORMS_ONLY, FULL, dataclasses.replace(FULL, trainable_layers=("conv*",))):
        loaded = models.load_pretrained_backbone(config, export_dir)
        np.testing.assert_allclose(models.embed(loaded, images).numpy(), expected, atol=1e-6)
