#!/usr/bin/env bash
# The whole test suite against real services. Called by `make test` (and so by .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1
export OOLONG_CACHE=${OOLONG_CACHE:-$PWD/.cache/oolong}
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
export CELERY_BROKER_URL=${CELERY_BROKER_URL:-redis://127.0.0.1:6379/0}
export PREFECT_HOME=${PREFECT_HOME:-$PWD/.cache/prefect}
# reasoning-gym imports matplotlib, which builds its font cache on first import by running
# fc-list: a process, which unit tests refuse. Built here, once, before any test runs.
export MPLCONFIGDIR=${MPLCONFIGDIR:-$PWD/.cache/matplotlib}
bash scripts/services.sh up
# At the end, the jails' image tmpfs under this checkout's cache is unmounted too
# (training_core/jail/runtime.py: a root caller's outlives the run and holds memory); each pytest
# session releases those under its own temporary directory (tests/conftest.py).
release_jail_images() {
  if [ "$(id -u)" = 0 ] && [ -x .venv/bin/python ]; then
    .venv/bin/python -c 'import os, sys; from pathlib import Path
from training_core.jail.runtime import release_images
for p in release_images(Path(os.environ["OOLONG_CACHE"])): print("released", p, file=sys.stderr)' || true
  fi
}
trap 'release_jail_images; bash scripts/services.sh down' EXIT
# checkov lives in its own tool environment: it installs an `hcl2` module that conflicts with
# python-hcl2 in the project's venv.
CHECKOV_ENV=.cache/tools/checkov
if [ ! -x "$CHECKOV_ENV/bin/checkov" ]; then
  echo "installing checkov into $CHECKOV_ENV"
  python3.11 -m venv "$CHECKOV_ENV"
  "$CHECKOV_ENV/bin/pip" install -q --disable-pip-version-check -c constraints.txt checkov
fi
mkdir -p test-artifacts
# SGLang's pinned wheel, unpacked (never installed): the oracle the contract and parity tests read
# and partly execute (tests/training_core/sglang_oracle.py). Fetched once per version.
SGLANG_PIN=$(sed -n 's/^sglang==\([^ ]*\).*/\1/p' constraints-sglang.txt)
SGLANG_SRC=.cache/sglang/$SGLANG_PIN
if [ ! -d "$SGLANG_SRC/sglang" ]; then
  echo "fetching the SGLang $SGLANG_PIN wheel (the protocol oracle; nothing of it is installed)"
  rm -rf "$SGLANG_SRC.tmp" && mkdir -p "$SGLANG_SRC.tmp/whl"
  .venv/bin/pip download -q --no-deps --only-binary=:all: --python-version 3.11 \
    --platform manylinux_2_34_x86_64 "sglang==$SGLANG_PIN" -d "$SGLANG_SRC.tmp/whl"
  .venv/bin/python -m zipfile -e "$SGLANG_SRC.tmp"/whl/*.whl "$SGLANG_SRC.tmp"
  rm -rf "$SGLANG_SRC.tmp/whl" && mv "$SGLANG_SRC.tmp" "$SGLANG_SRC"
fi
export OOLONG_SGLANG_SOURCE=${OOLONG_SGLANG_SOURCE:-$PWD/$SGLANG_SRC}
export OOLONG_REQUIRE_SGLANG_SOURCE=1  # the contract tests fail, not skip, without it
.venv/bin/python -c "import matplotlib.font_manager"
# The engine's CPU kernels, built once for this machine before any server starts (cpu_kernels.py).
.venv/bin/python -m training_core.rollout_server.cpu_kernels
# The shape the code must keep: lint, then the architecture contracts in pyproject.toml
# (training_core imports nothing of ours, the web app never imports workers, layers per app).
echo "lint: ruff check, lint-imports"
.venv/bin/ruff check .
.venv/bin/lint-imports --no-cache
if [ "$#" -gt 0 ] || [ "${OOLONG_TEST_LANES:-2}" = 1 ]; then
  set +e
  .venv/bin/python -m pytest -p no:cacheprovider "$@"
  rc=$?
  set -e
  if [ "$rc" = 5 ]; then echo "no tests were collected" >&2; exit 1; fi
  exit $rc
fi

# The whole suite in two lanes at once, each with its own database, Redis index, Prefect home and
# temporary directory, so they share nothing but the CPU: the platform lane (the web app and the
# integration tests: Celery, Prefect, multinode; they find a run's processes by its id, so they
# stay in one lane) and the engine lane (models, servers, trainers, jails, security, the rest).
# Much of the platform lane is waiting on processes and I/O. OOLONG_TEST_LANES=1: one lane.
# OOLONG_TEST_DURATIONS=N: each lane lists its N slowest tests (25; 0: every test).
lane() {  # lane NAME DATABASE_URL BROKER_URL TEST_REDIS_URL PYTEST_ARGS...
  local name=$1 db=$2 broker=$3 redis=$4
  shift 4
  DATABASE_URL=$db CELERY_BROKER_URL=$broker OOLONG_TEST_REDIS=$redis \
  PREFECT_HOME=$PWD/.cache/prefect-$name \
    .venv/bin/python -m pytest -p no:cacheprovider --durations=${OOLONG_TEST_DURATIONS:-25} --basetemp="/tmp/oolong-tests-$name" "$@" \
    > "test-artifacts/lane-$name.log" 2>&1
}
PLATFORM=(tests/webapp tests/integration)
echo "tests: two lanes (platform: ${PLATFORM[*]}; engine: the rest); logs in test-artifacts/lane-*.log"
set +e
lane engine "${DATABASE_URL%/*}/oolong_engine" "${CELERY_BROKER_URL%/*}/3" \
  "${CELERY_BROKER_URL%/*}/4" tests "${PLATFORM[@]/#/--ignore=}" &
engine=$!
lane platform "$DATABASE_URL" "$CELERY_BROKER_URL" "${OOLONG_TEST_REDIS:-${CELERY_BROKER_URL%/*}/1}" \
  "${PLATFORM[@]}" &
platform=$!
wait $engine; engine_rc=$?
wait $platform; platform_rc=$?
set -e
for name in engine platform; do
  echo; echo "======================== lane: $name ========================"
  cat "test-artifacts/lane-$name.log"
done
echo
echo "lanes: engine exit $engine_rc, platform exit $platform_rc"
for rc in $engine_rc $platform_rc; do
  if [ "$rc" = 5 ]; then echo "a lane collected no tests" >&2; exit 1; fi
  if [ "$rc" != 0 ]; then exit "$rc"; fi
done
