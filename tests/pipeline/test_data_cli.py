"""`dp-fedemb data ...`: the whole data path from the command line, and its errors."""

import json
import os

import pytest

from beam_jobs import partition, schedule
from pipeline import cli


def _run(capsys, *args: str) -> tuple[int, dict | None, str]:
    code = cli.main(["dp-fedemb", "data", *args])
    captured = capsys.readouterr()
    lines = captured.out.strip().splitlines()
    return code, json.loads(lines[-1]) if code == 0 and lines else None, captured.err


@pytest.mark.slow
def test_synth_ingest_split_dedup_partition(tmp_path, capsys):
    root = str(tmp_path)
    code, synth, _ = _run(
        capsys,
        "synth",
        "--out",
        f"{root}/raw",
        "--identities",
        "40",
        "--images-per-identity",
        "3",
        "--seed",
        "2",
    )
    assert code == 0 and synth["images"] == 120 and len(os.listdir(f"{root}/raw")) == 40
    code, ingested, _ = _run(
        capsys,
        "ingest",
        "--input",
        f"{root}/raw",
        "--out",
        f"{root}/ingested",
        "--runner",
        "DirectRunner",
    )
    assert code == 0 and ingested["records"] == 120 and ingested["bad"] == 0
    # Public pretraining data of another domain, from a source of its own.
    for verb, args in (
        ("synth", ["--identities=10", "--images-per-identity=2", "--seed=3", "--style=sketch"]),
        ("ingest", [f"--input={root}/raw_public"]),
    ):
        out = f"{root}/raw_public" if verb == "synth" else f"{root}/ingested_public"
        code, _, err = _run(capsys, verb, "--out", out, *args)
        assert code == 0, err
    code, split, _ = _run(
        capsys,
        "split",
        "--input",
        f"{root}/ingested",
        "--public-input",
        f"{root}/ingested_public",
        "--out",
        f"{root}/split",
        "--seed",
        "1",
        "--validation-fraction",
        "0.2",
        "--test-fraction",
        "0.2",
    )
    assert code == 0 and split["records"]["public"] == 20
    assert sum(split["records"].values()) == 120 + 20
    code, report, _ = _run(capsys, "dedup", "--input", f"{root}/split", "--out", f"{root}/dedup")
    assert code == 0 and report["train_vs_evaluation"]["kept"] == split["records"]["train"]
    assert report["public_vs_private"]["kept"] == 20
    code, manifest, _ = _run(
        capsys,
        "partition",
        "--input",
        f"{root}/dedup/train",
        "--out",
        f"{root}/part",
        "--num-shards",
        "4",
        "--users-per-virtual-client",
        "2",
        "--virtual-clients-per-round",
        "3",
        "--rounds",
        "10",
        "--schedule",
        "epoch",
    )
    assert code == 0 and manifest["users"] == split["users"]["train"]
    stats = partition.PartitionReader(f"{root}/part").participation_stats()
    assert stats.mode == schedule.EPOCH and stats.users_per_round == 6


def test_errors_are_one_line_with_nonzero_exit(tmp_path, capsys):
    code, _, err = _run(
        capsys, "ingest", "--input", str(tmp_path / "missing"), "--out", str(tmp_path / "o")
    )
    assert code != 0 and err.count("\n") == 1 and "--input" in err and "does not exist" in err
    code, _, err = _run(capsys, "synth", "--out", str(tmp_path / "s"), "--identities", "0")
    assert code != 0 and "--identities must be >= 1" in err
    code, _, err = _run(capsys, "frobnicate", "--out", str(tmp_path))
    assert code != 0 and "usage: dp-fedemb data" in err


@pytest.mark.parametrize("flag", ["--image-size=4", "--channels=2"])
def test_synth_rejects_bad_shapes(tmp_path, capsys, flag):
    code, _, err = _run(capsys, "synth", "--out", str(tmp_path / "s"), flag)
    assert code == 1 and err.startswith("dp-fedemb data: error:")


@pytest.mark.slow
def test_users_sharing_identities_from_synth_to_split(tmp_path, capsys):
    """The issue's new-user path on handwriting-like data: auto stops in one line naming
    the modes; identity keeps every record instead of sending every user to test."""
    root = str(tmp_path)
    shape = ["--identities=12", "--images-per-identity=2", "--image-size=8"]
    code, synth, _ = _run(
        capsys,
        "synth",
        "--out",
        f"{root}/raw",
        *shape,
        "--identities-per-user=6",
        "--users-sharing-identities=30",
    )
    assert code == 0 and synth["users"] == 30 and synth["images"] == 30 * 6 * 2
    code, _, _ = _run(capsys, "ingest", "--input", f"{root}/raw", "--out", f"{root}/ingested")
    assert code == 0
    code, _, err = _run(capsys, "split", "--input", f"{root}/ingested", "--out", f"{root}/auto")
    assert code == 1 and err.count("\n") == 1 and "--mode" in err
    assert "identity keeps 360 of 360 records (100%)" in err
    code, split, _ = _run(
        capsys,
        "split",
        "--input",
        f"{root}/ingested",
        "--out",
        f"{root}/split",
        "--mode=identity",
        "--test-fraction=0.3",
    )
    assert code == 0 and split["dropped_records"] == 0 and split["mode"] == "identity"
    assert split["users"]["train"] == 30 and split["records"]["test"] > 0


def test_a_tfrecord_with_a_bad_checksum_fails_without_printing_the_record(tmp_path, capsys):
    """Issue 63: Beam's error printed the record (user, identity, image) in hex."""
    import numpy as np
    import tensorflow as tf

    from beam_jobs import schema

    image = schema.encode_png(np.full((6, 6), 3, np.uint8))
    record = schema.serialize(schema.CanonicalRecord("alice-private", "face", image))
    path = tmp_path / "bad.tfrecord"
    with tf.io.TFRecordWriter(str(path)) as writer:
        writer.write(record)
    damaged = bytearray(path.read_bytes())
    damaged[20] ^= 0xFF  # inside the record: its checksum no longer matches
    path.write_bytes(bytes(damaged))
    code, _, err = _run(capsys, "ingest", "--input", str(path), "--out", str(tmp_path / "o"))
    assert code == 1 and err.count("\n") == 1, err
    assert "Not a valid TFRecord" in err and "data not shown" in err, err
    for secret in (b"alice-private", image[:16]):
        assert secret.hex() not in err and secret.decode("latin-1") not in err, err
