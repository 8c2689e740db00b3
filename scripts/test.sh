#!/usr/bin/env bash
# The README's test command: builds the environment if needed, checks the layering
# contracts (pyproject.toml's [tool.importlinter]), then runs the whole suite.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
lint-imports --no-cache --no-logo
# Two workers (RLJAX_TEST_WORKERS): XLA compiles one program on one thread, and the
# suite is mostly compiling small programs. --dist loadfile keeps each module (and the
# compiled programs its fixtures share) in one worker. --durations: CI's log names the
# slowest tests, for keeping the suite under its time limit.
exec python -m pytest -q -n "${RLJAX_TEST_WORKERS:-2}" --dist loadfile --durations=25 "$@"
