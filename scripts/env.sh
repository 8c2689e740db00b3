# Sourced by the other scripts: creates .venv (once) and installs rljax with its test extra.
# Reinstalls only when pyproject.toml changes, so repeated runs start at once.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${RLJAX_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
STAMP="$VENV/.rljax-installed"
WANT="$(sha256sum "$ROOT/pyproject.toml" | cut -d' ' -f1)"
if [ ! -f "$STAMP" ] || [ "$(cat "$STAMP")" != "$WANT" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # torch first, pinned, so pip takes the CPU build on disk and never a CUDA one.
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e "$ROOT[test,tfds]"
  echo "$WANT" >"$STAMP"
fi
export PATH="$VENV/bin:$PATH"
cd "$ROOT"
