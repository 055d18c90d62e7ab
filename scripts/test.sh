#!/usr/bin/env bash
# The test command (README, .ci/run): installs what the tests need, then runs them.
#   - spectune with its engine and test extras (into the active Python environment)
#   - the real engines the tests drive, cached under ~/.cache/spectune (scripts/install-engines.sh)
#   - PostgreSQL, for the shared-study test of `spectune tune --storage postgresql://...`
#   - Chromium, for the test that renders the HTML report headless and checks its screenshot
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k adaptive`.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e '.[engine,test]' 2>&1 | grep -v '^WARNING: Location' || true
bash scripts/install-engines.sh 2>&1 | grep -E '^(vllm|llama.cpp|sglang):' || { echo "engine install failed"; bash scripts/install-engines.sh; }
if ! ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null) || echo "postgresql not installed: its test will skip"
fi
if ! command -v chromium >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null) || echo "chromium not installed: the report screenshot test will skip"
fi
python -m pytest -q -rs "$@"
