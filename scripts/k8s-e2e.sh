#!/usr/bin/env bash
# The end-to-end run on Kubernetes (issue "Kubernetes for real", docs/kubernetes.md):
#   1. the cluster (scripts/k8s-up.sh: Kubernetes and KEDA built from source, Debian's etcd,
#      containerd, runc and CNI plugins), its images (scripts/k8s-images.sh);
#   2. a services instance of its own (scripts/services.sh: RabbitMQ with its management API,
#      Redis, Garage, on loopback ports 26000-26007), relayed to the pods on the node address;
#   3. KEDA (k8s/keda over KEDA's own config), the Secrets, then both overlays validated by the
#      API server (server-side dry run, KEDA's CRDs installed), and k8s/overlays/local applied;
#   4. scripts/k8s_e2e.py from the host through the pods: the README's main job, a job through
#      the gateway's Service (a tenant key made in this run's Redis; a wrong key refused), hostile
#      programs, network modes, clean-up, then autoscaling (a backlog scales the S pool from 1
#      to 4 pods and back; no job lost, one terminal result each), with the replica counts
#      written to $SANDQ_K8S_REPORT (default docs/img/k8s-replicas.csv);
#   5. scripts/k8s-down.sh, whatever happened (SANDQ_K8S_KEEP=1 keeps the cluster up).
# Exit 0 only if every check passed. Needs root; about 10-25 min on a 2-core machine with the
# builds cached (docs/kubernetes.md gives the steps' times).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
export K8S_VERSION=${K8S_VERSION:-v1.34.4} KEDA_VERSION=${KEDA_VERSION:-v2.20.2}
DIR=${SANDQ_K8S_DIR:-/var/lib/sandq-k8s}
RUN=${SANDQ_K8S_RUN:-/run/sandq-k8s}
CACHE=${SANDQ_K8S_CACHE:-/var/cache/sandq/k8s}
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-/var/cache/sandq/cargo-target}
NODE_IP=10.210.0.1
started=$(date +%s)
step_started=$started
times=()
step() { # step NAME: closes the previous step's timer
  local now; now=$(date +%s)
  [ -n "${current:-}" ] && times+=("$current: $(( now - step_started )) s")
  current=$1; step_started=$now
  echo "k8s-e2e: $(date -u +%T) == $1" >&2
}
finish() {
  local status=$?
  set +e
  step done
  echo "k8s-e2e: step times:" >&2; printf '  %s\n' "${times[@]}" >&2
  if [ "$status" != 0 ] && [ -f "$DIR/admin.conf" ]; then
    echo "k8s-e2e: FAILED; pods and the last worker log lines:" >&2
    "$CACHE/kubernetes-$K8S_VERSION/bin/kubectl" --kubeconfig="$DIR/admin.conf" get pods -A -o wide >&2
    for p in $("$CACHE/kubernetes-$K8S_VERSION/bin/kubectl" --kubeconfig="$DIR/admin.conf" -n sandq get pods -o name 2>/dev/null); do
      echo "--- $p" >&2
      "$CACHE/kubernetes-$K8S_VERSION/bin/kubectl" --kubeconfig="$DIR/admin.conf" -n sandq logs "$p" --all-containers --tail=15 >&2
    done
  fi
  if [ "${SANDQ_K8S_KEEP:-0}" = 1 ]; then
    echo "k8s-e2e: the cluster stays up (SANDQ_K8S_KEEP=1): KUBECONFIG=$DIR/admin.conf; scripts/k8s-down.sh removes it" >&2
  else
    "$here/scripts/k8s-down.sh"
  fi
  echo "k8s-e2e: finished in $(( $(date +%s) - started )) s (exit $status)" >&2
  exit "$status"
}
trap finish EXIT

step "build Kubernetes and KEDA (cached by version)"
"$here/scripts/k8s-build.sh" >/dev/null
step "the worker's and the gateway's release build"
cargo build --release --locked -q -p sandq-worker -p sandq-gateway -p sandq-cli
bin=$CARGO_TARGET_DIR/release
step "cluster up"
"$here/scripts/k8s-down.sh" 2>/dev/null   # nothing of an earlier run left
"$here/scripts/k8s-up.sh" >/dev/null
export KUBECONFIG=$DIR/admin.conf
kubectl() { "$CACHE/kubernetes-$K8S_VERSION/bin/kubectl" "$@"; }

step "images (OCI archives imported into containerd)"
SANDQ_RELEASE_BIN=$bin SANDQ_K8S_CONTAINERD_SOCK=$RUN/containerd/containerd.sock \
  "$here/scripts/k8s-images.sh" worker gateway rootfs keda | tee "$DIR/images.txt" >&2

step "services instance, relayed to the node address"
svc=$DIR/services
mkdir -p "$svc/tmp" && chmod 755 "$DIR" "$svc" && chmod 1777 "$svc/tmp"
export SANDQ_CONFIG=$svc/sandq.toml SANDQ_REDIS_PORT=26000 SANDQ_REDIS_DIR=$svc/redis
export RABBITMQ_NODENAME=sandq-k8s@localhost RABBITMQ_NODE_PORT=26001 RABBITMQ_DIST_PORT=26002
export SANDQ_RABBITMQ_DIR=$svc/rabbitmq SANDQ_RABBITMQ_MANAGEMENT_PORT=26007
export SANDQ_GARAGE_DIR=$svc/garage SANDQ_GARAGE_PORT=26003 SANDQ_GARAGE_RPC_PORT=26004 SANDQ_GARAGE_ADMIN_PORT=26005
"$here/scripts/services.sh" >&2
for port in 26000 26001 26003 26007; do
  # exec -a names the relays for k8s-down.sh.
  setsid bash -c "exec -a sandq-k8s-relay socat TCP-LISTEN:$port,bind=$NODE_IP,fork,reuseaddr TCP:127.0.0.1:$port" \
    >/dev/null 2>&1 < /dev/null &
done
# The worker's credentials, from the instance's config, with the node address for loopback.
read -r amqp_url redis_url key_id secret < <(python3 - "$SANDQ_CONFIG" <<'EOF'
import sys, tomllib
c = tomllib.load(open(sys.argv[1], "rb"))
print(c["amqp"]["url"], c["redis"]["url"], c["s3"]["access_key_id"], c["s3"]["secret_access_key"])
EOF
)
node() { sed "s/127\.0\.0\.1/$NODE_IP/" <<<"$1"; }

step "KEDA"
keda=$DIR/keda-apply
rm -rf "$keda" && mkdir -p "$keda"
cp -r "$CACHE/keda-$KEDA_VERSION/config" "$keda/config" && chmod -R u+w "$keda/config"
cp k8s/keda/kustomization.yaml "$keda/"
kubectl apply --server-side -k "$keda" >/dev/null
kubectl -n keda rollout status deploy/keda-operator --timeout=300s >&2
kubectl -n keda rollout status deploy/keda-metrics-apiserver --timeout=300s >&2
kubectl wait --for=condition=Available apiservice/v1beta1.external.metrics.k8s.io --timeout=300s >&2

step "manifests: server-side dry run of both overlays, then apply local"
kubectl apply -f k8s/base/namespace.yaml >/dev/null
kubectl -n sandq create secret generic sandq-worker --dry-run=client -o yaml \
  --from-literal=SANDQ__AMQP__URL="$(node "$amqp_url")" --from-literal=SANDQ__REDIS__URL="$(node "$redis_url")" \
  --from-literal=SANDQ__S3__ACCESS_KEY_ID="$key_id" --from-literal=SANDQ__S3__SECRET_ACCESS_KEY="$secret" \
  | kubectl apply -f - >/dev/null
# The gateway's: the same instance and users here (a cluster of yours gives it users of its own).
kubectl -n sandq create secret generic sandq-gateway --dry-run=client -o yaml \
  --from-literal=SANDQ__AMQP__URL="$(node "$amqp_url")" --from-literal=SANDQ__REDIS__URL="$(node "$redis_url")" \
  --from-literal=SANDQ__S3__ACCESS_KEY_ID="$key_id" --from-literal=SANDQ__S3__SECRET_ACCESS_KEY="$secret" \
  | kubectl apply -f - >/dev/null
kubectl -n sandq create secret generic sandq-keda --dry-run=client -o yaml \
  --from-literal=rabbitmq-management-url="http://guest:guest@$NODE_IP:26007/" | kubectl apply -f - >/dev/null
for overlay in local production; do
  out=$(kubectl apply --dry-run=server -k "k8s/overlays/$overlay" 2>&1) || { echo "$out" >&2; echo "k8s-e2e: the API server refused k8s/overlays/$overlay" >&2; exit 1; }
  echo "$out" | sed "s/^/  $overlay: /" >&2
  if kubectl kustomize "k8s/overlays/$overlay" | grep -n REPLACE_ME >/dev/null && [ "$overlay" = local ]; then
    echo "k8s-e2e: REPLACE_ME left in the local overlay" >&2; exit 1
  fi
done
kubectl apply -k k8s/overlays/local >&2

step "worker and gateway pods Ready (the first worker copies the rootfs to the node)"
for pool in s m; do
  kubectl -n sandq rollout status "deploy/sandq-worker-$pool" --timeout=900s >&2
done
# One replica from the Deployment, the second from its HPA's minimum (k8s_e2e.py checks both).
kubectl -n sandq rollout status deploy/sandq-gateway --timeout=300s >&2
kubectl -n sandq get pods -o wide >&2

step "jobs through the pods, hostile programs, autoscaling (scripts/k8s_e2e.py)"
python3 "$here/scripts/k8s_e2e.py" --sandq "$bin/sandq" --kubectl "$CACHE/kubernetes-$K8S_VERSION/bin/kubectl" \
  --gateway "http://$NODE_IP:30080" \
  --report "${SANDQ_K8S_REPORT:-$here/docs/img/k8s-replicas.csv}"
