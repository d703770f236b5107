"""Hostile and broken input (issue 8 item 3): a clear one-line error or a counted skip.

Images: corrupt, truncated, zero-size, decompression bombs (refused from the header,
before decoding), other pixel formats (converted exactly as the training/serving decoder
converts them). Names: path separators and ".." are opaque data; control characters,
bidirectional overrides, undecodable bytes and over-long names are counted skips; a name
becomes a path only through `schema.path_component`. Users in several splits, configs
of the wrong type, and the command line's one-line errors.
"""

import io
import json
import os
import sqlite3
import struct
import zlib

import numpy as np
import pytest
import tensorflow as tf
from PIL import Image

from beam_jobs import image_files, ingest, records_io, schema, split_protocols, splits, synthetic
from pipeline import cli
from pipeline import config as config_lib


def _encode(image: Image.Image, image_format: str = "PNG") -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=image_format)
    return buffer.getvalue()


def _grey_png(seed: int, side: int = 8) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side), dtype=np.uint8)
    return schema.encode_png(pixels)


def _png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png_with_header(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height 8-bit grey pixels but whose data holds a
    few rows only: decoding it would fail as truncated, so a too-large verdict shows the
    size was refused from the header, before decoding."""
    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", header)
        + _png_chunk(b"IDAT", zlib.compress(b"\x00" * 64))
        + _png_chunk(b"IEND", b"")
    )


def _write(path: str, data: bytes) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def _read_records(directory: str) -> list[schema.CanonicalRecord]:
    files = tf.io.gfile.glob(records_io.records_pattern(directory))
    return [schema.parse(r.numpy()) for r in tf.data.TFRecordDataset(files)]


# Pixel formats: each decodes, and to exactly what the serving decoder makes of it.

_RNG = np.random.default_rng(7)
PIXEL_FORMATS = {
    "RGBA": Image.fromarray(_RNG.integers(0, 256, (6, 5, 4), dtype=np.uint8), "RGBA"),
    "LA": Image.fromarray(_RNG.integers(0, 256, (6, 5, 2), dtype=np.uint8), "LA"),
    "P": Image.fromarray(_RNG.integers(0, 256, (6, 5, 3), dtype=np.uint8)).convert("P"),
    "1": Image.fromarray(_RNG.integers(0, 256, (6, 5), dtype=np.uint8)).convert("1"),
    "I;16": Image.fromarray(_RNG.integers(0, 65536, (6, 5)).astype(np.uint16)),
    "L": Image.fromarray(_RNG.integers(0, 256, (6, 5), dtype=np.uint8)),
    "RGB": Image.fromarray(_RNG.integers(0, 256, (6, 5, 3), dtype=np.uint8)),
}


@pytest.mark.parametrize("mode", sorted(PIXEL_FORMATS))
def test_every_pixel_format_is_converted_as_the_serving_decoder_does(mode):
    encoded = _encode(PIXEL_FORMATS[mode])
    record = schema.CanonicalRecord("user", "identity", encoded)
    assert schema.validate(record) == mode
    pixels = schema.decode_image(encoded)
    channels = 1 if pixels.ndim == 2 else 3
    served = tf.io.decode_image(encoded, channels=channels, expand_animations=False).numpy()
    # 16-bit samples keep their high byte (PIL's own convert("L") would saturate them).
    np.testing.assert_array_equal(pixels, served.reshape(pixels.shape))
    assert pixels.shape[:2] == (6, 5) and pixels.dtype == np.uint8


# Images and names through a real ingest job.


@pytest.fixture(scope="module")
def hostile_folder(tmp_path_factory):
    """An image folder with one good image per case and every kind of broken one."""
    root = str(tmp_path_factory.mktemp("hostile") / "raw")
    good = {
        ("alice", "a", "0.png"): _grey_png(0),
        ("alice", "a", "1.png"): _encode(PIXEL_FORMATS["RGBA"]),
        ("alice", "a", "2.png"): _encode(PIXEL_FORMATS["I;16"]),
        ("bob", "b", "0.jpg"): _encode(PIXEL_FORMATS["RGB"], "JPEG"),
        ("bob", "b..c", "0.png"): _grey_png(1),  # ".." inside a name is just text
    }
    valid_png = _grey_png(2)
    valid_jpeg = _encode(PIXEL_FORMATS["RGB"], "JPEG")
    bad = {
        ("bob", "b", "zero.png"): (b"", schema.EMPTY_IMAGE),
        ("bob", "b", "noise.png"): (
            b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4,
            schema.CORRUPT_IMAGE,
        ),
        ("bob", "b", "cut.png"): (valid_png[: len(valid_png) // 2], schema.CORRUPT_IMAGE),
        ("bob", "b", "cut.jpg"): (valid_jpeg[: len(valid_jpeg) // 2], schema.CORRUPT_IMAGE),
        ("bob", "b", "empty0x8.png"): (_png_with_header(0, 8), schema.CORRUPT_IMAGE),
        # Over the default limit but within PIL's own bomb guard: only our header check
        # stops it, and decoding it would have failed as truncated.
        ("bob", "b", "bomb.png"): (_png_with_header(6000, 6000), schema.IMAGE_TOO_LARGE),
        # Far over PIL's guard (10^10 pixels).
        ("bob", "b", "huge.png"): (_png_with_header(100_000, 100_000), schema.IMAGE_TOO_LARGE),
        ("bob", "b", "text.png"): (b"just some text", schema.UNSUPPORTED_IMAGE_FORMAT),
        ("carol\x1b[2J", "c", "0.png"): (valid_png, schema.INVALID_NAME),
        ("dave", "d\u202eevil", "0.png"): (valid_png, schema.INVALID_NAME),
        ("erin", "e\x07", "0.png"): (valid_png, schema.INVALID_NAME),
    }
    for (user, identity, name), data in good.items():
        _write(os.path.join(root, user, identity, name), data)
    for (user, identity, name), (data, _) in bad.items():
        _write(os.path.join(root, user, identity, name), data)
    # Undecodable bytes in a user folder name: tf.io.gfile.listdir raises on them.
    _write(os.path.join(root.encode(), b"fr\xffnk", b"f", b"0.png"), valid_png)
    expected_bad = {}
    for _, reason in bad.values():
        expected_bad[reason] = expected_bad.get(reason, 0) + 1
    expected_bad[schema.INVALID_NAME] += 1
    expected_users = sorted([("alice", "a")] * 3 + [("bob", "b"), ("bob", "b..c")])
    return root, expected_users, expected_bad


def test_hostile_image_folder_is_counted_never_a_crash(hostile_folder, tmp_path):
    root, expected_users, expected_bad = hostile_folder
    out = str(tmp_path / "ingested")
    summary = ingest.run_ingest([root], out, max_bad_fraction=1.0)
    assert summary["bad_by_reason"] == dict(sorted(expected_bad.items()))
    assert summary["records"] == len(expected_users)
    records = _read_records(out)
    assert sorted((r.user_id, r.identity) for r in records) == expected_users
    # The converted formats are kept as they came, and decode for the model's channels.
    for record in records:
        for channels in (1, 3):
            decoded = tf.io.decode_image(record.image, channels=channels, expand_animations=False)
            assert decoded.shape[-1] == channels


def test_pixel_limit_is_configurable_and_checked_before_reading(tmp_path):
    root = str(tmp_path / "raw")
    small = _grey_png(0, side=4)  # 16 pixels: within a limit of 20
    over_in_header = _grey_png(0, side=5)  # 25 pixels, under 8 bytes per allowed pixel
    over_in_size = _grey_png(0, side=16)  # more bytes than 20 pixels can need
    assert len(over_in_header) <= 8 * 20 < len(over_in_size)
    for name, data in (("0.png", small), ("1.png", over_in_header), ("2.png", over_in_size)):
        _write(os.path.join(root, "u", "i", name), data)
    summary = ingest.run_ingest([root], str(tmp_path / "out"), 1.0, max_image_pixels=20)
    assert summary["records"] == 1
    assert summary["bad_by_reason"] == {schema.IMAGE_TOO_LARGE: 2}
    details = sorted(b["detail"] for b in summary["bad_examples"])
    assert "5x5 pixels, over the limit of 20" in details[1]
    assert details[0].endswith("bytes cannot hold an image within 20 pixels")
    with pytest.raises(ValueError, match="max image pixels must be >= 1"):
        ingest.ReadImageFolder(root, max_image_pixels=0)


def test_invalid_folder_names_are_counted_and_reported_escaped(tmp_path):
    root = str(tmp_path / "raw")
    image = _grey_png(1)
    _write(os.path.join(root, "ok", "i", "0.png"), image)
    for user, identity in (("carol\x1b[2J", "c"), ("dave", "d\u202eevil"), ("erin", "e\x07")):
        _write(os.path.join(root, user, identity, "0.png"), image)
    _write(os.path.join(root.encode(), b"fr\xffnk", b"f", b"0.png"), image)
    summary = ingest.run_ingest([root], str(tmp_path / "out"), 1.0)
    assert summary["records"] == 1 and summary["bad_by_reason"] == {schema.INVALID_NAME: 4}
    sources = sorted(b["source"] for b in summary["bad_examples"])
    assert all(source.isprintable() for source in sources)
    escaped = "".join(sources)
    assert "carol\\x1b[2J" in escaped and "d\\u202eevil" in escaped
    assert "fr\\udcffnk" in escaped and "e\\x07" in escaped


def _canonical_bytes(user_id: bytes, identity: bytes, image: bytes) -> bytes:
    example = tf.train.Example()
    feature = example.features.feature
    feature[schema.USER_ID_KEY].bytes_list.value.append(user_id)
    feature[schema.IDENTITY_KEY].bytes_list.value.append(identity)
    feature[schema.IMAGE_KEY].bytes_list.value.append(image)
    return example.SerializeToString()


HOSTILE_NAMES = [
    # (user_id bytes, accepted)
    (b"users/1234", True),
    (b"../../etc/passwd", True),
    (b"..", True),
    (b"C:\\Windows\\system32", True),
    ("Zo\u00eb \u738b".encode(), True),
    (b"nul\x00byte", False),
    (b"new\nline", False),
    (b"esc\x1b[31m", False),
    (b"\xff\xfe not utf-8", False),
    ("line\u2028sep".encode(), False),
    ("bidi\u202egnp.exe".encode(), False),
    (b"x" * (schema.MAX_NAME_BYTES + 1), False),
]


def test_hostile_names_in_tfrecords_and_sqlite_are_data_or_counted(tmp_path):
    image = _grey_png(3)
    path = str(tmp_path / "names.tfrecord")
    with tf.io.TFRecordWriter(path) as writer:
        for user_id, _ in HOSTILE_NAMES:
            writer.write(_canonical_bytes(user_id, b"ident", image))
    database = str(tmp_path / "clients.sqlite")
    with sqlite3.connect(database) as connection:
        connection.execute(
            "CREATE TABLE examples (split_name TEXT, client_id TEXT, serialized_example_proto BLOB)"
        )
        connection.execute("CREATE TABLE client_metadata (client_id TEXT, split_name TEXT)")
        for client_id, _ in HOSTILE_NAMES:
            row = tf.train.Example()
            row.features.feature["label"].int64_list.value.append(3)
            row.features.feature[schema.IMAGE_KEY].bytes_list.value.append(image)
            # CAST keeps undecodable bytes as TEXT, as a foreign writer could store them.
            connection.execute(
                "INSERT INTO examples VALUES ('train', CAST(? AS TEXT), ?)",
                (client_id, row.SerializeToString()),
            )
            connection.execute(
                "INSERT INTO client_metadata VALUES (CAST(? AS TEXT), 'train')", (client_id,)
            )
    out = str(tmp_path / "out")
    summary = ingest.run_ingest([path, database], out, max_bad_fraction=1.0)
    rejected = sum(not accepted for _, accepted in HOSTILE_NAMES)
    assert summary["bad_by_reason"] == {schema.INVALID_NAME: 2 * rejected}
    users = sorted(r.user_id for r in _read_records(out))
    accepted = sorted(name.decode() for name, ok in HOSTILE_NAMES if ok)
    assert users == sorted(accepted * 2)


@pytest.mark.parametrize(
    "name",
    [
        "..",
        ".",
        "",
        ".hidden",
        "a/b",
        "../../../etc/passwd",
        "C:\\x",
        "nul\x00",
        "%2E%2E",
        "\udcff\udcfe",
        "\u738b" * 300,
        "ok-Name_1.png",
    ],
)
def test_path_component_keeps_every_name_inside_its_folder(tmp_path, name):
    component = schema.path_component(name)
    assert component not in ("", ".", "..") and not component.startswith(".")
    assert "/" not in component and "\\" not in component and "\x00" not in component
    assert len(component) <= 200 and component.isascii()
    target = tmp_path / component
    target.write_bytes(b"x")
    assert os.path.realpath(target.parent) == os.path.realpath(tmp_path)
    assert os.listdir(tmp_path) == [component]
    if name == "ok-Name_1.png":
        assert component == name  # ordinary names stay readable


def test_synthetic_folders_are_named_through_the_sanitiser(tmp_path):
    config = synthetic.SyntheticConfig(identities=3, images_per_identity=1, image_size=8)
    synthetic.write_image_folder(str(tmp_path / "s"), config)
    expected = sorted(schema.path_component(config.user_name(i)) for i in range(3))
    assert sorted(os.listdir(tmp_path / "s")) == expected


# A user in several splits: every user lands in exactly one split, deterministically.


def test_a_user_across_sources_and_splits_lands_in_one_split(tmp_path, capsys):
    # Every user lands in exactly one split; the assignment is a pure function of the
    # identities (split_protocols.py), so it does not depend on the order of the sources.
    config = split_protocols.SplitConfig(validation_fraction=0.3, test_fraction=0.3, seed=0)
    # Identities of one user that hash to different splits.
    by_split: dict[str, str] = {}
    for i in range(100):
        by_split.setdefault(split_protocols.identity_split(f"id{i}", config), f"id{i}")
    assert {split_protocols.TRAIN, split_protocols.TEST} <= set(by_split)
    folder = str(tmp_path / "folder")
    _write(os.path.join(folder, "shared", by_split[split_protocols.TRAIN], "0.png"), _grey_png(4))
    _write(os.path.join(folder, "solo", by_split[split_protocols.TRAIN], "0.png"), _grey_png(5))
    records = str(tmp_path / "more.tfrecord")
    with tf.io.TFRecordWriter(records) as writer:
        writer.write(
            schema.serialize(
                schema.CanonicalRecord("shared", by_split[split_protocols.TEST], _grey_png(6))
            )
        )

    def run(*args: str) -> None:
        assert cli.main(["dp-fedemb", "data", *args]) == 0, capsys.readouterr().err

    inputs = ["--input", folder, "--input", records]
    run("ingest", *inputs, "--out", str(tmp_path / "ingested"))
    split_dir = str(tmp_path / "split")
    run(
        "split",
        "--input",
        str(tmp_path / "ingested"),
        "--out",
        split_dir,
        "--validation-fraction=0.3",
        "--test-fraction=0.3",
        # Two users hold one identity: auto would stop and ask for a mode; faces' rule,
        # and its drop of 1 of 3 records, are what this test is about.
        "--mode=identity_and_user",
        "--max-dropped-fraction=0.5",
    )
    summary = records_io.read_json(os.path.join(split_dir, splits.SUMMARY_FILE))
    assert summary["dropped_cross_split_records"] == 1
    result = {
        split: sorted(
            (r.user_id, r.identity) for r in _read_records(os.path.join(split_dir, split))
        )
        for split in config.splits
    }
    # The shared user keeps only its most protected split's records (split_protocols.py).
    assert result[split_protocols.TEST] == [("shared", by_split[split_protocols.TEST])]
    assert result[split_protocols.TRAIN] == [("solo", by_split[split_protocols.TRAIN])]
    assert result[split_protocols.VALIDATION] == []


# Configs of the wrong type and the command line: one line on stderr, non-zero exit.

WRONG_CONFIGS = [
    ("train:\n  rounds: five\n", "train: rounds must be an integer"),
    ("train:\n  noise_multiplier: [1]\n", "noise_multiplier must be a number"),
    (
        "train:\n  dp_fedemb:\n    restart_every_epoch: 'yes'\n",
        "dp_fedemb.restart_every_epoch must be a boolean",
    ),
    ("pipeline:\n  enable_cache: 1\n", "pipeline.enable_cache must be true or false"),
    ("data:\n  inputs: /a/path\n", "data.inputs must be a list"),
    ("data:\n  max_image_pixels: 0\n", "data.max_image_pixels must be >= 1"),
    ("data:\n  max_image_pixels: 1.5\n", "data.max_image_pixels must be an integer"),
    ("split: 3\n", "split must be a mapping"),
    ("1: 2\n", "config keys must be names, got 1"),
    ("train:\n  null: 1\n", "config keys must be names, got None in train"),
    ("evaluate:\n  privacy_budget_epsilon: .nan\n", "must be finite"),
    ("!!python/object:os.system {}\n", "not valid YAML"),
]


@pytest.mark.parametrize("text, message", WRONG_CONFIGS)
def test_wrong_config_types_are_one_line_errors(tmp_path, capsys, text, message):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    assert cli.main(["dp-fedemb", "run", "--config", str(path)]) == cli.EXIT_INPUT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


def test_hostile_ingest_over_the_limit_is_one_line_on_the_command_line(
    hostile_folder, tmp_path, capsys
):
    root, _, _ = hostile_folder
    code = cli.main(["dp-fedemb", "data", "ingest", "--input", root, "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert code == cli.EXIT_INPUT_ERROR and err.count("\n") == 1
    assert "inputs are bad" in err and "invalid_name=" in err and "\x1b" not in err
    code = cli.main(["dp-fedemb", "train", "--data", root, "--output", str(tmp_path), "--rounds=x"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE and err.count("\n") == 1 and "--rounds" in err


def test_config_values_reach_ingest():
    config = config_lib.config_from_dict({"data": {"max_image_pixels": 1234}})
    assert config.data.max_image_pixels == 1234
    assert json.loads(json.dumps(config.to_dict()))["data"]["max_image_pixels"] == 1234


def test_hidden_folders_and_files_are_counted_as_skipped_not_bad(tmp_path):
    """Issue 63: names with a leading "." (a .git or sync folder, .DS_Store) were skipped
    without a count. Counted apart (`skipped_by_reason`), never read, and no bad share:
    a .DS_Store in every folder does not fail the 1% limit."""
    root = tmp_path / "images"
    for user in ("u1", "u2"):
        _write(str(root / user / "face" / "a.png"), _grey_png(1))
        _write(str(root / user / "face" / ".DS_Store"), b"\0\0\0\1Bud1")
    _write(str(root / "u1" / ".thumbnails" / "a.png"), _grey_png(2))
    _write(str(root / ".git" / "objects" / "x.png"), _grey_png(3))
    out = str(tmp_path / "out")
    summary = ingest.run_ingest([str(root)], out)
    assert summary["records"] == 2 and summary["bad"] == 0
    assert summary["skipped_by_reason"] == {image_files.HIDDEN_ENTRY: 4}
    assert sorted(r.user_id for r in _read_records(out)) == ["u1", "u2"]
    error = image_files.bad_share_error(
        "x", 2, {image_files.HIDDEN_ENTRY: 40, schema.CORRUPT_IMAGE: 1}, 0.3, "limit"
    )
    assert error is not None and "1 of 3 inputs are bad" in error and "hidden" not in error
