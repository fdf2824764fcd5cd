#!/usr/bin/env bash
# Builds the local cluster's images as OCI archives, without a registry or a Docker engine, and
# imports them into containerd's `k8s.io` namespace (the one the kubelet's CRI uses):
#
#   sandq.local/pause:<K8S_VERSION>   the pause binary built by scripts/k8s-build.sh, alone
#   sandq.local/worker:<key>          Debian 12 (mmdebstrap, minbase) with what the worker runs
#                                     (ip, iptables, mkfs.ext4, mount, tar, prlimit, tini) and the
#                                     release sandq-worker and sandq-container; key = the hash of
#                                     the binaries, the package list and this script
#   sandq.local/gateway:<key>         the same Debian layer (its glibc and CA certificates: webhooks
#                                     over https) and the release sandq-gateway, run as uid 65532;
#                                     key = the hash of the binary and the layer
#   sandq.local/rootfs:<rootfs key>   the same Debian layer, and the sandbox image
#                                     (oci-bundles/build-rootfs.sh) at /rootfs: the worker pod's
#                                     init container copies it to the node (k8s/base)
#   sandq.local/keda:<KEDA_VERSION>   KEDA's operator and metrics adapter (static Go binaries)
#
# Arguments: the images to make (default all five), e.g. `k8s-images.sh pause`.
# Each archive is cached in $SANDQ_K8S_CACHE/images by its key; an import of an image that
# containerd already holds is skipped. Prints `NAME=REF` lines on stdout (pause, worker, gateway,
# rootfs, keda), which scripts/k8s-e2e.sh feeds to kustomize. Needs root, umoci and mmdebstrap, and a
# running containerd (scripts/k8s-up.sh).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
K8S_VERSION=${K8S_VERSION:-v1.34.4}
KEDA_VERSION=${KEDA_VERSION:-v2.20.2}
CACHE=${SANDQ_K8S_CACHE:-/var/cache/sandq/k8s}
SOCK=${SANDQ_K8S_CONTAINERD_SOCK:-/run/sandq-k8s/containerd/containerd.sock}
images=$CACHE/images
log() { echo "k8s-images: $*" >&2; }
mkdir -p "$images"
ctr() { command ctr --address "$SOCK" --namespace k8s.io "$@"; }

read -r k8s_out keda_out < <("$here/scripts/k8s-build.sh")
want=" ${*:-pause worker gateway rootfs keda} "
wanted() { [[ "$want" == *" $1 "* ]]; }

# oci_archive NAME TAG CONFIG-ARGS -- LAYER.tar...: an OCI image layout with these layers,
# tarred. `umoci raw add-layer` adds an uncompressed tar as it is (it gzips it).
oci_archive() {
  local name=$1 tag=$2 archive=$images/$1-$2.oci.tar
  shift 2
  local config=()
  while [ "$1" != -- ]; do config+=("$1"); shift; done
  shift
  if [ ! -f "$archive" ]; then
    local layout
    layout=$(mktemp -d "$images/.layout.XXXXXX")
    umoci init --layout "$layout/oci"
    umoci new --image "$layout/oci:$tag"
    local layer
    for layer in "$@"; do umoci raw add-layer --image "$layout/oci:$tag" "$layer"; done
    umoci config --image "$layout/oci:$tag" --author sandq --os linux --architecture amd64 "${config[@]}"
    umoci gc --layout "$layout/oci"
    tar -C "$layout/oci" -cf "$archive.partial" .
    mv "$archive.partial" "$archive"
    rm -rf "$layout"
    # The image's own layers are in the archive now; the shared Debian layer stays.
    for layer in "$@"; do if [[ "$layer" == "$images/$name-"* ]]; then rm -f "$layer"; fi; done
    log "built $archive ($(du -h "$archive" | cut -f1))"
  fi
  # Only the newest archive of each image stays (the worker's key changes with every build).
  local old
  for old in "$images/$name"-*.oci.tar "$images/$name"-*.layer.tar; do
    [ -e "$old" ] || continue
    case "$old" in "$archive"|"$images/$name-$tag".*) ;; *) rm -f "$old" ;; esac
  done
  local ref=sandq.local/$name:$tag
  if ! ctr images ls -q | grep -xF "$ref" >/dev/null; then
    # The layout names the image by its tag alone (org.opencontainers.image.ref.name); the
    # base name makes it a full reference.
    ctr images import --base-name "sandq.local/$name" --digests=false "$archive" >&2
    ctr images ls -q | grep -xF "$ref" >/dev/null || { log "containerd did not name the image $ref"; exit 1; }
    log "imported $ref"
  fi
  # k8s/overlays/local names the newest build `local`.
  ctr images tag --force "$ref" "sandq.local/$name:local" >/dev/null
  echo "$name=$ref"
}

# --- pause ---------------------------------------------------------------------------------------
if wanted pause; then
pause_layer=$images/pause-$K8S_VERSION.layer.tar
if [ ! -f "$pause_layer" ] && [ ! -f "$images/pause-$K8S_VERSION.oci.tar" ]; then
  tar -C "$k8s_out/pause" --owner=0 --group=0 --numeric-owner -cf "$pause_layer.partial" pause
  mv "$pause_layer.partial" "$pause_layer"
fi
oci_archive pause "$K8S_VERSION" --config.entrypoint /pause --config.user 65535:65535 -- "$pause_layer"
fi

# --- the Debian layer the worker, gateway and rootfs images share --------------------------------
base_packages="tini iproute2 iptables e2fsprogs util-linux mount tar ca-certificates libseccomp2 procps kmod"
base_key=$(echo "bookworm minbase $base_packages" | sha256sum | cut -c1-16)
base_layer=$images/debian-$base_key.layer.tar
for old in "$images"/debian-*.layer.tar; do [ "$old" = "$base_layer" ] || rm -f "$old"; done
if { wanted worker || wanted gateway || wanted rootfs; } && [ ! -f "$base_layer" ]; then
  log "mmdebstrap: Debian 12 minbase with $base_packages"
  rm -rf "$base_layer.partial"
  mmdebstrap --mode=root --variant=minbase --format=tar --quiet --include="${base_packages// /,}" \
    --customize-hook='rm -rf "$1"/var/cache/apt/* "$1"/var/lib/apt/lists/*' \
    bookworm "$base_layer.partial"
  mv "$base_layer.partial" "$base_layer"
fi

# --- worker --------------------------------------------------------------------------------------
bin=${SANDQ_RELEASE_BIN:-${CARGO_TARGET_DIR:-/var/cache/sandq/cargo-target}/release}
if [ -z "${SANDQ_RELEASE_BIN:-}" ]; then
  crates=()
  wanted worker && crates+=(-p sandq-worker)
  wanted gateway && crates+=(-p sandq-gateway)
  if [ ${#crates[@]} -gt 0 ]; then (cd "$here" && cargo build --release --locked -q "${crates[@]}"); fi
fi
if wanted worker; then
worker_key=$(cat "$bin/sandq-worker" "$bin/sandq-container" "$base_layer" | sha256sum | cut -c1-16)
worker_layer=$images/worker-$worker_key.layer.tar
if [ ! -f "$worker_layer" ] && [ ! -f "$images/worker-$worker_key.oci.tar" ]; then
  stage=$(mktemp -d "$images/.stage.XXXXXX")
  # Without their debug info (the release profile keeps it for profiling: 10x the size).
  install -D -s -m 755 "$bin/sandq-worker" "$stage/usr/local/bin/sandq-worker"
  install -D -s -m 755 "$bin/sandq-container" "$stage/usr/local/bin/sandq-container"
  tar -C "$stage" --owner=0 --group=0 --numeric-owner -cf "$worker_layer.partial" usr
  rm -rf "$stage"
  mv "$worker_layer.partial" "$worker_layer"
fi
# No entrypoint: the Deployment names its command (tini, a shell reading the rootfs path, the
# worker).
oci_archive worker "$worker_key" --config.env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
  -- "$base_layer" "$worker_layer"
fi

# --- gateway -------------------------------------------------------------------------------------
if wanted gateway; then
gateway_key=$(cat "$bin/sandq-gateway" "$base_layer" | sha256sum | cut -c1-16)
gateway_layer=$images/gateway-$gateway_key.layer.tar
if [ ! -f "$gateway_layer" ] && [ ! -f "$images/gateway-$gateway_key.oci.tar" ]; then
  stage=$(mktemp -d "$images/.stage.XXXXXX")
  install -D -s -m 755 "$bin/sandq-gateway" "$stage/usr/local/bin/sandq-gateway"
  tar -C "$stage" --owner=0 --group=0 --numeric-owner -cf "$gateway_layer.partial" usr
  rm -rf "$stage"
  mv "$gateway_layer.partial" "$gateway_layer"
fi
# Not root: the image runs as an unnamed uid (the Deployment's runAsUser is the same), which
# owns no file of the image.
oci_archive gateway "$gateway_key" --config.env PATH=/usr/local/bin:/usr/bin:/bin \
  --config.entrypoint /usr/local/bin/sandq-gateway --config.user 65532:65532 \
  --config.exposedports 8080/tcp -- "$base_layer" "$gateway_layer"
fi

# --- rootfs --------------------------------------------------------------------------------------
if wanted rootfs; then
rootfs=$("$here/oci-bundles/build-rootfs.sh" | tail -n 1)
rootfs_key=$(basename "$(dirname "$rootfs")")
rootfs_layer=$images/rootfs-$rootfs_key.layer.tar
if [ ! -f "$rootfs_layer" ] && [ ! -f "$images/rootfs-$rootfs_key.oci.tar" ]; then
  log "packing the sandbox image $rootfs_key"
  # The image names its build: the init container copies it to <cache>/rootfs/<key>.
  stage=$(mktemp -d "$images/.stage.XXXXXX")
  echo "$rootfs_key" > "$stage/sandq-rootfs-key"
  tar -C "$(dirname "$rootfs")" --numeric-owner --xattrs -cf "$rootfs_layer.partial" rootfs
  tar -C "$stage" --owner=0 --group=0 --numeric-owner -rf "$rootfs_layer.partial" sandq-rootfs-key
  rm -rf "$stage"
  mv "$rootfs_layer.partial" "$rootfs_layer"
fi
oci_archive rootfs "$rootfs_key" --config.env PATH=/usr/sbin:/usr/bin:/sbin:/bin -- "$base_layer" "$rootfs_layer"
fi

# --- KEDA ----------------------------------------------------------------------------------------
if wanted keda; then
keda_layer=$images/keda-$KEDA_VERSION.layer.tar
if [ ! -f "$keda_layer" ] && [ ! -f "$images/keda-$KEDA_VERSION.oci.tar" ]; then
  tar -C "$keda_out/bin" --owner=0 --group=0 --numeric-owner -cf "$keda_layer.partial" keda keda-adapter
  mv "$keda_layer.partial" "$keda_layer"
fi
oci_archive keda "$KEDA_VERSION" --config.user 1000:1000 -- "$keda_layer"
fi
