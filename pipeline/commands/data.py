"""Data jobs: `dp-fedemb data {synth|ingest|split|dedup|partition} --flags`.

synth      write the synthetic identity dataset as an image folder (--out)
ingest     image folders / TFRecords / TFF SQLite files (--input, repeatable) -> --out
split      --input records [--public-input records] -> --out/{train,validation,test[,public]}
dedup      --input split dir -> --out split dir without train/public near duplicates
partition  --input records -> --out user-sharded partition + participation statistics

Beam jobs run on the DirectRunner unless --runner names another; --beam-args passes
further standard pipeline options (e.g. "--project=p --region=r").
"""

import json
import os
import shlex
from collections.abc import Sequence

from absl import flags

from beam_jobs import split_protocols  # no Beam or TensorFlow: the checks may use it
from pipeline import help_screen
from pipeline.commands import checks
from tff_algorithms.base import owned_files

VERBS = ("synth", "ingest", "split", "dedup", "partition")


def define_flags(flag_values: flags.FlagValues) -> None:
    def define(kind, name, default, help_text):
        getattr(flags, f"DEFINE_{kind}")(name, default, help_text, flag_values=flag_values)

    define("string", "out", None, "output directory")
    define("multi_string", "input", [], "input directory, file or pattern (repeatable for ingest)")
    define("integer", "seed", 0, "seed for synthesis and splits")
    # synth
    define("integer", "identities", 1000, "synth: number of identities")
    define("integer", "images-per-identity", 20, "synth: images per identity")
    define("integer", "image-size", 28, "synth: image side in pixels")
    define("integer", "channels", 1, "synth: 1 (grayscale) or 3 (RGB)")
    define(
        "integer",
        "identities-per-user",
        1,
        "synth: identities per user (1 faces-like, >1 landmarks-like)",
    )
    define(
        "integer",
        "users-sharing-identities",
        0,
        "synth: 0: each user holds identities of their own; N: N users draw "
        "--identities-per-user identities each from one shared pool of --identities, popular "
        "ones more often (landmarks-, handwriting-like)",
    )
    flags.DEFINE_enum(
        "style",
        "photo",
        ["photo", "sketch"],
        "synth: rendering style (a backbone pretrained on one meets a domain gap on the other)",
        flag_values=flag_values,
    )
    # ingest
    define(
        "float", "max-bad-fraction", 0.01, "ingest: fail when the share of bad inputs exceeds this"
    )
    define(
        "string",
        "identity-feature",
        None,
        "ingest: feature holding the identity in TFF SQLite files",
    )
    # split
    define("float", "validation-fraction", 0.1, "split: share of identities for validation")
    define("float", "test-fraction", 0.1, "split: share of identities for test")
    define(
        "float", "public-fraction", 0.0, "split: share of identities for a public pretraining split"
    )
    flags.DEFINE_enum(
        "mode",
        split_protocols.AUTO,
        [split_protocols.AUTO, *split_protocols.MODES],
        "split: evaluation protocol: identity_and_user (faces: held-out identities and their "
        "users), identity (EMNIST: held-out identities, shared users), held_out_images "
        "(landmarks: held-out users' images of training identities), auto (identity_and_user "
        "when users hold disjoint identities, else a stop naming the modes)",
        flag_values=flag_values,
    )
    define(
        "float",
        "max-dropped-fraction",
        0.1,
        "split: stop when the split would drop more than this share of the records",
    )
    define(
        "string",
        "public-input",
        None,
        "split: ingested records of separate public sources, all to the public split",
    )
    # dedup
    define(
        "integer",
        "hamming-threshold",
        16,
        "dedup: hash bits (of 63) a pair may differ in to be verified as near duplicates",
    )
    define("integer", "max-shift", 2, "dedup: shifts probed, in pixels of the 32x32 thumbnail")
    define(
        "float",
        "max-removed-fraction",
        0.1,
        "dedup: stop (after writing the report) when a split would lose more than this",
    )
    # partition
    define("integer", "num-shards", 16, "partition: number of user shards")
    define("integer", "users-per-virtual-client", 1, "partition: users per virtual client (k)")
    define("integer", "virtual-clients-per-round", 1, "partition: virtual clients per round")
    define("integer", "rounds", 1, "partition: rounds the participation statistics cover")
    flags.DEFINE_enum(
        "schedule",
        "sampled",
        ["sampled", "epoch", "fixed"],
        "partition: virtual-client schedule",
        flag_values=flag_values,
    )
    # Beam
    define("string", "runner", "DirectRunner", "Beam runner (named explicitly)")
    define("string", "beam-args", "", "further Beam pipeline options, shell-quoted")


def help_groups(flag_values: flags.FlagValues) -> list[tuple[str, list[str]]]:
    """`--help`'s groups: where data comes from and goes, then each verb's flags."""
    return help_screen.prefixed_groups(
        flag_values, ("input", "out", "seed"), {verb: f"{verb} only" for verb in VERBS}
    )


def _required(flag_values: flags.FlagValues, *names: str) -> None:
    for name in names:
        if not flag_values[name].value:
            raise ValueError(f"--{name} is required")


def _single_input(flag_values: flags.FlagValues) -> str:
    _required(flag_values, "input")
    if len(flag_values["input"].value) != 1:
        raise ValueError("exactly one --input is expected")
    return flag_values["input"].value[0]


def _split_mode_of(split_dir: str) -> str:
    """The mode `data split` wrote SPLIT_DIR by (its summary), identity_and_user without one."""
    from beam_jobs import records_io, splits

    summary = os.path.join(split_dir, splits.SUMMARY_FILE)
    if not os.path.exists(summary):
        return split_protocols.IDENTITY_AND_USER
    return records_io.read_json(summary).get("mode", split_protocols.IDENTITY_AND_USER)


_POSITIVE = (
    "identities",
    "images-per-identity",
    "image-size",
    "identities-per-user",
    "num-shards",
    "users-per-virtual-client",
    "virtual-clients-per-round",
    "rounds",
)
# Inputs each verb reads (flag -> kind); ingest takes patterns and several inputs.
_INPUTS = {"ingest": "any", "split": "dir", "dedup": "dir", "partition": "dir"}


def check(flag_values: flags.FlagValues, args: Sequence[str]) -> None:
    """The verb, flags and paths, before Beam or TensorFlow is imported (issue 29)."""
    if len(args) != 1 or args[0] not in VERBS:
        got = checks.shown(" ".join(args)) or "nothing"
        hint = checks.did_you_mean(args[0], VERBS) if len(args) == 1 else ""
        raise ValueError(f"usage: dp-fedemb data {{{'|'.join(VERBS)}}} --flags (got {got}){hint}")
    verb = args[0]
    value = {name: flag_values[name].value for name in flag_values}
    checks.required(flag_values, "out")
    for name in _POSITIVE:
        checks.number(name, value[name], 1)
    if value["channels"] not in (1, 3):
        raise ValueError(f"--channels must be 1 or 3, got {value['channels']}")
    checks.number("image-size", value["image-size"], 1, 4096)
    checks.number("seed", value["seed"], 0)
    checks.number("users-sharing-identities", value["users-sharing-identities"], 0)
    if 0 < value["users-sharing-identities"] and value["identities-per-user"] > value["identities"]:
        raise ValueError(
            f"--identities-per-user ({value['identities-per-user']}) must not exceed "
            f"--identities ({value['identities']}), the pool users share"
        )
    for name in ("max-bad-fraction", "validation-fraction", "test-fraction", "public-fraction"):
        checks.number(name, value[name], 0, 1)
    for name in ("max-removed-fraction", "max-dropped-fraction"):
        checks.number(name, value[name], 0, 1)
    checks.number("hamming-threshold", value["hamming-threshold"], 0, 63)
    checks.number("max-shift", value["max-shift"], 0, 31)
    try:
        import shlex

        shlex.split(value["beam-args"])
    except ValueError as e:
        raise ValueError(f"--beam-args cannot be split as shell words: {e}") from None
    if not value["runner"]:
        raise ValueError("--runner must name a Beam runner (e.g. DirectRunner)")
    if verb in _INPUTS:
        checks.required(flag_values, "input")
        if verb != "ingest" and len(value["input"]) != 1:
            raise ValueError("exactly one --input is expected")
        for path in value["input"]:
            checks.input_path("input", path, _INPUTS[verb])
    if verb == "split" and value["public-input"] is not None:
        checks.input_path("public-input", value["public-input"])
    out = value["out"]
    if "://" not in out and os.path.islink(out):
        raise ValueError(f"--out {checks.shown(out)} is a symbolic link; give a directory")
    for path in value["input"] or ():
        if "://" not in path and owned_files.overlapping(out, path):
            raise ValueError(
                f"--out {checks.shown(out)} lies in --input {checks.shown(path)}: a later run "
                "would read the job's files as inputs; give an --out outside it"
            )
    checks.output_dir("out", out)
    if verb != "synth":  # synth checks its folder itself (it continues an interrupted run)
        owned_files.claim_whole(out, f"data {verb}")


def run(flag_values: flags.FlagValues, args: Sequence[str]) -> int:
    if len(args) != 1 or args[0] not in VERBS:
        raise ValueError(
            f"usage: dp-fedemb data {{{'|'.join(VERBS)}}} --flags (got {' '.join(args) or 'nothing'})"
        )
    verb = args[0]
    value = {name: flag_values[name].value for name in flag_values}
    _required(flag_values, "out")
    beam_args = [f"--runner={value['runner']}", *shlex.split(value["beam-args"])]
    # Imported here so `dp-fedemb data --help` stays fast.
    from beam_jobs import (
        dedup,
        ingest,
        partition,
        partition_job,
        splits,
        synthetic,
    )

    if verb == "synth":
        config = synthetic.SyntheticConfig(
            identities=value["identities"],
            images_per_identity=value["images-per-identity"],
            image_size=value["image-size"],
            channels=value["channels"],
            identities_per_user=value["identities-per-user"],
            seed=value["seed"],
            style=value["style"],
            users_sharing_identities=value["users-sharing-identities"],
        )
        result = synthetic.write_image_folder(value["out"], config)
    elif verb == "ingest":
        _required(flag_values, "input")
        result = ingest.run_ingest(
            value["input"],
            value["out"],
            value["max-bad-fraction"],
            beam_args,
            value["identity-feature"],
        )
    elif verb == "split":
        config = split_protocols.SplitConfig(
            value["validation-fraction"],
            value["test-fraction"],
            value["public-fraction"],
            value["seed"],
            public_inputs=value["public-input"] is not None,
            mode=value["mode"],
            max_dropped_fraction=value["max-dropped-fraction"],
        )
        result = splits.run_split(
            _single_input(flag_values), value["out"], config, beam_args, value["public-input"]
        )
    elif verb == "dedup":
        config = dedup.DedupConfig(
            hamming_threshold=value["hamming-threshold"],
            max_shift=value["max-shift"],
            max_removed_fraction=value["max-removed-fraction"],
        )
        split_dir = _single_input(flag_values)
        result = dedup.run_dedup(
            split_dir, value["out"], config, beam_args, _split_mode_of(split_dir)
        )
    else:
        spec = partition.ScheduleSpec(
            value["users-per-virtual-client"],
            value["virtual-clients-per-round"],
            value["rounds"],
            value["schedule"],
        )
        result = partition_job.run_partition(
            _single_input(flag_values), value["out"], value["num-shards"], spec, beam_args=beam_args
        )
    print(json.dumps(result, sort_keys=True))
    return 0
