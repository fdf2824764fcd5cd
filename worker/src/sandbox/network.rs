//! The `outbound` network mode: a sandbox gets a veth pair on the host bridge `sandq0`
//! (10.213.0.0/16, gateway 10.213.0.1), NAT to the outside, and nothing else:
//!
//! - no inbound connection (FORWARD drops new connections towards the bridge);
//! - no connection to the worker's host (INPUT drops everything from the bridge);
//! - no private (10/8, 172.16/12, 192.168/16), carrier-grade NAT (100.64/10) or link-local
//!   (169.254/16, cloud metadata) destination;
//! - no traffic between sandboxes (bridge ports are `isolated`);
//! - no IPv6 at all: off on the bridge, the host's veth ends and inside the sandbox, and
//!   `ip6tables` drops anything from or to the bridge (security review F4).
//!
//! [`setup_host`] runs once at worker start (idempotent); [`attach`] runs in the helper for each
//! outbound container, between create and start. Addresses are handed out host-wide through
//! files in [`ADDRESS_DIR`] created with `O_EXCL` (the file name is the address, its content
//! the container's state dir); the helper removes its file after delete, and
//! `sandq-container cleanup` removes those of dead containers.

use std::net::Ipv4Addr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::process::Command;

/// The host bridge.
pub const BRIDGE: &str = "sandq0";
/// The sandboxes' subnet.
pub const SUBNET: &str = "10.213.0.0/16";
/// The gateway (the bridge's address).
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 1);
/// Where address reservations live (tmpfs: gone at reboot, as the bridge is).
pub const ADDRESS_DIR: &str = "/run/sandq/net";

fn run(program: &str, args: &[&str]) -> Result<(), String> {
    // The helper runs with an empty environment: name the system directories.
    let out = Command::new(program)
        .args(args)
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .output()
        .map_err(|e| format!("{program}: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(format!("{program} {}: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim()))
    }
}

fn ensure_rule(table: &str, rule: &[&str]) -> Result<(), String> {
    ensure_rule_with("iptables", table, rule)
}

/// Like [`ensure_rule_with`], but inserted first in its chain: a host's own earlier ACCEPT
/// rules (sshd on INPUT, say) must not let a sandbox through (security re-review).
fn ensure_rule_first(program: &str, table: &str, rule: &[&str]) -> Result<(), String> {
    let mut check = vec!["-t", table, "-C"];
    check.extend_from_slice(rule);
    if run(program, &check).is_ok() {
        return Ok(());
    }
    let mut insert = vec!["-t", table, "-I", rule[0], "1"];
    insert.extend_from_slice(&rule[1..]);
    run(program, &insert)
}

fn ensure_rule_with(program: &str, table: &str, rule: &[&str]) -> Result<(), String> {
    let mut check = vec!["-t", table, "-C"];
    check.extend_from_slice(rule);
    if run(program, &check).is_ok() {
        return Ok(());
    }
    let mut append = vec!["-t", table, "-A"];
    append.extend_from_slice(rule);
    run(program, &append)
}

/// Turns IPv6 off on `device` in the network namespace the caller is in (the sysctl files of
/// `/proc/sys/net` belong to the namespace of the process that opens them). A no-op on a
/// kernel without IPv6.
fn disable_ipv6(device: &str) -> Result<(), String> {
    let path = format!("/proc/sys/net/ipv6/conf/{device}/disable_ipv6");
    if !Path::new("/proc/sys/net/ipv6").exists() {
        return Ok(());
    }
    std::fs::write(&path, "1").map_err(|e| format!("{path}: {e}"))
}

/// The nameservers of the host's `/etc/resolv.conf`, loopback ones left out (a sandbox cannot
/// reach the host's loopback).
pub fn host_nameservers() -> Vec<std::net::Ipv4Addr> {
    std::fs::read_to_string("/etc/resolv.conf")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().strip_prefix("nameserver"))
        .filter_map(|a| a.trim().parse::<Ipv4Addr>().ok())
        .filter(|a| !a.is_loopback())
        .collect()
}

/// Writes the `resolv.conf` that outbound sandboxes get at `/etc/resolv.conf`.
///
/// # Errors
/// The write error.
pub fn write_resolv_conf(path: &Path, nameservers: &[Ipv4Addr]) -> std::io::Result<()> {
    let text: String = nameservers.iter().map(|n| format!("nameserver {n}\n")).collect();
    std::fs::write(path, text)
}

/// Creates the bridge, enables forwarding and installs the NAT and filter rules, unless they
/// exist; lets sandboxes reach `nameservers` on port 53 (also when private). Needs `ip`
/// (iproute2) and `iptables`.
///
/// # Errors
/// The failing command and its stderr.
pub fn setup_host(nameservers: &[Ipv4Addr]) -> Result<(), String> {
    if run("ip", &["link", "show", BRIDGE]).is_err() {
        run("ip", &["link", "add", BRIDGE, "type", "bridge"])?;
    }
    run("ip", &["addr", "replace", &format!("{GATEWAY}/16"), "dev", BRIDGE])?;
    // IPv4 only: no link-local IPv6 address on the bridge for a sandbox to reach the host by
    // (security review F4), and every IPv6 packet from or to the bridge dropped in case a
    // port or the bridge gets one anyway.
    disable_ipv6(BRIDGE)?;
    if Path::new("/proc/sys/net/ipv6").exists() {
        ensure_rule_first("ip6tables", "filter", &["INPUT", "-i", BRIDGE, "-j", "DROP"])?;
        ensure_rule_with("ip6tables", "filter", &["FORWARD", "-i", BRIDGE, "-j", "DROP"])?;
        ensure_rule_with("ip6tables", "filter", &["FORWARD", "-o", BRIDGE, "-j", "DROP"])?;
    }
    run("ip", &["link", "set", BRIDGE, "up"])?;
    std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").map_err(|e| format!("ip_forward: {e}"))?;
    std::fs::create_dir_all(ADDRESS_DIR).map_err(|e| format!("{ADDRESS_DIR}: {e}"))?;
    ensure_rule("nat", &["POSTROUTING", "-s", SUBNET, "!", "-o", BRIDGE, "-j", "MASQUERADE"])?;
    ensure_rule_first("iptables", "filter", &["INPUT", "-i", BRIDGE, "-j", "DROP"])?;
    ensure_rule("filter", &["FORWARD", "-o", BRIDGE, "-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "ACCEPT"])?;
    ensure_rule("filter", &["FORWARD", "-o", BRIDGE, "-j", "DROP"])?;
    for private in ["10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10", "169.254.0.0/16"] {
        ensure_rule("filter", &["FORWARD", "-i", BRIDGE, "-d", private, "-j", "DROP"])?;
    }
    ensure_rule("filter", &["FORWARD", "-i", BRIDGE, "-j", "ACCEPT"])?;
    // DNS to the configured nameservers, inserted ahead of the private-range drops.
    for nameserver in nameservers {
        for proto in ["udp", "tcp"] {
            let ns = nameserver.to_string();
            let rule = ["FORWARD", "-i", BRIDGE, "-d", ns.as_str(), "-p", proto, "--dport", "53", "-j", "ACCEPT"];
            let mut check = vec!["-C"];
            check.extend_from_slice(&rule);
            if run("iptables", &check).is_err() {
                let mut insert = vec!["-I", "FORWARD", "1"];
                insert.extend_from_slice(&rule[1..]);
                run("iptables", &insert)?;
            }
        }
    }
    Ok(())
}

fn hash(text: &str) -> u32 {
    // FNV-1a: a stable spread of container ids over names and addresses.
    text.bytes().fold(0x811c_9dc5_u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
}

/// Reserves a free address for `owner` (the container's state dir), starting from a hash of
/// it. Returns the address.
///
/// # Errors
/// When every address is taken or the directory is unwritable.
pub fn reserve_address(owner: &Path) -> Result<Ipv4Addr, String> {
    let start = hash(&owner.to_string_lossy());
    for i in 0..65_533u32 {
        let host = 2 + (start.wrapping_add(i) % 65_533); // 10.213.0.2 ..= 10.213.255.254
        let address = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 213, 0, 0)) + host);
        let path = Path::new(ADDRESS_DIR).join(address.to_string());
        match std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path) {
            Ok(mut file) => {
                use std::io::Write;
                file.write_all(owner.to_string_lossy().as_bytes()).map_err(|e| e.to_string())?;
                return Ok(address);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(e) => return Err(format!("{}: {e}", path.display())),
        }
    }
    Err("no free sandbox address".into())
}

/// Gives back an address.
pub fn release_address(address: Ipv4Addr) {
    let _ = std::fs::remove_file(Path::new(ADDRESS_DIR).join(address.to_string()));
}

/// Removes the reservations whose container state dir no longer exists (their helper died).
pub fn release_stale() {
    let Ok(entries) = std::fs::read_dir(ADDRESS_DIR) else { return };
    for entry in entries.flatten() {
        if let Ok(owner) = std::fs::read_to_string(entry.path()) {
            if !Path::new(&owner).exists() {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}

/// Host-side half of attaching a created container (init `pid`) to the bridge: a veth pair,
/// its sandbox end moved into the container's network namespace. Returns the sandbox end's
/// name, to be configured from inside with [`configure_inside`].
///
/// # Errors
/// The failing command.
pub fn attach(pid: i32, owner: &Path) -> Result<String, String> {
    let tag = hash(&owner.to_string_lossy());
    let host = format!("sqh{tag:08x}");
    let sandbox = format!("sqc{tag:08x}");
    run("ip", &["link", "add", &host, "type", "veth", "peer", "name", &sandbox])?;
    disable_ipv6(&host)?;
    run("ip", &["link", "set", &sandbox, "netns", &pid.to_string()])?;
    run("ip", &["link", "set", &host, "master", BRIDGE, "up"])?;
    run("bridge", &["link", "set", "dev", &host, "isolated", "on"])?;
    Ok(sandbox)
}

/// Sandbox-side half, run with the caller already in the container's network namespace.
///
/// # Errors
/// The failing command.
pub fn configure_inside(device: &str, address: Ipv4Addr) -> Result<(), String> {
    for name in ["all", "default", device] {
        disable_ipv6(name)?;
    }
    run("ip", &["addr", "add", &format!("{address}/16"), "dev", device])?;
    run("ip", &["link", "set", device, "up"])?;
    run("ip", &["route", "add", "default", "via", &GATEWAY.to_string()])
}
