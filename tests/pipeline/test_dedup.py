"""The dedup guard in the pipeline: a user's data whose training images are mostly copies
of evaluation images stops the run at DeduplicateSplits with one line that names the
fraction, the setting and the report with the pairs to check (issue 23 item 3)."""

import json
import os
import re

import pytest

from beam_jobs import schema
from bench import real_images
from pipeline import definition
from tests import support

pytestmark = pytest.mark.slow


def _photos_sharing_a_few_real_images(root: str, users: int = 60, pool: int = 8) -> None:
    """root/<user>/<identity>/<n>.png, every image one of `pool` real tiles: whichever
    users the split sends to evaluation, training holds copies of their images."""
    tiles = [original.pixels for original in real_images.originals(28)[:pool]]
    for user in range(users):
        folder = os.path.join(root, f"user{user:03d}", f"person{user:03d}")
        os.makedirs(folder)
        for n in range(3):
            with open(os.path.join(folder, f"{n}.png"), "wb") as f:
                f.write(schema.encode_png(tiles[(user + n) % pool]))


def test_a_dedup_removing_most_of_a_split_stops_the_run_in_one_line(tmp_path):
    photos = str(tmp_path / "photos")
    _photos_sharing_a_few_real_images(photos)
    error, process = support.run_refused(
        "run",
        "--output",
        str(tmp_path / "out"),
        "--set",
        f"data.inputs=[{photos}]",
        "--set",
        "split.public_fraction=0.2",
        "--set",
        "train.noise_multiplier=1.0",
        "--set",
        "train.users_per_virtual_client=2",
        "--set",
        "train.virtual_clients_per_round=2",
    )
    assert "dedup would remove" in error and "dedup.max_removed_fraction" in error
    # The report the line points at holds the pairs to check, and says it was refused.
    report_path = re.search(r"check the example pairs in (\S+)", error).group(1)
    with open(report_path) as f:
        sections = json.load(f)
    refused = [s for s in sections.values() if not s["within_limit"]]
    assert refused and all(s["examples"] for s in refused)
    assert all(s["removed_fraction"] > s["max_removed_fraction"] == 0.1 for s in refused)
    # Nothing trained on what was left.
    assert definition.PARTITION not in process.stdout
