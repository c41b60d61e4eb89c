#!/usr/bin/env bash
# Set up Pal on a fresh Debian 12 machine, as root. Idempotent: re-running it only does
# what is missing. Usage: sudo bash scripts/install.sh [--up [pal up options...]]
#   PAL_DATA_DIR  where images, snapshots and the store live (default /var/lib/pal)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

UP=0
if [[ "${1:-}" == "--up" ]]; then
  UP=1
  shift
fi

log() { printf '\033[1m==> %s\033[0m\n' "$*"; }

if [[ "$(id -u)" -ne 0 ]]; then
  echo "install.sh must run as root (it installs Debian packages and builds images under /var/lib)" >&2
  exit 1
fi

# Host tools: QEMU and the image builder's tools. python3-dev + gcc build any wheel pip
# cannot find prebuilt.
PACKAGES=(
  qemu-system-x86 qemu-utils mmdebstrap busybox-static xfsprogs lz4 e2fsprogs cpio kmod
  zstd xz-utils ca-certificates python3 python3-venv python3-dev gcc
)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  log "apt-get install ${missing[*]}"
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
else
  log "Debian packages already installed"
fi

# Pal needs Python 3.11: Debian 12's python3 is 3.11; prefer an explicit python3.11 on PATH.
PY=""
for cand in python3.11 python3; do
  if command -v "$cand" >/dev/null && "$cand" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
    PY="$(command -v "$cand")"
    break
  fi
done
if [[ -z "$PY" ]]; then
  echo "no Python 3.11 found (python3.11 or python3)" >&2
  exit 1
fi

if [[ ! -x .venv/bin/python ]] || ! .venv/bin/python -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  log "creating .venv with $PY"
  rm -rf .venv
  "$PY" -m venv .venv
fi

# Reinstall only when the dependency list changed (pyproject.toml's hash is the stamp).
STAMP=.venv/.pal-install-stamp
want="$(sha256sum pyproject.toml | cut -d' ' -f1)"
if [[ "$(cat "$STAMP" 2>/dev/null || true)" != "$want" ]] || ! .venv/bin/python -c 'import pal' 2>/dev/null; then
  log "pip install -e .[dev]"
  .venv/bin/python -m pip install --quiet --upgrade pip
  .venv/bin/python -m pip install --quiet -e '.[dev]'
  echo "$want" >"$STAMP"
else
  log "Python packages up to date"
fi

export PAL_DATA_DIR="${PAL_DATA_DIR:-/var/lib/pal}"
log "guest image 'default' in $PAL_DATA_DIR (reused when already built)"
.venv/bin/pal image build default --data-dir "$PAL_DATA_DIR"

if ((UP)); then
  log "starting pal up"
  exec .venv/bin/pal up --data-dir "$PAL_DATA_DIR" "$@"
fi
log "done. Start the server with: .venv/bin/pal up --data-dir $PAL_DATA_DIR"
