"""Splits of the private records into train, validation, test (and public), streamed and
deterministic: the Beam job of the split protocol in `beam_jobs.split_protocols` (split
names, modes, `SplitConfig` and the assignment of an identity or a user to a split; its
docstring says what each mode does), docs/design.md section 3.

`SplitRecords` groups the records by user (spilled to disk, `beam_jobs.spill`), assigns
them by `config.mode`, drops and counts what the mode drops, and summarises each split;
`run_split` reads and writes the records, resolves mode auto in the same pass and
stops with `split_protocols.SplitRefused` when the split would drop more than
`max_dropped_fraction` of the private records (after writing the summary, with the
split's records removed).
"""

import dataclasses
import math
import os
from collections.abc import Iterable

import apache_beam as beam
import tensorflow as tf
from apache_beam.metrics import Metrics

from beam_jobs import progress, records_io, schema, spill, split_protocols

# Where a record comes from: the private users, a public or an evaluation source.
_PRIVATE_SOURCE, _PUBLIC_SOURCE, _EVALUATION_SOURCE = "private", "public", "evaluation"

SUMMARY_FILE = "split_summary.json"
MODE_CHECK_FILE = "split_mode_check.json"
# Summary key: {distinct identities a training user holds: users holding that many}, the
# partition's `identities_per_user` known at the split, so a local head too small for
# them stops the run before dedup and pretraining (tff_algorithms.jobs.local_heads).
TRAIN_IDENTITIES_PER_USER = "train_identities_per_user"
METRICS_NAMESPACE = "dp_fedemb.split"
# Drop reason of evaluation sources' records of identities no training user holds.
EVALUATION_UNSEEN_IDENTITY = "evaluation_unseen_identity"


def _record_splits(
    user_id: str, serialized_records: Iterable[bytes], config: split_protocols.SplitConfig
):
    """(split, record) of one private user's records, before any drop. Here rather than in
    `split_protocols`: it parses the records (`schema`, which imports TensorFlow)."""
    if config.mode == split_protocols.HELD_OUT_IMAGES:
        split = split_protocols.user_split(user_id, config)
        return [(split, s) for s in serialized_records]
    public_user = (
        config.mode == split_protocols.IDENTITY
        and split_protocols.user_split(user_id, config) == split_protocols.PUBLIC
    )
    assigned = []
    for serialized in serialized_records:
        split = split_protocols.identity_split(schema.parse(serialized).identity, config)
        if public_user and split == split_protocols.TRAIN:
            split = split_protocols.PUBLIC
        assigned.append((split, serialized))
    return assigned


def _assign_user(
    user_records: tuple[tuple[str, str], Iterable[bytes]], config: split_protocols.SplitConfig
):
    (source, user_id), serialized_records = user_records
    if source != _PRIVATE_SOURCE:
        public = source == _PUBLIC_SOURCE
        for serialized in serialized_records:
            record = schema.parse(serialized)
            renamed = dataclasses.replace(
                record,
                user_id=(
                    split_protocols.PUBLIC_SOURCE_PREFIX
                    if public
                    else split_protocols.EVALUATION_SOURCE_PREFIX
                )
                + record.user_id,
                identity=split_protocols.PUBLIC_SOURCE_PREFIX + record.identity
                if public
                else record.identity,
            )
            yield beam.pvalue.TaggedOutput(
                split_protocols.PUBLIC if public else split_protocols.TEST,
                schema.serialize(renamed),
            )
        return
    assigned = _record_splits(user_id, serialized_records, config)
    yield beam.pvalue.TaggedOutput("input", len(assigned))
    if config.mode != split_protocols.IDENTITY_AND_USER:
        for split, serialized in assigned:
            yield beam.pvalue.TaggedOutput(split, serialized)
        return
    user_split_ = next(
        s for s in split_protocols.SPLIT_PRIORITY if any(s == split for split, _ in assigned)
    )
    dropped = sum(split != user_split_ for split, _ in assigned)
    if dropped:
        Metrics.counter(METRICS_NAMESPACE, "dropped_cross_split").inc(dropped)
        yield beam.pvalue.TaggedOutput("dropped", ("cross_split", dropped))
    for split, serialized in assigned:
        if split == user_split_:
            yield beam.pvalue.TaggedOutput(split, serialized)


def _seen_in_training(item, split: str):
    """Evaluation records of an identity training holds too; the rest counted as dropped
    (mode held_out_images)."""
    _, grouped = item
    records = list(grouped["records"])
    if grouped["train"]:
        for serialized in records:
            yield beam.pvalue.TaggedOutput(split, serialized)
        return
    # Counted apart: evaluation sources' records are no private records to guard.
    evaluation = sum(
        schema.parse(s).user_id.startswith(split_protocols.EVALUATION_SOURCE_PREFIX)
        for s in records
    )
    for reason, count in (
        ("unseen_identity", len(records) - evaluation),
        (EVALUATION_UNSEEN_IDENTITY, evaluation),
    ):
        if count:
            Metrics.counter(METRICS_NAMESPACE, f"dropped_{reason}").inc(count)
            yield beam.pvalue.TaggedOutput("dropped", (reason, count))


def _user_and_identity(serialized: bytes) -> tuple[str, str]:
    record = schema.parse(serialized)
    return record.user_id, record.identity


def _split_summary(
    counts: dict[tuple[str, str], int],
    dropped: dict[str, int],
    identities_per_user: dict[str, int],
    config: split_protocols.SplitConfig,
) -> dict:
    private_dropped = {r: n for r, n in dropped.items() if r != EVALUATION_UNSEEN_IDENTITY}
    return {
        "config": dataclasses.asdict(config),
        "mode": config.mode,
        "input_records": counts.get(("input", "records"), 0),
        "records": {s: counts.get((s, "records"), 0) for s in config.splits},
        "users": {s: counts.get((s, "users"), 0) for s in config.splits},
        "identities": {s: counts.get((s, "identities"), 0) for s in config.splits},
        # Private records only: what the drop guard compares with input_records.
        "dropped_records": sum(private_dropped.values()),
        "dropped_by_reason": dropped,
        "dropped_cross_split_records": dropped.get("cross_split", 0),
        TRAIN_IDENTITIES_PER_USER: dict(
            sorted(identities_per_user.items(), key=lambda kv: int(kv[0]))
        ),
    }


def _spilled_records(grouped: tuple) -> int:
    """How many records a user's spill references (spill.SpillByKey) point to."""
    return sum(spill.records_referenced(reference) for reference in grouped[1])


class SplitRecords(beam.PTransform):
    """Serialized canonical records -> {split name: records, "summary": one dict}, by
    `config.mode` (not auto: `run_split` resolves it first).

    The input is the private sources' records, or with `config.public_inputs` or
    `config.evaluation_inputs` a dict {"records": private sources' records,
    "public_records": public sources' records, "evaluation_records": evaluation sources'},
    holding the keys the config names.

    Records cross the groupings by user and identity as spill files under `spill_dir`
    (`spill.SpillByKey`; default `spill.folder`), removed once the summary is made.
    `records`: how many records come in, when the caller knows it: the progress line's
    total.
    """

    def __init__(
        self,
        config: split_protocols.SplitConfig,
        spill_dir: str | None = None,
        records: int | None = None,
    ):
        super().__init__()
        if config.mode not in split_protocols.MODES:
            raise ValueError(
                f"SplitRecords needs a mode of {split_protocols.MODES}, got {config.mode!r}"
            )
        self._config = config
        self._spill_dir = spill_dir
        self._records = records

    def expand(self, inputs):
        config = self._config
        spill_dir = spill.folder(self._spill_dir)
        expected = {"records"}
        expected |= {"public_records"} if config.public_inputs else set()
        expected |= {"evaluation_records"} if config.evaluation_inputs else set()
        given = set(inputs) if isinstance(inputs, dict) else {"records"}
        if given != expected or (len(expected) > 1) != isinstance(inputs, dict):
            raise ValueError(
                f"SplitRecords takes {sorted(expected)} for this config (public_inputs, "
                "evaluation_inputs), as a dict when more than the records"
            )
        sources = [(_PRIVATE_SOURCE, inputs["records"] if isinstance(inputs, dict) else inputs)]
        if config.public_inputs:
            sources.append((_PUBLIC_SOURCE, inputs["public_records"]))
        if config.evaluation_inputs:
            sources.append((_EVALUATION_SOURCE, inputs["evaluation_records"]))
        keyed = [
            records
            | f"KeyByUser{'' if source == _PRIVATE_SOURCE else source.title()}"
            >> beam.Map(lambda s, source=source: ((source, schema.parse(s).user_id), s))
            for source, records in sources
        ]
        assigned = (
            keyed
            | "FlattenSources" >> beam.Flatten()
            | "SpillByUser" >> spill.SpillByKey(spill_dir)
            | "GroupByUser" >> beam.GroupByKey()
            | "Progress"
            >> progress.Progress(
                "split", "records assigned", total=self._records, weight=_spilled_records
            )
            | "AssignUsers"
            >> beam.ParDo(spill.WithSpilledRecords(spill_dir, _assign_user, config)).with_outputs(
                "dropped", "input", *config.splits
            )
        )
        outputs = {split: assigned[split] for split in config.splits}
        dropped = [assigned["dropped"]]
        if config.mode == split_protocols.HELD_OUT_IMAGES:
            trained = (
                outputs[split_protocols.TRAIN]
                | "TrainIdentities" >> beam.Map(lambda s: schema.parse(s).identity)
                | "DistinctTrainIdentities" >> beam.Distinct()
                | "KeyTrainIdentities" >> beam.Map(lambda identity: (identity, True))
            )
            for split in split_protocols.EVALUATION_SPLITS:
                seen = (
                    {
                        "records": outputs[split]
                        | f"Key{split}ByIdentity"
                        >> beam.Map(lambda s: (schema.parse(s).identity, s))
                        | f"Spill{split}ByIdentity" >> spill.SpillByKey(spill_dir),
                        "train": trained,
                    }
                    | f"Join{split}Train" >> beam.CoGroupByKey()
                    | f"Seen{split}"
                    >> beam.ParDo(
                        spill.WithSpilledRecords(
                            spill_dir, _seen_in_training, split, fields=("records",)
                        )
                    ).with_outputs("dropped", split)
                )
                outputs[split] = seen[split]
                dropped.append(seen["dropped"])
        counts = [
            assigned["input"]
            | "SumInput" >> beam.CombineGlobally(sum)
            | "KeyInput" >> beam.Map(lambda n: (("input", "records"), n))
        ]
        for split in config.splits:
            parsed = outputs[split] | f"Parse{split}" >> beam.Map(schema.parse)
            counts.append(
                outputs[split]
                | f"Count{split}Records" >> beam.combiners.Count.Globally()
                | f"Key{split}Records" >> beam.Map(lambda n, s=split: ((s, "records"), n))
            )
            for field in ("users", "identities"):
                attribute = "user_id" if field == "users" else "identity"
                counts.append(
                    parsed
                    | f"{split}{field}" >> beam.Map(lambda r, a=attribute: getattr(r, a))
                    | f"Distinct{split}{field}" >> beam.Distinct()
                    | f"Count{split}{field}" >> beam.combiners.Count.Globally()
                    | f"Key{split}{field}" >> beam.Map(lambda n, s=split, f=field: ((s, f), n))
                )
        dropped_by_reason = (
            dropped
            | "AllDropped" >> beam.Flatten()
            | "SumDroppedPerReason" >> beam.CombinePerKey(sum)
            | "DroppedDict" >> beam.combiners.ToDict()
        )
        identities_per_user = (
            outputs[split_protocols.TRAIN]
            | "TrainUserIdentity" >> beam.Map(_user_and_identity)
            | "DistinctTrainUserIdentity" >> beam.Distinct()
            | "TrainUsers" >> beam.Keys()
            | "IdentitiesPerTrainUser" >> beam.combiners.Count.PerElement()
            | "KeyByIdentityCount" >> beam.Map(lambda user_count: (str(user_count[1]), 1))
            | "UsersPerIdentityCount" >> beam.CombinePerKey(sum)
            | "IdentitiesPerUserDict" >> beam.combiners.ToDict()
        )
        summary = (
            counts
            | "AllCounts" >> beam.Flatten()
            | "CountsDict" >> beam.combiners.ToDict()
            | "Summary"
            >> beam.Map(
                _split_summary,
                dropped=beam.pvalue.AsSingleton(dropped_by_reason),
                identities_per_user=beam.pvalue.AsSingleton(identities_per_user),
                config=config,
            )
            # Made from every split's count: every spilled record has been read back.
            | "RemoveSpill" >> beam.Map(spill.removed_then, spill_dir)
        )
        return {**outputs, "summary": summary}


def _shared_identities(records) -> beam.PCollection:
    """Records -> one dict: identities, and identities held by more than one user."""
    per_identity = (
        records
        | "IdentityUser" >> beam.Map(lambda s: (lambda r: (r.identity, r.user_id))(schema.parse(s)))
        | "DistinctHoldings" >> beam.Distinct()
        | "Identities" >> beam.Keys()
        | "HoldersPerIdentity" >> beam.combiners.Count.PerElement()
    )
    return (
        per_identity
        | "Holders" >> beam.Values()
        | "SharedOrNot" >> beam.Map(lambda holders: ("shared" if holders > 1 else "own", 1))
        | "CountKinds" >> beam.CombinePerKey(sum)
        | "KindsDict" >> beam.combiners.ToDict()
    )


def _refuse_auto(
    input_dir: str, out_dir: str, config: split_protocols.SplitConfig, kinds: dict, beam_args
) -> None:
    """Mode auto on records where some identity is held by two users: SplitRefused naming
    the modes and the records each would keep (counted by a second pass, only then; the
    counts are left in OUT_DIR/MODE_CHECK_FILE with the identities)."""
    check_path = os.path.join(out_dir, MODE_CHECK_FILE)
    with beam.Pipeline(options=records_io.pipeline_options(beam_args)) as pipeline:
        records = pipeline | "Read" >> records_io.ReadRecords(input_dir)
        summaries = [
            records
            | f"Split{mode}"
            >> SplitRecords(
                dataclasses.replace(config, mode=mode, public_inputs=False),
                os.path.join(out_dir, f"{mode}.{spill.SPILL_DIR}"),
            )
            for mode in split_protocols.MODES
        ]
        _ = (
            [split["summary"] for split in summaries]
            | "Summaries" >> beam.Flatten()
            | "SummaryList" >> beam.combiners.ToList()
            | "ByMode"
            >> beam.Map(
                lambda ss: {
                    "identities": kinds,
                    "kept_records": {
                        s["mode"]: s["input_records"] - s["dropped_records"] for s in ss
                    },
                    "input_records": max(s["input_records"] for s in ss),
                }
            )
            | "WriteCounts" >> records_io.WriteJson(check_path)
        )
    check = records_io.read_json(check_path)
    total = check["input_records"]
    choices = "; ".join(
        f"{mode} keeps {check['kept_records'][mode]:,} of {total:,} records "
        f"({check['kept_records'][mode] / max(total, 1):.0%}), evaluating "
        f"{split_protocols.PROTOCOLS[mode].evaluation}"
        for mode in split_protocols.MODES
    )
    shared = kinds["shared"]
    raise split_protocols.SplitRefused(
        f"split.mode auto: {shared:,} of {shared + kinds.get('own', 0):,} identities are held "
        f"by more than one user, so the evaluation protocol is yours to choose: set "
        f"split.mode (dp-fedemb data split --mode) to one of: {choices}"
    )


def _refuse_drops(summary: dict, config: split_protocols.SplitConfig) -> None:
    total, dropped = summary["input_records"], summary["dropped_records"]
    if dropped > config.max_dropped_fraction * total:
        fraction = dropped / total
        enough = math.ceil(fraction * 20 + 1e-9) / 20  # the next multiple of 0.05 above it
        reasons = ", ".join(
            f"{n:,} {r.replace('_', ' ')}" for r, n in summary["dropped_by_reason"].items()
        )
        others = [m for m in split_protocols.MODES if m != config.mode]
        raise split_protocols.SplitRefused(
            f"split mode {config.mode} would drop {dropped:,} of {total:,} private records "
            f"({fraction:.1%}: {reasons}), over split.max_dropped_fraction "
            f"{config.max_dropped_fraction:g}; if users share identities set split.mode to "
            f"{' or '.join(others)} (dp-fedemb data split --mode, dp-fedemb train "
            f"--split-mode), or accept the loss with "
            f"split.max_dropped_fraction={enough:g} (--max-dropped-fraction {enough:g})"
        )


def run_split(
    input_dir: str,
    out_dir: str,
    config: split_protocols.SplitConfig,
    beam_args=None,
    public_input_dir: str | None = None,
    evaluation_input_dir: str | None = None,
) -> dict:
    """Reads IN/records-* (and PUBLIC_IN/records-*, EVALUATION_IN/records-*), writes
    OUT/<split>/records-* and OUT/split_summary.json. `public_input_dir` is given exactly
    when `config.public_inputs` is set, `evaluation_input_dir` when
    `config.evaluation_inputs` is. Mode auto splits as identity_and_user and checks in the
    same pass that no identity is held by two users; if one is, the split is removed and
    SplitRefused names the modes and what each keeps (`_refuse_auto`). A split dropping
    more than `config.max_dropped_fraction` of the private records raises SplitRefused with
    its records removed and its summary kept."""
    if config.public_inputs != (public_input_dir is not None):
        raise ValueError(
            "run_split needs public_input_dir exactly when config.public_inputs is set"
        )
    if config.evaluation_inputs != (evaluation_input_dir is not None):
        raise ValueError(
            "run_split needs evaluation_input_dir exactly when config.evaluation_inputs is set"
        )
    requested = config.mode
    check_path = os.path.join(out_dir, MODE_CHECK_FILE)
    if requested == split_protocols.AUTO:
        # Split as identity_and_user, what auto stands for when no identity is held by
        # two users, and check that in the same pass; the split is removed otherwise.
        config = dataclasses.replace(config, mode=split_protocols.IDENTITY_AND_USER)
    summary_path = os.path.join(out_dir, SUMMARY_FILE)
    with beam.Pipeline(options=records_io.pipeline_options(beam_args)) as pipeline:
        records = pipeline | "Read" >> records_io.ReadRecords(input_dir)
        if requested == split_protocols.AUTO:
            _ = (
                _shared_identities(records)
                | "Check" >> beam.Map(lambda kinds: {"identities": kinds})
                | "WriteCheck" >> records_io.WriteJson(check_path)
            )
        others = {"public_records": public_input_dir, "evaluation_records": evaluation_input_dir}
        if any(others.values()):
            records = {"records": records} | {
                name: pipeline | f"Read{name}" >> records_io.ReadRecords(directory)
                for name, directory in others.items()
                if directory is not None
            }
        # Counted first (a pass over the record framing): the progress line's total.
        total = sum(
            records_io.count_records(directory)
            for directory in (input_dir, public_input_dir, evaluation_input_dir)
            if directory is not None
        )
        split = records | "Split" >> SplitRecords(
            config, os.path.join(out_dir, spill.SPILL_DIR), total
        )
        for name in config.splits:
            _ = split[name] | f"Write{name}" >> records_io.WriteRecords(os.path.join(out_dir, name))
        _ = (
            split["summary"]
            | "Requested" >> beam.Map(lambda s: {**s, "requested_mode": requested})
            | "WriteSummary" >> records_io.WriteJson(summary_path)
        )
    if requested == split_protocols.AUTO:
        kinds = records_io.read_json(check_path)["identities"]
        if kinds.get("shared", 0):
            # Nothing of the provisional split stays: no records, summary or split folder.
            for name in config.splits:
                folder = os.path.join(out_dir, name)
                records_io.remove_records(folder)
                if tf.io.gfile.isdir(folder) and not tf.io.gfile.listdir(folder):
                    tf.io.gfile.rmtree(folder)
            tf.io.gfile.remove(summary_path)
            _refuse_auto(input_dir, out_dir, config, kinds, beam_args)
    summary = records_io.read_json(summary_path)
    try:
        _refuse_drops(summary, config)
    except split_protocols.SplitRefused:
        # Nothing downstream may train on a split that stopped; the summary stays.
        for name in config.splits:
            records_io.remove_records(os.path.join(out_dir, name))
        raise
    return summary
