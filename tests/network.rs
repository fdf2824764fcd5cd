//! The `outbound` network mode against a server the test starts in a network namespace it
//! creates (`sandqt-ext`, 198.18.0.2, the benchmarking range; reached from the host through a
//! veth pair): outbound connections work, nothing connects in, the worker's host is out of
//! reach, and `none` still reaches nothing. Names resolve through the worker's configured
//! nameserver (here a DNS server in that netns). Package installs at run time (issue 9 §4)
//! go to an HTTPS package index and npm registry served from the same netns with a CA the test
//! makes (the host's `openssl` CLI), serving packages the test builds. No traffic leaves this
//! machine.

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use sandq_schemas::{JobStatus, NetworkMode, Sku};
use sandq_tests::{exits_within, python_job, service_port, wait, wait_for_status, Isolated};

const NETNS: &str = "sandqt-ext";

/// The tests take turns: they share the test netns and change the host's firewall.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const SERVER: &str = "198.18.0.2";

fn ip(args: &[&str]) {
    let status = Command::new("ip").args(args).status().expect("ip");
    assert!(status.success(), "ip {args:?}");
}

/// A DNS server for the test's netns: answers every A query with 198.18.0.2, AAAA with nothing.
const DNS_SERVER: &str = r"
import socket, struct
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('198.18.0.2', 53))
while True:
    data, addr = s.recvfrom(512)
    i = 12
    while data[i] != 0:
        i += data[i] + 1
    question = data[12:i + 5]
    qtype = struct.unpack('>H', data[i + 1:i + 3])[0]
    answer = b'\xc0\x0c' + struct.pack('>HHIH', 1, 1, 60, 4) + socket.inet_aton('198.18.0.2') if qtype == 1 else b''
    s.sendto(data[:2] + b'\x81\x80\x00\x01' + struct.pack('>H', 1 if answer else 0) + b'\x00\x00\x00\x00' + question + answer, addr)
";

/// The test's external host: a netns with a veth to the host, an HTTP server serving
/// `token.txt` and a DNS server. Removed on drop.
struct External {
    server: Child,
    dns: Child,
    _dir: tempfile::TempDir,
}

impl External {
    fn start(token: &str) -> Self {
        let _ = Command::new("ip").args(["netns", "del", NETNS]).status();
        let _ = Command::new("ip").args(["link", "del", "sqtx0"]).status();
        ip(&["netns", "add", NETNS]);
        ip(&["link", "add", "sqtx0", "type", "veth", "peer", "name", "sqtx1"]);
        ip(&["link", "set", "sqtx1", "netns", NETNS]);
        ip(&["addr", "add", "198.18.0.1/24", "dev", "sqtx0"]);
        ip(&["link", "set", "sqtx0", "up"]);
        ip(&["-n", NETNS, "addr", "add", "198.18.0.2/24", "dev", "sqtx1"]);
        ip(&["-n", NETNS, "link", "set", "sqtx1", "up"]);
        ip(&["-n", NETNS, "link", "set", "lo", "up"]);
        ip(&["-n", NETNS, "route", "add", "default", "via", "198.18.0.1"]);
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("token.txt"), token).expect("token");
        let server = Command::new("ip")
            .args(["netns", "exec", NETNS, "python3", "-m", "http.server", "8080", "--bind", SERVER])
            .current_dir(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("http server");
        let dns = Command::new("ip")
            .args(["netns", "exec", NETNS, "python3", "-c", DNS_SERVER])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("dns server");
        // Wait until it listens.
        for _ in 0..100 {
            let probe = Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    NETNS,
                    "python3",
                    "-c",
                    &format!("import socket; socket.create_connection(('{SERVER}', 8080), timeout=0.2)"),
                ])
                .stderr(Stdio::null())
                .status()
                .expect("probe");
            if probe.success() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        External { server, dns, _dir: dir }
    }

    /// Tries to connect from the external host to `address:port`; true when it connected.
    fn connects_to(&self, address: &str, port: u16) -> bool {
        Command::new("ip")
            .args([
                "netns",
                "exec",
                NETNS,
                "python3",
                "-c",
                &format!("import socket; socket.create_connection(('{address}', {port}), timeout=2)"),
            ])
            .stderr(Stdio::null())
            .status()
            .expect("connect")
            .success()
    }
}

impl Drop for External {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
        let _ = self.dns.kill();
        let _ = self.dns.wait();
        let _ = Command::new("ip").args(["netns", "del", NETNS]).status();
        let _ = Command::new("ip").args(["link", "del", "sqtx0"]).status();
    }
}

/// The address the worker reserved for the job (the reservation file names it).
/// The address reserved for the container `container_id` (the reservation file holds it).
fn sandbox_address(container_id: &str) -> Option<String> {
    std::fs::read_dir("/run/sandq/net").ok()?.flatten().find_map(|e| {
        let owner = std::fs::read_to_string(e.path()).ok()?;
        owner.contains(container_id).then(|| e.file_name().to_string_lossy().into_owned())
    })
}

#[tokio::test]
async fn outbound_works_inbound_and_the_host_do_not() {
    let _serial = SERIAL.lock().await;
    let token = uuid::Uuid::new_v4().to_string();
    let external = External::start(&token);
    let world = Isolated::new().await;
    // The sandboxes' resolver is the test's own DNS server.
    let worker_id = format!("{}-w", world.namespace);
    let mut worker = world.start_worker(&worker_id, &[("SANDQ__WORKER__NAMESERVERS", SERVER)]);
    let mut client = world.client().await;

    // The host's ports: the services of the config the tests use (CI runs its own, on other
    // ports), and one the test opens on every interface: services bound to 127.0.0.1 alone are
    // out of the sandbox's reach anyway, this one only the firewall keeps it from.
    let host_listener = std::net::TcpListener::bind("0.0.0.0:0").expect("host listener");
    let open_port = host_listener.local_addr().expect("host listener address").port();
    let ports =
        [service_port(&world.config.amqp.url), service_port(&world.config.redis.url), service_port(&world.config.s3.endpoint), open_port];
    let port_list = ports.map(|port| port.to_string()).join(", ");
    let code = format!(
        "import socket, time, urllib.request\n\
         print(urllib.request.urlopen('http://files.sandq.test:8080/token.txt', timeout=5).read().decode())\n\
         for port in ({port_list}):\n\
         \x20   s = socket.socket(); s.settimeout(1)\n\
         \x20   try:\n\
         \x20       s.connect(('10.213.0.1', port)); print('host', port, 'reached')\n\
         \x20   except OSError:\n\
         \x20       print('host', port, 'blocked')\n\
         srv = socket.socket(); srv.bind(('0.0.0.0', 9000)); srv.listen(1); srv.settimeout(6)\n\
         open('/tmp/listening', 'w').close()\n\
         try:\n\
         \x20   srv.accept(); print('inbound accepted')\n\
         except OSError:\n\
         \x20   print('no inbound')\n"
    );
    let mut spec = python_job(&code, Sku::S);
    spec.network = NetworkMode::Outbound;
    client.submit(&spec).await.expect("submit");
    wait_for_status(&mut client, &spec.job_id, JobStatus::Running, Duration::from_secs(30)).await;
    let container_id = sandq_tests::container_id_in_log(&sandq_tests::isolated_worker_log(&worker_id), &spec.job_id)
        .expect("the worker logged the job's container id");
    let address = {
        let mut found = None;
        for _ in 0..50 {
            found = sandbox_address(&container_id);
            if found.is_some() {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        found.expect("the job has no reserved address")
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert!(!external.connects_to(&address, 9000), "an outside host connected into the sandbox at {address}");
    let result = wait(&mut client, &spec.job_id).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    let lines: Vec<&str> = result.stdout.text.lines().collect();
    assert_eq!(lines[0], token, "the outbound request did not fetch the token");
    let blocked: Vec<String> = ports.iter().map(|port| format!("host {port} blocked")).collect();
    assert_eq!(&lines[1..=ports.len()], blocked.as_slice());
    assert_eq!(lines[ports.len() + 1], "no inbound");
    drop(host_listener);
    // Released with the container's delete, which the helper does once the result is out.
    let released = Instant::now() + Duration::from_secs(10);
    while sandbox_address(&container_id).is_some() {
        assert!(Instant::now() < released, "the address was not released within 10 s of the result");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Without `outbound`, the same server is out of reach.
    let none = python_job(
        &format!("import socket\ntry:\n    socket.create_connection(('{SERVER}', 8080), timeout=2); print('reached')\nexcept OSError as e:\n    print('unreachable', e.errno)\n"),
        Sku::S,
    );
    let result = sandq_tests::run(&mut client, &none).await;
    assert!(result.stdout.text.starts_with("unreachable"), "{}", result.stdout.text);

    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
    drop(external);
}

/// The firewall's blocked ranges cover more than private and link-local space: Azure's
/// platform address (168.63.129.16, the WireServer, a pod's route to node credentials), the
/// IANA special-purpose ranges, and the ranges a site adds (`worker.blocked_ranges`). Each is given
/// to the test's netns here (host routes through its veth), so that only the firewall stands
/// between a sandbox and a listener there; the netns' usual address is the control.
#[tokio::test]
async fn cloud_platform_special_purpose_and_configured_ranges_are_unreachable() {
    let _serial = SERIAL.lock().await;
    let external = External::start("token");
    let targets = ["168.63.129.16", "192.0.0.170", "198.18.0.3"];
    for target in targets {
        ip(&["-n", NETNS, "addr", "add", &format!("{target}/32"), "dev", "lo"]);
        if !target.starts_with("198.18.") {
            ip(&["route", "replace", &format!("{target}/32"), "via", SERVER, "dev", "sqtx0"]);
        }
    }
    struct Routes(&'static [&'static str]);
    impl Drop for Routes {
        fn drop(&mut self) {
            for target in self.0 {
                let _ = Command::new("ip").args(["route", "del", &format!("{target}/32")]).status();
            }
        }
    }
    let _routes = Routes(&["168.63.129.16", "192.0.0.170"]);
    let mut listener = Command::new("ip")
        .args(["netns", "exec", NETNS, "python3", "-c", "import socket\ns = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('0.0.0.0', 8081)); s.listen(16)\nwhile True: s.accept()[0].close()"])
        .spawn()
        .expect("listener");
    // Reachable from the host through the routes (so a blocked one is the firewall's doing).
    let mut from_host = Vec::new();
    for target in ["198.18.0.2"].iter().chain(targets.iter()) {
        let mut reached = false;
        for _ in 0..50 {
            reached = std::net::TcpStream::connect_timeout(&format!("{target}:8081").parse().expect("address"), Duration::from_millis(200))
                .is_ok();
            if reached {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        from_host.push((target.to_string(), reached));
    }
    let world = Isolated::new().await;
    let worker_id = format!("{}-w", world.namespace);
    let mut worker =
        world.start_worker_ready(&worker_id, &[("SANDQ__WORKER__NAMESERVERS", SERVER), ("SANDQ__WORKER__BLOCKED_RANGES", "198.18.0.3")]);
    let mut client = world.client().await;
    let code = "import socket\n\
                for target in ('198.18.0.2', '168.63.129.16', '192.0.0.170', '198.18.0.3'):\n\
                \x20   try:\n\
                \x20       socket.create_connection((target, 8081), timeout=3); print(target, 'reached')\n\
                \x20   except OSError:\n\
                \x20       print(target, 'blocked')\n";
    let mut spec = python_job(code, Sku::S);
    spec.network = NetworkMode::Outbound;
    let result = sandq_tests::run(&mut client, &spec).await;
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
    let _ = listener.kill();
    let _ = listener.wait();
    drop(external);
    assert!(from_host.iter().all(|(_, reached)| *reached), "the test's routes do not reach its netns: {from_host:?}");
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    assert_eq!(result.stdout.text, "198.18.0.2 reached\n168.63.129.16 blocked\n192.0.0.170 blocked\n198.18.0.3 blocked\n");
}

/// No IPv6 for outbound sandboxes, which would be a way to the host around the IPv4 policy:
/// the bridge has no IPv6 address for a sandbox to reach the host by, `ip6tables` drops
/// whatever comes from the bridge, and the sandbox's own namespace has IPv6 off (no link-local
/// address, nothing to send from).
#[tokio::test]
async fn outbound_sandboxes_have_no_ipv6_path_to_the_host() {
    let _serial = SERIAL.lock().await;
    let world = Isolated::new().await;
    let worker_id = format!("{}-w6", world.namespace);
    let mut worker = world.start_worker_ready(&worker_id, &[]);
    let mut client = world.client().await;
    let host_off = std::fs::read_to_string("/proc/sys/net/ipv6/conf/sandq0/disable_ipv6").expect("sandq0 sysctl");
    assert_eq!(host_off.trim(), "1", "IPv6 is on on the bridge");
    let addresses = Command::new("ip").args(["-6", "addr", "show", "dev", "sandq0"]).output().expect("ip");
    assert_eq!(String::from_utf8_lossy(&addresses.stdout), "", "the bridge has an IPv6 address");
    for rule in [["INPUT", "-i"], ["FORWARD", "-i"], ["FORWARD", "-o"]] {
        let status = Command::new("ip6tables").args(["-C", rule[0], rule[1], "sandq0", "-j", "DROP"]).status().expect("ip6tables");
        assert!(status.success(), "no ip6tables {rule:?} DROP rule for sandq0");
    }
    // A listener on every IPv6 address of the host, for the sandbox to try.
    let listener = std::net::TcpListener::bind("[::]:0").expect("listen on [::]");
    listener.set_nonblocking(true).expect("nonblocking");
    let port = listener.local_addr().expect("addr").port();
    let code = format!(
        "import socket\n\
         print('if_inet6', open('/proc/net/if_inet6').read().split())\n\
         dev = [n for i, n in socket.if_nameindex() if n != 'lo'][0]\n\
         for target in ('ff02::1', 'fe80::1'):\n\
         \x20   s = socket.socket(socket.AF_INET6); s.settimeout(2)\n\
         \x20   try:\n\
         \x20       s.connect((target, {port}, 0, socket.if_nametoindex(dev))); print(target, 'connected')\n\
         \x20   except OSError as e:\n\
         \x20       print(target, 'failed')\n"
    );
    let mut spec = python_job(&code, Sku::S);
    spec.network = NetworkMode::Outbound;
    let result = sandq_tests::run(&mut client, &spec).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    assert_eq!(result.stdout.text, "if_inet6 []\nff02::1 failed\nfe80::1 failed\n");
    assert!(listener.accept().is_err(), "the host listener was reached");
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
}

/// Rules and routes a test added to the host, removed on drop (`iptables -D` of each `-I`).
struct HostRules(Vec<(Vec<String>, Vec<String>)>);

impl HostRules {
    /// Runs `add` (a command and its arguments) now and `remove` on drop.
    fn add(&mut self, add: &[&str], remove: &[&str]) {
        let status = Command::new(add[0]).args(&add[1..]).status().expect("host command");
        assert!(status.success(), "{add:?}");
        self.0.push((add.iter().map(|s| (*s).to_owned()).collect(), remove.iter().map(|s| (*s).to_owned()).collect()));
    }
}

impl Drop for HostRules {
    fn drop(&mut self) {
        for (_, remove) in self.0.iter().rev() {
            let _ = Command::new(&remove[0]).args(&remove[1..]).status();
        }
    }
}

/// A host's own port-forwards and FORWARD rules do not open a way out of the policy. Like a
/// Docker host with a published port (DNAT from the host's own address) and its FORWARD ACCEPT
/// inserted at the top after the worker started (a restarted Docker): the sandbox reaches
/// neither the forwarded port through the host's address, nor the private address the host
/// forwards to; the test's public server stays reachable.
#[tokio::test]
async fn host_port_forwards_and_later_forward_rules_do_not_open_the_policy() {
    let _serial = SERIAL.lock().await;
    let token = uuid::Uuid::new_v4().to_string();
    let external = External::start(&token);
    // The "container" the host publishes: a private address in the test's netns.
    ip(&["-n", NETNS, "addr", "add", "172.31.254.2/32", "dev", "sqtx1"]);
    let mut rules = HostRules(Vec::new());
    rules.add(&["ip", "route", "add", "172.31.254.2/32", "dev", "sqtx0"], &["ip", "route", "del", "172.31.254.2/32", "dev", "sqtx0"]);
    let mut private = Command::new("ip")
        .args([
            "netns",
            "exec",
            NETNS,
            "python3",
            "-c",
            "import socket\ns = socket.socket(); s.bind(('172.31.254.2', 8081)); s.listen(8)\nwhile True: s.accept()[0].close()\n",
        ])
        .spawn()
        .expect("private listener");
    let world = Isolated::new().await;
    let worker_id = format!("{}-wf", world.namespace);
    let mut worker = world.start_worker_ready(&worker_id, &[("SANDQ__WORKER__NAMESERVERS", SERVER)]);
    // After the worker's start, as a restarted Docker would.
    for (port, to) in [("18080", "198.18.0.2:8080"), ("18081", "172.31.254.2:8081")] {
        let rule = ["PREROUTING", "-i", "sandq0", "-d", "10.213.0.1", "-p", "tcp", "--dport", port, "-j", "DNAT", "--to-destination", to];
        let mut add = vec!["iptables", "-t", "nat", "-I"];
        add.extend_from_slice(&rule);
        let mut remove = vec!["iptables", "-t", "nat", "-D"];
        remove.extend_from_slice(&rule);
        rules.add(&add, &remove);
    }
    let accept = ["FORWARD", "-d", "172.31.254.2", "-p", "tcp", "--dport", "8081", "-j", "ACCEPT"];
    rules.add(&[&["iptables", "-I"][..], &accept[..]].concat(), &[&["iptables", "-D"][..], &accept[..]].concat());
    let mut client = world.client().await;
    let code = "import socket\n\
                for host, port in (('198.18.0.2', 8080), ('10.213.0.1', 18080), ('10.213.0.1', 18081), ('172.31.254.2', 8081)):\n\
                \x20   s = socket.socket(); s.settimeout(2)\n\
                \x20   try:\n\
                \x20       s.connect((host, port)); print(host, port, 'reached')\n\
                \x20   except OSError:\n\
                \x20       print(host, port, 'blocked')\n";
    let mut spec = python_job(code, Sku::S);
    spec.network = NetworkMode::Outbound;
    let result = sandq_tests::run(&mut client, &spec).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    assert_eq!(
        result.stdout.text,
        "198.18.0.2 8080 reached\n10.213.0.1 18080 blocked\n10.213.0.1 18081 blocked\n172.31.254.2 8081 blocked\n"
    );
    drop(rules);
    let _ = private.kill();
    let _ = private.wait();
    drop(external);
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
}

/// Workers starting together on one host (and a host adding rules meanwhile) leave the
/// policy's jumps first in FORWARD and raw PREROUTING, once each, and every rule of the host's
/// in place: set-ups that deleted rules by stale numbers once lost both.
#[tokio::test]
async fn workers_starting_together_keep_the_policy_and_the_hosts_rules() {
    let _serial = SERIAL.lock().await;
    let world = Isolated::new().await;
    let mut rules = HostRules(Vec::new());
    // The host's own rules (TEST-NET-3 sources: never seen on this machine).
    for (chain, action) in [("FORWARD", "ACCEPT"), ("FORWARD", "DROP")] {
        let source = if action == "ACCEPT" { "203.0.113.1" } else { "203.0.113.2" };
        rules.add(&["iptables", "-I", chain, "1", "-s", source, "-j", action], &["iptables", "-D", chain, "-s", source, "-j", action]);
    }
    rules.add(
        &["iptables", "-t", "raw", "-I", "PREROUTING", "1", "-s", "203.0.113.3", "-j", "ACCEPT"],
        &["iptables", "-t", "raw", "-D", "PREROUTING", "-s", "203.0.113.3", "-j", "ACCEPT"],
    );
    let list = |table: &str, chain: &str| -> Vec<String> {
        let out = Command::new("iptables").args(["-t", table, "-S", chain]).output().expect("iptables");
        String::from_utf8_lossy(&out.stdout).lines().filter(|l| l.starts_with("-A ")).map(str::to_owned).collect()
    };
    for round in 0..3 {
        // A host writer inserting at the top while the workers start.
        let writer = std::thread::spawn(|| {
            for _ in 0..10 {
                let _ = Command::new("iptables").args(["-I", "FORWARD", "1", "-s", "203.0.113.9", "-j", "ACCEPT"]).status();
            }
        });
        let workers: Vec<Child> =
            (0..3).map(|i| world.start_worker(&format!("{}-r{round}w{i}", world.namespace), &[("SANDQ__WARM__PER_SKU", "0")])).collect();
        writer.join().expect("writer");
        for (i, mut worker) in workers.into_iter().enumerate() {
            let id = format!("{}-r{round}w{i}", world.namespace);
            let deadline = std::time::Instant::now() + Duration::from_secs(60);
            while !sandq_tests::isolated_worker_log(&id).contains("consuming") {
                assert!(std::time::Instant::now() < deadline, "worker {id} did not start");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            drop(worker.stdin.take());
            assert!(exits_within(&mut worker, Duration::from_secs(30)));
        }
        let forward = list("filter", "FORWARD");
        let jumps = ["-A FORWARD -i sandq0 -j SANDQ-FORWARD", "-A FORWARD -o sandq0 -j SANDQ-FORWARD"];
        assert_eq!(forward[..2], jumps, "round {round}: FORWARD is {forward:#?}");
        for jump in jumps {
            assert_eq!(forward.iter().filter(|r| *r == jump).count(), 1, "round {round}: FORWARD is {forward:#?}");
        }
        for host in ["-A FORWARD -s 203.0.113.1/32 -j ACCEPT", "-A FORWARD -s 203.0.113.2/32 -j DROP"] {
            assert!(forward.iter().any(|r| r == host), "round {round}: the host's rule {host:?} is gone: {forward:#?}");
        }
        assert_eq!(
            forward.iter().filter(|r| r.contains("203.0.113.9")).count(),
            10 * (round + 1),
            "round {round}: a host rule was deleted"
        );
        let raw = list("raw", "PREROUTING");
        assert_eq!(raw[0], "-A PREROUTING -i sandq0 -j SANDQ-RAW", "round {round}: {raw:#?}");
        assert_eq!(raw.iter().filter(|r| r.contains("SANDQ-RAW")).count(), 1);
        assert!(raw.iter().any(|r| r == "-A PREROUTING -s 203.0.113.3/32 -j ACCEPT"), "round {round}: the host's raw rule is gone");
    }
    for _ in 0..30 {
        let _ = Command::new("iptables").args(["-D", "FORWARD", "-s", "203.0.113.9", "-j", "ACCEPT"]).status();
    }
    drop(rules);
    world.delete_queues().await;
}

/// The test's package index and npm registry, served over HTTPS from the test's netns at
/// 198.18.0.2:443 as `pypi.sandq.test` and `npm.sandq.test` (every name resolves there), with a
/// certificate of a CA the test makes. The server script builds the packages it serves from
/// the token: a wheel of a pure-Python package whose `value()` returns the token, as a PEP 503
/// simple index, and an npm package whose export returns it (registry document with
/// `dist.tarball`, `dist.shasum` and `dist.integrity`).
const INDEX_SERVER: &str = r#"
import base64, hashlib, http.server, io, json, socketserver, ssl, sys, tarfile, zipfile
directory, token, py_name, npm_name = sys.argv[1:5]
module = py_name.replace('-', '_')
files = {
    f'{module}/__init__.py': f'def value():\n    return {token!r}\n',
    f'{module}-1.0.dist-info/METADATA': f'Metadata-Version: 2.1\nName: {py_name}\nVersion: 1.0\n',
    f'{module}-1.0.dist-info/WHEEL': 'Wheel-Version: 1.0\nGenerator: sandq-test\nRoot-Is-Purelib: true\nTag: py3-none-any\n',
}
record = []
for path, text in files.items():
    digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()
    record.append(f'{path},sha256={digest},{len(text.encode())}')
record.append(f'{module}-1.0.dist-info/RECORD,,')
files[f'{module}-1.0.dist-info/RECORD'] = '\n'.join(record) + '\n'
wheel = io.BytesIO()
with zipfile.ZipFile(wheel, 'w') as z:
    for path, text in files.items():
        z.writestr(path, text)
wheel = wheel.getvalue()
wheel_name = f'{module}-1.0-py3-none-any.whl'
tgz = io.BytesIO()
with tarfile.open(fileobj=tgz, mode='w:gz') as t:
    for path, text in {'package/package.json': json.dumps({'name': npm_name, 'version': '1.0.0', 'main': 'index.js'}),
                       'package/index.js': f'module.exports = () => {json.dumps(token)};\n'}.items():
        info = tarfile.TarInfo(path); data = text.encode(); info.size = len(data); info.mode = 0o644
        t.addfile(info, io.BytesIO(data))
tgz = tgz.getvalue()
tarball = f'https://npm.sandq.test/{npm_name}/-/{npm_name}-1.0.0.tgz'
document = {'name': npm_name, 'dist-tags': {'latest': '1.0.0'}, 'versions': {'1.0.0': {
    'name': npm_name, 'version': '1.0.0', 'main': 'index.js',
    'dist': {'tarball': tarball, 'shasum': hashlib.sha1(tgz).hexdigest(),
             'integrity': 'sha512-' + base64.b64encode(hashlib.sha512(tgz).digest()).decode()}}}}
routes = {
    ('pypi.sandq.test', f'/simple/{py_name}/'): ('text/html', (
        f'<!DOCTYPE html><html><body><a href="/files/{wheel_name}#sha256={hashlib.sha256(wheel).hexdigest()}">{wheel_name}</a></body></html>').encode()),
    ('pypi.sandq.test', f'/files/{wheel_name}'): ('application/octet-stream', wheel),
    ('npm.sandq.test', f'/{npm_name}'): ('application/json', json.dumps(document).encode()),
    ('npm.sandq.test', f'/{npm_name}/-/{npm_name}-1.0.0.tgz'): ('application/octet-stream', tgz),
}
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        host = (self.headers.get('Host') or '').split(':')[0]
        with open(f'{directory}/requests.log', 'a') as log:
            log.write(f'{host} {self.path}\n')
        found = routes.get((host, self.path))
        if found is None:
            self.send_response(404); self.send_header('Content-Length', '0'); self.end_headers(); return
        self.send_response(200); self.send_header('Content-Type', found[0]); self.send_header('Content-Length', str(len(found[1])))
        self.end_headers(); self.wfile.write(found[1])
    def log_message(self, *args):
        pass
class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(f'{directory}/server.pem', f'{directory}/server.key')
server = Server(('198.18.0.2', 443), Handler)
server.socket = context.wrap_socket(server.socket, server_side=True)
open(f'{directory}/listening', 'w').close()
server.serve_forever()
"#;

/// The package index of [`INDEX_SERVER`] and its CA (`ca.pem`, made with the openssl CLI).
/// Stopped on drop.
struct PackageIndex {
    server: Child,
    dir: tempfile::TempDir,
    /// The Python distribution (and npm package) name, unique to the test.
    name: String,
    /// What the packages' functions return.
    token: String,
}

impl PackageIndex {
    fn start() -> Self {
        let dir = tempfile::tempdir().expect("tempdir");
        let d = dir.path();
        let openssl = |args: &[&str]| {
            let out = Command::new("openssl").args(args).current_dir(d).output().expect("openssl");
            assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
        };
        openssl(&[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.pem",
            "-days",
            "2",
            "-subj",
            "/CN=sandq test CA",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
        ]);
        openssl(&["req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=pypi.sandq.test"]);
        std::fs::write(
            d.join("server.ext"),
            "subjectAltName=DNS:pypi.sandq.test,DNS:npm.sandq.test\nbasicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n\
             extendedKeyUsage=serverAuth\nsubjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid,issuer\n",
        )
        .expect("server.ext");
        openssl(&[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.pem",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.pem",
            "-days",
            "2",
            "-extfile",
            "server.ext",
        ]);
        let short = &uuid::Uuid::new_v4().simple().to_string()[..12];
        let name = format!("sandq-probe-{short}");
        let token = format!("installed-{}", uuid::Uuid::new_v4());
        let dir_text = d.to_str().expect("utf-8 tempdir").to_owned();
        let server = Command::new("ip")
            .args(["netns", "exec", NETNS, "python3", "-c", INDEX_SERVER, &dir_text, &token, &name, &name])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(d.join("server.err")).expect("server.err"))
            .spawn()
            .expect("index server");
        for _ in 0..300 {
            if d.join("listening").exists() {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let mut index = PackageIndex { server, dir, name, token };
        let listening = index.dir.path().join("listening").exists();
        assert!(
            listening,
            "index server did not start ({:?}): {}",
            index.server.try_wait(),
            std::fs::read_to_string(index.dir.path().join("server.err")).unwrap_or_default()
        );
        index
    }

    fn ca(&self) -> String {
        self.dir.path().join("ca.pem").to_str().expect("utf-8").to_owned()
    }

    /// The Python module of the package.
    fn module(&self) -> String {
        self.name.replace('-', "_")
    }

    /// The requests the index served, one `host path` a line.
    fn requests(&self) -> String {
        std::fs::read_to_string(self.dir.path().join("requests.log")).unwrap_or_default()
    }
}

impl Drop for PackageIndex {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
    }
}

/// The worker settings of the test's index: its nameserver, CA and URLs.
fn index_settings(ca: Option<&str>) -> Vec<(&'static str, String)> {
    let mut env = vec![
        ("SANDQ__WORKER__NAMESERVERS", SERVER.to_owned()),
        ("SANDQ__WORKER__PIP_INDEX_URL", "https://pypi.sandq.test/simple/".to_owned()),
        ("SANDQ__WORKER__NPM_REGISTRY", "https://npm.sandq.test/".to_owned()),
    ];
    if let Some(ca) = ca {
        env.push(("SANDQ__WORKER__EXTRA_CA_CERTS", ca.to_owned()));
    }
    env
}

fn outbound(mut spec: sandq_schemas::JobSpec, mode: sandq_schemas::RunMode) -> sandq_schemas::JobSpec {
    spec.network = NetworkMode::Outbound;
    spec.mode = Some(mode);
    spec
}

fn node_job(code: &str) -> sandq_schemas::JobSpec {
    let mut spec = python_job(code, Sku::S);
    spec.runtime = sandq_schemas::Runtime::Node;
    spec
}

/// The SHA-256 of a session's packages archive (`manifest.packages`), if it has one.
async fn packages_blob(world: &Isolated, session: &str) -> Option<String> {
    let s3 = sandq_core::storage::client(&world.config.s3);
    let names = sandq_schemas::names::Names::new(world.namespace.clone());
    let manifest = sandq_core::sessions::load(&s3, &world.config.s3.bucket, &names, session).await.expect("manifest");
    manifest.expect("the session exists").packages.map(|p| p.sha256)
}

/// Issue 9 §4: with the worker's extra CA, `pip install` (script mode), `%pip install`
/// (notebook mode) and `npm install` of packages that are not in the image install from the
/// test's HTTPS index and load in the same job; in a session, job 2 imports what job 1
/// installed without installing again, and installed packages are never artifacts. The
/// reported input `pip_install.py` (its package is in the image) runs as it is.
#[tokio::test]
async fn pip_and_npm_install_from_an_https_index_the_worker_trusts() {
    use sandq_schemas::RunMode;
    let _serial = SERIAL.lock().await;
    let external = External::start("unused");
    let index = PackageIndex::start();
    let world = Isolated::new().await;
    let worker_id = format!("{}-wp", world.namespace);
    let ca = index.ca();
    let settings = index_settings(Some(&ca));
    let env: Vec<(&str, &str)> = settings.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut worker = world.start_worker_ready(&worker_id, &env);
    let mut client = world.client().await;
    let (name, module, token) = (index.name.clone(), index.module(), index.token.clone());
    let log = || sandq_tests::isolated_worker_log(&worker_id);

    // Script mode: pip in a subprocess, then the import.
    let script = format!(
        "import subprocess, sys\n\
         subprocess.run([sys.executable, '-m', 'pip', 'install', '--quiet', '{name}'], check=True)\n\
         import {module}\nprint({module}.value())\n"
    );
    let result = sandq_tests::run(&mut client, &outbound(python_job(&script, Sku::S), RunMode::Script)).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}\n{}", result.stderr.text, log());
    assert_eq!(result.stdout.text, format!("{token}\n"), "{}", result.stderr.text);
    assert!(result.artifacts.is_empty(), "installed packages came back as artifacts: {:?}", result.artifacts);
    assert!(result.skipped_artifacts.is_empty(), "{:?}", result.skipped_artifacts);

    // Notebook mode: the %pip magic.
    let cell = format!("%pip install {name}\nimport {module}\nprint({module}.value())\n");
    let result = sandq_tests::run(&mut client, &outbound(python_job(&cell, Sku::S), RunMode::Notebook)).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}\n{:?}", result.stderr.text, result.error);
    assert!(result.stdout.text.contains(&format!("Successfully installed {name}-1.0")), "{}", result.stdout.text);
    assert_eq!(result.stdout.text.lines().last(), Some(token.as_str()), "{}", result.stdout.text);
    assert!(result.artifacts.is_empty(), "{:?}", result.artifacts);

    // Node.js: npm install, then require.
    let js = format!(
        "const {{ execSync }} = require('child_process');\n\
         execSync('npm install {name}', {{ stdio: ['ignore', 2, 2] }});\n\
         console.log(require('{name}')());\n"
    );
    let result = sandq_tests::run(&mut client, &outbound(node_job(&js), RunMode::Script)).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    assert_eq!(result.stdout.text, format!("{token}\n"), "{}", result.stderr.text);
    assert!(result.artifacts.is_empty(), "node_modules came back as artifacts: {:?}", result.artifacts);
    let requests = index.requests();
    for expected in [format!("pypi.sandq.test /simple/{name}/"), format!("npm.sandq.test /{name}")] {
        assert!(requests.lines().any(|l| l == expected), "the index never served {expected:?}: {requests}");
    }

    // A session: job 1 installs (and writes a file of its own), job 2 imports without pip.
    let session = format!("pkg-{}", uuid::Uuid::new_v4().simple());
    let mut first = outbound(python_job(&format!("{script}open('mine.txt', 'w').write('x')\n"), Sku::S), RunMode::Script);
    first.session = Some(session.clone());
    let result = sandq_tests::run(&mut client, &first).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    let paths: Vec<&str> = result.artifacts.iter().map(|a| a.path.as_str()).collect();
    assert_eq!(paths, ["mine.txt"], "only the job's own file is an artifact");
    let fetched = index.requests().lines().count();
    let archived = packages_blob(&world, &session).await.expect("job 1 left a packages archive");
    // /work holds only the job's own files: the packages live in /sandq/packages.
    let mut second = python_job(&format!("import os, {module}\nprint({module}.value())\nprint(sorted(os.listdir('/work')))\n"), Sku::S);
    second.session = Some(session.clone());
    second.mode = Some(RunMode::Script);
    let result = sandq_tests::run(&mut client, &second).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}\n{}", result.stderr.text, log());
    assert_eq!(result.stdout.text, format!("{token}\n['mine.txt']\n"));
    assert!(result.artifacts.is_empty(), "{:?}", result.artifacts);
    assert_eq!(packages_blob(&world, &session).await, Some(archived.clone()), "unchanged packages archived differently");
    // Node.js in a session too, and in notebook mode (a warm-capable job, network none).
    let mut node_first = outbound(node_job(&js), RunMode::Script);
    node_first.session = Some(session.clone());
    let result = sandq_tests::run(&mut client, &node_first).await;
    assert_eq!(result.stdout.text, format!("{token}\n"), "{}", result.stderr.text);
    let fetched_after_npm = index.requests().lines().count();
    assert!(fetched_after_npm > fetched, "npm fetched nothing");
    assert_ne!(packages_blob(&world, &session).await, Some(archived), "the npm package is not in the session's archive");
    let mut node_second = node_job(&format!("console.log(require('{name}')());\n"));
    node_second.session = Some(session.clone());
    let result = sandq_tests::run(&mut client, &node_second).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    assert_eq!(result.stdout.text.trim_end(), token, "{}", result.stderr.text);
    // The Python package is still there after the Node.js jobs, in notebook mode too (a job
    // a warm sandbox may take: network none).
    let mut third = python_job(&format!("import {module}\nprint({module}.value())\n"), Sku::S);
    third.session = Some(session.clone());
    let result = sandq_tests::run(&mut client, &third).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}\n{:?}", result.stderr.text, result.error);
    assert_eq!(result.stdout.text, format!("{token}\n"), "{}", result.stderr.text);
    assert_eq!(index.requests().lines().count(), fetched_after_npm, "a later job of the session fetched from the index again");

    // A job that replaces its packages tree with a link to /etc: the archive keeps the link as
    // a link, the next job's restore cannot extract it over the tree the worker made, and the
    // job runs anyway, with an empty user site (and nothing was written through the link).
    let mut sabotage =
        python_job("import os, shutil\nshutil.rmtree('/sandq/packages/python')\nos.symlink('/etc', '/sandq/packages/python')\n", Sku::S);
    sabotage.session = Some(session.clone());
    sabotage.mode = Some(RunMode::Script);
    let result = sandq_tests::run(&mut client, &sabotage).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    let mut after = python_job(
        "import os\nprint(os.path.islink('/sandq/packages/python'), sorted(os.listdir('/sandq/packages/python/lib/python3.13/site-packages')))\n",
        Sku::S,
    );
    after.session = Some(session.clone());
    after.mode = Some(RunMode::Script);
    let result = sandq_tests::run(&mut client, &after).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}\n{}", result.stderr.text, log());
    assert_eq!(result.stdout.text, "False []\n");
    assert!(log().contains("the session's packages were not all restored"), "{}", log());

    // The reported input: its package is in the image; pip says so and the import works.
    let reported = std::fs::read_to_string(sandq_tests::repo_root().join("tests/reported/pip_install.py")).expect("pip_install.py");
    let result = sandq_tests::run(&mut client, &outbound(python_job(&reported, Sku::S), RunMode::Script)).await;
    assert_eq!(result.status, JobStatus::Succeeded, "{}", result.stderr.text);
    assert_eq!(result.stdout.text, "  a    b\n---  ---\n  1    2\n", "{}", result.stderr.text);

    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
    drop(index);
    drop(external);
}

/// Issue 9 §4: without the CA, the install fails cleanly: the job is `failed` with pip's TLS
/// verification error in its stderr, and the worker goes on to run the next job.
#[tokio::test]
async fn without_the_ca_pip_install_fails_cleanly() {
    use sandq_schemas::RunMode;
    let _serial = SERIAL.lock().await;
    let external = External::start("unused");
    let index = PackageIndex::start();
    let world = Isolated::new().await;
    let worker_id = format!("{}-wn", world.namespace);
    let mut settings = index_settings(None);
    settings.push(("SANDQ__WARM__PER_SKU", "0".to_owned()));
    let env: Vec<(&str, &str)> = settings.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut worker = world.start_worker_ready(&worker_id, &env);
    let mut client = world.client().await;
    let (name, module) = (index.name.clone(), index.module());
    let script = format!(
        "import subprocess, sys\n\
         subprocess.run([sys.executable, '-m', 'pip', 'install', '--retries', '1', '{name}'], check=True)\n\
         import {module}\n"
    );
    let result = sandq_tests::run(&mut client, &outbound(python_job(&script, Sku::S), RunMode::Script)).await;
    assert_eq!(result.status, JobStatus::Failed, "{}", result.stderr.text);
    assert!(result.stderr.text.contains("CERTIFICATE_VERIFY_FAILED"), "no TLS verification error: {}", result.stderr.text);
    assert!(result.stderr.text.contains("CalledProcessError"), "{}", result.stderr.text);
    assert!(!index.requests().contains(&name), "the index served a request over an unverified connection");
    // No retries: npm's own (2, backing off from 10 s) would outlast the job's timeout.
    let js = format!("const {{ execSync }} = require('child_process');\nexecSync('npm install --fetch-retries=0 {name}', {{ stdio: ['ignore', 2, 2] }});\n");
    let result = sandq_tests::run(&mut client, &outbound(node_job(&js), RunMode::Script)).await;
    assert_eq!(result.status, JobStatus::Failed, "{}", result.stderr.text);
    assert!(
        result.stderr.text.contains("UNABLE_TO_VERIFY_LEAF_SIGNATURE") || result.stderr.text.contains("unable to verify"),
        "{}",
        result.stderr.text
    );
    let next = sandq_tests::run(&mut client, &python_job("print(6 * 7)", Sku::S)).await;
    assert_eq!(next.status, JobStatus::Succeeded, "{}", next.stderr.text);
    assert_eq!(next.stdout.text, "42\n");
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
    drop(index);
    drop(external);
}
