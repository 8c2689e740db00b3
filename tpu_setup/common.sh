# shellcheck shell=bash
# shellcheck disable=SC2034  # settings set here are read by the scripts that source this
# Sourced by every tpu_setup script, never run: the settings (flags or one env file), running
# or printing gcloud commands (--dry-run), a TPU's state, and the snippets run on workers.
#
# A setting is a flag (--accelerator-type=v4-8 or --accelerator-type v4-8) or a line of the
# env file (ACCELERATOR_TYPE=v4-8), named by --env FILE or $RLJAX_TPU_ENV; a flag wins over
# the file. Nothing else from the caller's environment is read, so a stray exported ZONE
# never changes where a slice is made.

TPU_SETUP_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# flag name, variable (= env file key), default. Defaults derived from others are filled in
# by finish_settings.
SETTINGS=(
  "project PROJECT"
  "zone ZONE"
  "name TPU_NAME"
  "accelerator-type ACCELERATOR_TYPE"
  "runtime-version RUNTIME_VERSION"
  "queued-resource QUEUED_RESOURCE"
  "valid-until-duration VALID_UNTIL_DURATION"
  "repo REPO"
  "wheel WHEEL"
  "jax-version JAX_VERSION"
  "extras EXTRAS tfds"
  "python PYTHON_VERSION 3.12"
  "model MODEL"
  "data DATA"
  "run RUN run"
  "command COMMAND"
  "jax-cache JAX_CACHE"
  "log-dir LOG_DIR"
  "poll-s POLL_S 30"
  "timeout-s TIMEOUT_S 0"
  "stop-grace-s STOP_GRACE_S 60"
  "log-lines LOG_LINES 20"
)
# Switches: --spot on the command line, SPOT=1 (or true/yes) in the env file.
SWITCHES=(
  "dry-run DRY_RUN"
  "queued QUEUED"
  "spot SPOT"
  "reserved RESERVED"
  "resume RESUME"
  "detach DETACH"
  "watch WATCH"
)

die() { echo "error: $*" >&2; exit 1; }
note() { echo "$*" >&2; }
on() { [ "${!1}" = 1 ]; }
sq() { local q="'"; printf "'%s'" "${1//$q/$q\\$q$q}"; }  # single-quoted for the worker's shell

usage() {  # the script's header comment (lines starting '# ' after the shebang)
  sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"
  echo
  echo "Settings (flag / env file key):"
  local entry flag var default
  for entry in "${SETTINGS[@]}" "${SWITCHES[@]}"; do
    read -r flag var default <<<"$entry"
    printf '  --%-22s %s%s\n' "$flag" "$var" "${default:+ (default $default)}"
  done
  echo "  --env FILE                KEY=VALUE lines, one per setting (or \$RLJAX_TPU_ENV)"
}

_lookup() {  # _lookup KIND NAME FIELD: the variable of flag or key NAME in SETTINGS/SWITCHES
  local -n table=$1
  local entry f v
  for entry in "${table[@]}"; do
    read -r f v _ <<<"$entry"
    if [ "$2" = "$f" ] || [ "$2" = "$v" ]; then echo "$v"; return 0; fi
  done
  return 1
}

# _set_switch VAR WHERE VALUE: VAR=1/0 from yes/no words; anything else stops the script
# (set directly, not through $(...), whose exit would stop only a subshell).
_set_switch() {
  case "${3,,}" in
    1|true|yes|on) printf -v "$1" 1 ;;
    0|false|no|off|"") printf -v "$1" 0 ;;
    *) die "$2$1 must be one of 1/true/yes/on or 0/false/no/off, got '$3'" ;;
  esac
}

# _env_value WHERE RAW: RAW's value as a shell would read it, without expanding anything:
# one pair of surrounding quotes is dropped, and outside quotes a `#` after whitespace starts
# a comment, as in a shell. Sets VALUE.
_env_value() {
  local where=$1 raw=$2 rest
  if [[ "$raw" =~ ^\"([^\"]*)\"(.*)$ ]] || [[ "$raw" =~ ^\'([^\']*)\'(.*)$ ]]; then
    VALUE=${BASH_REMATCH[1]} rest=${BASH_REMATCH[2]}
    [[ "$rest" =~ ^([[:space:]]+#.*)?[[:space:]]*$ ]] ||
      die "${where}text after the closing quote: '$rest' (only a '# comment' may follow)"
    return 0
  fi
  VALUE=${raw%%[[:space:]]#*}  # from the first whitespace + `#` on
  VALUE="${VALUE%"${VALUE##*[![:space:]]}"}"
}

load_env_file() {
  local file=$1 n=0 line key var
  [ -f "$file" ] || die "env file $file does not exist"
  while IFS= read -r line || [ -n "$line" ]; do
    n=$((n + 1))
    line="${line#"${line%%[![:space:]]*}"}"
    if [ -z "$line" ] || [ "${line:0:1}" = "#" ]; then continue; fi
    line="${line#export }"
    [[ "$line" =~ ^([A-Z_][A-Z0-9_]*)=(.*)$ ]] || die "$file:$n: expected KEY=VALUE, got '$line'"
    key=${BASH_REMATCH[1]}
    _env_value "$file:$n: " "${BASH_REMATCH[2]}"
    if var=$(_lookup SETTINGS "$key"); then
      printf -v "$var" '%s' "$VALUE"
      SET_AT[$var]="$file:$n: "
    elif var=$(_lookup SWITCHES "$key"); then
      _set_switch "$var" "$file:$n: " "$VALUE"
    else
      die "$file:$n: unknown setting $key (see --help for the list)"
    fi
  done <"$file"
}

# parse_args "$@": settings into their variables; words after `--` joined into COMMAND.
# ARGS keeps the arguments as given, so launch --resume can hand them to create/setup/stage.
parse_args() {
  ARGS=("$@")
  local entry flag var default env_file=${RLJAX_TPU_ENV:-} i
  declare -gA SET_AT=()  # variable -> "FILE:LINE: " or "--flag: ", named in errors
  for entry in "${SETTINGS[@]}"; do
    read -r flag var default <<<"$entry"
    printf -v "$var" '%s' "$default"
  done
  for entry in "${SWITCHES[@]}"; do read -r flag var <<<"$entry"; printf -v "$var" 0; done
  for ((i = 1; i <= $#; i++)); do  # the env file first, so flags override it
    case "${!i}" in
      --) break ;;
      --env=*) env_file=${!i#--env=} ;;
      --env) i=$((i + 1)); env_file=${!i:-} ;;
    esac
  done
  [ -n "$env_file" ] && load_env_file "$env_file"
  while [ $# -gt 0 ]; do
    case "$1" in
      -h|--help) usage; exit 0 ;;
      --) shift; COMMAND="$*"; break ;;
      --env=*) ;;
      --env) shift ;;
      --*=*)
        flag=${1%%=*} flag=${flag#--}
        if _lookup SWITCHES "$flag" >/dev/null; then
          die "--$flag is a switch and takes no value, got '$1': give --$flag alone (or $(_lookup SWITCHES "$flag")=1 in the env file)"
        fi
        var=$(_lookup SETTINGS "$flag") || die "unknown flag --$flag (see --help)"
        printf -v "$var" '%s' "${1#*=}"; SET_AT[$var]="--$flag: " ;;
      --*)
        flag=${1#--}
        if var=$(_lookup SWITCHES "$flag"); then
          printf -v "$var" 1
        elif var=$(_lookup SETTINGS "$flag"); then
          [ $# -ge 2 ] || die "--$flag needs a value"
          shift; printf -v "$var" '%s' "$1"; SET_AT[$var]="--$flag: "
        else
          die "unknown flag --$flag (see --help)"
        fi ;;
      *) die "unexpected argument '$1' (settings are flags; a command to launch goes after --)" ;;
    esac
    shift
  done
  finish_settings
}

# check_values: every setting but the command and local paths is one word; the few with a
# format have it. Any error stops the script before its first gcloud call.
check_values() {
  local entry flag var
  for entry in "${SETTINGS[@]}"; do
    read -r flag var _ <<<"$entry"
    case "$var" in COMMAND|REPO|LOG_DIR) continue ;; esac
    if [[ "${!var}" =~ [[:space:]] ]]; then
      die "${SET_AT[$var]:-}$var must be one word (no spaces), got '${!var}'"
    fi
  done
  if [ -n "$JAX_VERSION" ] && ! [[ "$JAX_VERSION" =~ ^[0-9]+(\.[0-9]+)*[A-Za-z0-9.+]*$ ]]; then
    die "${SET_AT[JAX_VERSION]:-}JAX_VERSION must be a version such as 0.10.2, got '$JAX_VERSION'"
  fi
  if [ -n "$JAX_CACHE" ] && ! [[ "$JAX_CACHE" =~ ^(gs://.+|/.*)$ ]]; then
    die "${SET_AT[JAX_CACHE]:-}JAX_CACHE must be a gs://bucket/path or an absolute path on the workers, got '$JAX_CACHE'"
  fi
}

finish_settings() {
  check_values
  [ -n "$REPO" ] || REPO=$(cd "$TPU_SETUP_DIR/.." && pwd)
  if on SPOT && on RESERVED; then die "--spot and --reserved exclude each other: choose one"; fi
  # Spot and reserved capacity are asked for through a queued resource, as Google advises.
  if on SPOT || on RESERVED || [ -n "$QUEUED_RESOURCE" ]; then QUEUED=1; fi
  if on QUEUED && [ -z "$QUEUED_RESOURCE" ]; then QUEUED_RESOURCE=$TPU_NAME; fi
  # Under runs/, which git ignores, when run from the repository's root.
  [ -n "$LOG_DIR" ] || LOG_DIR="runs/tpu_logs/$TPU_NAME/$RUN"
  [[ "$RUN" =~ ^[A-Za-z0-9._-]+$ ]] || die "--run must be letters, digits, '.', '_' or '-', got '$RUN'"
  local n
  for n in POLL_S TIMEOUT_S STOP_GRACE_S LOG_LINES; do
    [[ "${!n}" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "$n must be a number of seconds/lines, got '${!n}'"
  done
  WHERE=(--zone="$ZONE")
  if [ -n "$PROJECT" ]; then WHERE+=(--project="$PROJECT"); fi
}

require() {  # require VAR...: each setting must be given
  local var entry flag v
  for var in "$@"; do
    [ -z "${!var}" ] || continue
    for entry in "${SETTINGS[@]}"; do
      read -r flag v _ <<<"$entry"
      if [ "$v" = "$var" ]; then die "--$flag (or $var= in the env file) is required"; fi
    done
  done
}

runtime_version() {  # the TPU software version for the accelerator, unless one was given
  if [ -n "$RUNTIME_VERSION" ]; then echo "$RUNTIME_VERSION"; return; fi
  case "$ACCELERATOR_TYPE" in
    v4-*) echo tpu-ubuntu2204-base ;;
    v5litepod-*|v5e-*) echo v2-alpha-tpuv5-lite ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    v6e-*) echo v2-alpha-tpuv6e ;;
    *) die "no default --runtime-version for --accelerator-type=$ACCELERATOR_TYPE: give one" ;;
  esac
}

# gc ARGS...: run `gcloud ARGS`, or with --dry-run print it, quoted so it can be pasted.
gc() {
  if on DRY_RUN; then
    printf 'gcloud'; printf ' %q' "$@"; printf '\n'
    return 0
  fi
  { printf '+ gcloud'; printf ' %q' "$@"; printf '\n'; } >&2
  gcloud "$@"
}

# on_workers SCRIPT [GCLOUD FLAGS...]: run a bash snippet on every worker at once.
on_workers() {
  local script=$1
  shift
  gc compute tpus tpu-vm ssh "$TPU_NAME" "${WHERE[@]}" --worker=all --command="$script" "$@"
}

# describe_slice: print the state of the queued resource (queued) or of the VM.
describe_slice() {
  if on QUEUED; then
    gc compute tpus queued-resources describe "$QUEUED_RESOURCE" "${WHERE[@]}" --format='value(state.state)'
  else
    gc compute tpus tpu-vm describe "$TPU_NAME" "${WHERE[@]}" --format='value(state)'
  fi
}

# slice_state: the queued resource's state (queued) or the VM's; empty when it does not
# exist; any other failure (no credentials, no network) stops the script.
slice_state() {
  local out err rc=0
  err=$(mktemp)
  out=$(describe_slice 2>"$err") || rc=$?
  if [ "$rc" != 0 ]; then
    if grep -q -i -E 'NOT_FOUND|not found' "$err"; then out=""; else grep -v '^+ gcloud' "$err" >&2; rm -f "$err"; exit 1; fi
  fi
  rm -f "$err"
  echo "$out"
}

# wait_for_state WANT: poll until the slice reaches WANT (ACTIVE / READY); states from which
# it never gets there stop the script.
wait_for_state() {
  local want=$1 state start=$SECONDS
  if on DRY_RUN; then
    describe_slice
    echo "# ... repeated every ${POLL_S}s until the state is $want"
    return 0
  fi
  while :; do
    state=$(slice_state)
    note "state: ${state:-<none>} (waiting for $want, $((SECONDS - start))s)"
    case "$state" in
      "$want") return 0 ;;
      FAILED|SUSPENDED|SUSPENDING|PREEMPTED|TERMINATED|DELETING|"")
        die "${QUEUED_RESOURCE:-$TPU_NAME} is ${state:-gone}; it will not become $want (delete.sh, then create.sh)" ;;
    esac
    if [ "$TIMEOUT_S" != 0 ] && [ $((SECONDS - start)) -ge "${TIMEOUT_S%.*}" ]; then
      die "still ${state} after ${TIMEOUT_S}s (--timeout-s); it stays queued: delete.sh to give up"
    fi
    sleep "$POLL_S"
  done
}

# On the workers: one folder per run holds pid (the wrapper's pid = its process group),
# rc (written when the command ends), cmd and log.
# alive PID: false for a zombie too, which a container's init may leave unreaped for a while
# (`kill -0` succeeds on a zombie).
# shellcheck disable=SC2016  # $HOME is the worker's
run_dir_snippet() {
  printf 'd=$HOME/rljax-launch/%s\n' "$RUN"
  echo 'alive() { if command -v ps >/dev/null; then ps -o stat= -p "$1" | grep -q "^[^Z]"; else kill -0 "$1" 2>/dev/null; fi; }'
}

# Prints `RLJAX_STATE running|exited RC|died|none` then the log's last line. A wrapper that
# is gone without writing rc was killed (OOM killer, kill -9, a host that rebooted).
status_snippet() {
  run_dir_snippet
  cat <<'EOF'
if [ ! -f "$d/pid" ]; then echo "RLJAX_STATE none"; exit 0; fi
pid=$(cat "$d/pid")
if alive "$pid"; then echo "RLJAX_STATE running pid=$pid"
elif [ -f "$d/rc" ]; then echo "RLJAX_STATE exited $(cat "$d/rc")"
else echo "RLJAX_STATE died"; fi
tail -n 1 "$d/log" 2>/dev/null || true
EOF
}

# SIGTERM to the run's process group (rljax saves a checkpoint at an agreed step and exits
# 0), then SIGKILL after STOP_GRACE_S.
stop_snippet() {
  run_dir_snippet
  printf 'grace=%s\n' "$STOP_GRACE_S"
  cat <<'EOF'
if [ ! -f "$d/pid" ] || ! alive "$(cat "$d/pid")"; then echo "not running"; exit 0; fi
pid=$(cat "$d/pid")
kill -TERM -- "-$pid" 2>/dev/null || true
end=$((SECONDS + ${grace%.*}))
while alive "$pid" && [ "$SECONDS" -lt "$end" ]; do sleep 0.2; done
if alive "$pid"; then kill -KILL -- "-$pid" 2>/dev/null || true; echo "killed after ${grace}s"
else echo "stopped"; fi
EOF
}

# gather_logs: every worker's log of the run into LOG_DIR/<worker>.log.
gather_logs() {
  on DRY_RUN || mkdir -p "$LOG_DIR"
  on_workers "$(run_dir_snippet)"$'\ncat "$d/log"' --output-directory="$LOG_DIR"
  on DRY_RUN || note "logs of every worker: $LOG_DIR/<worker>.log"
}

# poll_states: one status_snippet on all workers; sets STATES (worker -> state line).
poll_states() {
  local dir=$LOG_DIR/.status f line
  rm -rf "$dir" && mkdir -p "$dir"
  declare -gA STATES=()
  on_workers "$(status_snippet)" --output-directory="$dir" >/dev/null 2>"$dir/stderr" || true
  for f in "$dir"/*.log; do
    [ -e "$f" ] || continue
    line=$(grep -m1 '^RLJAX_STATE ' "$f") || continue
    STATES[$(basename "$f" .log)]=${line#RLJAX_STATE }
  done
}

# watch_run: poll the workers until all exit 0 (returns 0), or stop them all when one
# died or failed and name it (exits 1). Unreachable workers three polls running mean the
# slice itself is gone or preempted.
watch_run() {
  if on DRY_RUN; then
    on_workers "$(status_snippet)" --output-directory="$LOG_DIR/.status"
    echo "# ... repeated every ${POLL_S}s until every worker has exited"
    return 0
  fi
  local workers=0 misses=0 w state bad running finished last=""
  while :; do
    poll_states
    [ "$workers" = 0 ] && workers=${#STATES[@]}
    if [ "${#STATES[@]}" = 0 ] || [ "${#STATES[@]}" -lt "$workers" ]; then
      misses=$((misses + 1))
      note "could not reach every worker (${#STATES[@]}/$workers answered): $(tail -n 2 "$LOG_DIR/.status/stderr")"
      if [ "$misses" -ge 3 ]; then
        die "workers unreachable three times running; slice state: '$(slice_state)'. If it was preempted: launch.sh --resume (same settings)"
      fi
      sleep "$POLL_S"; continue
    fi
    misses=0 bad=() running=0 finished=0
    for w in $(printf '%s\n' "${!STATES[@]}" | sort -n); do
      state=${STATES[$w]}
      case "$state" in
        running*) running=$((running + 1)) ;;
        "exited 0") finished=$((finished + 1)) ;;
        "exited "*) bad+=("worker $w exited with code ${state#exited }") ;;
        died) bad+=("worker $w died without an exit code (killed: OOM killer, kill -9 or a reboot)") ;;
        *) bad+=("worker $w has no run '$RUN' ($state)") ;;
      esac
    done
    if [ "${#bad[@]}" -gt 0 ]; then
      note "$(IFS=';'; echo "${bad[*]}"): stopping the other workers"
      on_workers "$(stop_snippet)" >&2 || true
      gather_logs || true
      die "$(IFS=';'; echo "${bad[*]}"): stopped every worker of run '$RUN'; logs in $LOG_DIR/"
    fi
    if [ "$finished" = "$workers" ]; then
      gather_logs || true
      note "run '$RUN': all $workers workers exited 0"
      return 0
    fi
    if [ "$running:$finished" != "$last" ]; then
      note "$(date +%T) run '$RUN': $running running, $finished finished"
      last="$running:$finished"
    fi
    sleep "$POLL_S"
  done
}
