#!/usr/bin/env bash
# Removes the cluster of scripts/k8s-up.sh and everything it made: its processes, the pods'
# containers and the sandboxes the worker pods started, their cgroups, mounts and network
# namespaces, the links sqk8s0 and sqk8sbr0, kube-proxy's and the CNI plugins' iptables rules,
# the relays and services instance of scripts/k8s-e2e.sh, and $SANDQ_K8S_DIR and $SANDQ_K8S_RUN.
# The builds and images cached by version ($SANDQ_K8S_CACHE) stay. Safe to run any number of
# times, and on a half-started cluster. Needs root.
set -uo pipefail
DIR=${SANDQ_K8S_DIR:-/var/lib/sandq-k8s}
RUN=${SANDQ_K8S_RUN:-/run/sandq-k8s}
CACHE=${SANDQ_K8S_CACHE:-/var/cache/sandq/k8s}
K8S_VERSION=${K8S_VERSION:-v1.34.4}
log() { echo "k8s-down: $*" >&2; }

stop() { # stop NAME: SIGTERM, then SIGKILL after 10 s
  local f=$RUN/$1.pid pid
  [ -f "$f" ] || return 0
  pid=$(cat "$f")
  if kill -0 "$pid" 2>/dev/null; then
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 1 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null
  fi
  rm -f "$f"
}

# The kubelet first, so that nothing restarts what goes next; then every pod's processes.
stop kubelet
if [ -S "$RUN/containerd/containerd.sock" ]; then
  for task in $(ctr --address "$RUN/containerd/containerd.sock" -n k8s.io tasks ls -q 2>/dev/null); do
    ctr --address "$RUN/containerd/containerd.sock" -n k8s.io tasks kill -s SIGKILL "$task" >/dev/null 2>&1
  done
fi
# Whatever is left in the pods' cgroups (the worker pods' sandboxes are nested there).
kill_cgroup_tree() { # kill_cgroup_tree DIR: SIGKILL every process below, then remove the dirs
  local d=$1 p
  [ -d "$d" ] || return 0
  for _ in 1 2 3; do
    while read -r procs; do
      for p in $(cat "$procs" 2>/dev/null); do kill -KILL "$p" 2>/dev/null; done
    done < <(find "$d" -name cgroup.procs 2>/dev/null)
    sleep 0.3
  done
  find "$d" -depth -type d -exec rmdir {} \; 2>/dev/null
}
for root in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods /sys/fs/cgroup/kubepods.slice; do
  kill_cgroup_tree "$root"
done
for name in kube-proxy kube-scheduler kube-controller-manager kube-apiserver etcd containerd; do stop "$name"; done
pkill -KILL -f "containerd-shim-runc-v2 .*$RUN/containerd" 2>/dev/null
# The relays run as `exec -a sandq-k8s-relay socat ...`: their command line starts with that name
# (no "socat" in it).
pkill -KILL -f "^sandq-k8s-relay TCP-LISTEN:" 2>/dev/null
stop relays

# The e2e run's services instance (scripts/k8s-e2e.sh).
svc=$DIR/services
if [ -d "$svc" ]; then
  [ -f "$svc/rabbitmq/rabbitmq.pid" ] && RABBITMQ_NODENAME=sandq-k8s@localhost timeout 60 rabbitmqctl -q shutdown >/dev/null 2>&1
  [ -f "$svc/redis/redis.pid" ] && timeout 10 redis-cli -p 26000 shutdown nosave >/dev/null 2>&1
  pkill -KILL -f "$svc/" 2>/dev/null
fi

# Mounts below the dirs (deepest first), and the network namespaces the CNI plugins made.
for m in $(awk -v a="$DIR/" -v b="$RUN/" 'index($5, a) == 1 || index($5, b) == 1 || $5 == substr(b, 1, length(b) - 1) { print $5 }' /proc/self/mountinfo | sort -r); do
  umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null
done
for ns in $(ip netns list 2>/dev/null | awk '/^cni-/ {print $1}'); do ip netns delete "$ns" 2>/dev/null; done

# Network: links, kube-proxy's rules (its own clean-up), the CNI plugins' NAT chains.
ip link delete sqk8sbr0 2>/dev/null
ip link delete sqk8s0 2>/dev/null
proxy=$CACHE/kubernetes-$K8S_VERSION/bin/kube-proxy
[ -x "$proxy" ] && "$proxy" --cleanup >/dev/null 2>&1
# The bridge plugin's masquerading: a POSTROUTING rule per pod, commented with the network's
# name, jumping to a chain of its own.
chains=$(iptables -t nat -S POSTROUTING 2>/dev/null | grep -F '"sandq-k8s"' | grep -oE -- '-j CNI-[0-9a-f]+' | cut -c4- | sort -u)
iptables -t nat -S POSTROUTING 2>/dev/null | grep -F '"sandq-k8s"' | sed 's/^-A/-D/' | while read -r rule; do
  eval "iptables -t nat $rule" 2>/dev/null
done
for chain in $chains; do iptables -t nat -F "$chain" 2>/dev/null; iptables -t nat -X "$chain" 2>/dev/null; done
if [ -f "$DIR/bridge-nf-call-iptables.before" ]; then
  sysctl -qw "net.bridge.bridge-nf-call-iptables=$(cat "$DIR/bridge-nf-call-iptables.before")"
fi

rm -rf "$DIR" "$RUN"
[ -e "$DIR" ] && log "WARNING: could not remove $DIR"
left=$(pgrep -af "$DIR/|$RUN/|kube-apiserver|kube-controller-manager|kube-scheduler|kubelet --config=$DIR" | grep -v pgrep)
[ -n "$left" ] && log "WARNING: processes left: $left"
log "removed"
