#!/usr/bin/env bash
# The notebook runner's own tests (oci-bundles/runner/tests) run by the sandbox image's own
# interpreter, with the image's packages (IPython, pandas, matplotlib, cloudpickle...: what the
# runner meets in a sandbox), so that no test is skipped for want of one; a skip that names a
# missing module fails the run. Run by scripts/test.sh; needs root (a mount namespace, chroot).
#
# The image (oci-bundles/build-rootfs.sh, cached under $SANDQ_CACHE) is used read-only: in a
# private mount namespace it is bind-mounted read-only, a tmpfs goes on its /tmp, and the runner
# and a pytest made for the image's Python version (pure Python, pinned in
# oci-bundles/runner/tests/requirements.txt; packaging and pygments come from the image) are
# bind-mounted read-only under it. That pytest is cached under $SANDQ_CACHE by the pins and the
# image's Python version, made once under a lock, `.complete` last.
#
# Environment: SANDQ_ROOTFS (default: what oci-bundles/build-rootfs.sh prints, building it if
# needed), SANDQ_CACHE (/var/cache/sandq), SANDQ_PIP_PYTHON (a python3 with pip: python3).
set -euo pipefail
cd "$(dirname "$0")/.."

cache=${SANDQ_CACHE:-/var/cache/sandq}
rootfs=${SANDQ_ROOTFS:-}
if [ -z "$rootfs" ]; then
  built=$(oci-bundles/build-rootfs.sh)
  rootfs=${built##*$'\n'}
fi
[ -x "$rootfs/usr/bin/python3" ] || { echo "no sandbox image at $rootfs" >&2; exit 1; }
# The image's Python version, read from its python3 link (nothing runs in the shared image).
version=$(readlink "$rootfs/usr/bin/python3")
version=${version#python}
[[ $version =~ ^3\.[0-9]+$ ]] || { echo "cannot tell the image's Python version ($rootfs/usr/bin/python3)" >&2; exit 1; }

requirements=oci-bundles/runner/tests/requirements.txt
key=$( (cat "$requirements"; echo "$version") | sha256sum | cut -c1-16)
site=$cache/runner-pytest-$key
mkdir -p "$cache"
(
  flock 9
  if [ ! -f "$site/.complete" ]; then
    rm -rf "$site" "$site.tmp"
    "${SANDQ_PIP_PYTHON:-python3}" -m pip install --quiet --disable-pip-version-check --no-compile --no-deps \
      --only-binary=:all: --implementation py --python-version "$version" --target "$site.tmp" -r "$requirements"
    touch "$site.tmp/.complete"
    mv "$site.tmp" "$site"
  fi
) 9>"$site.lock"

root=$(mktemp -d)
trap 'rmdir "$root"' EXIT
set +e
out=$(unshare --mount --propagation private -- bash -euo pipefail -c '
  rootfs=$1 runner=$2 site=$3 root=$4
  mount --bind "$rootfs" "$root"
  mount -o remount,bind,ro "$root"
  mount -t tmpfs -o size=1g,mode=1777 tmpfs "$root/tmp"
  mkdir "$root/tmp/runner" "$root/tmp/pytest"
  mount --bind "$runner" "$root/tmp/runner"
  mount -o remount,bind,ro "$root/tmp/runner"
  mount --bind "$site" "$root/tmp/pytest"
  mount -o remount,bind,ro "$root/tmp/pytest"
  mount --rbind /dev "$root/dev"
  mount -t proc proc "$root/proc"
  exec chroot "$root" /usr/bin/env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/tmp LANG=C.UTF-8 \
    PYTHONPATH=/tmp/pytest PYTHONDONTWRITEBYTECODE=1 python3 -m pytest -q -p no:cacheprovider -rfs /tmp/runner/tests
' runner-tests "$rootfs" "$PWD/oci-bundles/runner" "$site" "$root" 2>&1)
status=$?
set -e
printf '%s\n' "$out"
if grep -q '^SKIPPED.*could not import' <<<"$out"; then
  echo "runner tests: a test was skipped for want of a package the sandbox image should have" >&2
  status=1
fi
exit "$status"
