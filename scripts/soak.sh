#!/usr/bin/env bash
# Soak test (see scripts/soak.py): perf_analyzer --streaming at concurrency 16 against a real
# tritonserver on the built-in tiny model; reports failed requests, RSS growth, KV usage afterwards.
#   scripts/soak.sh                 # 10 minutes (by hand)
#   scripts/soak.sh --duration 20   # the short version CI runs
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup.sh" >/dev/null
exec "$ROOT/.venv/bin/python" "$ROOT/scripts/soak.py" "$@"
