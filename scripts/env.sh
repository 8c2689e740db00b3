# Sourced by the other scripts: creates .venv (once) and installs rljax with its test extra.
# Reinstalls only when pyproject.toml changes, so repeated runs start at once.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RLJAX_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
STAMP="$VENV/.rljax-installed"
# RLJAX_BENCH=1 adds the bench extra (TRL, the baseline of experiments/bench_grpo_step.py);
# the tests and CI never need it.
EXTRAS="test,tfds"
if [ "${RLJAX_BENCH:-0}" = 1 ]; then
  EXTRAS="$EXTRAS,bench"
fi
HASH="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
HAVE="$(cat "$STAMP" 2>/dev/null || true)"
# An install with the bench extra also serves a run without it.
if [ "$HAVE" != "$HASH $EXTRAS" ] && [ "$HAVE" != "$HASH $EXTRAS,bench" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # torch first, pinned, so pip takes the CPU build on disk and never a CUDA one (trl,
  # in the bench extra, would otherwise pull a CUDA torch).
  # pip byte-compiles every module here on purpose: with PYTHONDONTWRITEBYTECODE=1 (set on
  # these machines) Python never caches bytecode itself, and every test subprocess would
  # recompile jax, transformers and torch on import (measured: --no-compile took the suite
  # from ~530 s to 640-737 s).
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e "${ROOT}[${EXTRAS}]"
  echo "$HASH $EXTRAS" >"$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
