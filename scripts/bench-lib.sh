# Shared by the benchmark scripts that compare sandq with runc and a chrooted python3
# (scripts/bench-anchors.sh, scripts/bench-forked.sh): source it, don't run it.

# Installs hyperfine and runc (Debian's) when missing.
bench_tools() {
  local missing=()
  command -v hyperfine >/dev/null || missing+=(hyperfine)
  command -v runc >/dev/null || missing+=(runc)
  if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >&2
  fi
}

# The environment every anchor runs with: a sandbox's, less what is sandq's own.
bench_env=(PATH=/usr/local/bin:/usr/bin:/bin HOME=/tmp TMPDIR=/tmp LANG=C.UTF-8 MPLBACKEND=Agg MPLCONFIGDIR=/tmp/matplotlib PYTHONDONTWRITEBYTECODE=1)

# Writes a runc bundle in $1 running $4... as root in $3 (cwd) on the rootfs $2, read-only, with
# runc's default spec, a tmpfs /tmp and, when BENCH_WORK is set, that directory bound at /work.
runc_bundle() {
  local bundle=$1 rootfs=$2 cwd=$3
  shift 3
  mkdir -p "$bundle"
  runc spec --bundle "$bundle"
  python3 - "$bundle/config.json" "$rootfs" "$cwd" "${BENCH_WORK:-}" "$*" "${bench_env[@]}" <<'PY'
import json, shlex, sys
path, rootfs, cwd, work, args, *env = sys.argv[1:]
spec = json.load(open(path))
spec["root"] = {"path": rootfs, "readonly": True}
p = spec["process"]
p["terminal"] = False
p["env"] = env
p["user"] = {"uid": 0, "gid": 0}
p["args"], p["cwd"] = shlex.split(args), cwd
spec["mounts"].append({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev", "mode=1777"]})
if work:
    spec["mounts"].append({"destination": "/work", "type": "bind", "source": work, "options": ["rbind", "rw"]})
json.dump(spec, open(path, "w"))
PY
}

# The command running $3 in /mnt (the job dir $2 bound there) chrooted into the rootfs $1, in a
# private mount namespace with a tmpfs /tmp.
chroot_cmd() {
  echo "unshare -m sh -c 'mount -t tmpfs tmpfs $1/tmp && mount --bind $2 $1/mnt && exec chroot $1 env -i ${bench_env[*]} sh -c \"cd /mnt && exec $3\"'"
}
