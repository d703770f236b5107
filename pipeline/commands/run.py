"""Run the whole TFX pipeline locally: `dp-fedemb run [--config FILE] [--output DIR]`.

With no arguments: the embedded synthetic dataset (deterministic), LocalDagRunner and an
ML Metadata SQLite store under --output. Ends by printing the pushed model, its epsilon
(found by the lineage query), recall@FAR on held-out identities, and the report.
--set section.key=value overrides the config file; --from-component re-runs from that
component on, reusing the previous run's artifacts upstream (e.g. PrivateTrain).
--print-config prints the effective config (what the run would use) and exits.
"""

import sys
from collections.abc import Sequence

from absl import flags

from pipeline.commands import checks


def define_flags(flag_values: flags.FlagValues) -> None:
    flags.DEFINE_string(
        "config", None, "pipeline config file (JSON or YAML)", flag_values=flag_values
    )
    flags.DEFINE_string(
        "output", None, "output directory (overrides pipeline.output_dir)", flag_values=flag_values
    )
    flags.DEFINE_multi_string(
        "set",
        [],
        "config override section.key=value (YAML value), repeatable",
        flag_values=flag_values,
    )
    flags.DEFINE_boolean(
        "print-config",
        False,
        "print the effective, validated config (defaults, file and --set overlaid) as YAML "
        "and exit",
        flag_values=flag_values,
    )
    flags.DEFINE_multi_string(
        "from-component",
        [],
        "partial run: start at this component, reusing the last run upstream",
        flag_values=flag_values,
    )


def _overrides(flag_values: flags.FlagValues) -> list[str]:
    overrides = list(flag_values["set"].value)
    if flag_values["output"].value is not None:
        overrides.append(f"pipeline.output_dir={flag_values['output'].value}")
    return overrides


def help_defaults() -> dict[str, str]:
    """Effective defaults of the flags that default to None (shown by --help)."""
    from pipeline import config as config_lib

    pipeline = config_lib.PipelineSection()
    return {
        "config": "none: the embedded defaults (synthetic data, docs/config.md)",
        "output": f"pipeline.output_dir of the config, {pipeline.output_dir}",
    }


def check(flag_values: flags.FlagValues, args: Sequence[str]) -> None:
    """The config file, --set overrides (keys, types, the checks that need no library)
    and the output directory, before TensorFlow, Beam or TFX is imported (issue 29)."""
    checks.no_arguments(args)
    from pipeline import config as config_lib

    if flag_values["config"].value is not None:
        checks.input_path("config", flag_values["config"].value, "file")
    if flag_values["output"].value is not None and not flag_values["output"].value:
        raise ValueError("--output must not be empty")
    config = config_lib.check_config(flag_values["config"].value, _overrides(flag_values))
    # Checked, not made: the pipeline makes it (a refused run leaves nothing behind).
    checks.output_dir("output", config.pipeline.output_dir, create=False)


def run(flag_values: flags.FlagValues, args: Sequence[str]) -> int:
    if args:
        raise ValueError(f"unexpected arguments: {' '.join(args)}")
    from pipeline import config as config_lib

    try:
        config = config_lib.load_config(flag_values["config"].value, _overrides(flag_values))
        if flag_values["print-config"].value:
            import yaml

            print(yaml.safe_dump(config.to_dict(), sort_keys=False), end="")
            return 0
        print(f"dp-fedemb run: output in {config.pipeline.output_dir}", flush=True)

        from pipeline import local_run

        summary = local_run.run_pipeline(
            config, tuple(flag_values["from-component"].value), sys.stdout
        )
    finally:
        # Validation and the components import TFF: its import-time context would
        # otherwise fail noisily at exit, after the one error line.
        if "tff_algorithms.federated.runtime" in sys.modules:
            sys.modules["tff_algorithms.federated.runtime"].release_import_time_context()
    recall = ", ".join(f"{far}: {value:.4f}" for far, value in summary.recall_at_far.items())
    if summary.pushed_to:
        print(f"pushed model: {summary.pushed_to}")
    else:
        print(f"not pushed: {'; '.join(summary.not_blessed_because)}")
    print(
        f"epsilon: {summary.epsilon:.4g} (delta {summary.delta:.3g}; user level, "
        f"{summary.accounting_convention} accounting, {summary.neighboring_relation} relation)"
    )
    print(f"recall@FAR on held-out identities: {recall}")
    if summary.gain_over_pretrained:
        gains = ", ".join(
            f"{far}: {g['difference']:+.4f} [{g['interval'][0]:+.4f}, {g['interval'][1]:+.4f}]"
            for far, g in summary.gain_over_pretrained.items()
        )
        print(f"gain over the pretrained start ({summary.confidence:.0%} interval): {gains}")
    print(f"report: {summary.report_path}")
    return 0
