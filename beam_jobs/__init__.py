"""Beam side of dp-fedemb: ingest, synthetic data, partitioning, dedup, evaluation."""
