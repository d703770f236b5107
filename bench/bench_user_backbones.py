"""A backbone the user brings, through `dp-fedemb run`, against the small CNN at equal ε.

Arms (each a whole pipeline run: ingest, split, dedup, public pretraining, private
training, evaluation):
- `small_cnn`: the default backbone, 28×28 grey;
- `keras:MobileNetV3Small`: the paper's family, at 64×64 RGB, from scratch (weights=None)
  then public pretraining; BatchNorm becomes GroupNorm (`batch_norm: auto`);
- `file:face.keras`: a user's Keras file with BatchNormalization, RGB 32×32 in, 48-d out,
  its BatchNorm frozen (`batch_norm: auto` for a file).

Data, both shapes, real renders of matplotlib's fonts (the same files as Debian's
fonts-dejavu-core and fonts-stix; `bench/rendered_images.py`):
- `shared`: writers who share characters (`bench/character_writers.py`: writer u writes
  in font u mod 22, `characters_per_user` characters), split by identity;
- `one_per_user`: every user holds one identity of their own (a character in one
  font, several renders of it), split by identity and user.
Public data: matplotlib's toolbar icons and DejaVu pictographs, one identity per user.

Each arm's trained model and the small CNN's are scored on the same test split with a
paired bootstrap (`scoring.compare_saved_models`), so the difference's interval is the
paired one. Writes bench/results/bench_user_backbones.json (`make bench` runs it too).

    python -m bench.bench_user_backbones [--quick] [--root /tmp/user_backbones]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import time

import numpy as np
from PIL import Image

from bench import character_writers, rendered_images

RESULTS = os.path.join(os.path.dirname(__file__), "results")
SMALL_CNN = "small_cnn"
MOBILENET_V3 = "keras:MobileNetV3Small"
USER_FILE = "file"
SIZES = {
    "full": {"writers": 200, "characters_per_user": 6, "one_per_user": 300, "renders": 4},
    "quick": {"writers": 60, "characters_per_user": 4, "one_per_user": 80, "renders": 3},
}
# The schedule of every run: a few rounds at ε 8 over every user each round (auto).
TRAIN = {
    "rounds": 3,
    "target_epsilon": 8.0,
    "virtual_clients_per_round": "auto",
}


def _save(pixels: np.ndarray, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    Image.fromarray(pixels).save(path)


def write_one_per_user(root: str, users: int, renders: int, size: int, seed: int) -> int:
    """User u holds one identity no one else holds: a character in one font, `renders`
    renders of it (faces: one identity per user)."""
    pairs = [
        (font, character)
        for character in character_writers.CHARACTERS
        for font in character_writers.LATIN_FONTS
    ]
    order = np.random.default_rng(seed).permutation(len(pairs))[:users]
    for user, index in enumerate(order):
        font, character = pairs[index]
        identity = f"{font.split('.')[0]}_{character_writers._FOLDER[character]}"
        for n in range(renders):
            render_seed = rendered_images.seed_of("single", seed, user, n, size)
            pixels = rendered_images.render(f"glyph:{font}:{character}", size, 0, render_seed)
            _save(pixels, os.path.join(root, f"user{user:05d}", identity, f"{n}.png"))
    return users * renders


def user_file(path: str) -> str:
    """The user's Keras file: a small face network with BatchNorm, RGB 32×32 → 48-d."""
    import tensorflow as tf

    init = tf.keras.initializers.GlorotUniform(seed=0)
    inputs = tf.keras.Input((32, 32, 3))
    x = inputs
    for filters in (32, 64):
        x = tf.keras.layers.Conv2D(filters, 3, padding="same", kernel_initializer=init)(x)
        x = tf.keras.layers.BatchNormalization()(x)
        x = tf.keras.layers.ReLU()(x)
        x = tf.keras.layers.MaxPool2D()(x)
    x = tf.keras.layers.Conv2D(64, 3, padding="same", kernel_initializer=init)(x)
    x = tf.keras.layers.BatchNormalization()(x)
    x = tf.keras.layers.ReLU()(x)
    x = tf.keras.layers.GlobalAveragePooling2D()(x)
    outputs = tf.keras.layers.Dense(48, kernel_initializer=init, name="embedding")(x)
    tf.keras.Model(inputs, outputs).save(path)
    return path


def arms(model_path: str) -> dict[str, dict]:
    return {
        SMALL_CNN: {},
        MOBILENET_V3: {"architecture": MOBILENET_V3, "image_size": 64, "channels": 3},
        USER_FILE: {
            "architecture": f"file:{model_path}",
            "image_size": 32,
            "channels": 3,
            "embedding_size": 48,
        },
    }


def _run(root: str, name: str, data: dict, train: dict, split_mode: str) -> dict:
    output = os.path.join(root, "runs", name)
    config = {
        "pipeline": {"output_dir": output},
        "data": data,
        "split": {"mode": split_mode},
        "pretrain": {"job": {"rounds": 3}},
        "train": {**TRAIN, **train},
    }
    path = os.path.join(root, f"{name}.json")
    with open(path, "w") as f:
        json.dump(config, f)
    started = time.perf_counter()
    done = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "dp-fedemb"), "run", "--config", path],
        capture_output=True,
        text=True,
    )
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{name}: dp-fedemb run failed: {done.stderr[-2000:]}")
    model = _newest(output, "PrivateTrain", "model")
    evaluation = _newest(output, "EvaluateAndBless", "evaluation")
    with open(os.path.join(evaluation, "evaluation.json")) as f:
        evaluated = json.load(f)
    with open(os.path.join(_newest(output, "PrivateTrain", "privacy_ledger"), "ledger.json")) as f:
        epsilon = json.load(f)["history"][-1]["epsilon"]
    return {
        "wall_seconds": round(seconds, 1),
        "epsilon": epsilon,
        "recall_at_far": evaluated["model"]["recall_at_far"],
        "model": os.path.join(model, "Format-Serving"),
        "output": output,
    }


def _newest(output: str, component: str, artifact: str) -> str:
    """The folder of the component's newest execution (a re-run after a code change adds
    one; TFX numbers them in order)."""
    found = glob.glob(os.path.join(output, "pipeline_root", component, artifact, "*"))
    return max(found, key=lambda path: int(os.path.basename(path)))


def _test_split(output: str) -> str:
    found = glob.glob(
        os.path.join(output, "pipeline_root", "DeduplicateSplits", "*", "*", "Split-test")
    )
    return max(found, key=lambda path: int(path.split(os.sep)[-2]))


def run(
    out_dir: str, quick: bool, root: str | None = None, shapes: str = "shared,one_per_user"
) -> dict:
    """Every arm on every shape (module docstring); `run_all`'s entry point."""
    sizes = SIZES["quick" if quick else "full"]
    root = os.path.abspath(root or os.path.join(out_dir, "bench_user_backbones_work"))
    os.makedirs(root, exist_ok=True)
    size = 64  # written at the largest input; each model resizes
    public = os.path.join(root, "public")
    if not os.path.isdir(public):
        character_writers.write_public(public, 6, 4, size, 0)
    shared = os.path.join(root, "shared")
    if not os.path.isdir(shared):
        character_writers.write_private(
            shared, sizes["writers"], sizes["characters_per_user"], 1, size, 0
        )
    single = os.path.join(root, "one_per_user")
    if not os.path.isdir(single):
        write_one_per_user(single, sizes["one_per_user"], sizes["renders"], size, 0)
    model_path = os.path.join(root, "face.keras")
    if not os.path.exists(model_path):
        user_file(model_path)

    from tff_algorithms.evaluation import scoring

    results: dict = {"sizes": sizes, "train": TRAIN, "shapes": {}}
    for shape in shapes.split(","):
        inputs, mode = (shared, "identity") if shape == "shared" else (single, "auto")
        data = {"inputs": [inputs], "public_inputs": [public]}
        runs = {
            arm: _run(root, f"{shape}-{arm.replace(':', '_')}", data, train, mode)
            for arm, train in arms(model_path).items()
        }
        test = _test_split(runs[SMALL_CNN]["output"])
        for arm in (MOBILENET_V3, USER_FILE):
            compared = scoring.compare_saved_models(
                {arm: runs[arm]["model"], SMALL_CNN: runs[SMALL_CNN]["model"]},
                test,
                split_mode="identity" if mode == "identity" else "identity_and_user",
            )
            runs[arm]["versus_small_cnn"] = compared[arm]["versus"][SMALL_CNN]
            runs[arm]["recall_at_far_interval"] = compared[arm]["recall_at_far_interval"]
        results["shapes"][shape] = runs
        print(json.dumps({shape: runs}, indent=1), flush=True)
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--root", default=None, help="where the data and runs go")
    parser.add_argument("--shapes", default="shared,one_per_user")
    args = parser.parse_args(argv)
    results = run(RESULTS, args.quick, args.root, args.shapes)
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, "bench_user_backbones.json"), "w") as f:
        json.dump(results, f, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
