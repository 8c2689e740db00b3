#!/usr/bin/env bash
# Copy a model folder and data from gs:// to every worker's local disk.
#
#   stage.sh --env my.env --model gs://bucket/models/Qwen2.5-0.5B-Instruct \
#            --data gs://bucket/data/gsm8k
#
# MODEL lands in ~/models/<its last name>, DATA in ~/data/<its last name>, on every worker
# (`gcloud storage rsync`, so a second run copies only what changed). Point the run at them
# with --set hf_path=$HOME/models/NAME --set task.path=$HOME/data/NAME.
set -euo pipefail
# shellcheck source=/dev/null  # common.sh is linted on its own (following it 8 times is slow)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_args "$@"
require ZONE TPU_NAME
[ -n "$MODEL$DATA" ] || die "give --model gs://... and/or --data gs://... (MODEL= / DATA= in the env file)"

steps='set -euo pipefail'
for pair in "models:$MODEL" "data:$DATA"; do
  kind=${pair%%:*} src=${pair#*:}
  [ -n "$src" ] || continue
  [[ "$src" == gs://?* ]] || die "the $kind source must be a gs:// folder, got '$src'"
  src=${src%/}
  dest="\$HOME/$kind/$(basename "$src")"
  steps+=$'\n'"mkdir -p \"$dest\""
  steps+=$'\n'"gcloud storage rsync --recursive $(sq "$src") \"$dest\""
  steps+=$'\n'"du -sh \"$dest\""
done
on_workers "$steps"
