#!/usr/bin/env bash
# Creates .venv with Python 3.10 and installs exactly requirements/lock.txt with uv,
# then the project in editable mode. Quick no-op when nothing changed.
# Every installed module is compiled to bytecode at install time: uv does not compile by
# default, and where PYTHONDONTWRITEBYTECODE is set (CI machines, containers) no .pyc is
# ever written, so each process would compile TensorFlow, TFF, Beam and TFX from source
# again (about 30 s of CPU a process on 2 cores: every `dp-fedemb` a test starts).
# SETUP_VENV and SETUP_LOCK name another environment and lock (`make airflow-setup`:
# .venv-airflow from requirements/airflow-lock.txt).
set -euo pipefail
cd "$(dirname "$0")/.."

UV_VERSION=0.13.9
export UV_PYTHON_DOWNLOADS=never   # never fetch a Python build: use the machine's 3.10

die() { echo "setup: $*" >&2; exit 1; }

works_as_310() {
  [ -n "$1" ] && "$1" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 10))' >/dev/null 2>&1
}

find_python() {
  if [ -n "${PYTHON:-}" ]; then
    works_as_310 "$PYTHON" || die "PYTHON=$PYTHON is not a working Python 3.10"
    echo "$PYTHON"; return
  fi
  local candidate
  for candidate in "$(command -v python3.10 || true)" \
      "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.10*/bin/python3.10 \
      /usr/bin/python3.10 /usr/local/bin/python3.10; do
    if works_as_310 "$candidate"; then echo "$candidate"; return; fi
  done
  die "Python 3.10 not found: install it (e.g. 'pyenv install 3.10' or 'apt-get install python3.10') or set PYTHON=/path/to/python3.10"
}

find_uv() {
  if command -v uv >/dev/null 2>&1; then command -v uv; return; fi
  local boot=.cache/uv-bootstrap
  if [ ! -x "$boot/bin/uv" ]; then
    echo "setup: installing uv $UV_VERSION into $boot" >&2
    "$1" -m venv "$boot" >&2 || die "could not create $boot with $1"
    "$boot/bin/python" -m pip install -q "uv==$UV_VERSION" >&2 || die "could not install uv from the package index"
  fi
  echo "$boot/bin/uv"
}

VENV="${SETUP_VENV:-.venv}"
LOCK="${SETUP_LOCK:-requirements/lock.txt}"
[ -f "$LOCK" ] || die "no lock file $LOCK"
PY="$(find_python)"
UV="$(find_uv "$PY")"

if ! works_as_310 "$VENV"/bin/python; then
  rm -rf "$VENV"
  "$UV" venv --quiet --python "$PY" "$VENV"
fi

stamp="$VENV"/.dp-fedemb-installed
# This script is in the stamp: a change to how it installs re-installs.
want="$(cat "$LOCK" setup.py scripts/setup_env.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
  exit 0
fi
echo "setup: installing the locked environment into $VENV" >&2
"$UV" pip sync --quiet --compile-bytecode --python "$VENV"/bin/python "$LOCK"
"$UV" pip install --quiet --python "$VENV"/bin/python --no-deps --no-build-isolation -e .
echo "$want" > "$stamp"
