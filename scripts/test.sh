#!/usr/bin/env bash
# The README's test command: builds the environment if needed, then runs the whole suite.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
exec python -m pytest -q "$@"
