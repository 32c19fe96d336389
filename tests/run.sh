#!/usr/bin/env bash
# The test command (README, .ci/run): installs what the tests need, checks the layer contract, runs the whole suite.
# Browser tests use Debian's chromium (a test tool's own browser download cannot work offline).
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -r requirements-dev.txt
# the repository as an editable package (pyproject.toml): `engine` and `treeviz` import from any folder,
# `treeviz-engine` is on PATH; its dependencies are the line above
python -m pip install -q --no-deps --no-build-isolation -e .
if [ ! -x /usr/bin/chromium ]; then
    if [ "$(id -u)" = 0 ]; then
        (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null
    else
        sudo apt-get update -qq && sudo apt-get install -y -qq chromium >/dev/null
    fi
fi
lint-imports --no-logo  # the layer contract (pyproject.toml [tool.importlinter]): fails before any test runs
python -m pytest -q "$@"
