//! The `outbound` network mode: a sandbox gets a veth pair on the host bridge `sandq0`
//! (10.213.0.0/16, gateway 10.213.0.1), NAT to the outside, and nothing else:
//!
//! - no inbound connection (FORWARD drops new connections towards the bridge);
//! - no connection to the worker's host (INPUT drops everything from the bridge);
//! - no private (10/8, 172.16/12, 192.168/16), carrier-grade NAT (100.64/10) or link-local
//!   (169.254/16, cloud metadata) destination;
//! - no traffic between sandboxes (bridge ports are `isolated`);
//! - no IPv6 at all: off on the bridge, the host's veth ends and inside the sandbox, and
//!   `ip6tables` drops anything from or to the bridge (test:
//!   outbound_sandboxes_have_no_ipv6_path_to_the_host in tests/network.rs);
//! - ahead of anything the host adds: the policy lives in chains of its own (`SANDQ-FORWARD`,
//!   and `SANDQ-RAW` in the `raw` table's PREROUTING, which runs before any DNAT), jumped to
//!   from the top of FORWARD and PREROUTING, positions re-asserted at every worker start. The
//!   raw chain drops packets addressed to the host itself or to private ranges before a
//!   host's port-forward (Docker, kube-proxy NodePorts, libvirt) could rewrite them into
//!   forwarded traffic (test: host_port_forwards_and_later_forward_rules_do_not_open_the_policy
//!   in tests/network.rs).
//!
//! [`setup_host`] runs once at worker start (idempotent); [`attach`] runs in the helper for each
//! outbound container, between create and start. Addresses are handed out host-wide through
//! files in [`ADDRESS_DIR`] created with `O_EXCL` (the file name is the address, its content
//! the container's state dir); the helper removes its file after delete, and
//! `sandq-container cleanup` removes those of dead containers.

use std::net::Ipv4Addr;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The host bridge.
pub const BRIDGE: &str = "sandq0";
/// The sandboxes' subnet.
pub const SUBNET: &str = "10.213.0.0/16";
/// The gateway (the bridge's address).
pub const GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 213, 0, 1);
/// Where address reservations live (tmpfs: gone at reboot, as the bridge is).
pub const ADDRESS_DIR: &str = "/run/sandq/net";

/// Why a step of the outbound network's set-up (host side or inside a sandbox) failed. The
/// text names the command or file and what went wrong.
#[derive(Debug, thiserror::Error)]
pub enum NetworkError {
    /// A program (`ip`, `iptables`, `iptables-restore`, `bridge`) could not be started.
    #[error("{program}: {source}")]
    Spawn {
        /// The program's name.
        program: String,
        /// Why it could not be started.
        #[source]
        source: std::io::Error,
    },
    /// A started program's stdin could not be written or its output not collected.
    #[error("{program}: {source}")]
    Pipe {
        /// The program's name.
        program: String,
        /// The pipe's I/O error.
        #[source]
        source: std::io::Error,
    },
    /// A program ran and exited unsuccessfully.
    #[error("{command}: {stderr}")]
    Command {
        /// The program and its arguments, space-separated.
        command: String,
        /// Its stderr, trimmed (lossy UTF-8).
        stderr: String,
    },
    /// A file or dir (a sysctl, [`ADDRESS_DIR`], a reservation, the set-up lock) could not be
    /// made, opened or written.
    #[error("{}: {source}", path.display())]
    File {
        /// The file or dir.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// The set-up lock could not be taken.
    #[error("{}: {source}", path.display())]
    Lock {
        /// The lock file (`<ADDRESS_DIR>/.setup.lock`).
        path: PathBuf,
        /// The `flock` error.
        #[source]
        source: nix::errno::Errno,
    },
    /// IPv4 forwarding could not be turned on (`/proc/sys/net/ipv4/ip_forward`).
    #[error("ip_forward: {0}")]
    Forwarding(#[source] std::io::Error),
    /// The jumps into sandq's chains could not be made the first rules of their parent chain
    /// within 10 `iptables-restore` transactions (other writers kept changing it).
    #[error("cannot put {rules:?} first in {table} {parent}: {stderr}")]
    NotFirst {
        /// The rule specs that were to come first.
        rules: Vec<String>,
        /// The table (`raw`, `filter`).
        table: String,
        /// The parent chain (`PREROUTING`, `FORWARD`).
        parent: String,
        /// The last transaction's stderr, trimmed (empty when it succeeded but lost a race).
        stderr: String,
    },
    /// `iptables-restore` refused to write one of sandq's chains.
    #[error("cannot write {table} {chain}: {stderr}")]
    Restore {
        /// The table (`raw`, `filter`).
        table: String,
        /// sandq's chain (`SANDQ-RAW`, `SANDQ-FORWARD`).
        chain: String,
        /// `iptables-restore`'s stderr, trimmed.
        stderr: String,
    },
    /// An address reservation was created but its owner could not be written into it.
    #[error("{source}")]
    Reservation {
        /// The reservation file (`<ADDRESS_DIR>/<address>`).
        path: PathBuf,
        /// The write error.
        #[source]
        source: std::io::Error,
    },
    /// Every address of [`SUBNET`] (but the network's, the gateway's and broadcast) is
    /// reserved.
    #[error("no free sandbox address")]
    NoFreeAddress,
}

/// Why a text is not an IPv4 range ([`parse_range`]).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RangeError {
    /// The part before `/` (or the whole text) is not an IPv4 address.
    #[error("{text:?} is not an IPv4 address or range")]
    Address {
        /// The text as given.
        text: String,
        /// The address parser's error.
        #[source]
        source: std::net::AddrParseError,
    },
    /// The part after `/` is not a number from 0 to 32.
    #[error("{text:?}: the prefix length must be 0 to 32")]
    Prefix {
        /// The text as given.
        text: String,
    },
}

fn spawn_error(program: &str) -> impl FnOnce(std::io::Error) -> NetworkError + '_ {
    move |source| NetworkError::Spawn { program: program.to_owned(), source }
}

fn file_error(path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> NetworkError {
    let path = path.into();
    move |source| NetworkError::File { path, source }
}

fn run(program: &str, args: &[&str]) -> Result<(), NetworkError> {
    // The helper runs with an empty environment: name the system directories.
    let out = Command::new(program).args(args).env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin").output().map_err(spawn_error(program))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(NetworkError::Command {
            command: format!("{program} {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        })
    }
}

fn ensure_rule(table: &str, rule: &[&str]) -> Result<(), NetworkError> {
    ensure_rule_with("iptables", table, rule)
}

/// Like [`ensure_rule_with`], but inserted first in its chain: a host's own earlier ACCEPT
/// rules (sshd on INPUT, say) must not let a sandbox through.
fn ensure_rule_first(program: &str, table: &str, rule: &[&str]) -> Result<(), NetworkError> {
    let mut check = vec!["-t", table, "-C"];
    check.extend_from_slice(rule);
    if run(program, &check).is_ok() {
        return Ok(());
    }
    let mut insert = vec!["-t", table, "-I", rule[0], "1"];
    insert.extend_from_slice(&rule[1..]);
    run(program, &insert)
}

fn ensure_rule_with(program: &str, table: &str, rule: &[&str]) -> Result<(), NetworkError> {
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
fn disable_ipv6(device: &str) -> Result<(), NetworkError> {
    let path = format!("/proc/sys/net/ipv6/conf/{device}/disable_ipv6");
    if !Path::new("/proc/sys/net/ipv6").exists() {
        return Ok(());
    }
    std::fs::write(&path, "1").map_err(file_error(path))
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

/// Public resolvers (Cloudflare's, Quad9's) outbound sandboxes get by default when every
/// nameserver of the host is in a blocked range.
pub const PUBLIC_NAMESERVERS: [Ipv4Addr; 2] = [Ipv4Addr::new(1, 1, 1, 1), Ipv4Addr::new(9, 9, 9, 9)];

/// Whether `addr` is in `range` (CIDR text as [`parse_range`] accepts; false when it does not
/// parse).
pub fn in_range(addr: Ipv4Addr, range: &str) -> bool {
    let Ok(canonical) = parse_range(range) else { return false };
    let Some((net, prefix)) = canonical.split_once('/') else { return false };
    let (Ok(net), Ok(prefix)) = (net.parse::<Ipv4Addr>(), prefix.parse::<u32>()) else { return false };
    let mask = if prefix == 0 { 0 } else { u32::MAX << (32 - prefix) };
    u32::from(addr) & mask == u32::from(net)
}

/// Whether `addr` is in [`BLOCKED_RANGES`] or `extra_blocked`.
pub fn is_blocked(addr: Ipv4Addr, extra_blocked: &[String]) -> bool {
    BLOCKED_RANGES.iter().copied().chain(extra_blocked.iter().map(String::as_str)).any(|range| in_range(addr, range))
}

/// The nameservers outbound sandboxes get when `worker.nameservers` is not set: the host's
/// ([`host_nameservers`]) that are not in a blocked range, else [`PUBLIC_NAMESERVERS`]. Each
/// nameserver is let through the firewall on port 53, so a default one in a blocked range
/// would open that range's resolver to sandboxes without anyone choosing it (on Azure the
/// host's resolver is 168.63.129.16, on GCP 169.254.169.254; a private resolver answers for
/// private zones). A private resolver is used only when configured (test:
/// addresses_are_matched_against_ranges).
pub fn default_nameservers(extra_blocked: &[String]) -> Vec<Ipv4Addr> {
    let allowed: Vec<Ipv4Addr> = host_nameservers().into_iter().filter(|ns| !is_blocked(*ns, extra_blocked)).collect();
    if allowed.is_empty() {
        PUBLIC_NAMESERVERS.to_vec()
    } else {
        allowed
    }
}

/// Writes the `resolv.conf` that outbound sandboxes get at `/etc/resolv.conf`.
///
/// # Errors
/// The write error.
pub fn write_resolv_conf(path: &Path, nameservers: &[Ipv4Addr]) -> std::io::Result<()> {
    let text: String = nameservers.iter().map(|n| format!("nameserver {n}\n")).collect();
    std::fs::write(path, text)
}

/// Never a sandbox's destination (but for DNS to a configured nameserver): private (RFC 1918),
/// carrier-grade NAT (RFC 6598; Alibaba's metadata 100.100.100.200 is in it) and link-local
/// (RFC 3927: the EC2, GCP, Azure and OpenStack metadata at 169.254.169.254) ranges; "this
/// network" (0/8), IETF protocol assignments (192.0.0.0/24), multicast (224/4) and reserved
/// (240/4, broadcast included) from the IANA special-purpose registry (RFC 6890); and Azure's
/// platform address 168.63.129.16 (the WireServer and its VMs' default DNS; test:
/// cloud_platform_special_purpose_and_configured_ranges_are_unreachable in tests/network.rs).
/// Not 198.18.0.0/15 (benchmarking, RFC 2544): the tests' network
/// namespaces stand in for the internet there. `worker.blocked_ranges` adds a site's own.
pub const BLOCKED_RANGES: [&str; 10] = [
    "10.0.0.0/8",
    "172.16.0.0/12",
    "192.168.0.0/16",
    "100.64.0.0/10",
    "169.254.0.0/16",
    "0.0.0.0/8",
    "192.0.0.0/24",
    "224.0.0.0/4",
    "240.0.0.0/4",
    "168.63.129.16/32",
];

/// An IPv4 range in CIDR notation (`a.b.c.d/n`, or one address), checked; its canonical text.
///
/// # Errors
/// [`RangeError`]: what is wrong with `text`.
pub fn parse_range(text: &str) -> Result<String, RangeError> {
    let (addr, prefix) = text.split_once('/').unwrap_or((text, "32"));
    let addr: Ipv4Addr = addr.parse().map_err(|source| RangeError::Address { text: text.to_owned(), source })?;
    let prefix: u32 = prefix.parse().ok().filter(|p| *p <= 32).ok_or_else(|| RangeError::Prefix { text: text.to_owned() })?;
    let mask = if prefix == 0 { 0 } else { u32::MAX << (32 - prefix) };
    Ok(format!("{}/{prefix}", Ipv4Addr::from(u32::from(addr) & mask)))
}

/// The filter chain holding the FORWARD policy of the bridge's traffic.
const FORWARD_CHAIN: &str = "SANDQ-FORWARD";
/// The raw-table chain (PREROUTING, before conntrack and DNAT) guarding destinations.
const RAW_CHAIN: &str = "SANDQ-RAW";

/// The rules of `parent` in `table`, as `iptables -S` prints them (without `-A <parent> `).
fn list_rules(table: &str, parent: &str) -> Result<Vec<String>, NetworkError> {
    let args = ["-t", table, "-S", parent];
    let out = Command::new("iptables").args(args).env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin").output().map_err(spawn_error("iptables"))?;
    if !out.status.success() {
        return Err(NetworkError::Command {
            command: format!("iptables {}", args.join(" ")),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    let prefix = format!("-A {parent} ");
    Ok(String::from_utf8_lossy(&out.stdout).lines().filter_map(|l| l.strip_prefix(&prefix)).map(str::to_owned).collect())
}

/// Makes `jumps` (rule specs of `parent` in `table`, `-j` included) the first rules of `parent`,
/// once each. In one `iptables-restore --noflush` transaction, every copy of them is deleted by
/// its text and they are inserted at the top: no moment without them, and no other rule is
/// touched, whoever else changes the chain meanwhile (a transaction that finds the chain
/// changed fails whole and is retried; deleting by rule number would race other writers and
/// remove their rules; test: workers_starting_together_keep_the_policy_and_the_hosts_rules in
/// tests/network.rs). Rules a host inserted at the top since the last start (a restarted
/// Docker) end up after them.
fn ensure_first(table: &str, parent: &str, jumps: &[Vec<&str>]) -> Result<(), NetworkError> {
    let wanted: Vec<String> = jumps.iter().map(|j| j.join(" ")).collect();
    let mut last = String::new();
    for _ in 0..10 {
        let rules = list_rules(table, parent)?;
        if rules.len() >= wanted.len() && rules[..wanted.len()] == wanted[..] && rules[wanted.len()..].iter().all(|r| !wanted.contains(r)) {
            return Ok(());
        }
        let mut script = format!("*{table}\n");
        for rule in rules.iter().filter(|r| wanted.contains(r)) {
            script.push_str(&format!("-D {parent} {rule}\n"));
        }
        for rule in wanted.iter().rev() {
            script.push_str(&format!("-I {parent} 1 {rule}\n"));
        }
        script.push_str("COMMIT\n");
        let out = iptables_restore(&script)?;
        last = String::from_utf8_lossy(&out.stderr).trim().to_owned();
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    Err(NetworkError::NotFirst { rules: wanted, table: table.to_owned(), parent: parent.to_owned(), stderr: last })
}

/// Makes `rules` (rule specs without `-A <chain>`) the whole content of `chain` in `table`, in
/// one `iptables-restore --noflush` transaction: declaring the chain empties (or creates) it,
/// and the rules follow in order, so there is no moment with part of them. The chain is
/// sandq's own: every worker of a host writes the same content (their settings must agree).
fn replace_chain(table: &str, chain: &str, rules: &[String]) -> Result<(), NetworkError> {
    let mut script = format!("*{table}\n:{chain} - [0:0]\n");
    for rule in rules {
        script.push_str(&format!("-A {chain} {rule}\n"));
    }
    script.push_str("COMMIT\n");
    let out = iptables_restore(&script)?;
    if !out.status.success() {
        return Err(NetworkError::Restore {
            table: table.to_owned(),
            chain: chain.to_owned(),
            stderr: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        });
    }
    Ok(())
}

/// Runs `iptables-restore --noflush` on `script` (one transaction); its output, whatever its
/// exit status.
///
/// # Errors
/// [`NetworkError::Spawn`] or [`NetworkError::Pipe`] when it cannot be run.
fn iptables_restore(script: &str) -> Result<std::process::Output, NetworkError> {
    use std::io::Write;
    const PROGRAM: &str = "iptables-restore";
    let pipe_error = |source| NetworkError::Pipe { program: PROGRAM.to_owned(), source };
    let mut child = Command::new(PROGRAM)
        .arg("--noflush")
        .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
        .stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(spawn_error(PROGRAM))?;
    if let Some(mut stdin) = child.stdin.take() {
        stdin.write_all(script.as_bytes()).map_err(pipe_error)?;
    }
    child.wait_with_output().map_err(pipe_error)
}

/// Held while the host's network set-up is changed: workers starting together on one host take
/// turns (`flock` on `<ADDRESS_DIR>/.setup.lock`).
fn setup_lock() -> Result<nix::fcntl::Flock<std::fs::File>, NetworkError> {
    std::fs::create_dir_all(ADDRESS_DIR).map_err(file_error(ADDRESS_DIR))?;
    let path = Path::new(ADDRESS_DIR).join(".setup.lock");
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .mode(0o600)
        .open(&path)
        .map_err(file_error(&path))?;
    nix::fcntl::Flock::lock(file, nix::fcntl::FlockArg::LockExclusive).map_err(|(_, source)| NetworkError::Lock { path, source })
}

/// Creates the bridge, enables forwarding and installs the NAT and filter rules, unless they
/// exist; lets sandboxes reach `nameservers` on port 53 (also when private), and nothing in
/// [`BLOCKED_RANGES`] or `extra_blocked` (ranges in canonical CIDR text, [`parse_range`]). Needs `ip`
/// (iproute2) and `iptables` (with the `addrtype` match).
///
/// # Errors
/// [`NetworkError`]: the failing command and its stderr, or the file.
pub fn setup_host(nameservers: &[Ipv4Addr], extra_blocked: &[String]) -> Result<(), NetworkError> {
    let _turn = setup_lock()?;
    if run("ip", &["link", "show", BRIDGE]).is_err() {
        run("ip", &["link", "add", BRIDGE, "type", "bridge"])?;
    }
    run("ip", &["addr", "replace", &format!("{GATEWAY}/16"), "dev", BRIDGE])?;
    // IPv4 only: no link-local IPv6 address on the bridge for a sandbox to reach the host by,
    // and every IPv6 packet from or to the bridge dropped in case a port or the bridge gets one
    // anyway (test: outbound_sandboxes_have_no_ipv6_path_to_the_host).
    disable_ipv6(BRIDGE)?;
    if Path::new("/proc/sys/net/ipv6").exists() {
        ensure_rule_first("ip6tables", "filter", &["INPUT", "-i", BRIDGE, "-j", "DROP"])?;
        ensure_rule_first("ip6tables", "filter", &["FORWARD", "-i", BRIDGE, "-j", "DROP"])?;
        ensure_rule_first("ip6tables", "filter", &["FORWARD", "-o", BRIDGE, "-j", "DROP"])?;
    }
    run("ip", &["link", "set", BRIDGE, "up"])?;
    std::fs::write("/proc/sys/net/ipv4/ip_forward", "1").map_err(NetworkError::Forwarding)?;
    std::fs::create_dir_all(ADDRESS_DIR).map_err(file_error(ADDRESS_DIR))?;
    ensure_rule("nat", &["POSTROUTING", "-s", SUBNET, "!", "-o", BRIDGE, "-j", "MASQUERADE"])?;
    ensure_rule_first("iptables", "filter", &["INPUT", "-i", BRIDGE, "-j", "DROP"])?;

    // Before DNAT and conntrack: nothing addressed to the host itself, nor to a blocked range
    // (DNS to the nameservers excepted, first). Each chain is written whole, in one
    // transaction: a range added by a newer version lands before the final ACCEPT, not after.
    let blocked: Vec<String> = BLOCKED_RANGES.iter().map(|r| (*r).to_owned()).chain(extra_blocked.iter().cloned()).collect();
    let dns: Vec<(String, &str)> = nameservers.iter().flat_map(|n| ["udp", "tcp"].map(|p| (n.to_string(), p))).collect();
    // Workers of one host share the chains and must share these settings: another worker's
    // nameserver allowance found here is replaced, and said so.
    let mut others: Vec<Ipv4Addr> = list_rules("raw", RAW_CHAIN)
        .unwrap_or_default()
        .iter()
        .filter(|r| r.contains("--dport 53"))
        .filter_map(|rule| rule.split_whitespace().skip_while(|w| *w != "-d").nth(1)?.trim_end_matches("/32").parse::<Ipv4Addr>().ok())
        .filter(|a| !nameservers.contains(a))
        .collect();
    others.sort_unstable();
    others.dedup();
    for other in others {
        tracing::warn!(nameserver = %other, "replacing another worker's DNS allowance in the sandboxes' firewall: workers of one host must have the same worker.nameservers and worker.blocked_ranges");
    }
    let mut raw: Vec<String> = dns.iter().map(|(ns, proto)| format!("-d {ns} -p {proto} --dport 53 -j RETURN")).collect();
    raw.push("-m addrtype --dst-type LOCAL -j DROP".to_owned());
    raw.extend(blocked.iter().map(|range| format!("-d {range} -j DROP")));
    replace_chain("raw", RAW_CHAIN, &raw)?;
    ensure_first("raw", "PREROUTING", &[vec!["-i", BRIDGE, "-j", RAW_CHAIN]])?;

    // Forwarding, in a chain of its own at the top of FORWARD.
    let mut forward: Vec<String> = dns.iter().map(|(ns, proto)| format!("-i {BRIDGE} -d {ns} -p {proto} --dport 53 -j ACCEPT")).collect();
    forward.push(format!("-o {BRIDGE} -m conntrack --ctstate RELATED,ESTABLISHED -j ACCEPT"));
    forward.push(format!("-o {BRIDGE} -j DROP"));
    forward.extend(blocked.iter().map(|range| format!("-i {BRIDGE} -d {range} -j DROP")));
    forward.push(format!("-i {BRIDGE} -j ACCEPT"));
    replace_chain("filter", FORWARD_CHAIN, &forward)?;
    ensure_first("filter", "FORWARD", &[vec!["-i", BRIDGE, "-j", FORWARD_CHAIN], vec!["-o", BRIDGE, "-j", FORWARD_CHAIN]])?;
    remove_legacy_rules(nameservers);
    Ok(())
}

/// Removes the FORWARD rules earlier versions appended to FORWARD itself (now in
/// [`FORWARD_CHAIN`]; after its verdicts they were never reached). Best effort.
fn remove_legacy_rules(nameservers: &[Ipv4Addr]) {
    let mut legacy: Vec<Vec<String>> = vec![
        vec!["-o", BRIDGE, "-m", "conntrack", "--ctstate", "RELATED,ESTABLISHED", "-j", "ACCEPT"],
        vec!["-o", BRIDGE, "-j", "DROP"],
        vec!["-i", BRIDGE, "-j", "ACCEPT"],
    ]
    .into_iter()
    .map(|r| r.into_iter().map(str::to_owned).collect())
    .collect();
    for range in BLOCKED_RANGES {
        legacy.push(["-i", BRIDGE, "-d", range, "-j", "DROP"].map(str::to_owned).to_vec());
    }
    for ns in nameservers {
        for proto in ["udp", "tcp"] {
            legacy.push(["-i", BRIDGE, "-d", &ns.to_string(), "-p", proto, "--dport", "53", "-j", "ACCEPT"].map(|s| s.to_owned()).to_vec());
        }
    }
    for rule in legacy {
        let mut delete = vec!["-t", "filter", "-D", "FORWARD"];
        delete.extend(rule.iter().map(String::as_str));
        for _ in 0..8 {
            if run("iptables", &delete).is_err() {
                break;
            }
        }
    }
}

fn hash(text: &str) -> u32 {
    // FNV-1a: a stable spread of container ids over names and addresses.
    text.bytes().fold(0x811c_9dc5_u32, |h, b| (h ^ u32::from(b)).wrapping_mul(0x0100_0193))
}

/// Reserves a free address for `owner` (the container's state dir), starting from a hash of
/// it. Returns the address.
///
/// # Errors
/// [`NetworkError::NoFreeAddress`] when every address is taken; [`NetworkError::File`] or
/// [`NetworkError::Reservation`] when the directory is unwritable.
pub fn reserve_address(owner: &Path) -> Result<Ipv4Addr, NetworkError> {
    let start = hash(&owner.to_string_lossy());
    for i in 0..65_533u32 {
        let host = 2 + (start.wrapping_add(i) % 65_533); // 10.213.0.2 ..= 10.213.255.254
        let address = Ipv4Addr::from(u32::from(Ipv4Addr::new(10, 213, 0, 0)) + host);
        let path = Path::new(ADDRESS_DIR).join(address.to_string());
        match std::fs::OpenOptions::new().write(true).create_new(true).mode(0o600).open(&path) {
            Ok(mut file) => {
                use std::io::Write;
                file.write_all(owner.to_string_lossy().as_bytes()).map_err(|source| NetworkError::Reservation { path, source })?;
                return Ok(address);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(source) => return Err(NetworkError::File { path, source }),
        }
    }
    Err(NetworkError::NoFreeAddress)
}

/// Gives back an address.
pub fn release_address(address: Ipv4Addr) {
    let _ = std::fs::remove_file(Path::new(ADDRESS_DIR).join(address.to_string()));
}

/// Removes the reservations whose container state dir no longer exists (their helper died).
pub fn release_stale() {
    let Ok(entries) = std::fs::read_dir(ADDRESS_DIR) else { return };
    // Reservations are named by their address; dot files (the set-up lock) are not ones.
    for entry in entries.flatten().filter(|e| !e.file_name().to_string_lossy().starts_with('.')) {
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
/// [`NetworkError`]: the failing command.
pub fn attach(pid: i32, owner: &Path) -> Result<String, NetworkError> {
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
/// [`NetworkError`]: the failing command.
pub fn configure_inside(device: &str, address: Ipv4Addr) -> Result<(), NetworkError> {
    for name in ["all", "default", device] {
        disable_ipv6(name)?;
    }
    run("ip", &["addr", "add", &format!("{address}/16"), "dev", device])?;
    run("ip", &["link", "set", device, "up"])?;
    run("ip", &["route", "add", "default", "via", &GATEWAY.to_string()])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_checked_and_canonical() {
        assert_eq!(parse_range("198.51.100.7/24"), Ok("198.51.100.0/24".to_owned()));
        assert_eq!(parse_range("203.0.113.7"), Ok("203.0.113.7/32".to_owned()));
        assert_eq!(parse_range("0.0.0.0/0"), Ok("0.0.0.0/0".to_owned()));
        for bad in ["example.com", "1.2.3/8", "::1/128"] {
            assert!(matches!(parse_range(bad), Err(RangeError::Address { .. })), "{bad}");
        }
        for bad in ["203.0.113.7/33", "1.2.3.4/x"] {
            assert_eq!(parse_range(bad), Err(RangeError::Prefix { text: bad.to_owned() }), "{bad}");
        }
        let error = parse_range("1.2.3.4/x").expect_err("bad prefix").to_string();
        assert_eq!(error, r#""1.2.3.4/x": the prefix length must be 0 to 32"#);
        let error = parse_range("example.com").expect_err("not an address").to_string();
        assert_eq!(error, r#""example.com" is not an IPv4 address or range"#);
        for range in BLOCKED_RANGES {
            assert_eq!(parse_range(range).as_deref(), Ok(range), "canonical");
        }
    }

    #[test]
    fn errors_name_the_command_or_file() {
        let command =
            NetworkError::Command { command: "ip link add sandq0 type bridge".into(), stderr: "RTNETLINK answers: File exists".into() };
        assert_eq!(command.to_string(), "ip link add sandq0 type bridge: RTNETLINK answers: File exists");
        let not_first = NetworkError::NotFirst {
            rules: vec!["-i sandq0 -j SANDQ-RAW".into()],
            table: "raw".into(),
            parent: "PREROUTING".into(),
            stderr: String::new(),
        };
        assert_eq!(not_first.to_string(), r#"cannot put ["-i sandq0 -j SANDQ-RAW"] first in raw PREROUTING: "#);
        let spawn = run("/nonexistent/sandq-no-such-program", &[]).expect_err("no such program");
        assert!(matches!(&spawn, NetworkError::Spawn { program, .. } if program == "/nonexistent/sandq-no-such-program"), "{spawn:?}");
        assert!(spawn.to_string().starts_with("/nonexistent/sandq-no-such-program: "), "{spawn}");
        let failed = run("false", &["a", "b"]).expect_err("false fails");
        assert_eq!(failed.to_string(), "false a b: ");
        assert_eq!(NetworkError::NoFreeAddress.to_string(), "no free sandbox address");
    }

    #[test]
    fn addresses_are_matched_against_ranges() {
        let addr = |s: &str| s.parse::<Ipv4Addr>().expect("address");
        assert!(is_blocked(addr("168.63.129.16"), &[]), "Azure's platform address");
        assert!(is_blocked(addr("169.254.169.254"), &[]));
        assert!(is_blocked(addr("10.255.255.53"), &[]));
        assert!(is_blocked(addr("100.100.100.200"), &[]), "in CGNAT");
        assert!(!is_blocked(addr("1.1.1.1"), &[]));
        assert!(!is_blocked(addr("198.18.0.3"), &[]));
        assert!(is_blocked(addr("198.18.0.3"), &["198.18.0.0/30".to_owned()]));
        assert!(!is_blocked(addr("198.18.0.4"), &["198.18.0.0/30".to_owned()]));
        assert!(in_range(addr("203.0.113.9"), "0.0.0.0/0"));
        assert!(!in_range(addr("203.0.113.9"), "not a range"));
        assert!(PUBLIC_NAMESERVERS.iter().all(|ns| !is_blocked(*ns, &[])));
    }
}
