"""Write a deployable pipeline: `dp-fedemb compile --target kubeflow|airflow --out FILE`.

kubeflow: Kubeflow Pipelines V2 JSON (TFX KubeflowV2DagRunner); every component runs in
--image. airflow: an Airflow DAG file building the same pipeline with AirflowDagRunner.
The config (--config, --set) is validated first, as for `dp-fedemb run`.
"""

import sys
from collections.abc import Sequence

from absl import flags

from pipeline.commands import checks

TARGETS = ("kubeflow", "airflow")


def define_flags(flag_values: flags.FlagValues) -> None:
    flags.DEFINE_enum("target", None, list(TARGETS), "orchestrator", flag_values=flag_values)
    flags.DEFINE_string("out", None, "file to write", flag_values=flag_values)
    flags.DEFINE_string(
        "config", None, "pipeline config file (JSON or YAML)", flag_values=flag_values
    )
    flags.DEFINE_multi_string(
        "set",
        [],
        "config override section.key=value (YAML value), repeatable",
        flag_values=flag_values,
    )
    flags.DEFINE_string(
        "image",
        None,
        "container image of the components (overrides pipeline.image)",
        flag_values=flag_values,
    )
    flags.DEFINE_string(
        "pipeline-root",
        None,
        "pipeline root on the orchestrator (default: OUTPUT/pipeline_root of the config)",
        flag_values=flag_values,
    )


def help_defaults() -> dict[str, str]:
    """Effective defaults of the flags that default to None (shown by --help)."""
    from pipeline import config as config_lib

    pipeline = config_lib.PipelineSection()
    return {
        "config": "none: the embedded defaults (docs/config.md)",
        "image": f"pipeline.image of the config, {pipeline.image}",
        "pipeline-root": f"{pipeline.output_dir}/pipeline_root (pipeline.output_dir)",
    }


def _overrides(flag_values: flags.FlagValues) -> list[str]:
    overrides = list(flag_values["set"].value)
    if flag_values["image"].value is not None:
        overrides.append(f"pipeline.image={flag_values['image'].value}")
    return overrides


def check(flag_values: flags.FlagValues, args: Sequence[str]) -> None:
    """Flags, config and the output file, before TFX is imported (issue 29)."""
    checks.no_arguments(args)
    checks.required(flag_values, "target", "out")
    if flag_values["config"].value is not None:
        checks.input_path("config", flag_values["config"].value, "file")
    if flag_values["image"].value is not None and not flag_values["image"].value.strip():
        raise ValueError("--image must name a container image")
    from pipeline import config as config_lib

    config_lib.check_config(flag_values["config"].value, _overrides(flag_values))
    # Checked, not made: `run` makes its directory once the whole config is valid.
    checks.output_file("out", flag_values["out"].value, create=False)


def run(flag_values: flags.FlagValues, args: Sequence[str]) -> int:
    if args:
        raise ValueError(f"unexpected arguments: {' '.join(args)}")
    for name in ("target", "out"):
        if not flag_values[name].value:
            raise ValueError(f"--{name} is required")
    from pipeline import compile_targets, definition
    from pipeline import config as config_lib

    out = flag_values["out"].value
    try:
        config = config_lib.load_config(flag_values["config"].value, _overrides(flag_values))
        root = flag_values["pipeline-root"].value or definition.pipeline_root(config)
        compile_target = (
            compile_targets.compile_kubeflow
            if flag_values["target"].value == "kubeflow"
            else compile_targets.compile_airflow
        )
        try:
            written = compile_target(config, out, root)
        except Exception as e:
            # The compilers write through TensorFlow's file API: a directory that cannot
            # be made (e.g. under /proc, which passes `os.access`) is one line naming --out.
            import tensorflow as tf

            if isinstance(e, tf.errors.OpError):
                raise ValueError(
                    f"--out {checks.shown(out)} cannot be written: {e.message}"
                ) from None
            raise
    finally:
        # Validation imports TFF: its import-time context would otherwise fail noisily
        # at exit, after the one error line.
        if "tff_algorithms.federated.runtime" in sys.modules:
            sys.modules["tff_algorithms.federated.runtime"].release_import_time_context()
    print(written)
    return 0
