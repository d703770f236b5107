"""Property-based fuzzing of ingest record parsing and config parsing (issue 8 item 3).

Each property feeds generated input to the parser and accepts exactly two outcomes: a
value, or the project's own error (`schema.RecordError` with a known reason,
`ValueError` for configs) whose message is one line. Anything else (another exception
type, a multi-line message) is a crash the fuzzer found. Examples are derandomized and
capped, so the run is bounded and the same in CI every time (about 30 s in all).
"""

import contextlib
import io
import os
import sqlite3
import string
import tempfile
import unicodedata

import apache_beam as beam
import numpy as np
import tensorflow as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from PIL import Image

from beam_jobs import ingest, schema
from pipeline import config as config_lib

FUZZ = settings(
    max_examples=500,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
RECORD_REASONS = {
    schema.MISSING_FIELD,
    schema.CORRUPT_IMAGE,
    schema.UNSUPPORTED_IMAGE_FORMAT,
    schema.IMAGE_TOO_LARGE,
    schema.EMPTY_IMAGE,
    schema.INVALID_NAME,
}


def _one_line_record_error(error: schema.RecordError) -> None:
    assert error.reason in RECORD_REASONS, error.reason
    assert "\n" not in str(error) and str(error), repr(str(error))


def _encoded(pixels: np.ndarray, image_format: str) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format=image_format)
    return buffer.getvalue()


_RNG = np.random.default_rng(0)
SEED_IMAGES = [
    _encoded(_RNG.integers(0, 256, (9, 7), dtype=np.uint8), "PNG"),
    _encoded(_RNG.integers(0, 256, (9, 7, 3), dtype=np.uint8), "PNG"),
    _encoded(_RNG.integers(0, 256, (9, 7, 4), dtype=np.uint8), "PNG"),
    _encoded(_RNG.integers(0, 256, (16, 16, 3), dtype=np.uint8), "JPEG"),
    _encoded(_RNG.integers(0, 256, (16, 16), dtype=np.uint8), "JPEG"),
]


@st.composite
def mutated_images(draw) -> bytes:
    """A valid PNG/JPEG with a few bytes overwritten, inserted or cut."""
    data = bytearray(draw(st.sampled_from(SEED_IMAGES)))
    for _ in range(draw(st.integers(1, 4))):
        position = draw(st.integers(0, len(data) - 1))
        action = draw(st.sampled_from(("overwrite", "insert", "truncate")))
        if action == "overwrite":
            data[position] = draw(st.integers(0, 255))
        elif action == "insert":
            data[position:position] = draw(st.binary(min_size=1, max_size=8))
        else:
            del data[position:]
            if not data:
                break
    return bytes(data)


@FUZZ
@given(mutated_images())
def test_accepted_images_decode_identically_for_training(image):
    """Whatever validation accepts, the training/serving decoder decodes to the same
    pixels: no record that passed ingest can stop a training round."""
    try:
        pixels = schema.decode_image(image)
    except schema.RecordError as e:
        _one_line_record_error(e)
        return
    channels = 1 if pixels.ndim == 2 else 3
    served = tf.io.decode_image(image, channels=channels, expand_animations=False).numpy()
    if schema.image_format(image) == "png":
        np.testing.assert_array_equal(served.reshape(pixels.shape), pixels)
    else:  # JPEG decoders may round differently (PIL and TF ship different libjpeg builds)
        assert served.shape[:2] == pixels.shape[:2]


names = st.one_of(
    st.text(max_size=12),
    st.binary(max_size=12).map(lambda b: b.decode("utf-8", "surrogateescape")),
    st.sampled_from(["..", ".", "/", "a/../b", "\x00", "\u202e", "%", "%2E"]),
)


def _example(features: dict) -> bytes:
    example = tf.train.Example()
    for key, (kind, values) in features.items():
        getattr(example.features.feature[key], kind).value.extend(values)
    return example.SerializeToString()


feature_values = st.one_of(
    st.tuples(st.just("bytes_list"), st.lists(st.binary(max_size=16), max_size=3)),
    st.tuples(st.just("int64_list"), st.lists(st.integers(-(2**63), 2**63 - 1), max_size=3)),
    st.tuples(st.just("float_list"), st.lists(st.floats(width=32), max_size=3)),
)
feature_keys = st.sampled_from(
    [schema.USER_ID_KEY, schema.IDENTITY_KEY, schema.IMAGE_KEY, "label", "pixels", "other"]
)


@st.composite
def serialized_records(draw) -> bytes:
    """Serialized examples: well-formed canonical ones with hostile names and images,
    examples with arbitrary features, and arbitrary bytes."""
    kind = draw(st.sampled_from(("canonical", "features", "bytes")))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "features":
        return _example(draw(st.dictionaries(feature_keys, feature_values, max_size=4)))
    image = draw(st.one_of(st.sampled_from(SEED_IMAGES), mutated_images(), st.binary(max_size=32)))
    user, identity = (
        draw(names).encode("utf-8", "surrogateescape"),
        draw(names).encode("utf-8", "surrogateescape"),
    )
    return _example(
        {
            schema.USER_ID_KEY: ("bytes_list", [user]),
            schema.IDENTITY_KEY: ("bytes_list", [identity]),
            schema.IMAGE_KEY: ("bytes_list", [image]),
        }
    )


@FUZZ
@given(serialized_records())
def test_canonical_record_parsing_is_a_record_or_a_counted_reason(serialized):
    # What ingest's ReadCanonicalTFRecords does per record: parse, then validate.
    try:
        record = schema.parse(serialized)
        schema.validate(record)
    except schema.RecordError as e:
        _one_line_record_error(e)
        return
    # Accepted: the names are clean and the record round-trips.
    for name in (record.user_id, record.identity):
        assert not any(unicodedata.category(c) in ("Cc", "Cs") for c in name)
    assert schema.parse(schema.serialize(record)) == record


_IDENTITY_FEATURES = ("identity", "label", "class")  # ingest's order of preference
_SQL_CLIENT_DATA = tempfile.TemporaryDirectory(prefix="fuzz_sql_client_data_")


def _one_row_database(client_id: str, serialized: bytes) -> str:
    """A TFF client-data file holding one row (the tables of TFF's SQLite files)."""
    path = os.path.join(_SQL_CLIENT_DATA.name, "clients.sqlite")
    if os.path.exists(path):
        os.remove(path)
    with contextlib.closing(sqlite3.connect(path)) as connection, connection:
        connection.execute(
            "CREATE TABLE examples (split_name TEXT NOT NULL, client_id TEXT NOT NULL, "
            "serialized_example_proto BLOB NOT NULL)"
        )
        # Undecodable client ids are stored as their raw bytes, as a real file may hold.
        raw_id = client_id.encode("utf-8", "surrogateescape")
        connection.execute(
            "INSERT INTO examples VALUES ('train', CAST(? AS TEXT), ?)", (raw_id, serialized)
        )
    return path


def _expected_identity(features: dict) -> str | None:
    """The identity ingest must take: the single value of the first identity feature
    present, as text (None when that feature is not single-valued)."""
    present = [name for name in _IDENTITY_FEATURES if name in features]
    if not present:
        return None
    _, values = features[present[0]]
    if len(values) != 1:
        return None
    value = values[0]
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


@st.composite
def tff_rows(draw) -> dict:
    """Features of a TFF client-data row: arbitrary ones, or a well-formed row (one
    identity feature, an encoded image or a square of pixel values) that ingest may keep."""
    if draw(st.booleans()):
        keys = st.sampled_from([*_IDENTITY_FEATURES, "pixels", schema.IMAGE_KEY, "x"])
        return draw(st.dictionaries(keys, feature_values, max_size=4))
    identity = draw(
        st.one_of(
            st.tuples(
                st.just("bytes_list"), names.map(lambda n: [n.encode("utf-8", "surrogateescape")])
            ),
            st.tuples(
                st.just("int64_list"),
                st.lists(st.integers(-(2**63), 2**63 - 1), min_size=1, max_size=1),
            ),
        )
    )
    if draw(st.booleans()):
        image_key = schema.IMAGE_KEY
        image = ("bytes_list", [draw(st.one_of(st.sampled_from(SEED_IMAGES), mutated_images()))])
    else:
        image_key = "pixels"
        size = draw(st.integers(1, 6)) ** 2 * draw(st.sampled_from([1, 3]))
        pixel = st.floats(0, 1, width=32)
        image = ("float_list", draw(st.lists(pixel, min_size=size, max_size=size)))
    return {draw(st.sampled_from(_IDENTITY_FEATURES)): identity, image_key: image}


@FUZZ
@given(names, tff_rows())
def test_tff_client_data_rows_are_a_record_or_a_counted_reason(client_id, features):
    """ingest's ReadSqlClientData row reader, on a real one-row SQLite file: the read
    counts its one row for the progress line, every row marks its client as seen and becomes either the record its features describe or a
    BadInput with a known reason (what the ingest summary counts, per reason)."""
    database = _one_row_database(client_id, _example(features))
    reader = ingest._ReadSqlRowsFn(database, None, None, schema.DEFAULT_MAX_IMAGE_PIXELS)
    done, seen, *outputs = list(reader.process((1, 1)))
    assert (done.tag, done.value) == (ingest._DONE_TAG, 1)  # the progress line's count
    assert seen.tag == ingest._ROW_CLIENT_TAG
    assert seen.value == client_id.encode("utf-8", "surrogateescape")
    assert len(outputs) == 1, outputs
    (output,) = outputs
    if isinstance(output, beam.pvalue.TaggedOutput):
        assert output.tag == ingest.BAD_TAG
        bad = output.value
        assert bad.reason in RECORD_REASONS, bad.reason
        assert "\n" not in bad.detail and bad.detail, repr(bad.detail)
        assert bad.source == f"{database}#rowid=1"
        return
    # Accepted: the record is the row's client, identity and image, and it validates.
    record = schema.parse(output)
    assert record.user_id == client_id
    assert record.identity == _expected_identity(features)
    kind, values = features.get(schema.IMAGE_KEY, ("", []))
    if values:
        assert kind == "bytes_list" and record.image == values[0]
    else:  # pixel values, encoded to a PNG of exactly those values' count
        assert schema.decode_image(record.image).size == len(features["pixels"][1])
    schema.validate(record)


@FUZZ
@given(names, names)
def test_path_component_is_one_safe_and_injective_name(first, second):
    for name in (first, second):
        component = schema.path_component(name)
        assert component not in (".", "..") and not component.startswith(".")
        assert set(component) <= set(string.ascii_letters + string.digits + "-_.%~")
        assert 0 < len(component) <= 200
    if first != second:
        assert schema.path_component(first) != schema.path_component(second)


# Config parsing: the sections and keys a config has, with values of any type.

_SECTIONS = {
    "pipeline": ["name", "output_dir", "enable_cache", "image", "beam_args"],
    "data": [
        "inputs",
        "public_inputs",
        "max_bad_fraction",
        "identity_feature",
        "max_image_pixels",
        "synthetic",
        "synthetic_public",
    ],
    "split": ["validation_fraction", "test_fraction", "public_fraction", "seed"],
    "dedup": ["hamming_threshold", "max_shift", "max_removed_fraction"],
    "partition": ["num_shards"],
    "pretrain": ["source", "backbone_dir", "job"],
    "train": ["algorithm", "rounds", "noise_multiplier", "clip_norm", "delta", "channels"],
    "evaluate": [
        "privacy_budget_epsilon",
        "gate_far",
        "max_recall_regression",
        "bootstrap_resamples",
        "confidence",
    ],
    "push": ["serving_dir"],
}
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(10**12), 10**12),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.dictionaries(st.one_of(st.text(max_size=6), st.integers()), inner, max_size=3),
    ),
    max_leaves=6,
)


@st.composite
def config_dicts(draw) -> dict:
    config: dict = {}
    for section in draw(st.lists(st.sampled_from(sorted(_SECTIONS)), max_size=3, unique=True)):
        if draw(st.integers(0, 9)) == 0:
            config[section] = draw(values)  # a section that is not a mapping
            continue
        keys = draw(st.lists(st.sampled_from(_SECTIONS[section] + ["nonsense"]), max_size=3))
        config[section] = {key: draw(values) for key in keys}
    if draw(st.booleans()):
        config[draw(st.one_of(st.integers(), st.text(max_size=4)))] = draw(values)
    return config


@settings(FUZZ, max_examples=250)
@given(config_dicts())
def test_config_parsing_is_a_config_or_one_line_error(values_dict):
    try:
        config = config_lib.config_from_dict(values_dict)
    except ValueError as e:
        assert str(e) and "\n" not in str(e), repr(str(e))
        return
    assert isinstance(config, config_lib.PipelineConfig)
    config.to_dict()  # a valid config always serializes


@FUZZ
@given(st.text(max_size=60))
def test_config_text_and_overrides_are_a_config_or_one_line_error(tmp_path_factory, text):
    path = tmp_path_factory.mktemp("fuzz") / "config.yaml"
    path.write_text(text, encoding="utf-8")
    for load in (
        lambda: config_lib.load_config(str(path)),
        lambda: config_lib.load_config(None, [text]),
    ):
        try:
            load()
        except ValueError as e:
            assert str(e) and "\n" not in str(e), repr(str(e))
