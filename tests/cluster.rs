//! A RabbitMQ cluster of its own for a test (`tests/rabbitmq_cluster.rs`): `size` nodes on
//! loopback, started in parallel the way `scripts/services.sh` starts its single node (the
//! `rabbitmq-server` wrapper, which runs the node as the `rabbitmq` user; every file under one
//! temp dir; nothing read from `/etc/rabbitmq`), then joined to the first with
//! `stop_app; join_cluster; start_app`.
//!
//! - Node names `sqc<i>-<random>@localhost`; one random Erlang cookie for the cluster, given to
//!   the nodes with `-setcookie` (`RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS`) and to `rabbitmqctl` with
//!   `--erlang-cookie`, so no other node or CLI on the machine can talk to these nodes, nor they
//!   to them.
//! - Ports from `SANDQ_RABBITMQ_CLUSTER_PORT` (the first of 10 consecutive ports that `.ci/run`
//!   checks and exports: base + i is node i's AMQP port, base + 3 + i its distribution port;
//!   the rest spare); default [`DEFAULT_BASE_PORT`]. Every port must be free, or the cluster
//!   refuses to start (it would otherwise talk to someone else's node).
//! - On drop: every node shut down (killed by its pid file if it does not stop), the temp dir
//!   removed, and the epmd on 4369 killed only when this cluster started it and no node is
//!   registered with it any more (a shared epmd serves every node on the machine).

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// First port when `SANDQ_RABBITMQ_CLUSTER_PORT` is unset: 5700..5709, beside the default
/// node's 5672 and outside the ranges `.ci/run` picks for its instances (20000 and up).
pub const DEFAULT_BASE_PORT: u16 = 5700;

/// One node of a [`RabbitCluster`].
#[derive(Debug, Clone)]
pub struct Node {
    /// Erlang node name (`sqc1-<random>@localhost`).
    pub name: String,
    /// AMQP port on 127.0.0.1.
    pub amqp_port: u16,
    /// Erlang distribution port on 127.0.0.1.
    pub dist_port: u16,
    /// Its files (mnesia, log, config, pid file).
    pub dir: PathBuf,
}

/// A RabbitMQ cluster started by a test; stopped and removed on drop.
pub struct RabbitCluster {
    /// The nodes; the first is the one the others joined.
    pub nodes: Vec<Node>,
    cookie: String,
    dir: tempfile::TempDir,
    epmd_was_running: bool,
}

/// True when nothing listens on `127.0.0.1:port`.
fn port_free(port: u16) -> bool {
    std::net::TcpListener::bind(("127.0.0.1", port)).is_ok()
}

/// Waits (up to `limit`) until something accepts TCP connections on `127.0.0.1:port`.
fn wait_port(port: u16, limit: Duration) -> bool {
    let started = Instant::now();
    while started.elapsed() < limit {
        if std::net::TcpStream::connect(("127.0.0.1", port)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    false
}

fn epmd_running() -> bool {
    Command::new("pgrep").args(["-x", "epmd"]).stdout(Stdio::null()).status().is_ok_and(|s| s.success())
}

impl RabbitCluster {
    /// Starts a cluster of `size` nodes (at most 3: the port layout) and waits until every
    /// node runs and has joined the first. Panics with the nodes' logs when one does not.
    pub fn start(size: usize) -> Self {
        assert!((1..=3).contains(&size), "a cluster of 1 to 3 nodes");
        let base: u16 = std::env::var("SANDQ_RABBITMQ_CLUSTER_PORT")
            .ok()
            .map(|p| p.parse().expect("SANDQ_RABBITMQ_CLUSTER_PORT: a port number"))
            .unwrap_or(DEFAULT_BASE_PORT);
        let tag = &uuid::Uuid::new_v4().simple().to_string()[..8];
        let dir = tempfile::Builder::new().prefix("sandq-rabbitmq-cluster-").tempdir().expect("temp dir");
        let nodes: Vec<Node> = (0..size)
            .map(|i| {
                let offset = u16::try_from(i).expect("node index");
                Node {
                    name: format!("sqc{}-{tag}@localhost", i + 1),
                    amqp_port: base + offset,
                    dist_port: base + 3 + offset,
                    dir: dir.path().join(format!("node{}", i + 1)),
                }
            })
            .collect();
        for node in &nodes {
            for port in [node.amqp_port, node.dist_port] {
                assert!(port_free(port), "port {port} is in use: set SANDQ_RABBITMQ_CLUSTER_PORT to the first of 10 free ports");
            }
        }
        let cluster = RabbitCluster { nodes, cookie: uuid::Uuid::new_v4().simple().to_string(), dir, epmd_was_running: epmd_running() };
        // The nodes run as the rabbitmq user: it must reach and own their dirs.
        for path in [dir_of(&cluster)].into_iter().chain(cluster.nodes.iter().map(|n| n.dir.clone())) {
            std::fs::create_dir_all(&path).expect("node dir");
            set_mode(&path, 0o755);
        }
        for node in &cluster.nodes {
            for sub in ["mnesia", "log"] {
                std::fs::create_dir_all(node.dir.join(sub)).expect("node dir");
            }
            std::fs::write(node.dir.join("enabled_plugins"), "[].\n").expect("enabled_plugins");
            for file in ["rabbitmq.conf", "rabbitmq-env.conf"] {
                std::fs::write(node.dir.join(file), "").expect("config file");
            }
        }
        let status = Command::new("chown").args(["-R", "rabbitmq:rabbitmq"]).arg(dir_of(&cluster)).status().expect("chown");
        assert!(status.success(), "cannot give the cluster's dir to the rabbitmq user");
        // In parallel: a node takes ~10 s to boot on this machine.
        std::thread::scope(|scope| {
            for i in 0..cluster.nodes.len() {
                let cluster = &cluster;
                scope.spawn(move || cluster.start_node(i));
            }
        });
        for i in 1..cluster.nodes.len() {
            let first = cluster.nodes[0].name.clone();
            for args in [vec!["stop_app"], vec!["join_cluster", first.as_str()], vec!["start_app"]] {
                let out = cluster.ctl(i, &args);
                assert!(
                    out.status.success(),
                    "{} {args:?}: {}{}",
                    cluster.nodes[i].name,
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
        }
        for i in 0..cluster.nodes.len() {
            cluster.await_startup(i);
        }
        cluster
    }

    /// `amqp://guest:guest@127.0.0.1:<port>/%2f` of every node, in node order.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(|n| format!("amqp://guest:guest@127.0.0.1:{}/%2f", n.amqp_port)).collect()
    }

    /// Runs `rabbitmqctl -n <node i> --erlang-cookie <cookie> <args>` (60 s timeout).
    pub fn ctl(&self, i: usize, args: &[&str]) -> Output {
        self.cli("rabbitmqctl", i, args)
    }

    /// Runs `rabbitmq-queues` against node `i`, like [`RabbitCluster::ctl`].
    pub fn queues_cli(&self, i: usize, args: &[&str]) -> Output {
        self.cli("rabbitmq-queues", i, args)
    }

    fn cli(&self, program: &str, i: usize, args: &[&str]) -> Output {
        let mut command = Command::new("timeout");
        command.args(["60", program, "-n", &self.nodes[i].name, "--erlang-cookie", &self.cookie]).args(args);
        clear_rabbitmq_env(&mut command);
        command.output().expect(program)
    }

    /// Starts node `i` (again: after [`RabbitCluster::stop_node`] it rejoins its cluster by
    /// itself) and waits until it has booted.
    pub fn start_node(&self, i: usize) {
        let node = &self.nodes[i];
        let mut command = Command::new("rabbitmq-server");
        command.arg("-detached");
        clear_rabbitmq_env(&mut command);
        let path = |name: &str| node.dir.join(name).display().to_string();
        command
            .env("RABBITMQ_NODENAME", &node.name)
            .env("RABBITMQ_NODE_PORT", node.amqp_port.to_string())
            .env("RABBITMQ_NODE_IP_ADDRESS", "127.0.0.1")
            .env("RABBITMQ_DIST_PORT", node.dist_port.to_string())
            .env("RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS", format!("-kernel inet_dist_use_interface {{127,0,0,1}} -setcookie {}", self.cookie))
            .env("RABBITMQ_MNESIA_BASE", path("mnesia"))
            .env("RABBITMQ_LOG_BASE", path("log"))
            .env("RABBITMQ_PID_FILE", path("rabbitmq.pid"))
            .env("RABBITMQ_ENABLED_PLUGINS_FILE", path("enabled_plugins"))
            .env("RABBITMQ_CONFIG_FILE", path("rabbitmq.conf"))
            .env("RABBITMQ_CONF_ENV_FILE", path("rabbitmq-env.conf"))
            .env("RABBITMQ_ADVANCED_CONFIG_FILE", path("advanced.config"))
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        let _ = command.status().expect("rabbitmq-server");
        assert!(wait_port(node.amqp_port, Duration::from_secs(120)), "node {} did not open its AMQP port:\n{}", node.name, self.log(i));
        self.await_startup(i);
    }

    fn await_startup(&self, i: usize) {
        let started = Instant::now();
        loop {
            let out = self.ctl(i, &["-q", "await_startup"]);
            if out.status.success() {
                return;
            }
            assert!(
                started.elapsed() < Duration::from_secs(120),
                "node {} did not finish booting: {}\n{}",
                self.nodes[i].name,
                String::from_utf8_lossy(&out.stderr),
                self.log(i)
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// Stops node `i` (the whole Erlang node, as an operator's `rabbitmqctl stop` does: its
    /// clients' connections are closed) and waits until its AMQP port is closed.
    pub fn stop_node(&self, i: usize) {
        let out = self.ctl(i, &["stop"]);
        assert!(out.status.success(), "stop {}: {}", self.nodes[i].name, String::from_utf8_lossy(&out.stderr));
        let started = Instant::now();
        while !port_free(self.nodes[i].amqp_port) {
            assert!(started.elapsed() < Duration::from_secs(60), "node {} still listens", self.nodes[i].name);
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The OS process id of node `i`'s Erlang VM (its pid file), checked to be that node's: the
    /// VM's environment names it (`RABBITMQ_NODENAME`; its command line does not).
    fn vm_pid(&self, i: usize) -> Option<String> {
        let pid = std::fs::read_to_string(self.nodes[i].dir.join("rabbitmq.pid")).ok()?.trim().to_owned();
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        let expected = format!("RABBITMQ_NODENAME={}", self.nodes[i].name);
        environ.split(|b| *b == 0).any(|var| var == expected.as_bytes()).then_some(pid)
    }

    /// Freezes node `i` (SIGSTOP to its Erlang VM): its TCP connections stay open but it
    /// answers nothing, as a hung node; [`RabbitCluster::thaw_node`] resumes it.
    pub fn freeze_node(&self, i: usize) {
        let pid = self.vm_pid(i).unwrap_or_else(|| panic!("no VM for node {}", self.nodes[i].name));
        assert!(Command::new("kill").args(["-STOP", &pid]).status().expect("kill").success());
    }

    /// Resumes a node [`RabbitCluster::freeze_node`] froze (SIGCONT).
    pub fn thaw_node(&self, i: usize) {
        if let Some(pid) = self.vm_pid(i) {
            let _ = Command::new("kill").args(["-CONT", &pid]).status();
        }
    }

    /// The index of the node a quorum queue's leader is on, asked of node `ask` (a running
    /// one); `None` when the queue or its leader is unknown.
    pub fn queue_leader(&self, ask: usize, queue: &str) -> Option<usize> {
        let out = self.ctl(ask, &["-q", "--no-table-headers", "list_queues", "name", "leader"]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let leader =
            text.lines().find_map(|l| l.split_once('\t').filter(|(name, _)| *name == queue).map(|(_, leader)| leader.trim().to_owned()))?;
        self.nodes.iter().position(|n| n.name == leader)
    }

    /// The indexes of the nodes that hold a replica of a quorum queue (its members), asked of
    /// node `ask`.
    pub fn queue_members(&self, ask: usize, queue: &str) -> Vec<usize> {
        let out = self.ctl(ask, &["-q", "--no-table-headers", "list_queues", "name", "members"]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let Some(members) = text.lines().find_map(|l| l.split_once('\t').filter(|(name, _)| *name == queue).map(|(_, m)| m.to_owned()))
        else {
            return Vec::new();
        };
        (0..self.nodes.len()).filter(|i| members.contains(&self.nodes[*i].name)).collect()
    }

    /// Moves the leadership of quorum queue `queue` off node `from` (asked of node `ask`, not
    /// `from`): removes `from`'s replica, which makes the leader there step down and the others
    /// elect one of them, then adds the replica back (it catches up from the new leader). Returns
    /// the new leader's index. Panics when RabbitMQ refuses or no other leader appears within 60 s.
    pub fn move_leader_off(&self, ask: usize, queue: &str, from: usize) -> usize {
        let node = self.nodes[from].name.clone();
        let out = self.queues_cli(ask, &["delete_member", queue, &node]);
        assert!(
            out.status.success(),
            "delete_member {queue} {node}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        let started = Instant::now();
        let leader = loop {
            match self.queue_leader(ask, queue) {
                Some(leader) if leader != from => break leader,
                _ => {
                    assert!(started.elapsed() < Duration::from_secs(60), "no new leader for {queue}");
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        };
        let out = self.queues_cli(ask, &["add_member", queue, &node]);
        assert!(
            out.status.success(),
            "add_member {queue} {node}: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        leader
    }

    /// The indexes of the nodes that hold a client connection named `connection_name`
    /// (lapin's `connection_name` client property), asked of node `ask`: the connections'
    /// server ports are the nodes' AMQP ports.
    pub fn connection_nodes(&self, ask: usize, connection_name: &str) -> Vec<usize> {
        let out = self.ctl(ask, &["-q", "--no-table-headers", "list_connections", "port", "client_properties"]);
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let quoted = format!("\"{connection_name}\"");
        let mut found: Vec<usize> = text
            .lines()
            .filter(|l| l.contains(&quoted))
            .filter_map(|l| l.split('\t').next().and_then(|port| port.trim().parse::<u16>().ok()))
            .filter_map(|port| self.nodes.iter().position(|n| n.amqp_port == port))
            .collect();
        found.sort_unstable();
        found.dedup();
        found
    }

    /// The last 40 lines of node `i`'s log (for failure messages).
    pub fn log(&self, i: usize) -> String {
        let path = self.nodes[i].dir.join("log").join(format!("{}.log", self.nodes[i].name));
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(40)..].join("\n")
    }
}

fn dir_of(cluster: &RabbitCluster) -> PathBuf {
    cluster.dir.path().to_path_buf()
}

fn set_mode(path: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).expect("chmod");
}

/// The test runs inside an instance's environment (`RABBITMQ_NODENAME`, `RABBITMQ_NODE_PORT`...
/// name the single node of `scripts/services.sh`): none of it may reach the cluster's commands.
fn clear_rabbitmq_env(command: &mut Command) {
    for (key, _) in std::env::vars_os() {
        if key.to_string_lossy().starts_with("RABBITMQ_") {
            command.env_remove(key);
        }
    }
}

impl Drop for RabbitCluster {
    fn drop(&mut self) {
        // A node a failed test left frozen could not shut down.
        for i in 0..self.nodes.len() {
            self.thaw_node(i);
        }
        std::thread::scope(|scope| {
            for i in 0..self.nodes.len() {
                let cluster = &*self;
                scope.spawn(move || {
                    let _ = cluster.ctl(i, &["shutdown"]);
                });
            }
        });
        // A node that did not stop: by the pid it wrote (its Erlang VM).
        for i in 0..self.nodes.len() {
            if let Some(pid) = self.vm_pid(i) {
                let _ = Command::new("kill").args(["-KILL", &pid]).status();
            }
        }
        if !self.epmd_was_running && epmd_running() {
            let names =
                Command::new("epmd").arg("-names").output().map(|o| String::from_utf8_lossy(&o.stdout).into_owned()).unwrap_or_default();
            if !names.lines().any(|l| l.starts_with("name ")) {
                let _ = Command::new("epmd").arg("-kill").stdout(Stdio::null()).status();
            }
        }
        // The temp dir goes with `self.dir`.
    }
}
