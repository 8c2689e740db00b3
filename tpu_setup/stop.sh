#!/usr/bin/env bash
# Stop the run on every worker: SIGTERM to its process group (rljax agrees on a step, saves
# a checkpoint and exits 0), SIGKILL after STOP_GRACE_S seconds. The slice stays.
#
#   stop.sh --env my.env [--run NAME] [--stop-grace-s 120]
set -euo pipefail
# shellcheck source=/dev/null  # common.sh is linted on its own (following it 8 times is slow)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_args "$@"
require ZONE TPU_NAME
on_workers "$(stop_snippet)"
