#!/usr/bin/env bash
# The whole test suite against real services. Called by `make test` (and so by .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1 TOKENIZERS_PARALLELISM=false DS_ACCELERATOR=cpu HF_HUB_OFFLINE=1
export OOLONG_CACHE=${OOLONG_CACHE:-$PWD/.cache/oolong}
export DATABASE_URL=${DATABASE_URL:-postgres://postgres@127.0.0.1:5432/postgres}
export CELERY_BROKER_URL=${CELERY_BROKER_URL:-redis://127.0.0.1:6379/0}
export PREFECT_HOME=${PREFECT_HOME:-$PWD/.cache/prefect}
bash scripts/services.sh up
trap 'bash scripts/services.sh down' EXIT
# checkov lives in its own tool environment: it installs an `hcl2` module that conflicts with
# python-hcl2 in the project's venv.
CHECKOV_ENV=.cache/tools/checkov
if [ ! -x "$CHECKOV_ENV/bin/checkov" ]; then
  echo "installing checkov into $CHECKOV_ENV"
  python3.11 -m venv "$CHECKOV_ENV"
  "$CHECKOV_ENV/bin/pip" install -q --disable-pip-version-check -c constraints.txt checkov
fi
mkdir -p test-artifacts
# The shape the code must keep: lint, then the architecture contracts in pyproject.toml
# (training_core imports nothing of ours, the web app never imports workers, layers per app).
echo "lint: ruff check, lint-imports"
.venv/bin/ruff check .
.venv/bin/lint-imports --no-cache
set +e
.venv/bin/python -m pytest -p no:cacheprovider "$@"
rc=$?
set -e
if [ "$rc" = 5 ]; then echo "no tests were collected" >&2; exit 1; fi
exit $rc
