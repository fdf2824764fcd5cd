#!/usr/bin/env bash
# Starts a single-node Kubernetes cluster on this machine, from source (scripts/k8s-build.sh)
# and Debian's etcd, containerd, runc and CNI plugins; scripts/k8s-down.sh removes it and
# everything it made. Idempotent: a component already running is left alone.
#
#   etcd 3.4 (Debian)        127.0.0.1:12379, data in $DIR/etcd
#   kube-apiserver           https://10.210.0.1:6443 (the node address below, not 0.0.0.0)
#   kube-controller-manager, kube-scheduler (loopback ports), kube-proxy (iptables mode)
#   containerd 1.6 (Debian)  its own socket, root and state ($RUN/containerd), not the system's
#   kubelet                  node "sandq-node", cgroupfs driver (cgroups v1 or v2)
#   network                  a portless bridge sqk8s0 with the node address 10.210.0.1/32, so that
#                            no component listens on or sends to the machine's own networks;
#                            pods on the bridge sqk8sbr0 (CNI bridge plugin, 10.211.0.0/24,
#                            masqueraded); services 10.212.0.0/24
#
# Writes $DIR/admin.conf (kubeconfig for kubectl). Logs: $DIR/log/<component>.log.
# Env: SANDQ_K8S_DIR (/var/lib/sandq-k8s), SANDQ_K8S_RUN (/run/sandq-k8s), K8S_VERSION,
# KEDA_VERSION, SANDQ_K8S_CACHE (/var/cache/sandq/k8s). Needs root.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
export K8S_VERSION=${K8S_VERSION:-v1.34.4}
DIR=${SANDQ_K8S_DIR:-/var/lib/sandq-k8s}
RUN=${SANDQ_K8S_RUN:-/run/sandq-k8s}
NODE=sandq-node
NODE_IP=10.210.0.1
POD_CIDR=10.211.0.0/24
SVC_CIDR=10.212.0.0/24
API=https://$NODE_IP:6443
log() { echo "k8s-up: $(date -u +%T) $*" >&2; }
started=$(date +%s)

# --- packages from Debian ------------------------------------------------------------------------
need=()
command -v containerd >/dev/null || need+=(containerd)
command -v etcd >/dev/null || need+=(etcd-server)
[ -x /usr/lib/cni/bridge ] || need+=(containernetworking-plugins)
command -v umoci >/dev/null || need+=(umoci)
command -v conntrack >/dev/null || need+=(conntrack)
command -v mmdebstrap >/dev/null || need+=(mmdebstrap)
command -v runc >/dev/null || need+=(runc)
command -v openssl >/dev/null || need+=(openssl)
if [ ${#need[@]} -gt 0 ]; then
  log "installing ${need[*]}"
  apt-get update -qq >&2 || true
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
fi
# The Debian packages' own services stay off: this cluster runs its own instances.

read -r k8s_out _keda_out < <("$here/scripts/k8s-build.sh")
B=$k8s_out/bin
mkdir -p "$DIR"/{log,pki,kubeconfig,cni/net.d,cni/ipam,kubelet} "$RUN"
P=$DIR/pki

# --- network -------------------------------------------------------------------------------------
# A bridge without ports (this kernel has no dummy links): an address of the node alone.
ip link show sqk8s0 >/dev/null 2>&1 || ip link add sqk8s0 type bridge
ip addr replace "$NODE_IP/32" dev sqk8s0
ip link set sqk8s0 up
sysctl -qw net.ipv4.ip_forward=1
# Pods behind one bridge reach each other through a Service only when bridged frames pass
# iptables (kube-proxy's DNAT). The value before is kept for k8s-down.sh.
[ -f "$DIR/bridge-nf-call-iptables.before" ] || cat /proc/sys/net/bridge/bridge-nf-call-iptables > "$DIR/bridge-nf-call-iptables.before"
sysctl -qw net.bridge.bridge-nf-call-iptables=1
cat > "$DIR/cni/net.d/10-sandq.conflist" <<EOF
{
  "cniVersion": "0.4.0",
  "name": "sandq-k8s",
  "plugins": [
    {
      "type": "bridge",
      "bridge": "sqk8sbr0",
      "isGateway": true,
      "ipMasq": true,
      "hairpinMode": true,
      "ipam": {
        "type": "host-local",
        "ranges": [[{ "subnet": "$POD_CIDR" }]],
        "routes": [{ "dst": "0.0.0.0/0" }],
        "dataDir": "$DIR/cni/ipam"
      }
    }
  ]
}
EOF

# --- certificates --------------------------------------------------------------------------------
# One CA for the cluster, one for the aggregation layer's front proxy (KEDA's metrics API).
ca() { # ca NAME CN
  [ -f "$P/$1.crt" ] && return
  openssl req -x509 -newkey rsa:2048 -nodes -keyout "$P/$1.key" -out "$P/$1.crt" -days 30 -subj "/CN=$2" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign,digitalSignature" 2>/dev/null
}
cert() { # cert NAME CA SUBJECT [SAN]
  [ -f "$P/$1.crt" ] && return
  local ext="$P/$1.ext"
  printf 'basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth,clientAuth\n' > "$ext"
  [ -n "${4:-}" ] && echo "subjectAltName=$4" >> "$ext"
  openssl req -new -newkey rsa:2048 -nodes -keyout "$P/$1.key" -out "$P/$1.csr" -subj "$3" 2>/dev/null
  openssl x509 -req -in "$P/$1.csr" -CA "$P/$2.crt" -CAkey "$P/$2.key" -CAcreateserial -days 30 \
    -extfile "$ext" -out "$P/$1.crt" 2>/dev/null
  rm -f "$P/$1.csr" "$ext"
}
ca ca sandq-k8s-ca
ca front-proxy-ca sandq-k8s-front-proxy-ca
cert apiserver ca "/CN=kube-apiserver" \
  "IP:$NODE_IP,IP:10.212.0.1,IP:127.0.0.1,DNS:localhost,DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local"
cert apiserver-kubelet-client ca "/O=system:masters/CN=kube-apiserver-kubelet-client"
cert admin ca "/O=system:masters/CN=sandq-admin"
cert controller-manager ca "/CN=system:kube-controller-manager"
cert scheduler ca "/CN=system:kube-scheduler"
cert kube-proxy ca "/CN=system:kube-proxy"
cert kubelet-client ca "/O=system:nodes/CN=system:node:$NODE"
cert kubelet ca "/CN=$NODE" "IP:$NODE_IP,DNS:$NODE"
cert front-proxy-client front-proxy-ca "/CN=front-proxy-client"
[ -f "$P/sa.key" ] || { openssl genrsa -out "$P/sa.key" 2048 2>/dev/null; openssl rsa -in "$P/sa.key" -pubout -out "$P/sa.pub" 2>/dev/null; }
chmod 600 "$P"/*.key

kubeconfig() { # kubeconfig NAME CERT
  local f=$DIR/kubeconfig/$1.conf
  [ -f "$f" ] && return
  "$B/kubectl" config --kubeconfig="$f" set-cluster sandq --server="$API" --certificate-authority="$P/ca.crt" --embed-certs >/dev/null
  "$B/kubectl" config --kubeconfig="$f" set-credentials "$1" --client-certificate="$P/$2.crt" --client-key="$P/$2.key" --embed-certs >/dev/null
  "$B/kubectl" config --kubeconfig="$f" set-context default --cluster=sandq --user="$1" >/dev/null
  "$B/kubectl" config --kubeconfig="$f" use-context default >/dev/null
  chmod 600 "$f"
}
for c in admin controller-manager scheduler kube-proxy; do kubeconfig "$c" "$c"; done
kubeconfig kubelet kubelet-client
cp "$DIR/kubeconfig/admin.conf" "$DIR/admin.conf"
kubectl=("$B/kubectl" --kubeconfig="$DIR/admin.conf")

# --- processes -----------------------------------------------------------------------------------
running() { [ -f "$RUN/$1.pid" ] && kill -0 "$(cat "$RUN/$1.pid")" 2>/dev/null; }
start() { # start NAME CMD...: in its own session, logging to $DIR/log/NAME.log
  local name=$1; shift
  running "$name" && return
  log "starting $name"
  setsid "$@" >>"$DIR/log/$name.log" 2>&1 < /dev/null &
  echo $! > "$RUN/$name.pid"
}
wait_for() { # wait_for WHAT SECONDS CMD...
  local what=$1 seconds=$2; shift 2
  for _ in $(seq 1 "$seconds"); do "$@" >/dev/null 2>&1 && return 0; sleep 1; done
  log "$what did not come up in $seconds s; last lines of its log:"; return 1
}

start etcd etcd --name sandq --data-dir "$DIR/etcd" \
  --listen-client-urls http://127.0.0.1:12379 --advertise-client-urls http://127.0.0.1:12379 \
  --listen-peer-urls http://127.0.0.1:12380 --initial-advertise-peer-urls http://127.0.0.1:12380 \
  --initial-cluster sandq=http://127.0.0.1:12380 --listen-metrics-urls http://127.0.0.1:12381
wait_for etcd 30 curl -sf http://127.0.0.1:12381/health || { tail -n 20 "$DIR/log/etcd.log" >&2; exit 1; }

start kube-apiserver "$B/kube-apiserver" --etcd-servers=http://127.0.0.1:12379 \
  --bind-address="$NODE_IP" --advertise-address="$NODE_IP" --secure-port=6443 \
  --service-cluster-ip-range="$SVC_CIDR" --allow-privileged=true \
  --authorization-mode=Node,RBAC --enable-admission-plugins=NodeRestriction \
  --client-ca-file="$P/ca.crt" --tls-cert-file="$P/apiserver.crt" --tls-private-key-file="$P/apiserver.key" \
  --kubelet-client-certificate="$P/apiserver-kubelet-client.crt" --kubelet-client-key="$P/apiserver-kubelet-client.key" \
  --kubelet-certificate-authority="$P/ca.crt" --kubelet-preferred-address-types=InternalIP \
  --service-account-issuer=https://kubernetes.default.svc.cluster.local \
  --service-account-key-file="$P/sa.pub" --service-account-signing-key-file="$P/sa.key" \
  --requestheader-client-ca-file="$P/front-proxy-ca.crt" --requestheader-allowed-names=front-proxy-client \
  --requestheader-extra-headers-prefix=X-Remote-Extra- --requestheader-group-headers=X-Remote-Group \
  --requestheader-username-headers=X-Remote-User \
  --proxy-client-cert-file="$P/front-proxy-client.crt" --proxy-client-key-file="$P/front-proxy-client.key" \
  --enable-aggregator-routing=true --profiling=false
wait_for kube-apiserver 120 "${kubectl[@]}" get --raw /readyz || { tail -n 30 "$DIR/log/kube-apiserver.log" >&2; exit 1; }

start kube-controller-manager "$B/kube-controller-manager" --kubeconfig="$DIR/kubeconfig/controller-manager.conf" \
  --authentication-kubeconfig="$DIR/kubeconfig/controller-manager.conf" \
  --authorization-kubeconfig="$DIR/kubeconfig/controller-manager.conf" \
  --bind-address=127.0.0.1 --leader-elect=false --use-service-account-credentials=true \
  --cluster-signing-cert-file="$P/ca.crt" --cluster-signing-key-file="$P/ca.key" --root-ca-file="$P/ca.crt" \
  --service-account-private-key-file="$P/sa.key" --service-cluster-ip-range="$SVC_CIDR" \
  --allocate-node-cidrs=false --controllers='*,-cloud-node-lifecycle,-service-lb-controller,-node-route-controller'
start kube-scheduler "$B/kube-scheduler" --kubeconfig="$DIR/kubeconfig/scheduler.conf" \
  --authentication-kubeconfig="$DIR/kubeconfig/scheduler.conf" --authorization-kubeconfig="$DIR/kubeconfig/scheduler.conf" \
  --bind-address=127.0.0.1 --leader-elect=false

# containerd of its own: socket, root and state apart from a system containerd's.
cat > "$DIR/containerd.toml" <<EOF
version = 2
root = "$DIR/containerd"
state = "$RUN/containerd"
[grpc]
  address = "$RUN/containerd/containerd.sock"
[plugins."io.containerd.internal.v1.opt"]
  path = "$DIR/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "sandq.local/pause:$K8S_VERSION"
  # The kubelet asks for negative OOM scores (-998 for pod sandboxes), which need
  # CAP_SYS_RESOURCE; root on these machines lacks it (CapEff 000001fffeffffff). Clamp them at
  # containerd's own score instead of failing every pod.
  restrict_oom_score_adj = $( grep -q '^CapEff:.*' /proc/self/status && (( (0x$(awk '/^CapEff/ {print $2}' /proc/self/status) >> 24) & 1 )) && echo false || echo true )
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "$DIR/cni/net.d"
EOF
start containerd containerd --config "$DIR/containerd.toml"
wait_for containerd 30 ctr --address "$RUN/containerd/containerd.sock" version || { tail -n 20 "$DIR/log/containerd.log" >&2; exit 1; }
# The pause image before the kubelet makes its first pod sandbox.
SANDQ_K8S_CONTAINERD_SOCK=$RUN/containerd/containerd.sock "$here/scripts/k8s-images.sh" pause >/dev/null

cat > "$DIR/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
address: $NODE_IP
port: 10250
readOnlyPort: 0
healthzBindAddress: 127.0.0.1
authentication:
  anonymous: { enabled: false }
  webhook: { enabled: true }
  x509: { clientCAFile: $P/ca.crt }
authorization: { mode: Webhook }
tlsCertFile: $P/kubelet.crt
tlsPrivateKeyFile: $P/kubelet.key
cgroupDriver: cgroupfs
failCgroupV1: false
containerRuntimeEndpoint: unix://$RUN/containerd/containerd.sock
failSwapOn: false
podCIDR: $POD_CIDR
maxPods: 40
# A shared development machine's disk: evict late, and never collect the images, which no
# registry can give back. In bytes, not a share of the disk: a file system whose blocks are
# mostly reserved (ext4 resv_strict: 252 GB, of which a few GB were available to the rest
# of the machine, 2026-12-04) was under 2 % free while GBs remained, and every pod was evicted.
evictionHard: { memory.available: "200Mi", nodefs.available: "1Gi", imagefs.available: "1Gi", nodefs.inodesFree: "2%" }
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
serializeImagePulls: false
EOF
start kubelet "$B/kubelet" --config="$DIR/kubelet.yaml" --kubeconfig="$DIR/kubeconfig/kubelet.conf" \
  --root-dir="$DIR/kubelet" --hostname-override="$NODE" --node-ip="$NODE_IP" \
  --node-labels=sandq-worker=true
cat > "$DIR/kube-proxy.yaml" <<EOF
apiVersion: kubeproxy.config.k8s.io/v1alpha1
kind: KubeProxyConfiguration
clientConnection: { kubeconfig: $DIR/kubeconfig/kube-proxy.conf }
mode: iptables
clusterCIDR: 10.211.0.0/16
hostnameOverride: $NODE
bindAddress: $NODE_IP
healthzBindAddress: 127.0.0.1:10256
metricsBindAddress: 127.0.0.1:10249
nodePortAddresses: ["$NODE_IP/32"]
conntrack: { maxPerCore: 0 }
EOF
start kube-proxy "$B/kube-proxy" --config="$DIR/kube-proxy.yaml"

wait_for "node $NODE" 120 "${kubectl[@]}" wait --for=condition=Ready "node/$NODE" --timeout=1s \
  || { tail -n 30 "$DIR/log/kubelet.log" >&2; exit 1; }
log "cluster up in $(( $(date +%s) - started )) s: export KUBECONFIG=$DIR/admin.conf; $B/kubectl get nodes"
echo "$DIR/admin.conf"
