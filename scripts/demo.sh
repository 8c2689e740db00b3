#!/usr/bin/env bash
# The README's main job: builds the environment if needed, then runs the CPU demo.
source "$(dirname "${BASH_SOURCE[0]}")/env.sh"
# The demo replaces its own run directory each time (the experiment never overwrites one).
exec python experiments/arithmetic_grpo.py --set run.overwrite=true "$@"
