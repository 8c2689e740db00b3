#!/usr/bin/env bash
# Run one command on every worker, detached, and watch it.
#
#   launch.sh --env my.env --run grpo -- rljax train gsm8k_qwen25_grpo --distributed \
#     --set recipe=0.5b-v5e16 --set run.dir=gs://bucket/runs/grpo
#
# The words after -- (or COMMAND= in the env file) are joined with spaces and run by bash
# in ~/rljax with ~/rljax-venv active, under setsid + nohup, so a dropped ssh (or a closed
# laptop) does not stop it. Each worker keeps its log in ~/rljax-launch/RUN/log (an older
# log is renamed, not overwritten). Then this script watches: every POLL_S seconds it asks
# every worker; when one has died or exited non-zero it stops the others and names it;
# when all exited 0 it gathers the logs into LOG_DIR. --detach skips the watching
# (status.sh --watch resumes it); Ctrl-C of the watcher leaves the run running.
#
# JAX_CACHE=gs://bucket/jax-cache sets JAX_COMPILATION_CACHE_DIR on the workers, so a
# relaunch loads its programs instead of compiling them again.
#
# --resume: first the slice's state. A queued resource that is SUSPENDED or FAILED (a spot
# slice that was reclaimed is never re-provisioned) or a VM that is PREEMPTED is deleted;
# then, if it is gone, create.sh, setup.sh and stage.sh run with these same settings before
# the launch. The command itself must continue the run (rljax: --set run.resume=auto with
# run.dir on gs://, where the checkpoints outlive the slice).
set -euo pipefail
# shellcheck source=/dev/null  # common.sh is linted on its own (following it 8 times is slow)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_args "$@"
require ZONE TPU_NAME COMMAND

# recreate: the slice, its software and its data again, with the same settings.
recreate() {
  "$TPU_SETUP_DIR/create.sh" "${ARGS[@]}"
  "$TPU_SETUP_DIR/setup.sh" "${ARGS[@]}"
  if [ -n "$MODEL$DATA" ]; then "$TPU_SETUP_DIR/stage.sh" "${ARGS[@]}"; fi
}

ensure_slice() {
  local want=READY state
  if on QUEUED; then want=ACTIVE; fi
  if on DRY_RUN; then
    describe_slice
    echo "# --resume: when that state is SUSPENDED, FAILED or PREEMPTED:"
    "$TPU_SETUP_DIR/delete.sh" "${ARGS[@]}"
    echo "# --resume: then, or when the slice is gone:"
    recreate
    return 0
  fi
  state=$(slice_state)
  note "--resume: ${QUEUED_RESOURCE:-$TPU_NAME} is ${state:-gone}"
  case "$state" in
    "$want") return 0 ;;
    "") recreate ;;
    SUSPENDED|SUSPENDING|FAILED|PREEMPTED|TERMINATED)
      "$TPU_SETUP_DIR/delete.sh" "${ARGS[@]}"
      recreate ;;
    *) wait_for_state "$want" ;;  # still being provisioned
  esac
}

# The launch on each worker. The wrapper writes its pid (its process group: setsid made it
# a session leader) and runs the command with eval in a subshell, so $HOME and quotes mean
# what they would in a shell and an `exit` in it still leaves an exit code in rc. Both
# trap SIGTERM (a no-op; the command itself gets the default action back) so that on a
# stop they wait for the command to finish its checkpoint and record how it ended.
# shellcheck disable=SC2016  # $d and $HOME are the worker's
launch_snippet() {
  run_dir_snippet
  cat <<'EOS'
if [ -f "$d/pid" ] && alive "$(cat "$d/pid")"; then
  echo "run already running here (pid $(cat "$d/pid")): stop.sh first" >&2; exit 1
fi
[ -f "$HOME/rljax-venv/bin/activate" ] || { echo "no ~/rljax-venv here: run setup.sh first" >&2; exit 1; }
mkdir -p "$d" && rm -f "$d/pid" "$d/rc"
if [ -f "$d/log" ]; then mv "$d/log" "$d/log.$(date +%Y%m%d-%H%M%S)"; fi
EOS
  printf 'printf "%%s\\n" %s >"$d/cmd"\n' "$(sq "$COMMAND")"
  printf ': >"$d/env"\n'
  if [ -n "$JAX_CACHE" ]; then
    printf 'echo %s >>"$d/env"\n' "$(sq "export JAX_COMPILATION_CACHE_DIR=$(sq "$JAX_CACHE")")"
  fi
  cat <<'EOS'
cd "$HOME/rljax" 2>/dev/null || cd "$HOME"
setsid nohup bash -c 'd=$1; echo $$ >"$d/pid"; trap : TERM
. "$HOME/rljax-venv/bin/activate"; . "$d/env"
echo "[launch] $(date -u +%FT%TZ) $(hostname): $(cat "$d/cmd")"
(trap : TERM; eval "$(cat "$d/cmd")"); rc=$?
echo "[launch] exit code $rc"; echo "$rc" >"$d/rc"' wrapper "$d" >"$d/log" 2>&1 </dev/null &
for _ in $(seq 50); do [ -s "$d/pid" ] && break; sleep 0.1; done
echo "started pid $(cat "$d/pid"), log $d/log"
EOS
}

if on RESUME; then ensure_slice; fi
if ! on DRY_RUN && compgen -G "$LOG_DIR/*.log" >/dev/null; then
  old="$LOG_DIR/before-$(date +%Y%m%d-%H%M%S)"  # logs gathered from an earlier launch
  mkdir -p "$old" && mv "$LOG_DIR"/*.log "$old"/
fi
if ! on_workers "$(launch_snippet)"; then
  # Not stopped here: the usual cause is a run already running, which must not be killed.
  die "the launch failed on at least one worker (see above); status.sh shows where it runs, stop.sh stops it"
fi
if on DETACH; then
  on DRY_RUN || note "detached: status.sh --watch, logs.sh and stop.sh take the same settings"
  exit 0
fi
watch_run
