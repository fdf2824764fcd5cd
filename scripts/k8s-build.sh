#!/usr/bin/env bash
# Builds the Kubernetes components and KEDA from source, from the Go module proxy, and caches
# the binaries outside the repository keyed by version (like Garage in scripts/services.sh):
#
#   $SANDQ_K8S_CACHE/kubernetes-<K8S_VERSION>/bin/{kube-apiserver,kube-controller-manager,
#                                                kube-scheduler,kubelet,kubectl,kube-proxy}
#   $SANDQ_K8S_CACHE/keda-<KEDA_VERSION>/bin/{keda,keda-adapter}
#   $SANDQ_K8S_CACHE/keda-<KEDA_VERSION>/config/   (KEDA's own CRDs and RBAC, from its module)
#   $SANDQ_K8S_CACHE/pause-<K8S_VERSION>/pause     (build/pause/linux/pause.c, static)
#
# A finished build is marked by a `.done` file; a half-done one is redone. Prints nothing else
# on stdout; progress goes to stderr.
#
# Why these versions: Debian 12's containerd is 1.6 and the machines run cgroups v1 (hybrid).
# Kubernetes 1.35 made the kubelet refuse cgroups v1 by default and is the last to support
# containerd 1.x, so 1.34 is the newest release that runs here with its defaults. KEDA supports
# the three newest Kubernetes minors of its day; v2.20 covers 1.34 (keda.sh/docs/operate/cluster).
#
# The `k8s.io/kubernetes` module is not meant to be required: its go.mod pins every staging
# module (`k8s.io/api`, `k8s.io/client-go`, ...) at v0.0.0 with a replace to ./staging. A module
# of ours requires it and replaces each staging module with its published version (v0.<minor>.<patch>
# for v1.<minor>.<patch>), read from its go.mod, so the set stays right when the version moves.
set -euo pipefail
K8S_VERSION=${K8S_VERSION:-v1.34.4}
KEDA_VERSION=${KEDA_VERSION:-v2.20.2}
CACHE=${SANDQ_K8S_CACHE:-/var/cache/sandq/k8s}
export GOFLAGS=${GOFLAGS:--mod=mod}
export GOPATH=${GOPATH:-$CACHE/gopath}
export GOCACHE=${GOCACHE:-$CACHE/gocache}
export CGO_ENABLED=0
log() { echo "k8s-build: $*" >&2; }
mkdir -p "$CACHE"

k8s_out=$CACHE/kubernetes-$K8S_VERSION
# kube-proxy too: Services' cluster IPs (KEDA's API service, the in-cluster API server address)
# must route from pods.
k8s_cmds="kube-apiserver kube-controller-manager kube-scheduler kubelet kubectl kube-proxy"
if [ "$(cat "$k8s_out/.cmds" 2>/dev/null)" != "$k8s_cmds" ] || [ ! -f "$k8s_out/.done" ]; then
  started=$(date +%s)
  rm -rf "$k8s_out" && mkdir -p "$k8s_out/bin"
  work=$(mktemp -d "$CACHE/build-k8s.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  cd "$work"
  go mod init sandq.invalid/k8s-build >/dev/null 2>&1
  src=$(go mod download -json "k8s.io/kubernetes@$K8S_VERSION" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
  [ -d "$src" ] || { log "cannot download k8s.io/kubernetes@$K8S_VERSION"; exit 1; }
  staging_version=v0.${K8S_VERSION#v1.}
  go mod edit -require="k8s.io/kubernetes@$K8S_VERSION"
  grep -oE '^\s+k8s\.io/[a-z0-9-]+ => \./staging/' "$src/go.mod" | awk '{print $1}' | while read -r m; do
    go mod edit -replace="$m=$m@$staging_version"
  done
  cat > tools.go <<'EOF'
//go:build tools

package tools

import (
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubelet"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kube-proxy"
)
EOF
  log "resolving k8s.io/kubernetes@$K8S_VERSION (staging modules at $staging_version)"
  # Minimal version selection keeps kubernetes' own requirements: nothing here asks for newer.
  go mod tidy >/dev/null
  ldflags="-s -w -X k8s.io/component-base/version.gitVersion=$K8S_VERSION"
  ldflags+=" -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=$(echo "$K8S_VERSION" | cut -d. -f2)"
  ldflags+=" -X k8s.io/component-base/version.gitTreeState=clean -X k8s.io/component-base/version.buildDate=1970-01-01T00:00:00Z"
  ldflags+=" -X k8s.io/client-go/pkg/version.gitVersion=$K8S_VERSION"
  for cmd in $k8s_cmds; do
    log "building $cmd $K8S_VERSION"
    go build -trimpath -ldflags "$ldflags" -o "$k8s_out/bin/$cmd" "k8s.io/kubernetes/cmd/$cmd"
  done
  # The pause container: build/pause/linux/pause.c from the same release, linked statically.
  mkdir -p "$k8s_out/pause"
  gcc -Os -static -Wall -Werror -DVERSION="$K8S_VERSION" -o "$k8s_out/pause/pause" "$src/build/pause/linux/pause.c"
  strip "$k8s_out/pause/pause"
  cd / && rm -rf "$work" && trap - EXIT
  echo "$k8s_cmds" > "$k8s_out/.cmds"
  echo "$K8S_VERSION built in $(( $(date +%s) - started )) s on $(date -u +%FT%TZ)" > "$k8s_out/.done"
  log "$(cat "$k8s_out/.done")"
fi

keda_out=$CACHE/keda-$KEDA_VERSION
if [ ! -f "$keda_out/.done" ]; then
  started=$(date +%s)
  rm -rf "$keda_out" && mkdir -p "$keda_out/bin"
  src=$(cd "$CACHE" && GOFLAGS= go mod download -json "github.com/kedacore/keda/v2@$KEDA_VERSION" | sed -n 's/^\t"Dir": "\(.*\)",$/\1/p')
  [ -d "$src" ] || { log "cannot download github.com/kedacore/keda/v2@$KEDA_VERSION"; exit 1; }
  work=$(mktemp -d "$CACHE/build-keda.XXXXXX")
  trap 'rm -rf "$work"' EXIT
  # Its module as it is, with its own go.mod and go.sum (it has replace directives of its own).
  cp -r "$src/." "$work/" && chmod -R u+w "$work" && cd "$work"
  ldflags="-s -w -X github.com/kedacore/keda/v2/version.Version=${KEDA_VERSION#v} -X github.com/kedacore/keda/v2/version.GitCommit=module-proxy"
  log "building keda operator $KEDA_VERSION"
  go build -trimpath -ldflags "$ldflags" -o "$keda_out/bin/keda" ./cmd/operator
  log "building keda metrics adapter $KEDA_VERSION"
  go build -trimpath -ldflags "$ldflags" -o "$keda_out/bin/keda-adapter" ./cmd/adapter
  cp -r config "$keda_out/config"
  cd / && rm -rf "$work" && trap - EXIT
  echo "$KEDA_VERSION built in $(( $(date +%s) - started )) s on $(date -u +%FT%TZ)" > "$keda_out/.done"
  log "$(cat "$keda_out/.done")"
fi
# The binaries are what is kept: the module downloads and the build cache (~8 GB) go once
# both builds are done (a new version rebuilds from the proxy in ~6 min each).
rm -rf "$CACHE/gocache" "$CACHE/gopath" 2>/dev/null || { chmod -R u+w "$CACHE/gopath" 2>/dev/null; rm -rf "$CACHE/gopath"; }
echo "$k8s_out $keda_out"
