"""The default pipeline's dedup step on the default pipeline's data, timed.

`make run`'s DeduplicateSplits runs `beam_jobs.dedup.run_dedup` on the splits that
CanonicalExampleGen makes of the embedded synthetic data (16,000 private 28x28 images in
four splits, 3,000 public sketches). This benchmark renders the same data with the same
functions and the pipeline's default config (`pipeline.config.load_config()`), then runs
the dedup with the pipeline's default Beam arguments, timing each of `repeats` runs (wall
and this process's CPU, threads included). Quick: a tenth of the identities, one run.

Issue 23 asks for dedup in `make run` at 15 s or less; the component adds little to
`run_dedup` (MLMD bookkeeping and file renames).
"""

import dataclasses
import os
import tempfile
import time

from beam_jobs import dedup, ingest, near_duplicates, split_protocols, splits, synthetic
from pipeline import config as config_lib


def _ingested(root: str, section: config_lib.SyntheticSection, name: str, beam_args) -> str:
    folder = os.path.join(root, f"synthetic_{name}")
    synthetic.write_image_folder(folder, synthetic.SyntheticConfig(**dataclasses.asdict(section)))
    out = os.path.join(root, name)
    ingest.run_ingest([folder], out, 0.0, beam_args)
    return out


def _scaled(section: config_lib.SyntheticSection, quick: bool) -> config_lib.SyntheticSection:
    if not quick:
        return section
    return dataclasses.replace(section, identities=max(section.identities // 10, 20))


def run(out_dir: str, quick: bool) -> dict:
    del out_dir
    config = config_lib.load_config()
    beam_args = list(config.pipeline.beam_args)
    public = config.synthetic_public
    repeats = 1 if quick else 3
    with tempfile.TemporaryDirectory(prefix="bench_dedup_pipeline_") as root:
        private_dir = _ingested(root, _scaled(config.data.synthetic, quick), "private", beam_args)
        public_dir = (
            _ingested(root, _scaled(public, quick), "public", beam_args) if public else None
        )
        split_dir = os.path.join(root, "split")
        split_summary = splits.run_split(
            private_dir,
            split_dir,
            split_protocols.SplitConfig(**config.split_config_dict()),
            beam_args,
            public_dir,
        )
        dedup_config = dedup.DedupConfig(**dataclasses.asdict(config.dedup))
        runs = []
        for repeat in range(repeats):
            wall, cpu = time.perf_counter(), time.process_time()
            report = dedup.run_dedup(
                split_dir, os.path.join(root, f"dedup_{repeat}"), dedup_config, beam_args
            )
            runs.append(
                {
                    "wall_seconds": round(time.perf_counter() - wall, 2),
                    "cpu_seconds": round(time.process_time() - cpu, 2),
                }
            )
    return {
        "beam_args": beam_args,
        "records": {name: section["candidate_records"] for name, section in sorted(report.items())},
        "split_users": split_summary["users"],
        "removed": {
            name: section["removed_exact"] + section["removed_near"]
            for name, section in sorted(report.items())
        },
        "threads": near_duplicates.THREADS,
        "runs": runs,
        "best_wall_seconds": min(r["wall_seconds"] for r in runs),
    }
