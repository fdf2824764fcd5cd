#!/usr/bin/env bash
# Builds the sandbox image rootfs (Debian trixie: Python 3.13, Node.js 20, the data-science
# libraries of packages.txt, PyPDF2 from PyPI) with mmdebstrap, or reuses the cached one.
#
# Cache: $SANDQ_CACHE/rootfs/<key>/rootfs (default SANDQ_CACHE=/var/cache/sandq), where <key> is
# the sha256 of this script and packages.txt. A second run with the same recipe prints the path
# in well under a second. Measured facts behind the recipe: ../shared/notes/rootfs.md and
# docs/sandbox-image.md.
#
# Output: the rootfs path, alone on the last line of stdout. Needs root (mmdebstrap --mode=root).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache=${SANDQ_CACHE:-/var/cache/sandq}
pypdf2_version=3.0.1
# SOURCE_DATE_EPOCH fixed: builds of one recipe give the same files (2026-01-01T00:00:00Z).
export SOURCE_DATE_EPOCH=1767225600

key=$( (cat "$here/build-rootfs.sh" "$here/packages.txt"; echo "pypdf2=$pypdf2_version") | sha256sum | cut -c1-16)
dest="$cache/rootfs/$key"
if [ -f "$dest/.complete" ]; then
  echo "$dest/rootfs"
  exit 0
fi

mkdir -p "$cache/rootfs" "$cache/wheels"
exec 9>"$cache/rootfs/.lock"
flock 9
if [ -f "$dest/.complete" ]; then
  echo "$dest/rootfs"
  exit 0
fi

if ! command -v mmdebstrap >/dev/null; then
  echo "installing mmdebstrap" >&2
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mmdebstrap >&2
fi

wheel="$cache/wheels/pypdf2-$pypdf2_version-py3-none-any.whl"
if [ ! -f "$wheel" ]; then
  # PyPDF2 is not packaged in trixie; pip inside the chroot cannot verify TLS here, so the wheel
  # is fetched on the host and installed offline (rootfs.md).
  python3 -m pip download --quiet "PyPDF2==$pypdf2_version" --no-deps -d "$cache/wheels" >&2
fi

rm -rf "$dest"
mkdir -p "$dest"
build="$dest/rootfs.partial"
packages=$(grep -v '^#' "$here/packages.txt" | grep -v '^$' | paste -sd, -)
started=$(date +%s)
echo "building sandbox rootfs $key (takes 1.5 to 5 minutes)" >&2
mmdebstrap --mode=root --variant=essential --quiet \
  --include="$packages" \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-exclude=/usr/share/info/*' \
  --dpkgopt='path-exclude=/usr/share/lintian/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-include=/usr/share/doc/*/copyright' \
  --customize-hook='mkdir -p "$1/work" "$1/sandq" "$1/opt/sandq/wheels"' \
  --customize-hook="copy-in $wheel /opt/sandq/wheels" \
  --customize-hook="chroot \"\$1\" python3 -m pip install --quiet --no-index --no-deps --break-system-packages /opt/sandq/wheels/$(basename "$wheel")" \
  --customize-hook='rm -rf "$1/opt/sandq/wheels" "$1/var/cache/apt"/*.bin "$1/var/lib/apt/lists"/*' \
  --customize-hook='chroot "$1" python3 -c "import pandas, numpy, scipy, statsmodels, matplotlib, seaborn, plotly, sklearn, xgboost, requests, bs4, httpx, openpyxl, docx, pypdf, PyPDF2, PIL, IPython"' \
  --customize-hook='chroot "$1" node -e "process.exit(0)"' \
  trixie "$build" >&2
mv "$build" "$dest/rootfs"
echo "$key built in $(( $(date +%s) - started )) s" > "$dest/.complete"
echo "sandbox rootfs built in $(( $(date +%s) - started )) s" >&2
echo "$dest/rootfs"
