#!/usr/bin/env bash
# Install rljax with jax[tpu] on every worker, then print jax.device_count() from each.
#
#   setup.sh --env my.env                       # the committed HEAD of this repository
#   setup.sh --env my.env --wheel gs://bucket/rljax-0.1.0-py3-none-any.whl
#
# From the repository (REPO, default the one holding this script): `git archive HEAD` is
# copied to every worker and unpacked into ~/rljax (uncommitted changes are not copied:
# commit first, so the run's code has a commit id). From a wheel on gs://: each worker
# copies it with `gcloud storage cp`. Either way a Python PYTHON_VERSION venv is made in
# ~/rljax-venv with uv (TPU VM images ship Python 3.10; rljax needs 3.11+) and rljax[EXTRAS],
# jax[tpu] (==JAX_VERSION when given) and gcsfs (gs:// run directories, compilation cache)
# are installed. Safe to run again.
set -euo pipefail
# shellcheck source=/dev/null  # common.sh is linted on its own (following it 8 times is slow)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
parse_args "$@"
require ZONE TPU_NAME

jax_req="jax[tpu]${JAX_VERSION:+==$JAX_VERSION}"
extras=${EXTRAS:+[$EXTRAS]}
# Each step on the workers; $HOME is expanded there.
# shellcheck disable=SC2016
{
  steps='set -euo pipefail'
  if [ -n "$WHEEL" ]; then
    [[ "$WHEEL" == gs://*.whl ]] || die "--wheel must be a gs://.../*.whl file, got '$WHEEL'"
    wheel_file="\$HOME/$(basename "$WHEEL")"
    steps+=$'\n'"gcloud storage cp $(sq "$WHEEL") \"$wheel_file\""
    target="\"$wheel_file$extras\""
  else
    tarball="${TMPDIR:-/tmp}/rljax-$TPU_NAME.tar.gz"
    steps+=$'\n''rm -rf "$HOME/rljax.new" && mkdir "$HOME/rljax.new"'
    steps+=$'\n''tar -xzf "$HOME/rljax.tar.gz" -C "$HOME/rljax.new"'
    steps+=$'\n''rm -rf "$HOME/rljax" && mv "$HOME/rljax.new" "$HOME/rljax"'
    target="-e \"\$HOME/rljax$extras\""
  fi
  # Ubuntu 24.04 images mark the system Python as externally managed; 22.04's pip has no
  # --break-system-packages.
  steps+=$'\n''python3 -m pip install -q --user -U uv || python3 -m pip install -q --user -U --break-system-packages uv'
  steps+=$'\n'"\"\$HOME/.local/bin/uv\" venv -q --allow-existing --python $(sq "$PYTHON_VERSION") \"\$HOME/rljax-venv\""
  steps+=$'\n'"\"\$HOME/.local/bin/uv\" pip install -q --python \"\$HOME/rljax-venv/bin/python\" $target $(sq "$jax_req") gcsfs"
  steps+=$'\n''"$HOME/rljax-venv/bin/python" -c "import jax; jax.distributed.initialize(); print(f\"worker {jax.process_index()}: jax.device_count()={jax.device_count()} local={jax.local_device_count()} {jax.devices()[0].device_kind}\")"'
}

if [ -z "$WHEEL" ]; then
  if ! on DRY_RUN && [ -n "$(git -C "$REPO" status --porcelain --untracked-files=no)" ]; then
    note "warning: $REPO has uncommitted changes; the workers get HEAD ($(git -C "$REPO" rev-parse --short HEAD))"
  fi
  if on DRY_RUN; then
    printf 'git -C %q archive --format=tar.gz -o %q HEAD\n' "$REPO" "$tarball"
  else
    git -C "$REPO" archive --format=tar.gz -o "$tarball" HEAD
  fi
  gc compute tpus tpu-vm scp "$tarball" "$TPU_NAME:rljax.tar.gz" "${WHERE[@]}" --worker=all
fi
on_workers "$steps"
