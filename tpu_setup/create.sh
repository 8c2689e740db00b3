#!/usr/bin/env bash
# Create a TPU VM or pod slice and wait until it can be used.
#
#   create.sh --env my.env                      # settings from the env file
#   create.sh --name rl --zone us-central2-b --accelerator-type v4-8
#   create.sh --env my.env --spot               # a queued resource for spot capacity
#
# Directly (tpu-vm create, then waits for READY), or as a queued resource with --queued,
# --spot or --reserved (queued-resources create, then waits for ACTIVE: with --timeout-s 0,
# the default, it waits as long as the queue takes; Ctrl-C leaves the request queued).
# --dry-run prints the gcloud commands and runs nothing.
set -euo pipefail
# shellcheck source=/dev/null  # common.sh is linted on its own (following it 8 times is slow)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_args "$@"
require ZONE TPU_NAME ACCELERATOR_TYPE
version=$(runtime_version)

if on QUEUED; then
  extra=()
  if on SPOT; then extra+=(--spot); fi
  if on RESERVED; then extra+=(--reserved); fi
  if [ -n "$VALID_UNTIL_DURATION" ]; then extra+=(--valid-until-duration="$VALID_UNTIL_DURATION"); fi
  gc compute tpus queued-resources create "$QUEUED_RESOURCE" "${WHERE[@]}" \
    --node-id="$TPU_NAME" --accelerator-type="$ACCELERATOR_TYPE" \
    --runtime-version="$version" "${extra[@]}"
  wait_for_state ACTIVE
else
  gc compute tpus tpu-vm create "$TPU_NAME" "${WHERE[@]}" \
    --accelerator-type="$ACCELERATOR_TYPE" --version="$version"
  wait_for_state READY
fi
on DRY_RUN || note "$TPU_NAME ($ACCELERATOR_TYPE) is ready; next: setup.sh"
