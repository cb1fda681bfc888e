#!/usr/bin/env bash
# Bootstraps everything `make serve` and `make test` need, idempotently:
#   .venv (Python 3.11) with the pinned requirements and backend_src/ (package paged_llm) installed,
#   libb64 for perf_analyzer, a Triton backend directory (python backend + the stub for .venv's Python),
#   and the built-in tiny model.
# A second run only checks stamps and returns in about a second.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$ROOT/.venv"
BUILD="$ROOT/.build"
mkdir -p "$BUILD"

log() { printf '[setup] %s\n' "$*" >&2; }

find_python() {
  for candidate in "${PYTHON:-}" python3.11 python3; do
    [ -n "$candidate" ] || continue
    if command -v "$candidate" >/dev/null 2>&1 &&
      "$candidate" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' 2>/dev/null; then
      command -v "$candidate"
      return 0
    fi
  done
  return 1
}

# 1. The virtual environment and the pinned dependencies (re-installed only when the pins change).
if [ ! -x "$VENV/bin/python" ]; then
  PY="$(find_python)" || { log "Python 3.11 not found (set PYTHON=/path/to/python3.11)"; exit 1; }
  log "creating $VENV with $PY"
  "$PY" -m venv "$VENV"
fi
deps_hash="$(cat requirements.txt backend_src/pyproject.toml | sha256sum | cut -c1-16)"
deps_stamp="$VENV/.paged_llm-deps-$deps_hash"
if [ ! -f "$deps_stamp" ]; then
  log "installing pinned dependencies (first run takes a few minutes)"
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check -r requirements.txt
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e backend_src
  rm -f "$VENV"/.paged_llm-deps-*
  touch "$deps_stamp"
fi

# 2. libb64 (perf_analyzer links libb64.so.0d): Debian's libb64-0d when it is missing.
if ! ldconfig -p 2>/dev/null | grep -q 'libb64\.so\.0d'; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    log "installing Debian's libb64-0d"
    (apt-get install -y -q libb64-0d >/dev/null 2>&1 ||
      { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q libb64-0d >/dev/null 2>&1; }) ||
      log "apt-get could not install libb64-0d; perf_analyzer will use the copy bundled with nvidia-pytriton"
  else
    log "libb64-0d missing and apt-get unavailable; perf_analyzer will use the copy bundled with nvidia-pytriton"
  fi
fi

# 3. The Triton backend directory, libraries for perf_analyzer, and the tiny model, all done in Python
#    (paged_llm.launcher.launch knows the layout of the nvidia-pytriton wheel).
"$VENV/bin/python" -m paged_llm.launcher.launch prepare
