#!/usr/bin/env bash
# The slice's state and, on every worker, whether the run is running, exited (with its
# code) or died, with its log's last line. --watch keeps watching like launch.sh does:
# when a worker dies or fails it stops the others and names it.
#
#   status.sh --env my.env [--run NAME] [--watch]
set -euo pipefail
# shellcheck source=/dev/null  # common.sh is linted on its own (following it 8 times is slow)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_args "$@"
require ZONE TPU_NAME
if on WATCH; then watch_run; exit; fi
describe_slice
if on DRY_RUN; then on_workers "$(status_snippet)" --output-directory="$LOG_DIR/.status"; exit 0; fi
poll_states
for f in "$LOG_DIR"/.status/*.log; do
  [ -e "$f" ] || { note "no worker answered: $(tail -n 2 "$LOG_DIR/.status/stderr")"; exit 1; }
  echo "worker $(basename "$f" .log): $(sed -e 's/^RLJAX_STATE //' "$f" | tr '\n' ' ')"
done
