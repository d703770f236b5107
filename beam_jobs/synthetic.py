"""Synthetic identity dataset as Beam records and as an image folder (docs/design.md
section 3). What an identity and an image are, and how users hold identities, is
`beam_jobs.synthetic_images`, which renders them; its names are re-exported here.

The Beam source renders slices of units in parallel; `write_image_folder` writes the
folder a user's images would be in (what `dp-fedemb run` ingests by default), in
several processes when the folder is large.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from collections.abc import Iterator

import apache_beam as beam

from beam_jobs import schema, synthetic_images
from beam_jobs.synthetic_images import (  # noqa: F401 - its public names re-exported
    PHOTO,
    SKETCH,
    STYLES,
    TEMPORARY_SUFFIX,
    SyntheticConfig,
    holdings_of_units,
    render_image,
    user_holdings,
    write_images,
)

# Below this many images a folder is written in this process: starting a process costs
# about as much as rendering a few hundred images.
_PARALLEL_MIN_IMAGES = 2000


def records_for_identities(
    config: SyntheticConfig, start: int, stop: int
) -> Iterator[schema.CanonicalRecord]:
    """Canonical records of identities [start, stop), in order."""
    for identity_index in range(start, min(stop, config.identities)):
        user_id = config.user_name(identity_index)
        identity = config.identity_name(identity_index)
        for image_index in range(config.images_per_identity):
            pixels = render_image(config, identity_index, image_index)
            yield schema.CanonicalRecord(user_id, identity, schema.encode_png(pixels))


def records_for_units(
    config: SyntheticConfig, start: int, stop: int
) -> Iterator[schema.CanonicalRecord]:
    """Canonical records of units [start, stop) (`SyntheticConfig.units`), in order; for
    users with identities of their own, the same as `records_for_identities`."""
    for user_index, identity_index, first_image in holdings_of_units(config, start, stop):
        user_id = config.user_index_name(user_index)
        identity = config.identity_name(identity_index)
        for image_index in range(first_image, first_image + config.images_per_identity):
            pixels = render_image(config, identity_index, image_index)
            yield schema.CanonicalRecord(user_id, identity, schema.encode_png(pixels))


class SyntheticRecords(beam.PTransform):
    """PBegin -> serialized canonical records of the whole synthetic dataset."""

    def __init__(self, config: SyntheticConfig, units_per_bundle: int = 64):
        super().__init__()
        self._config = config
        self._units_per_bundle = units_per_bundle

    def expand(self, pbegin):
        config, step = self._config, self._units_per_bundle
        return (
            pbegin
            | "UnitSlices" >> beam.Create(range(0, config.units, step))
            # Spread slices over workers before the expensive rendering.
            | "Reshuffle" >> beam.Reshuffle()
            | "Render"
            >> beam.FlatMap(
                lambda start: (
                    schema.serialize(r) for r in records_for_units(config, start, start + step)
                )
            )
        )


def _planned_images(config: SyntheticConfig) -> Iterator[tuple[str, int, int]]:
    """(path relative to OUT, identity index, image index) of every image, in order."""
    width = len(str(config.images_per_identity - 1))
    for user_index, identity_index, first_image in holdings_of_units(config, 0, config.units):
        # Names become folders only through the one sanitiser (schema.path_component).
        folder = os.path.join(
            schema.path_component(config.user_index_name(user_index)),
            schema.path_component(config.identity_name(identity_index)),
        )
        for n in range(config.images_per_identity):
            yield os.path.join(folder, f"{n:0{width}d}.png"), identity_index, first_image + n


def _foreign_entry(out_dir: str, planned: set[str]) -> str | None:
    """The first path under OUT that this config would not write (nor its temporaries)."""
    folders = {os.path.dirname(path) for path in planned}
    folders |= {os.path.dirname(folder) for folder in folders}
    for current, subdirs, names in os.walk(out_dir):
        relative = os.path.relpath(current, out_dir)
        for name in subdirs:
            path = os.path.normpath(os.path.join(relative, name))
            if path not in folders or os.path.islink(os.path.join(current, name)):
                return os.path.join(current, name)
        for name in names:
            path = os.path.normpath(os.path.join(relative, name))
            kept = path.removesuffix(TEMPORARY_SUFFIX)
            if kept not in planned or not os.path.isfile(os.path.join(current, name)):
                return os.path.join(current, name)
    return None


def _write_in_processes(
    out_dir: str, config: SyntheticConfig, images: list[tuple[str, int, int]], processes: int
) -> None:
    """`write_images` over contiguous slices of IMAGES, one `python -m
    beam_jobs.synthetic_images` per slice: fresh interpreters that import neither
    TensorFlow nor Beam (this one runs their threads, so it does not fork) and that, unlike
    multiprocessing's spawn, never re-run the caller's main module. Contiguous slices keep
    an identity's images together (its parts are drawn once per process)."""
    step = -(-len(images) // processes)
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(synthetic_images.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    workers = []
    try:
        for start in range(0, len(images), step):
            worker = subprocess.Popen(
                [sys.executable, "-m", synthetic_images.__name__],
                stdin=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
            )
            workers.append(worker)
            job = {
                "out_dir": out_dir,
                "config": dataclasses.asdict(config),
                "images": images[start : start + step],
            }
            worker.stdin.write(json.dumps(job).encode())
            worker.stdin.close()
        for worker in workers:
            error = worker.stderr.read().decode(errors="replace").strip().splitlines()
            if worker.wait() != 0:
                raise _worker_error(out_dir, error[-1] if error else "", worker.returncode)
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()
            worker.stderr.close()


def _worker_error(out_dir: str, last_line: str, returncode: int) -> Exception:
    """The error a worker stopped with: an OSError as the worker raised it (a full disk
    stays a full disk, errno and file included), else its last line."""
    try:
        error = json.loads(last_line)
        return OSError(error["errno"], error["strerror"], error["filename"])
    except (ValueError, TypeError, KeyError):
        return RuntimeError(
            f"writing synthetic images into {out_dir} failed: {last_line or f'exit code {returncode}'}"
        )


def write_image_folder(out_dir: str, config: SyntheticConfig, processes: int | None = None) -> dict:
    """Writes OUT/<user_id>/<identity>/<image>.png; returns a summary.

    Each image is written to a temporary name and renamed, so an image that exists is
    whole. An interrupted run (a full disk, a kill) is continued by running it again
    with the same settings: OUT may then hold only what this config writes, and the
    images already there are kept. The files do not depend on `processes` (how many
    render at once; None: one per core, or this process alone for a small folder).
    """
    images = list(_planned_images(config))
    if os.path.isdir(out_dir) and os.listdir(out_dir):
        foreign = _foreign_entry(out_dir, {path for path, _, _ in images})
        if foreign is not None:
            shown = foreign if foreign.isprintable() else ascii(foreign)
            raise ValueError(
                f"output directory {out_dir} holds {shown}, which this synth run would not "
                "write; give an empty directory (or the same settings to continue a run)"
            )
    for folder in dict.fromkeys(os.path.dirname(path) for path, _, _ in images):
        os.makedirs(os.path.join(out_dir, folder), exist_ok=True)
    if processes is None:
        processes = len(os.sched_getaffinity(0)) if len(images) >= _PARALLEL_MIN_IMAGES else 1
    if processes <= 1:
        write_images(out_dir, config, images)
    else:
        _write_in_processes(out_dir, config, images, processes)
    return {
        "out": out_dir,
        "users": config.users,
        "images": config.images,
        **dataclasses.asdict(config),
    }
