#!/usr/bin/env bash
# The README's test command: builds the environment if needed, checks the layering
# contracts (pyproject.toml's [tool.importlinter]), then runs the whole suite.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
lint-imports --no-cache --no-logo
exec python -m pytest -q "$@"
