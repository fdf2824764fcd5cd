#!/usr/bin/env bash
# Brings up everything sandq needs on one machine, idempotently:
#   - RabbitMQ (127.0.0.1:5672, guest/guest) and Redis (127.0.0.1:6379): installed from Debian's
#     packages if missing, started if down;
#   - Garage, a real S3 server, single node (127.0.0.1:3900, region "garage"): built once with
#     `cargo install garage --locked` into $SANDQ_CACHE (keyed by version), started if down,
#     with a layout, an access key and the bucket "sandq";
#   - the sandbox image (oci-bundles/build-rootfs.sh, cached by content);
#   - the config file the worker and the CLI read by default ($SANDQ_CONFIG, default
#     /etc/sandq/sandq.toml).
# Needs root. Safe to run any number of times.
#
# Another instance of the services (CI brings up one from nothing per run, .ci/run) is chosen by
# environment variables; unset, each has the default above:
#   SANDQ_CONFIG            config file written (/etc/sandq/sandq.toml)
#   SANDQ_CACHE             builds cached by version and content (/var/cache/sandq)
#   SANDQ_REDIS_PORT        Redis port (6379)
#   SANDQ_REDIS_DIR         Redis working dir and log (/var/lib/redis, log /var/log/redis/ci.log)
#   SANDQ_GARAGE_DIR        Garage config, metadata, data, log and pid (/var/lib/sandq-garage)
#   SANDQ_GARAGE_PORT       Garage S3 port (3900); RPC and admin: SANDQ_GARAGE_RPC_PORT (3901),
#                           SANDQ_GARAGE_ADMIN_PORT (3903)
#   RABBITMQ_NODE_PORT      AMQP port (5672); RabbitMQ's own variable, like RABBITMQ_NODENAME,
#                           which rabbitmqctl also follows
#   SANDQ_RABBITMQ_DIR      when set, a RabbitMQ node of its own (RABBITMQ_NODENAME required,
#                           distribution port RABBITMQ_DIST_PORT, default AMQP port + 20000) keeps
#                           every file there, listens on 127.0.0.1 only and ignores /etc/rabbitmq;
#                           the dir must be reachable by the rabbitmq user
#   SANDQ_RABBITMQ_MANAGEMENT_PORT  with SANDQ_RABBITMQ_DIR: that node's management API on
#                           127.0.0.1:PORT (KEDA reads queue depth from it); unset: no plugin
set -euo pipefail

here=$(cd "$(dirname "$0")/.." && pwd)
cache=${SANDQ_CACHE:-/var/cache/sandq}
config=${SANDQ_CONFIG:-/etc/sandq/sandq.toml}
garage_version=2.5.0
garage_bin="$cache/garage-$garage_version/bin/garage"
garage_dir=${SANDQ_GARAGE_DIR:-/var/lib/sandq-garage}
garage_conf="$garage_dir/garage.toml"
garage_port=${SANDQ_GARAGE_PORT:-3900}
garage_rpc_port=${SANDQ_GARAGE_RPC_PORT:-3901}
garage_admin_port=${SANDQ_GARAGE_ADMIN_PORT:-3903}
redis_port=${SANDQ_REDIS_PORT:-6379}
amqp_port=${RABBITMQ_NODE_PORT:-5672}
log() { echo "services: $*" >&2; }

apt_updated=0
need_pkg() { # need_pkg COMMAND PACKAGE...
  command -v "$1" >/dev/null 2>&1 && return 0
  shift
  if [ $apt_updated = 0 ]; then apt-get update -qq >&2; apt_updated=1; fi
  log "installing $*"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >&2
}

wait_port() { # wait_port PORT SECONDS: whether 127.0.0.1:PORT accepts within SECONDS (0: now)
  local tries=$(( $2 * 5 ))
  for i in $(seq 0 "$tries"); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    [ "$i" -lt "$tries" ] && sleep 0.2
  done
  return 1
}

need_pkg cc build-essential   # cargo's linker and C build scripts (Garage, libseccomp-sys)
need_pkg pkg-config pkg-config
need_pkg python3 python3       # the sandbox image's build and the tests' Python client
# build-rootfs.sh fetches a wheel with pip (checked here: a change to that script is a change of
# the image's cache key, and rebuilds it).
if ! python3 -m pip --version >/dev/null 2>&1; then
  if [ $apt_updated = 0 ]; then apt-get update -qq >&2; apt_updated=1; fi
  log "installing python3-pip"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-pip >&2
fi
dpkg -s libseccomp-dev >/dev/null 2>&1 || { apt-get update -qq >&2; apt_updated=1; DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libseccomp-dev >&2; }
need_pkg curl curl
need_pkg ip iproute2
need_pkg iptables iptables   # the outbound network mode's NAT and firewall

# --- Redis ---------------------------------------------------------------------------------
need_pkg redis-server redis-server
if ! redis-cli -h 127.0.0.1 -p "$redis_port" ping >/dev/null 2>&1; then
  log "starting redis on port $redis_port"
  if [ -n "${SANDQ_REDIS_DIR:-}" ]; then
    redis_files=(--dir "$SANDQ_REDIS_DIR" --logfile "$SANDQ_REDIS_DIR/redis.log" --pidfile "$SANDQ_REDIS_DIR/redis.pid")
    mkdir -p "$SANDQ_REDIS_DIR"
  else
    redis_files=(--dir /var/lib/redis --logfile /var/log/redis/ci.log)
    mkdir -p /var/lib/redis /var/log/redis
  fi
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port "$redis_port" --save "" --appendonly no \
    "${redis_files[@]}" >&2
  wait_port "$redis_port" 30 || { log "redis did not start"; exit 1; }
fi

# --- RabbitMQ ------------------------------------------------------------------------------
need_pkg rabbitmq-server rabbitmq-server
if [ -n "${SANDQ_RABBITMQ_DIR:-}" ]; then
  # A node of its own: every file under the dir, nothing read from /etc/rabbitmq, loopback only.
  : "${RABBITMQ_NODENAME:?SANDQ_RABBITMQ_DIR needs RABBITMQ_NODENAME (e.g. sandq-ci@localhost)}"
  rabbitmq_dir=$SANDQ_RABBITMQ_DIR
  mkdir -p "$rabbitmq_dir/mnesia" "$rabbitmq_dir/log"
  [ -f "$rabbitmq_dir/enabled_plugins" ] || echo '[].' > "$rabbitmq_dir/enabled_plugins"
  touch "$rabbitmq_dir/rabbitmq.conf" "$rabbitmq_dir/rabbitmq-env.conf"
  # The management API on loopback, for KEDA's rabbitmq trigger (scripts/k8s-e2e.sh): it counts
  # a queue's ready and unacknowledged messages, where AMQP gives only the ready ones.
  if [ -n "${SANDQ_RABBITMQ_MANAGEMENT_PORT:-}" ]; then
    echo '[rabbitmq_management].' > "$rabbitmq_dir/enabled_plugins"
    grep -qs '^management.tcp.port' "$rabbitmq_dir/rabbitmq.conf" || printf 'management.tcp.port = %s\nmanagement.tcp.ip = 127.0.0.1\n' \
      "$SANDQ_RABBITMQ_MANAGEMENT_PORT" >> "$rabbitmq_dir/rabbitmq.conf"
  fi
  chown -R rabbitmq:rabbitmq "$rabbitmq_dir"
  su rabbitmq -s /bin/sh -c 'test -w "$0"' "$rabbitmq_dir/mnesia" \
    || { log "the rabbitmq user cannot write $rabbitmq_dir (a parent dir closed to it?)"; exit 1; }
  export RABBITMQ_NODE_PORT=$amqp_port RABBITMQ_NODE_IP_ADDRESS=127.0.0.1
  export RABBITMQ_DIST_PORT=${RABBITMQ_DIST_PORT:-$(( amqp_port + 20000 ))}
  export RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS="-kernel inet_dist_use_interface {127,0,0,1}"
  export RABBITMQ_MNESIA_BASE=$rabbitmq_dir/mnesia RABBITMQ_LOG_BASE=$rabbitmq_dir/log
  export RABBITMQ_PID_FILE=$rabbitmq_dir/rabbitmq.pid
  export RABBITMQ_ENABLED_PLUGINS_FILE=$rabbitmq_dir/enabled_plugins
  export RABBITMQ_CONFIG_FILE=$rabbitmq_dir/rabbitmq.conf RABBITMQ_CONF_ENV_FILE=$rabbitmq_dir/rabbitmq-env.conf
  export RABBITMQ_ADVANCED_CONFIG_FILE=$rabbitmq_dir/advanced.config
fi
# The largest message the broker takes: 16 MiB, above the largest valid job body (13 MiB with
# the default limits: code 1 MiB, stdin 8 MiB, 4 MiB for the rest; the worker's
# validate::max_body_bytes). With the broker's default, 128 MiB, a few oversized messages pinned
# ~1 GiB of a worker's memory before it refused them (test: the_broker_refuses_messages_over_16_mib). Read at the
# node's start.
rabbitmq_conf=${RABBITMQ_CONFIG_FILE:-/etc/rabbitmq/rabbitmq.conf}
mkdir -p "$(dirname "$rabbitmq_conf")"
grep -qs '^max_message_size' "$rabbitmq_conf" || echo 'max_message_size = 16777216' >>"$rabbitmq_conf"
if ! wait_port "$amqp_port" 1; then
  log "starting rabbitmq${RABBITMQ_NODENAME:+ node $RABBITMQ_NODENAME} on port $amqp_port"
  rabbitmq-server -detached >&2 || true
  wait_port "$amqp_port" 120 || { log "rabbitmq did not start"; exit 1; }
fi
# The port opens before the broker accepts connections; wait until it answers.
for attempt in $(seq 1 60); do
  rabbitmqctl -q await_startup >/dev/null 2>&1 && break
  [ "$attempt" = 60 ] && { log "rabbitmq${RABBITMQ_NODENAME:+ node $RABBITMQ_NODENAME} did not finish starting"; exit 1; }
  sleep 1
done

# --- Garage (S3) ---------------------------------------------------------------------------
if [ ! -x "$garage_bin" ]; then
  command -v cargo >/dev/null || { log "cargo not found: install Rust (rustup.rs), then run this again"; exit 1; }
  log "building garage $garage_version (once; ~15 minutes on 2 cores)"
  cargo install garage --version "$garage_version" --locked --root "$cache/garage-$garage_version" >&2
fi
mkdir -p "$garage_dir/meta" "$garage_dir/data"
# The config is written on every run (the ports may differ from the last one's), keeping the
# RPC secret of an existing one.
rpc_secret=$(sed -n 's/^rpc_secret = "\([0-9a-f]*\)"$/\1/p' "$garage_conf" 2>/dev/null || true)
[ -n "$rpc_secret" ] || rpc_secret=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
cat > "$garage_conf.tmp" <<EOF
metadata_dir = "$garage_dir/meta"
data_dir = "$garage_dir/data"
db_engine = "sqlite"
replication_factor = 1
rpc_bind_addr = "127.0.0.1:$garage_rpc_port"
rpc_public_addr = "127.0.0.1:$garage_rpc_port"
rpc_secret = "$rpc_secret"

[s3_api]
s3_region = "garage"
api_bind_addr = "127.0.0.1:$garage_port"
root_domain = ".s3.garage.localhost"

[admin]
api_bind_addr = "127.0.0.1:$garage_admin_port"
EOF
garage_server="garage -c $garage_conf server"   # its command line (any version), for pgrep and pkill
if cmp -s "$garage_conf.tmp" "$garage_conf"; then
  rm -f "$garage_conf.tmp"
else
  chmod 600 "$garage_conf.tmp"
  mv "$garage_conf.tmp" "$garage_conf"
  # A garage still running on the old config is replaced below by one on the new config.
  if pkill -KILL -f "$garage_server" 2>/dev/null; then log "garage config changed: restarting garage"; fi
fi
garage() { "$garage_bin" -c "$garage_conf" "$@"; }
if ! wait_port "$garage_port" 0 || ! pgrep -f "$garage_server" >/dev/null; then
  # A garage without its S3 listener (still shutting down, or it lost the port to one that
  # was) would hold the RPC port and never serve: kill it before starting a new one.
  pkill -KILL -f "$garage_server" 2>/dev/null || true
  for _ in $(seq 1 50); do pgrep -f "$garage_server" >/dev/null || break; sleep 0.1; done
  wait_port "$garage_port" 0 && { log "port $garage_port is taken by another program"; exit 1; }
  log "starting garage on port $garage_port ($garage_dir)"
  # setsid: its own session and process group, so that nothing cleaning up the caller's
  # process group (a CI step, a terminal closing) takes the S3 server down with it.
  setsid nohup "$garage_bin" -c "$garage_conf" server >>"$garage_dir/garage.log" 2>&1 < /dev/null &
  echo $! > "$garage_dir/garage.pid"
  wait_port "$garage_port" 60 || { log "garage did not start; see $garage_dir/garage.log"; exit 1; }
fi
for _ in $(seq 1 50); do garage status >/dev/null 2>&1 && break; sleep 0.2; done
# A fresh Garage has no layout: give this node a role and apply it. The output is captured
# before it is searched: `cmd | grep -q` under pipefail fails when grep exits early and the
# writer gets SIGPIPE, which once left a new machine's layout unassigned.
layout=$(garage layout show 2>&1) || { log "garage layout show failed: $layout"; exit 1; }
if grep -q "No nodes currently have a role" <<<"$layout"; then
  node=$(garage node id -q | cut -d@ -f1)
  log "garage: assigning a layout to node ${node:0:16}"
  garage layout assign -z dc1 -c 1G "$node" >/dev/null
  layout=$(garage layout show 2>&1)
fi
if grep -q "garage layout apply" <<<"$layout"; then
  # Staged changes (just assigned, or left by an interrupted earlier run): apply the version
  # the server proposes.
  version=$(sed -n 's/.*garage layout apply --version \([0-9][0-9]*\).*/\1/p' <<<"$layout")
  version=${version%%$'\n'*}
  [ -n "$version" ] || { log "garage: no version to apply in: $layout"; exit 1; }
  garage layout apply --version "$version" >/dev/null
fi
# The layout takes a moment to become active: retry the first admin call until it is ready.
for attempt in $(seq 1 50); do
  if garage key info sandq-key >/dev/null 2>&1 || garage key create sandq-key >/dev/null 2>&1; then break; fi
  [ "$attempt" = 50 ] && { log "garage: cannot create the access key (layout not ready?)"; garage layout show >&2 || true; exit 1; }
  sleep 0.2
done
garage bucket info sandq >/dev/null 2>&1 || garage bucket create sandq >/dev/null
garage bucket allow --read --write --owner sandq --key sandq-key >/dev/null
key_info=$(garage key info sandq-key --show-secret)
key_id=$(awk -F': *' '/Key ID/ {print $2; exit}' <<<"$key_info")
secret=$(awk -F': *' '/Secret key/ {print $2; exit}' <<<"$key_info")
[ -n "$key_id" ] && [ -n "$secret" ] || { log "cannot read garage key"; exit 1; }

# --- Sandbox image -------------------------------------------------------------------------
rootfs=$("$here/oci-bundles/build-rootfs.sh" | tail -n 1)

# --- Config --------------------------------------------------------------------------------
mkdir -p "$(dirname "$config")"
umask 077
cat > "$config.tmp" <<EOF
# Written by scripts/services.sh; read by sandq-worker and sandq (see docs/operations.md).
namespace = "sandq"

[amqp]
url = "amqp://guest:guest@127.0.0.1:$amqp_port/%2f"

[redis]
url = "redis://127.0.0.1:$redis_port/"

[s3]
endpoint = "http://127.0.0.1:$garage_port"
region = "garage"
bucket = "sandq"
access_key_id = "$key_id"
secret_access_key = "$secret"

[worker]
rootfs = "$rootfs"
EOF
mv "$config.tmp" "$config"
log "ready: rabbitmq, redis, garage (S3) and the sandbox image; config in $config"
