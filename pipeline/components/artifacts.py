"""Artifact types the dp-fedemb pipeline adds to ML Metadata (namespaced, as KFP V2 requires).

Standard TFX types (Examples, Model, ModelBlessing, ModelEvaluation, PushedModel)
are used where they fit; these types name what the standard ones cannot. Custom
properties that lineage queries read (epsilon, delta) are written by the
components as MLMD custom properties, so no file has to be opened to find them.
"""

from tfx import types


class DedupReport(types.Artifact):
    """dedup_report.json: exact and near duplicates removed from train and public data."""

    TYPE_NAME = "dp_fedemb.DedupReport"


class VirtualClientPartition(types.Artifact):
    """User-sharded training records (beam_jobs.partition layout) for virtual clients."""

    TYPE_NAME = "dp_fedemb.VirtualClientPartition"


class ScheduleStatistics(types.Artifact):
    """participation.json: what the privacy accountant needs to know of the schedule."""

    TYPE_NAME = "dp_fedemb.ScheduleStatistics"


class PrivacyLedger(types.Artifact):
    """ledger.json of a private training run; custom properties epsilon and delta."""

    TYPE_NAME = "dp_fedemb.PrivacyLedger"


class TrainingMetrics(types.Artifact):
    """metrics.json of a training run (held-out recall@FAR, epsilon, rounds, time)."""

    TYPE_NAME = "dp_fedemb.TrainingMetrics"


class PipelineReport(types.Artifact):
    """index.html with plots: ROC, recall during training, ledger, extrapolation."""

    TYPE_NAME = "dp_fedemb.PipelineReport"


# Custom property names shared by the components and the lineage query.
# The model's epsilon: composed over every private run its weights come from (Logit-DP
# pretraining on the same users and the training; tff_algorithms.privacy.composition).
EPSILON = "epsilon"
DELTA = "delta"
# On PrivateTrain's artifacts: the training run's own epsilon, and how many private runs
# the model's epsilon composes (1 without private pretraining).
RUN_EPSILON = "run_epsilon"
COMPOSED_RUNS = "composed_runs"
# What the epsilon means (tff_algorithms.privacy.accounting): "strict" or "paper", and the
# neighbouring relation, on Model, PrivacyLedger, TrainingMetrics and ModelEvaluation.
ACCOUNTING_CONVENTION = "accounting_convention"
NEIGHBORING_RELATION = "neighboring_relation"
# On PrivacyLedger: the cross-run budget of the training users (tff_algorithms.privacy.budget).
DATASET_FINGERPRINT = "dataset_fingerprint"
DATASET_EPSILON = "dataset_epsilon"  # composed over every run charged, this one included
DATASET_BUDGET_EPSILON = "dataset_budget_epsilon"
BUDGET_OVERRIDDEN = "budget_overridden"  # 1: over budget, started on an explicit override
BUDGET_RUN_ID = "budget_run_id"  # the run's id in the budget ledger
BUDGET_LEDGER = "budget_ledger"  # the ledger's path
BUDGET_CHAIN = "budget_chain"  # the run's entry's chain (tff_algorithms.privacy.budget_chain)
BUDGET_LEDGER_REPAIRED = "budget_ledger_repaired"  # 1: a repaired ledger accepted at the charge
