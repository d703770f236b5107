"""Exact all-pairs recall@FAR of a serving SavedModel on held-out data.

`dp-fedemb evaluate --model DIR --data DIR [--json]`: DIR of --data holds canonical
TFRecords (e.g. OUT/data/split/test of `dp-fedemb train`) or is an image folder
ROOT/<user_id>/<identity>/<image>. Images go through the model's own preprocessing.
With --json, one JSON object on stdout: recall_at_far (FAR string -> recall),
thresholds, pair counts and ROC points.
"""

import json
from collections.abc import Sequence

from absl import flags


def define_flags(flag_values: flags.FlagValues) -> None:
    flags.DEFINE_string("model", None, "serving SavedModel directory", flag_values=flag_values)
    flags.DEFINE_string("data", None, "evaluation records or image folder", flag_values=flag_values)
    flags.DEFINE_boolean("json", False, "print one JSON object", flag_values=flag_values)


def run(flag_values: flags.FlagValues, args: Sequence[str]) -> int:
    if args:
        raise ValueError(f"unexpected arguments: {' '.join(args)}")
    for name in ("model", "data"):
        if not flag_values[name].value:
            raise ValueError(f"--{name} is required")
    from tff_algorithms import runtime, train_job

    # Evaluation needs no TFF; drop TFF's import-time context before it can fail at exit.
    runtime.release_import_time_context()
    result = train_job.evaluate_saved_model(flag_values["model"].value, flag_values["data"].value)
    if flag_values["json"].value:
        print(json.dumps(result, sort_keys=True))
        return 0
    print(
        f"{result['images']} images of {result['identities']} identities, "
        f"{result['genuine_pairs']} genuine / {result['impostor_pairs']} impostor pairs"
    )
    for far, recall in result["recall_at_far"].items():
        print(f"recall@FAR={far}: {recall:.4f}")
    return 0
