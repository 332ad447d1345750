#!/usr/bin/env bash
# Every test module on its own, each in a fresh pytest process (a test that passes only after
# another one set something up fails here). Integration modules by default; pass paths or globs
# for others: `bash scripts/test_isolated.sh tests/webapp/test_*.py`.
set -uo pipefail
cd "$(dirname "$0")/.."
modules=("$@")
[ ${#modules[@]} -eq 0 ] && modules=(tests/integration/test_*.py)
failed=()
for module in "${modules[@]}"; do
  echo "== $module (alone)"
  if ! bash scripts/test.sh "$module" -q; then failed+=("$module"); fi
done
if [ ${#failed[@]} -gt 0 ]; then
  echo "failed when run alone: ${failed[*]}" >&2
  exit 1
fi
echo "every module passed alone (${#modules[@]})"
