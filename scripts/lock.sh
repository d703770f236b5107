#!/usr/bin/env bash
# Re-resolves requirements/lock.txt from the .in files and the overrides (docs/design.md section 1).
set -euo pipefail
cd "$(dirname "$0")/.."
UV="$(command -v uv || echo .cache/uv-bootstrap/bin/uv)"
[ -x "$UV" ] || { bash scripts/setup_env.sh; UV="$(command -v uv || echo .cache/uv-bootstrap/bin/uv)"; }
UV_PYTHON_DOWNLOADS=never "$UV" pip compile requirements/base.in requirements/dev.in \
  --override requirements/overrides.txt \
  --python .venv/bin/python --python-platform x86_64-manylinux_2_31 \
  --generate-hashes --quiet -o requirements/lock.txt
