#!/usr/bin/env bash
# Set up Pal on a fresh Debian 12 machine, as root. Idempotent: re-running it only does
# what is missing. Usage: bash scripts/install.sh [--up [pal up options...] | --for-tests]
#   --up          then run `pal up` with the options that follow
#   --for-tests   set up for scripts/test.sh (no hint about starting a server)
#   PAL_DATA_DIR  where images, snapshots and the store live (default /var/lib/pal)
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"

UP=0
FOR_TESTS=0
if [[ "${1:-}" == "--up" ]]; then
  UP=1
  shift
elif [[ "${1:-}" == "--for-tests" ]]; then
  FOR_TESTS=1
  shift
fi

log() { printf '\033[1m==> %s\033[0m\n' "$*"; }

if [[ "$(id -u)" -ne 0 ]]; then
  echo "install.sh must run as root (it installs Debian packages and builds images under /var/lib)" >&2
  exit 1
fi

# Host tools: QEMU and the image builder's tools. python3-dev + gcc build any wheel pip
# cannot find prebuilt. nftables brings libnftables (each VM's namespace rules, in-process);
# iproute2 (`ip netns`) and openssl are used by `pal bench network` and the tests.
# chromium + a font: the dashboard's browser tests (Playwright drives Debian's chromium; it
# never downloads a browser).
# skopeo + umoci import container images (OCI / Docker archives, registries); buildah
# builds Dockerfiles (`pal image build -f`). runsc (gVisor): the peer `pal bench peer` measures.
# golang-go: builds and tests the Go SDK (sdk/go; standard library only, nothing downloaded).
# protobuf-compiler: protoc, which regenerates pal/e2b/gen (the test that it is current);
# libprotobuf-dev: the well-known types it imports (google/protobuf/timestamp.proto), which
# protoc alone does not bring on a fresh machine.
PACKAGES=(
  qemu-system-x86 qemu-utils mmdebstrap busybox-static xfsprogs lz4 e2fsprogs cpio kmod
  zstd xz-utils ca-certificates python3 python3-venv python3-dev gcc
  nftables iproute2 openssl
  chromium fonts-dejavu-core
  skopeo umoci buildah
  runsc
  postgresql
  golang-go
  protobuf-compiler libprotobuf-dev
  nfs-ganesha nfs-ganesha-vfs rpcbind
)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Node >= 18 and npm for the TypeScript SDK: Debian's packages, unless the host already has
# a node and npm (another packaging of Node.js would conflict with Debian's npm).
if ! command -v node >/dev/null || ! command -v npm >/dev/null; then
  missing+=(nodejs npm)
fi
if ((${#missing[@]})); then
  log "apt-get install ${missing[*]}"
  apt-get update
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
else
  log "Debian packages already installed"
fi
# Volumes (docs/volumes.md): each node runs its own nfs-ganesha (and rpcbind) in namespaces
# of its own; Debian's ganesha service would serve /etc/ganesha on every interface (the
# host's own rpcbind, if it runs one, is left alone: Pal's registers in a private /run).
for unit in nfs-ganesha.service nfs-ganesha-lock.service; do
  if command -v systemctl >/dev/null && systemctl list-unit-files "$unit" >/dev/null 2>&1; then
    systemctl disable --now "$unit" >/dev/null 2>&1 || true
  fi
done

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

# The TypeScript SDK's pinned dev tools (typescript, openapi-typescript) from its lock file.
NPM_STAMP=sdk/typescript/node_modules/.pal-install-stamp
want_npm="$(sha256sum sdk/typescript/package-lock.json | cut -d' ' -f1)"
if [[ "$(cat "$NPM_STAMP" 2>/dev/null || true)" != "$want_npm" ]]; then
  log "npm ci (sdk/typescript)"
  (cd sdk/typescript && npm ci --no-audit --no-fund --loglevel=error)
  echo "$want_npm" >"$NPM_STAMP"
else
  log "TypeScript SDK dev packages up to date"
fi

# The unmodified E2B JavaScript clients tests/e2b drives, from their lock file.
E2B_NPM_STAMP=tests/e2b/js/node_modules/.pal-install-stamp
want_e2b_npm="$(sha256sum tests/e2b/js/package-lock.json | cut -d' ' -f1)"
if [[ "$(cat "$E2B_NPM_STAMP" 2>/dev/null || true)" != "$want_e2b_npm" ]]; then
  log "npm ci (tests/e2b/js: e2b, @e2b/code-interpreter)"
  (cd tests/e2b/js && npm ci --no-audit --no-fund --loglevel=error)
  echo "$want_e2b_npm" >"$E2B_NPM_STAMP"
else
  log "E2B JavaScript test clients up to date"
fi

# The dashboard terminal's xterm.js, pinned, into the package's static files.
log "dashboard terminal assets (xterm.js)"
bash scripts/vendor-xterm.sh

export PAL_DATA_DIR="${PAL_DATA_DIR:-/var/lib/pal}"
log "guest image 'default' in $PAL_DATA_DIR (reused when already built)"
.venv/bin/pal image build default --data-dir "$PAL_DATA_DIR"

if ((UP)); then
  # The ports it will use, as `pal up` derives them (its first log line says what it got).
  api_port=8080
  ports_port="${PAL_PORTS_PORT:-}"
  args=("$@")
  for ((i = 0; i < ${#args[@]}; i++)); do
    case "${args[i]}" in
      --port) api_port="${args[i + 1]:-$api_port}" ;;
      --port=*) api_port="${args[i]#--port=}" ;;
      --ports-port) ports_port="${args[i + 1]:-}" ;;
      --ports-port=*) ports_port="${args[i]#--ports-port=}" ;;
    esac
  done
  if [[ -n "$ports_port" ]]; then
    log "starting pal up: API on port $api_port, VM ports on $ports_port"
  else
    log "starting pal up: API on port $api_port, VM ports on $((api_port + 2)) (a free one it prints if that is taken)"
  fi
  exec .venv/bin/pal up --data-dir "$PAL_DATA_DIR" "$@"
fi
if ((FOR_TESTS)); then
  log "set up for the tests (data dir $PAL_DATA_DIR)"
else
  log "done. Start the server with: .venv/bin/pal up --data-dir $PAL_DATA_DIR"
fi
