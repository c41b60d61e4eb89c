#!/usr/bin/env bash
# The dashboard terminal's browser libraries (xterm.js and its fit addon), from the npm
# registry at the versions scripts/xterm/package-lock.json pins (with their integrity
# hashes), copied into the package's static files: Pal serves them itself, no CDN.
# Run by scripts/install.sh; again only when the lock file changed.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
SRC=scripts/xterm
version="$(sed -n 's/.*"@xterm\/xterm": "\([0-9.]*\)".*/\1/p' "$SRC/package.json")"
DEST="pal/dashboard/static/vendor/xterm-$version"
STAMP="$SRC/node_modules/.pal-vendor-stamp"
want="$(sha256sum "$SRC/package-lock.json" | cut -d' ' -f1)"
if [[ "$(cat "$STAMP" 2>/dev/null || true)" == "$want" && -f "$DEST/xterm.js" ]]; then
  echo "xterm.js $version already vendored in $DEST"
  exit 0
fi
(cd "$SRC" && npm ci --no-audit --no-fund --loglevel=error)
rm -rf "$DEST.tmp" && mkdir -p "$DEST.tmp"
cp "$SRC/node_modules/@xterm/xterm/lib/xterm.js" "$SRC/node_modules/@xterm/xterm/css/xterm.css" "$DEST.tmp/"
cp "$SRC/node_modules/@xterm/xterm/LICENSE" "$DEST.tmp/LICENSE"
cp "$SRC/node_modules/@xterm/addon-fit/lib/addon-fit.js" "$DEST.tmp/"
cp "$SRC/node_modules/@xterm/addon-fit/LICENSE" "$DEST.tmp/LICENSE.addon-fit"
rm -rf "$DEST" && mv "$DEST.tmp" "$DEST"
echo "$want" >"$STAMP"
echo "vendored xterm.js $version into $DEST"
