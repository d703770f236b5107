#!/usr/bin/env bash
# Resolves requirements/airflow-lock.txt: the base lock plus Apache Airflow (airflow.in).
# Every package of requirements/lock.txt is a constraint, except the few below that
# Airflow 2.7.0 cannot share with it; the TF/TFF/TFX/Beam stack stays as in the base lock.
set -euo pipefail
cd "$(dirname "$0")/.."
UV="$(command -v uv || echo .cache/uv-bootstrap/bin/uv)"
[ -x "$UV" ] || { bash scripts/setup_env.sh; UV="$(command -v uv || echo .cache/uv-bootstrap/bin/uv)"; }
# Released from the base pins: Airflow 2.7.0 pins opentelemetry-api 1.15 (so the
# opentelemetry SDK and the Beam GCP clients that need a newer one move back), needs
# werkzeug<2.3 through connexion 2, and sqlalchemy>=1.4.24 (airflow-overrides.txt).
RELEASED="sqlalchemy werkzeug opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions google-cloud-pubsub google-cloud-spanner"
mkdir -p .cache
constraints=.cache/airflow-constraints.txt
# One requirement a line (hashes dropped): the base lock less the released packages.
awk -v released="$RELEASED" '
  BEGIN { n = split(released, r, " "); for (i = 1; i <= n; i++) skip[r[i]] = 1 }
  /^[A-Za-z0-9]/ { name = tolower($1); sub(/==.*/, "", name); gsub(/_/, "-", name);
                   sub(/\[.*\]/, "", name); if (!(name in skip)) { sub(/ *\\$/, "", $1); print $1 } }
' requirements/lock.txt > "$constraints"
UV_PYTHON_DOWNLOADS=never "$UV" pip compile requirements/base.in requirements/dev.in requirements/airflow.in \
  --override requirements/overrides.txt --override requirements/airflow-overrides.txt \
  --constraint "$constraints" \
  --python .venv/bin/python --python-platform x86_64-manylinux_2_31 \
  --generate-hashes --quiet -o requirements/airflow-lock.txt
