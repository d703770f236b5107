"""TFF's SQLite client data through the whole pipeline, in the split mode each data set needs.

Two small files laid out as TFF's own datasets are (tables `examples` and
`client_metadata`, one serialized tf.train.Example per row keyed by client id):
- EMNIST: client = writer, every writer writes every character (label int64, pixels as
  28x28 floats): shared identities, split mode `identity` (held-out characters, writers
  in training and evaluation both);
- Landmarks (GLDv2): client = photographer, label `class` int64, JPEG bytes: many
  photographers share landmarks, split mode `held_out_images` (photographers' images of
  training landmarks, genuine pairs across photographers), evaluated on a test file of
  its own (`data.evaluation_inputs`, as TFF ships GLDv2's test split) while held-out
  private photographers fill validation.
Each goes through `dp-fedemb run` (ingest -> split -> dedup -> partition -> train ->
evaluate), and the test checks what the mode promises on the records each stage wrote.
"""

import collections
import io
import itertools
import json
import os
import sqlite3

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from beam_jobs import synthetic
from tests import support
from tff_algorithms.evaluation import scoring as evaluation

pytestmark = pytest.mark.slow

WRITERS = 8
CHARACTERS = 20  # split seed 0 holds out 2 for validation and 7 for test
PHOTOGRAPHERS = 30
TEST_PHOTOGRAPHERS = 10
LANDMARKS = 12
LANDMARKS_PER_PHOTOGRAPHER = 4
PHOTOS_PER_LANDMARK = 2


def _tff_database(path: str, rows: list[tuple[str, bytes]]) -> None:
    """The layout tff.simulation.datasets' SQLite client data has (split `train`)."""
    with sqlite3.connect(path) as connection:
        connection.execute(
            "CREATE TABLE examples (split_name TEXT NOT NULL, client_id TEXT NOT NULL, "
            "serialized_example_proto BLOB NOT NULL)"
        )
        connection.execute(
            "CREATE TABLE client_metadata (client_id TEXT NOT NULL, split_name TEXT NOT NULL, "
            "num_examples INTEGER NOT NULL)"
        )
        connection.executemany("INSERT INTO examples VALUES ('train', ?, ?)", rows)
        counts = collections.Counter(client for client, _ in rows)
        connection.executemany(
            "INSERT INTO client_metadata VALUES (?, 'train', ?)", sorted(counts.items())
        )


def _emnist_file(path: str) -> None:
    # Each (writer, character) is an image of its own: render index writer.
    style = synthetic.SyntheticConfig(identities=CHARACTERS, image_size=28, seed=11)
    rows = []
    for writer, character in itertools.product(range(WRITERS), range(CHARACTERS)):
        pixels = synthetic.render_image(style, character, writer).astype(np.float32) / 255.0
        example = tf.train.Example()
        example.features.feature["pixels"].float_list.value.extend(pixels.ravel().tolist())
        example.features.feature["label"].int64_list.value.append(character)
        rows.append((f"f{writer:04d}_00", example.SerializeToString()))
    _tff_database(path, rows)


def _landmarks_file(path: str, photographers: range) -> None:
    # Photographers draw their landmarks Zipf-like from one pool (beam_jobs.synthetic);
    # the train and test files hold different photographers of the same landmarks.
    config = synthetic.SyntheticConfig(
        identities=LANDMARKS,
        images_per_identity=PHOTOS_PER_LANDMARK,
        identities_per_user=LANDMARKS_PER_PHOTOGRAPHER,
        users_sharing_identities=PHOTOGRAPHERS + TEST_PHOTOGRAPHERS,
        image_size=28,
        seed=12,
    )
    rows = []
    for record in synthetic.records_for_units(config, photographers.start, photographers.stop):
        jpeg = io.BytesIO()
        Image.open(io.BytesIO(record.image)).save(jpeg, format="JPEG", quality=95)
        example = tf.train.Example()
        example.features.feature["image/encoded_jpeg"].bytes_list.value.append(jpeg.getvalue())
        landmark = int(record.identity.removeprefix("id"))
        example.features.feature["class"].int64_list.value.append(landmark)
        rows.append((f"photographer-{record.user_id}", example.SerializeToString()))
    _tff_database(path, rows)


def _run(
    tmp_path, database: str, mode: str, identities_per_user: int, evaluation_input: str = ""
) -> tuple[dict, dict]:
    """`dp-fedemb run` on `database` in split mode `mode` (test records from
    `evaluation_input` when given), from a random backbone; returns (evaluation.json,
    {split: [(user, identity)]}) of the run."""
    values = support.tiny_pipeline(
        str(tmp_path / "output"),
        data={
            "inputs": [database],
            "evaluation_inputs": [evaluation_input] * bool(evaluation_input),
        },
        split={
            "mode": mode,
            "validation_fraction": 0.2,
            "test_fraction": 0.0 if evaluation_input else 0.3,
        },
        pretrain={"source": "none"},
        # A local head row for every identity the two users of a virtual client hold
        # (the default, one per user, is refused before training on such data).
        train={"trainable_layers": ["*"], "head_capacity": 2 * identities_per_user},
    )
    _, store, _ = support.run_pipeline(values, tmp_path)
    [evaluated] = store.get_artifacts_by_type("ModelEvaluation")
    with open(os.path.join(evaluated.uri, "evaluation.json")) as f:
        report = json.load(f)
    test_dir = report["model"]["records"]
    names = {}
    for split in ("train", "validation", "test"):
        records = test_dir.replace("Split-test", f"Split-{split}")
        names[split] = [
            (user.decode(), identity.decode())
            for user, identity, _ in evaluation.user_encoded_images(records).as_numpy_iterator()
        ]
    return report, names


def test_emnist_layout_trains_and_evaluates_in_identity_mode(tmp_path):
    database = str(tmp_path / "emnist.sqlite")
    _emnist_file(database)
    report, names = _run(tmp_path, database, "identity", CHARACTERS)
    assert report["split_mode"] == "identity"
    identities = {split: {i for _, i in pairs} for split, pairs in names.items()}
    users = {split: {u for u, _ in pairs} for split, pairs in names.items()}
    # Held-out characters never trained on; their writers are training writers too.
    assert identities["test"] and not identities["test"] & identities["train"]
    assert users["test"] & users["train"]
    # Every record went somewhere: identity mode drops nothing.
    assert sum(len(pairs) for pairs in names.values()) == WRITERS * CHARACTERS
    model = report["model"]
    assert not model["genuine_pairs_across_users_only"]
    per_identity = collections.Counter(i for _, i in names["test"])
    assert model["genuine_pairs"] == sum(n * (n - 1) // 2 for n in per_identity.values())
    assert set(model["recall_at_far"]) == {"0.1", "0.01", "0.001"}


def test_landmarks_layout_trains_and_evaluates_on_its_own_test_file(tmp_path):
    database, test_file = str(tmp_path / "landmarks.sqlite"), str(tmp_path / "test.sqlite")
    _landmarks_file(database, range(PHOTOGRAPHERS))
    _landmarks_file(test_file, range(PHOTOGRAPHERS, PHOTOGRAPHERS + TEST_PHOTOGRAPHERS))
    report, names = _run(
        tmp_path, database, "held_out_images", LANDMARKS_PER_PHOTOGRAPHER, test_file
    )
    assert report["split_mode"] == "held_out_images" and report["evaluation_inputs"]
    identities = {split: {i for _, i in pairs} for split, pairs in names.items()}
    users = {split: {u for u, _ in pairs} for split, pairs in names.items()}
    # Test: the test file's photographers only, renamed apart; validation: held-out
    # private photographers; neither trained on. Their landmarks are training landmarks.
    assert users["test"] and all(u.startswith("evaluation:photographer-") for u in users["test"])
    assert users["validation"] and not users["validation"] & users["train"]
    assert identities["test"] | identities["validation"] <= identities["train"]
    model = report["model"]
    assert model["genuine_pairs_across_users_only"]
    # Genuine pairs: two test images of one landmark by two different photographers.
    pairs = names["test"]
    expected = sum(
        1
        for (user_a, identity_a), (user_b, identity_b) in itertools.combinations(pairs, 2)
        if identity_a == identity_b and user_a != user_b
    )
    assert 0 < model["genuine_pairs"] == expected
    assert set(model["recall_at_far"]) == {"0.1", "0.01", "0.001"}
