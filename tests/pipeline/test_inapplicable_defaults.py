"""A default that does not apply to the chosen optimizer is not applied (issue 67 item 3).

Tried as a user would: `--dp-sgd-optimizer adam` was refused ("server_momentum applies
to the sgd optimizer") until `--server-momentum 0` was added too, because the recipe's
momentum (sgd's) blocked the documented option. Now, for every algorithm, recipe and
optimizer a flag can choose, the job builds, and its momentum is the recipe's under sgd
and 0 under adam or lamb (whose momentum is beta1); a momentum the user sets explicitly
with adam or lamb is still refused in one line. The same holds for a pipeline config's
`train` and `pretrain.job` sections.
"""

import pytest
from absl import flags

from pipeline import config as pipeline_config
from pipeline.commands import train, train_config
from tff_algorithms import algorithms
from tff_algorithms.config import model_config, recipes


def _job(*args: str):
    flag_values = flags.FlagValues()
    train.define_flags(flag_values)
    flag_values(["dp-fedemb train", "--data=d", "--output=o", *args])
    return train_config.job_config({name: flag_values[name].value for name in flag_values})


def _optimizer_flags() -> list[tuple[str, str, str]]:
    """(algorithm, optimizer flag, optimizer) for every choice a flag gives."""
    out = []
    for name in algorithms.names():
        algorithm = algorithms.get(name)
        section = algorithm.section
        if section is not None and "optimizer" in section.keys():
            flag = f"--{section.name.replace('_', '-')}-optimizer"
        elif algorithm.server_optimizer:
            flag = "--server-optimizer"
        else:
            continue
        out += [(name, flag, optimizer) for optimizer in model_config.OPTIMIZERS]
    return out


CHOICES = _optimizer_flags()


def test_every_registered_way_to_choose_an_optimizer_is_covered():
    assert {flag for _, flag, _ in CHOICES} >= {
        "--server-optimizer",
        "--dp-sgd-optimizer",
        "--logit-dp-optimizer",
    }


@pytest.mark.parametrize("recipe", list(recipes.RECIPES))
@pytest.mark.parametrize("algorithm, flag, optimizer", CHOICES)
def test_choosing_an_optimizer_alone_builds_the_job(algorithm, flag, optimizer, recipe):
    alone = _job(f"--algorithm={algorithm}", f"--recipe={recipe}")
    chosen = _job(f"--algorithm={algorithm}", f"--recipe={recipe}", f"{flag}={optimizer}")
    if optimizer == model_config.SGD:
        assert chosen.server_momentum == alone.server_momentum
    else:
        assert chosen.server_momentum == 0.0


@pytest.mark.parametrize("algorithm, flag, optimizer", CHOICES)
def test_a_momentum_set_explicitly_for_adam_or_lamb_is_refused(algorithm, flag, optimizer):
    if optimizer == model_config.SGD:
        assert _job(f"--algorithm={algorithm}", f"{flag}=sgd", "--server-momentum=0.5")
        return
    with pytest.raises(ValueError, match="server_momentum applies to the sgd"):
        _job(f"--algorithm={algorithm}", f"{flag}={optimizer}", "--server-momentum=0.5")


def test_a_pipeline_config_takes_the_same_rule(tmp_path):
    config = pipeline_config.load_config(
        None,
        [
            "train.server_optimizer=adam",
            "train.server_momentum=null",
            "pretrain.source=private_contrastive",
            "pretrain.job.logit_dp.optimizer=lamb",
        ],
    )
    assert config.train_job_dict()["server_momentum"] == 0.0
    assert config.pretrain_job_dict()["server_momentum"] == 0.0
    with pytest.raises(ValueError, match="server_momentum applies to the sgd"):
        pipeline_config.load_config(
            None, ["train.server_optimizer=adam", "train.server_momentum=0.9"]
        ).train_job_dict()


# The same for an algorithm's own setting: dp_sgd.sigmoid_head scores the softmax head,
# and the private recipe's head_loss (cosface, the federated algorithms') refused it.
@pytest.mark.parametrize("algorithm", ["dp-sgd-centralized", "dp-last-layer"])
def test_the_sigmoid_head_alone_builds_the_job_on_the_softmax_head(algorithm):
    chosen = _job(f"--algorithm={algorithm}", "--dp-sgd-sigmoid-head")
    assert chosen.settings.sigmoid_head and chosen.head_loss == "softmax"


def test_without_the_sigmoid_head_the_recipes_head_loss_stays():
    assert _job("--algorithm=dp-sgd-centralized").head_loss == "cosface"


def test_a_head_loss_set_explicitly_with_the_sigmoid_head_is_refused_in_one_line():
    with pytest.raises(ValueError, match="set head_loss to softmax") as refused:
        _job("--algorithm=dp-sgd-centralized", "--dp-sgd-sigmoid-head", "--head-loss=cosface")
    assert "\n" not in str(refused.value)


def test_a_pipeline_config_takes_the_sigmoid_heads_rule():
    config = pipeline_config.load_config(
        None, ["train.algorithm=dp-sgd-centralized", "train.dp_sgd.sigmoid_head=true"]
    )
    assert config.train_job_dict()["head_loss"] == "softmax"
