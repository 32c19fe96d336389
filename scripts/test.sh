#!/usr/bin/env bash
# The test command (README, .ci/run): installs what the tests need, then runs the whole suite.
# Browser tests use Debian's chromium (a test tool's own browser download cannot work offline).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -r requirements-dev.txt
if [ ! -x /usr/bin/chromium ]; then
    if [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null
    else
        sudo apt-get update -qq && sudo apt-get install -y -qq chromium >/dev/null
    fi
fi
python -m pytest -q "$@"
