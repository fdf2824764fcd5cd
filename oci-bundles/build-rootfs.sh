#!/usr/bin/env bash
# Builds the sandbox image rootfs (Debian trixie: Python 3.13, Node.js 20, the data-science
# libraries and fonts of packages.txt, the wheels below from PyPI, the npm packages of
# node/package-lock.json) with mmdebstrap, or reuses the cached one.
#
# Cache: $SANDQ_CACHE/rootfs/<key>/rootfs (default SANDQ_CACHE=/var/cache/sandq), where <key> is
# the sha256 of this script, packages.txt and node/package-lock.json. A second run with the same recipe prints the path
# in well under a second. Measured facts behind the recipe: docs/sandbox-image.md.
#
# Output: the rootfs path, alone on the last line of stdout. Needs root (mmdebstrap --mode=root).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
cache=${SANDQ_CACHE:-/var/cache/sandq}
# Python packages trixie does not package (or packages only with a desktop's worth of
# dependencies: python3-opencv pulls GTK, VTK and GDAL), as pinned wheels for CPython 3.13 on
# x86_64, fetched on the host and installed offline without dependencies (the build's import
# check below proves what they need is there).
wheels=(PyPDF2==3.0.1 pyarrow==26.0.1 opencv-python-headless==5.0.0.93)
# SOURCE_DATE_EPOCH fixed: builds of one recipe give the same files (2026-01-01T00:00:00Z).
export SOURCE_DATE_EPOCH=1767225600

key=$(cat "$here/build-rootfs.sh" "$here/packages.txt" "$here/node/package-lock.json" "$here/image-check.py" "$here/image-check.js" \
  "$here/sitecustomize-sandq.py" \
  | sha256sum | cut -c1-16)
dest="$cache/rootfs/$key"
if [ -f "$dest/.complete" ]; then
  echo "$dest/rootfs"
  exit 0
fi

mkdir -p "$cache/rootfs" "$cache/wheels" "$cache/npm"
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

# pip inside the chroot cannot verify TLS here, so the wheels are fetched on the host (rootfs.md).
wheel_dir="$cache/wheels/$key"
if [ ! -f "$wheel_dir/.complete" ]; then
  rm -rf "$wheel_dir"
  python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.13 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$wheel_dir" "${wheels[@]}" >&2
  touch "$wheel_dir/.complete"
fi
# npm packages: the lockfile pins every version and its integrity hash; `npm ci` on the host
# (pure JavaScript, no install scripts) and the tree copied in.
npm_dir="$cache/npm/$key"
if [ ! -f "$npm_dir/.complete" ]; then
  if ! command -v npm >/dev/null; then
    echo "installing npm" >&2
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm >&2
  fi
  rm -rf "$npm_dir"
  mkdir -p "$npm_dir"
  cp "$here/node/package.json" "$here/node/package-lock.json" "$npm_dir/"
  (cd "$npm_dir" && npm ci --omit=dev --ignore-scripts --no-audit --no-fund --loglevel=error >&2)
  touch "$npm_dir/.complete"
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
  --dpkgopt='path-exclude=/usr/share/fonts/opentype/noto/NotoSerifCJK*' \
  --customize-hook='mkdir -p "$1/work" "$1/sandq" "$1/opt/sandq/wheels" "$1/usr/local/lib"' \
  --customize-hook="copy-in $(echo "$wheel_dir"/*.whl) /opt/sandq/wheels" \
  --customize-hook='chroot "$1" sh -c "python3 -m pip install --quiet --root-user-action=ignore --no-index --no-deps --break-system-packages /opt/sandq/wheels/*.whl"' \
  --customize-hook="copy-in $npm_dir/node_modules /usr/local/lib" \
  --customize-hook='ln -s usr/local/lib/node_modules "$1/node_modules"' \
  --customize-hook='ln -s ../lib/node_modules/npm/bin/npm-cli.js "$1/usr/local/bin/npm"' \
  --customize-hook='ln -s ../lib/node_modules/npm/bin/npx-cli.js "$1/usr/local/bin/npx"' \
  --customize-hook='chroot "$1" env HOME=/tmp npm --version >/dev/null' \
  --customize-hook='sed -i "s/^#font\.family:.*/font.family: sans-serif, Noto Sans CJK JP, Lohit Devanagari, Symbola/" "$1/etc/matplotlibrc"' \
  --customize-hook='grep -q "^font.family: sans-serif, Noto Sans CJK JP, Lohit Devanagari, Symbola" "$1/etc/matplotlibrc"' \
  --customize-hook='mkdir -p "$1/usr/share/sandq/matplotlib"' \
  --customize-hook='chroot "$1" env MPLCONFIGDIR=/usr/share/sandq/matplotlib python3 -c "import matplotlib.font_manager as fm; fm.fontManager"' \
  --customize-hook='ls "$1/usr/share/sandq/matplotlib"/fontlist-*.json' \
  --customize-hook="cat $here/sitecustomize-sandq.py >> \"\$1/etc/python3.13/sitecustomize.py\"" \
  --customize-hook='rm -rf "$1/opt/sandq/wheels" "$1/var/cache/apt"/*.bin "$1/var/lib/apt/lists"/*' \
  --customize-hook="copy-in $here/image-check.py $here/image-check.js /tmp" \
  --customize-hook='chroot "$1" python3 /tmp/image-check.py >/dev/null' \
  --customize-hook='chroot "$1" sh -c "cd / && node /tmp/image-check.js" >/dev/null' \
  --customize-hook='rm -f "$1/tmp/image-check.py" "$1/tmp/image-check.js"' \
  trixie "$build" >&2
mv "$build" "$dest/rootfs"
echo "$key built in $(( $(date +%s) - started )) s" > "$dest/.complete"
echo "sandbox rootfs built in $(( $(date +%s) - started )) s" >&2
echo "$dest/rootfs"
