#!/usr/bin/env bash
# Installs what the tests need (CPU PyTorch pinned) and runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install --quiet -r requirements-dev.txt -c constraints-cpu.txt
# The web UI's browser tests drive Debian's chromium (no browser download at run time).
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt-get install -y -qq chromium chromium-driver >/dev/null || { apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null; } \
      || echo "could not install chromium: tests/test_webui_browser.py will be skipped" >&2
  else
    echo "tests/test_webui_browser.py needs chromium and chromium-driver: sudo apt-get install -y chromium chromium-driver" >&2
  fi
fi
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# Two workers (pytest-xdist): the tests run one torch thread each (tests/conftest.py), so two share the 2 cores of
# a CI machine; the multi-process launches are one group (one worker, one at a time). PYTEST_WORKERS=0: no workers.
exec python -m pytest -n "${PYTEST_WORKERS:-2}" --dist loadgroup "$@"
