#!/usr/bin/env bash
# A Pal cluster on this machine: PostgreSQL, an S3 server (moto), 2 `pal server` replicas
# and 3 `pal node`s, every data dir in a temp dir (removed at the end). As root, after
# scripts/install.sh. Ctrl-C stops it; --once stops right after the tour.
#   PAL_DATA_DIR  where a built image is copied from (default /var/lib/pal)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$REPO"
if [[ "$(id -u)" -ne 0 ]]; then
  echo "cluster-demo.sh must run as root (nodes jail QEMU and make network namespaces)" >&2
  exit 1
fi
[[ -x .venv/bin/python ]] || { echo "run scripts/install.sh first" >&2; exit 1; }
exec .venv/bin/python -m pal_tools.localcluster.demo "$@"
