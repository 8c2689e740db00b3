#!/usr/bin/env bash
# Delete the TPU VM, or the queued resource and its slice (--queued/--spot/--reserved or
# QUEUED_RESOURCE= in the env file, as given to create.sh). It does not ask: gcloud's own
# prompt is answered by --quiet. Logs gathered on this machine (LOG_DIR) stay; the workers'
# disks do not: keep checkpoints on gs:// (run.dir=gs://...).
#
#   delete.sh --env my.env [--dry-run]
set -euo pipefail
# shellcheck source=/dev/null  # common.sh is linted on its own (following it 8 times is slow)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_args "$@"
require ZONE TPU_NAME
if on QUEUED; then
  # --force deletes the queued resource together with the slice it holds.
  gc compute tpus queued-resources delete "$QUEUED_RESOURCE" "${WHERE[@]}" --force --quiet
else
  gc compute tpus tpu-vm delete "$TPU_NAME" "${WHERE[@]}" --quiet
fi
