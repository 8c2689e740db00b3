#!/usr/bin/env bash
# Gather every worker's log of the run into LOG_DIR/<worker>.log (default
# runs/tpu_logs/<name>/<run>/) and print the last LOG_LINES lines of each.
#
#   logs.sh --env my.env [--run NAME] [--log-lines 50]
set -euo pipefail
# shellcheck source=/dev/null  # common.sh is linted on its own (following it 8 times is slow)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_args "$@"
require ZONE TPU_NAME
gather_logs
on DRY_RUN && exit 0
for f in "$LOG_DIR"/*.log; do
  [ -e "$f" ] || continue
  echo "==> $f <=="
  tail -n "$LOG_LINES" "$f"
done
