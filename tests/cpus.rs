//! The sandbox's size is what the program sees (issue 9, section 2): every CPU count Python,
//! Node.js and `nproc` report equals the SKU's cores (at most the host's CPUs: the worker pins
//! each sandbox to that many CPUs of its own). Real worker and containers; the reported input
//! `tests/reported/cpu_count.py` runs as it is.

use sandq_schemas::{JobStatus, RunMode, Runtime, Sku};
use sandq_tests::{client, python_job, repo_root, run};

/// CPUs in a kernel CPU list (`0`, `0-1`, `1,3-4`), counted here (not by the worker's code).
fn count_cpu_list(list: &str) -> usize {
    let number = |n: &str| n.trim().parse::<usize>().unwrap_or_else(|e| panic!("{list:?}: {e}"));
    list.trim().split(',').map(|part| part.split_once('-').map_or(1, |(a, b)| number(b) - number(a) + 1)).sum()
}

/// The CPUs this machine has online.
fn host_cpus() -> usize {
    count_cpu_list(&std::fs::read_to_string("/sys/devices/system/cpu/online").expect("online cpus"))
}

/// The cores the harness's worker gives a SKU (S is set to 1 there, M keeps its default 2).
fn expected(sku: Sku) -> usize {
    let cores = match sku {
        Sku::S => 1,
        _ => 2,
    };
    cores.min(host_cpus())
}

#[tokio::test]
async fn python_sees_the_skus_cores_everywhere() {
    // Right on SKU S: every line says 1 (on M: 2), whatever the host has.
    let code = std::fs::read_to_string(repo_root().join("tests/reported/cpu_count.py")).expect("cpu_count.py");
    let extra = "import subprocess\nprint('nproc', subprocess.run(['nproc'], capture_output=True, text=True).stdout.strip())\nallowed = [l for l in open('/proc/self/status') if l.startswith('Cpus_allowed_list')][0]\nprint('Cpus_allowed_list', allowed.split(':')[1].strip())\n";
    let mut client = client().await;
    for sku in [Sku::S, Sku::M] {
        for mode in [RunMode::Notebook, RunMode::Script] {
            let mut spec = python_job(&format!("{code}{extra}"), sku);
            spec.mode = Some(mode);
            let result = run(&mut client, &spec).await;
            assert_eq!(result.status, JobStatus::Succeeded, "{sku:?} {mode:?}: {result:?}");
            let n = expected(sku);
            let mut names = Vec::new();
            for line in result.stdout.text.lines() {
                let (name, value) = line.rsplit_once(' ').expect("name value");
                names.push(name.to_owned());
                if name == "Cpus_allowed_list" {
                    // The cpuset: n CPUs, as the kernel lists them (`0`, `0-1`, `1,3`).
                    assert_eq!(count_cpu_list(value), n, "{sku:?} {mode:?}: {line}");
                } else {
                    assert_eq!(value, n.to_string(), "{sku:?} {mode:?}: {line}");
                }
            }
            assert_eq!(names.len(), 8, "every count printed: {}", result.stdout.text);
        }
    }
}

#[tokio::test]
async fn node_sees_the_skus_cores() {
    let code = "const os = require('os');\nconsole.log(os.availableParallelism());\nconsole.log(require('child_process').execSync('nproc').toString().trim());\n";
    let mut client = client().await;
    for sku in [Sku::S, Sku::M] {
        let mut spec = python_job(code, sku);
        spec.runtime = Runtime::Node;
        let result = run(&mut client, &spec).await;
        assert_eq!(result.status, JobStatus::Succeeded, "{sku:?}: {result:?}");
        let n = expected(sku);
        assert_eq!(result.stdout.text, format!("{n}\n{n}\n"), "{sku:?}");
    }
}
