"""Exact all-pairs recall@FAR of a serving SavedModel on held-out data.

`dp-fedemb evaluate --model DIR --data DIR [--compare DIR] [--bootstrap-resamples N]
[--max-bad-fraction F] [--json]`: DIR of --data holds canonical TFRecords (e.g.
OUT/data/split/test of `dp-fedemb train`) or is an image folder
ROOT/<user_id>/<identity>/<image>. Images are checked as ingest checks them
(`beam_jobs.image_files`): bad ones are skipped and counted by reason, and more than
--max-bad-fraction of them is a one-line error. Images go through the model's own
preprocessing. Every recall comes with a 95% bootstrap interval
over identities; --compare (e.g. the pretrained backbone) adds the model's gain over that
one with a paired interval. With --json, one JSON object on stdout: recall_at_far (FAR
string -> recall), recall_at_far_interval, thresholds, pair counts, ROC points and, with
--compare, versus. --split-mode says which pairs are genuine (held_out_images: two
users' images only); auto, the default, takes the mode `dp-fedemb train` or `dp-fedemb
data split` wrote beside --data (split_summary.json in its parent), else
identity_and_user.
"""

import json
import os
from collections.abc import Sequence

from absl import flags

from beam_jobs import split_protocols  # no Beam or TensorFlow: the checks may use it
from pipeline.commands import checks


def define_flags(flag_values: flags.FlagValues) -> None:
    flags.DEFINE_string("model", None, "serving SavedModel directory", flag_values=flag_values)
    flags.DEFINE_string("data", None, "evaluation records or image folder", flag_values=flag_values)
    flags.DEFINE_string(
        "compare", None, "another serving SavedModel to compare with", flag_values=flag_values
    )
    flags.DEFINE_integer(
        "bootstrap-resamples",
        1000,
        "identity resamples of the intervals, 1 to 1e6",
        flag_values=flag_values,
    )
    flags.DEFINE_float(
        "max-bad-fraction",
        0.01,
        "fail when the share of bad images (skipped, counted by reason) exceeds this",
        flag_values=flag_values,
    )
    flags.DEFINE_boolean("json", False, "print one JSON object", flag_values=flag_values)
    flags.DEFINE_string(
        "split-mode",
        "auto",
        "the split's protocol: identity_and_user, identity, held_out_images (genuine pairs "
        "across users only), or auto: the mode recorded beside --data, else identity_and_user",
        flag_values=flag_values,
    )


def _split_mode(requested: str, data: str) -> str:
    """`requested`, or for auto the mode of the split summary beside `data`."""
    if requested != split_protocols.AUTO:
        return requested
    from beam_jobs import records_io, splits

    summary = os.path.join(os.path.dirname(os.path.normpath(data)), splits.SUMMARY_FILE)
    if os.path.isfile(summary):
        return records_io.read_json(summary).get("mode", split_protocols.IDENTITY_AND_USER)
    return split_protocols.IDENTITY_AND_USER


def help_defaults() -> dict[str, str]:
    """Effective defaults of the flags that default to None (shown by --help)."""
    return {"compare": "none: no comparison"}


def check(flag_values: flags.FlagValues, args: Sequence[str]) -> None:
    """Flags and paths, before TensorFlow is imported (issue 29)."""
    checks.no_arguments(args)
    checks.required(flag_values, "model", "data")
    checks.number("bootstrap-resamples", flag_values["bootstrap-resamples"].value, 1, 10**6)
    checks.number("max-bad-fraction", flag_values["max-bad-fraction"].value, 0, 1)
    checks.input_path("model", flag_values["model"].value, "dir")
    checks.input_path("data", flag_values["data"].value)
    modes = (split_protocols.AUTO, *split_protocols.MODES)
    mode = flag_values["split-mode"].value
    if mode not in modes:
        raise ValueError(
            f"--split-mode must be one of {', '.join(modes)}, got {checks.shown(repr(mode))}"
            f"{checks.did_you_mean(mode, modes)}"
        )
    if flag_values["compare"].value is not None:
        checks.input_path("compare", flag_values["compare"].value, "dir")


def run(flag_values: flags.FlagValues, args: Sequence[str]) -> int:
    if args:
        raise ValueError(f"unexpected arguments: {' '.join(args)}")
    for name in ("model", "data"):
        if not flag_values[name].value:
            raise ValueError(f"--{name} is required")
    resamples = flag_values["bootstrap-resamples"].value
    if resamples < 1:
        raise ValueError(f"--bootstrap-resamples must be >= 1, got {resamples}")
    from tff_algorithms.evaluation import scoring as evaluation
    from tff_algorithms.federated import runtime

    # Evaluation needs no TFF; drop TFF's import-time context before it can fail at exit.
    runtime.release_import_time_context()
    models = {"model": flag_values["model"].value}
    if flag_values["compare"].value:
        models["compare"] = flag_values["compare"].value
    data = flag_values["data"].value
    split_mode = _split_mode(flag_values["split-mode"].value, data)
    result = evaluation.compare_saved_models(
        models,
        data,
        resamples,
        max_bad_fraction=flag_values["max-bad-fraction"].value,
        limit_name="--max-bad-fraction",
        split_mode=split_mode,
    )["model"]
    result["split_mode"] = split_mode
    if flag_values["json"].value:
        print(json.dumps(result, sort_keys=True))
        return 0
    across = (
        " (genuine pairs across users only)" if result["genuine_pairs_across_users_only"] else ""
    )
    print(
        f"{result['images']} images of {result['identities']} identities, split mode "
        f"{split_mode}: {result['genuine_pairs']} genuine{across} / "
        f"{result['impostor_pairs']} impostor pairs"
    )
    if result["bad"]:
        reasons = ", ".join(f"{k}={v}" for k, v in result["bad_by_reason"].items())
        print(f"skipped {result['bad']} bad images: {reasons}")
    for far, recall in result["recall_at_far"].items():
        low, high = result["recall_at_far_interval"][far]
        line = f"recall@FAR={far}: {recall:.4f} [{low:.4f}, {high:.4f}]"
        gain = result["versus"].get("compare", {}).get(far)
        if gain:
            low, high = gain["interval"]
            line += f", gain {gain['difference']:+.4f} [{low:+.4f}, {high:+.4f}]"
        print(line)
    return 0
