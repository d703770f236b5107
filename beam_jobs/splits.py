"""Splits by identity and user (DESIGN.md section 3), streamed and deterministic.

Each identity goes to a split by a keyed hash of (seed, identity), so the assignment
needs no global state and is the same on every worker and run. A user goes to the most
protected split among their identities' splits (test, then validation, then train, then
public), and keeps only the records whose identity is in that split; the rest are
dropped and counted. Hence evaluation identities and their users never appear in
training, no user is in two splits, and no identity is in two splits. The optional public
split (for non-private pretraining) ranks last, so a user holding any private identity
never lands in it.

Public data usually comes from elsewhere (the paper pretrains on ImageNet, a different
domain from the private users' faces): records from separate public sources go whole to
the public split, grouped apart from the private sources' users, so a public record
never moves a private user and a private record never becomes public. Their user and
identity names get the prefix `PUBLIC_SOURCE_PREFIX`: names from separate sources are
unrelated, and unprefixed they could collide with private ones (which dedup, rightly,
refuses as a split that is not disjoint).
"""

import dataclasses
import hashlib
import os
from collections.abc import Iterable

import apache_beam as beam
from apache_beam.metrics import Metrics

from beam_jobs import records_io, schema

TRAIN = "train"
VALIDATION = "validation"
TEST = "test"
PUBLIC = "public"
# Most protected first: a user with identities in several splits goes to the first.
SPLIT_PRIORITY = (TEST, VALIDATION, TRAIN, PUBLIC)
EVALUATION_SPLITS = (VALIDATION, TEST)
# Names of records from separate public sources, in the public split.
PUBLIC_SOURCE_PREFIX = "public:"

SUMMARY_FILE = "split_summary.json"
METRICS_NAMESPACE = "dp_fedemb.split"


@dataclasses.dataclass(frozen=True)
class SplitConfig:
    """Fractions of identities per split; train takes the rest.

    public_inputs: records from separate public sources are given too (they all go
    to the public split, which then exists even when public_fraction is 0).
    """

    validation_fraction: float = 0.1
    test_fraction: float = 0.1
    public_fraction: float = 0.0
    seed: int = 0
    public_inputs: bool = False

    def __post_init__(self) -> None:
        fractions = (self.validation_fraction, self.test_fraction, self.public_fraction)
        if any(f < 0 for f in fractions) or sum(fractions) >= 1.0:
            raise ValueError(
                f"split fractions must be >= 0 and leave room for train, got {fractions}"
            )

    @property
    def splits(self) -> tuple[str, ...]:
        has_public = self.public_fraction > 0 or self.public_inputs
        present = {TRAIN, VALIDATION, TEST} | ({PUBLIC} if has_public else set())
        return tuple(s for s in SPLIT_PRIORITY if s in present)


def _unit_interval(seed: int, key: str) -> float:
    digest = hashlib.blake2b(f"{seed}\x00{key}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def identity_split(identity: str, config: SplitConfig) -> str:
    """The split of an identity: a pure function of (seed, identity)."""
    u = _unit_interval(config.seed, identity)
    for split, fraction in (
        (TEST, config.test_fraction),
        (VALIDATION, config.validation_fraction),
        (PUBLIC, config.public_fraction),
    ):
        if u < fraction:
            return split
        u -= fraction
    return TRAIN


def _assign_user(user_records: tuple[tuple[bool, str], Iterable[bytes]], config: SplitConfig):
    (from_public_source, user_id), serialized_records = user_records
    if from_public_source:
        for serialized in serialized_records:
            record = schema.parse(serialized)
            renamed = dataclasses.replace(
                record,
                user_id=PUBLIC_SOURCE_PREFIX + record.user_id,
                identity=PUBLIC_SOURCE_PREFIX + record.identity,
            )
            yield beam.pvalue.TaggedOutput(PUBLIC, schema.serialize(renamed))
        return
    by_split: dict[str, list[bytes]] = {}
    for serialized in serialized_records:
        split = identity_split(schema.parse(serialized).identity, config)
        by_split.setdefault(split, []).append(serialized)
    user_split = next(s for s in SPLIT_PRIORITY if s in by_split)
    for split, records in by_split.items():
        if split != user_split:
            Metrics.counter(METRICS_NAMESPACE, "dropped_cross_split").inc(len(records))
            yield beam.pvalue.TaggedOutput("dropped", (user_id, split, len(records)))
    for serialized in by_split[user_split]:
        yield beam.pvalue.TaggedOutput(user_split, serialized)


def _split_summary(counts: dict[tuple[str, str], int], dropped: int, config: SplitConfig) -> dict:
    return {
        "config": dataclasses.asdict(config),
        "records": {s: counts.get((s, "records"), 0) for s in config.splits},
        "users": {s: counts.get((s, "users"), 0) for s in config.splits},
        "identities": {s: counts.get((s, "identities"), 0) for s in config.splits},
        "dropped_cross_split_records": dropped,
    }


class SplitByIdentityAndUser(beam.PTransform):
    """Serialized canonical records -> {split name: records, "summary": one dict}.

    The input is the private sources' records, or with `config.public_inputs` a dict
    {"records": private sources' records, "public_records": public sources' records}.
    """

    def __init__(self, config: SplitConfig):
        super().__init__()
        self._config = config

    def expand(self, inputs):
        config = self._config
        if config.public_inputs != isinstance(inputs, dict):
            raise ValueError(
                "SplitByIdentityAndUser takes {'records', 'public_records'} exactly when "
                "config.public_inputs is set"
            )
        sources = [(False, inputs["records"] if config.public_inputs else inputs)]
        if config.public_inputs:
            sources.append((True, inputs["public_records"]))
        keyed = [
            records
            | f"KeyByUser{'Public' if public else ''}"
            >> beam.Map(lambda s, p=public: ((p, schema.parse(s).user_id), s))
            for public, records in sources
        ]
        assigned = (
            keyed
            | "FlattenSources" >> beam.Flatten()
            | "GroupByUser" >> beam.GroupByKey()
            | "AssignUsers"
            >> beam.FlatMap(_assign_user, config).with_outputs("dropped", *config.splits)
        )
        counts = []
        for split in config.splits:
            parsed = assigned[split] | f"Parse{split}" >> beam.Map(schema.parse)
            counts.append(
                assigned[split]
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
        dropped = (
            assigned["dropped"]
            | "DroppedCount" >> beam.Map(lambda item: item[2])
            | "SumDropped" >> beam.CombineGlobally(sum)
        )
        summary = (
            counts
            | "AllCounts" >> beam.Flatten()
            | "CountsDict" >> beam.combiners.ToDict()
            | "Summary"
            >> beam.Map(_split_summary, dropped=beam.pvalue.AsSingleton(dropped), config=config)
        )
        return {**{split: assigned[split] for split in config.splits}, "summary": summary}


def run_split(
    input_dir: str,
    out_dir: str,
    config: SplitConfig,
    beam_args=None,
    public_input_dir: str | None = None,
) -> dict:
    """Reads IN/records-* (and PUBLIC_IN/records-*), writes OUT/<split>/records-* and
    OUT/split_summary.json. `public_input_dir` is given exactly when
    `config.public_inputs` is set."""
    if config.public_inputs != (public_input_dir is not None):
        raise ValueError(
            "run_split needs public_input_dir exactly when config.public_inputs is set"
        )
    summary_path = os.path.join(out_dir, SUMMARY_FILE)
    with beam.Pipeline(options=records_io.pipeline_options(beam_args)) as pipeline:
        records = pipeline | "Read" >> records_io.ReadRecords(input_dir)
        if public_input_dir is not None:
            records = {
                "records": records,
                "public_records": pipeline
                | "ReadPublic" >> records_io.ReadRecords(public_input_dir),
            }
        split = records | "Split" >> SplitByIdentityAndUser(config)
        for name in config.splits:
            _ = split[name] | f"Write{name}" >> records_io.WriteRecords(os.path.join(out_dir, name))
        _ = split["summary"] | "WriteSummary" >> records_io.WriteJson(summary_path)
    return records_io.read_json(summary_path)
