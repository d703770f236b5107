"""The pipeline config: file plus overrides, every problem a one-line error before running."""

import fcntl
import json
import re

import pytest

from pipeline import cli, definition
from pipeline import config as config_lib
from tests import paths, support


def test_defaults_are_valid_and_round_trip_through_a_file(tmp_path):
    config = config_lib.load_config()
    assert config.train_job_dict()["algorithm"] == "dp-fedemb"
    assert config.pretrain_job_dict()["algorithm"] == "centralized"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    assert config_lib.load_config(str(path)) == config


def test_a_pretrain_job_override_keeps_the_rest_of_the_pretraining_recipe():
    config = config_lib.load_config(None, ["pretrain.job.rounds=5", "train.batch_size=4"])
    job = config.pretrain_job_dict()
    assert job["rounds"] == 5
    # Not train's batch size, learning rate and momentum: the pretraining recipe's.
    assert {k: job[k] for k in ("batch_size", "server_learning_rate", "server_momentum")} == {
        "batch_size": 32,
        "server_learning_rate": 0.02,
        "server_momentum": 0.9,
    }
    assert config.train_job_dict()["batch_size"] == 4


def test_a_train_override_keeps_the_rest_of_the_recipe(tmp_path):
    """`--set train.rounds=40` changes the rounds, nothing else of the default recipe; a
    file's train section overlays it the same way."""
    default = config_lib.load_config().train_job_dict()
    changed = config_lib.load_config(None, ["train.rounds=40"]).train_job_dict()
    assert changed == {**default, "rounds": 40}
    path = tmp_path / "config.yaml"
    path.write_text("train:\n  rounds: 40\n")
    assert config_lib.load_config(str(path)).train_job_dict() == changed


def test_the_noise_is_set_one_way_and_either_way_replaces_the_recipes():
    default = config_lib.load_config().train_job_dict()
    fixed = config_lib.load_config(None, ["train.noise_multiplier=1.2"]).train_job_dict()
    assert fixed == {**default, "noise_multiplier": 1.2, "target_epsilon": None}
    target = config_lib.load_config(None, ["train.target_epsilon=4"]).train_job_dict()
    assert target == {**default, "noise_multiplier": None, "target_epsilon": 4.0}
    with pytest.raises(ValueError, match="not both"):
        config_lib.load_config(None, ["train.noise_multiplier=1.2", "train.target_epsilon=4"])


def test_null_restores_the_library_default():
    from tff_algorithms.config import job_config

    library = job_config.TrainJobConfig()
    job = config_lib.load_config(
        None, ["train.head_loss=null", "train.virtual_clients_per_round=null"]
    ).train_job_dict()
    assert (job["head_loss"], job["virtual_clients_per_round"]) == (
        library.head_loss,
        library.virtual_clients_per_round,
    )
    # The recipe's target gone, the noise multiplier falls back to the library's.
    job = config_lib.load_config(None, ["train.target_epsilon=null"]).train_job_dict()
    assert (job["noise_multiplier"], job["target_epsilon"]) == (library.noise_multiplier, None)
    # A pretraining key: not the pretraining recipe's 12 epochs, nor train's 20.
    pretrain = config_lib.load_config(None, ["pretrain.job.rounds=null"]).pretrain_job_dict()
    assert pretrain["rounds"] == library.rounds
    config = config_lib.load_config(None, ["dedup.hamming_threshold=null", "partition=null"])
    assert config.dedup == config_lib.DedupSection()
    assert config.partition == config_lib.PartitionSection()
    # Where null is a value of its own, it stays one.
    no_public = [
        "data.synthetic_public=null",
        "pretrain.source=none",
        'train.trainable_layers=["*"]',
    ]
    assert config_lib.load_config(None, no_public).data.synthetic_public is None


def test_a_synthetic_public_override_keeps_the_rest_of_its_default():
    """The public default is another seed and style than SyntheticSection's defaults:
    overriding its size must not turn it into the private population."""
    config = config_lib.load_config(None, ["data.synthetic_public.identities=60"])
    public = config.data.synthetic_public
    expected = config_lib.load_config().data.synthetic_public
    assert public.identities == 60
    assert (public.seed, public.style, public.images_per_identity) == (
        expected.seed,
        expected.style,
        expected.images_per_identity,
    )


def test_yaml_file_and_overrides(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("train:\n  rounds: 7\nsplit:\n  public_fraction: 0.3\n")
    config = config_lib.load_config(
        str(path), ["train.rounds=9", "data.inputs=[]", "evaluate.privacy_budget_epsilon=4"]
    )
    assert config.train["rounds"] == 9
    assert config.split.public_fraction == 0.3
    assert config.evaluate.privacy_budget_epsilon == 4.0


@pytest.mark.parametrize(
    "override, message",
    [
        ("trian.rounds=3", "unknown config key trian"),
        ("split.public_fractoin=0.1", "unknown config key split.public_fractoin"),
        ("train.roundz=3", "unknown config key train.roundz"),
        ("train.rounds=0", "config train"),
        ("train.rounds=many", "config train"),
        ("split.test_fraction=0.9", "config split"),
        ("data.synthetic.identities=-1", "config data.synthetic"),
        ("evaluate.privacy_budget_epsilon=0", "privacy_budget_epsilon must be > 0"),
        ("evaluate.gate_far=0.5", "gate_far must be one of"),
        ("evaluate.bootstrap_resamples=0", "bootstrap_resamples must be >= 1"),
        ("evaluate.confidence=1", "confidence must be in"),
        ("pretrain.source=elsewhere", "pretrain.source must be one of"),
        ("pretrain.source=import", "pretrain.backbone_dir"),
        ("train.algorithm=centralized", "private training"),
        ("train.head_init=zeros", "config train: head_init must be one of"),
        ("train.server_optimizer=adamw", "config train: server_optimizer must be one of sgd"),
        ("train.class_means_norm=0", "config train: class_means_norm"),
        ("train.head_loss_margin=-0.1", "config train: head_loss_margin"),
        ("pipeline.enable_cache=maybe", "must be true or false"),
        ("runtime.executor=gpu", "config runtime: executor must be one of worker, in_process"),
        ("data.inputs=[/does/not/exist]", "does not exist"),
        ("data.public_inputs=[/does/not/exist]", "data.public_inputs: /does/not/exist does not"),
        ("data.synthetic_public.style=oil", "config data.synthetic_public: style must be one of"),
        ("data.evaluation_inputs=[/does/not/exist]", "data.evaluation_inputs: /does/not/exist"),
        (
            # An existing directory that holds no output (/tmp may hold the checkout).
            "data.evaluation_inputs=[docs]",
            "data.evaluation_inputs needs split.mode held_out_images",
        ),
        ("data.synthetic_public=null", "pretrain.source is public but there is no public data"),
        ("train", "section.key=value"),
    ],
)
def test_bad_values_are_one_line_errors(override, message):
    with pytest.raises(ValueError, match=message) as raised:
        config_lib.load_config(None, [override])
    assert "\n" not in str(raised.value)


def test_evaluation_inputs_take_the_test_split_of_held_out_images(tmp_path):
    base = ["split.mode=held_out_images", f"data.evaluation_inputs=[{tmp_path}]"]
    with pytest.raises(ValueError, match="set split.test_fraction to 0") as raised:
        config_lib.load_config(None, base)
    assert "\n" not in str(raised.value)
    config = config_lib.load_config(None, [*base, "split.test_fraction=0"])
    assert config.split_config_dict()["evaluation_inputs"] is True
    assert config_lib.load_config().split_config_dict()["evaluation_inputs"] is False


def test_public_data_comes_from_its_own_sources_unless_a_fraction_is_split_off(tmp_path):
    default = config_lib.load_config()
    # The synthetic default renders its public data apart (sketches of other identities).
    assert default.synthetic_public.style == "sketch" and default.split.public_fraction == 0
    assert default.split_config_dict()["public_inputs"] is True
    # A user's own data: no synthetic public set; public data from data.public_inputs
    # or, failing that, a fraction of the user's identities.
    own = [f"data.inputs=[{tmp_path}]"]
    with pytest.raises(ValueError, match="no public data"):
        config_lib.load_config(None, own)
    split_off = config_lib.load_config(None, [*own, "split.public_fraction=0.2"])
    assert split_off.synthetic_public is None
    assert split_off.split_config_dict()["public_inputs"] is False
    given = config_lib.load_config(None, [*own, f"data.public_inputs=[{tmp_path}]"])
    assert given.synthetic_public is None and given.split_config_dict()["public_inputs"] is True


def test_bad_files_are_one_line_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        config_lib.load_config(str(tmp_path / "missing.yaml"))
    broken = tmp_path / "broken.json"
    broken.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        config_lib.load_config(str(broken))
    listing = tmp_path / "list.yaml"
    listing.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="mapping of sections"):
        config_lib.load_config(str(listing))


def _readme_set_examples() -> list[str]:
    """`--set` examples of the user docs: README.md and docs/*.md (the config reference)."""
    root = paths.REPO
    docs = [root / "README.md", *sorted((root / "docs").glob("*.md"))]
    text = "\n".join(path.read_text() for path in docs)
    found = set(re.findall(r"--set ([a-z_.]+=[^\s`]+)", text))
    return sorted(e for e in found if not e.startswith("section."))  # the syntax line


def _leaves(values: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in values.items():
        if isinstance(value, dict):
            flat.update(_leaves(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def test_every_readme_set_example_changes_only_its_key():
    examples = _readme_set_examples()
    assert len(examples) >= 3, examples
    default = _leaves(config_lib.load_config().to_dict())
    for example in examples:
        key, value = config_lib.parse_override(example)
        changed = _leaves(config_lib.load_config(None, [example]).to_dict())
        differing = {k for k in default.keys() | changed.keys() if default.get(k) != changed.get(k)}
        assert differing <= {key}, (example, differing)
        assert changed[key] == value


def test_print_config_prints_the_effective_config_and_runs_nothing(tmp_path, capsys):
    args = ["--output", str(tmp_path / "out"), "--set", "train.rounds=7"]
    assert cli.main(["dp-fedemb", "run", *args, "--print-config"]) == 0
    printed = tmp_path / "printed.yaml"
    printed.write_text(capsys.readouterr().out)
    expected = config_lib.load_config(
        None, ["train.rounds=7", f"pipeline.output_dir={tmp_path / 'out'}"]
    )
    assert config_lib.load_config(str(printed)) == expected
    assert not (tmp_path / "out").exists()


def test_run_command_reports_config_errors_on_one_line(capsys):
    assert cli.main(["dp-fedemb", "run", "--set", "train.roundz=3"]) == cli.EXIT_INPUT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown config key train.roundz" in err


def test_a_second_run_on_the_same_output_directory_is_refused_on_one_line(tmp_path, capsys):
    from pipeline import local_run

    # What a running `dp-fedemb run` holds; two runs would interleave one ML Metadata store.
    with open(tmp_path / local_run.RUN_LOCK_FILE, "a") as running:
        fcntl.flock(running.fileno(), fcntl.LOCK_EX)
        code = cli.main(["dp-fedemb", "run", "--output", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == cli.EXIT_INPUT_ERROR
    assert err.count("\n") == 1 and f"another dp-fedemb run is using {tmp_path}" in err
    assert not (tmp_path / "metadata.sqlite").exists()  # refused before anything ran


@pytest.mark.slow
def test_a_population_too_small_for_the_schedule_stops_right_after_the_split(tmp_path):
    """About 76 training users cannot fill the recipe's rounds of 48 x 8: the run stops
    before statistics and dedup, with one error line naming the setting and no traceback."""
    error, process = support.run_refused(
        "run",
        "--output",
        str(tmp_path / "out"),
        "--set",
        "data.synthetic.identities=100",
        "--set",
        "data.synthetic_public.identities=20",
        timeout=600,
    )
    assert "train: " in error and "set virtual_clients_per_round to at most 9" in error
    assert (
        definition.DEDUP not in process.stdout and definition.STATISTICS_GEN not in process.stdout
    )


def test_an_output_directory_inside_the_inputs_is_refused(tmp_path):
    images = tmp_path / "images"
    images.mkdir()
    for output in (images, images / "runs"):
        with pytest.raises(ValueError, match="pipeline.output_dir .* lies in data.inputs"):
            config_lib.load_config(
                None, [f"data.inputs=[{images}]", f"pipeline.output_dir={output}"]
            )
