//! A channel the broker closes while the connection stands (RabbitMQ's `consumer_timeout`,
//! which counts from delivery, so a job that waited and then ran long can hit it): only that
//! slot's channel is reopened; the job running on another slot goes on and is settled; the
//! timed-out job's redelivery waits for its running attempt on the same worker instead of
//! running the program a second time beside it; every job gets exactly one terminal result;
//! the worker keeps consuming.
//!
//! RabbitMQ 3.10's consumer timeout is node-wide (`consumer_timeout`, checked on each channel's
//! tick, `channel_tick_interval`, read when a channel opens), so the test sets both on the
//! tests' node (`RABBITMQ_NODENAME` when set) for its duration and restores them on drop. It is
//! a test binary of its own: cargo runs test binaries one at a time, so no other test's
//! channel sees the short timeout.

use std::process::Command;
use std::time::Duration;

use sandq_schemas::{JobStatus, Sku};
use sandq_tests::{exits_within, isolated_worker_log, python_job, wait, wait_for_status, Isolated};

/// Runs `rabbitmqctl eval EXPR` on the tests' node; returns its output.
fn rabbit_eval(expr: &str) -> String {
    let out = Command::new("rabbitmqctl").args(["eval", expr]).output().expect("rabbitmqctl");
    assert!(out.status.success(), "rabbitmqctl eval {expr}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// The node's consumer timeout and channel tick, set short; the previous values are put back
/// on drop.
struct ShortConsumerTimeout {
    previous: [(&'static str, String); 2],
}

impl ShortConsumerTimeout {
    fn set(timeout_ms: u64, tick_ms: u64) -> Self {
        let previous =
            ["consumer_timeout", "channel_tick_interval"].map(|key| (key, rabbit_eval(&format!("application:get_env(rabbit, {key})."))));
        rabbit_eval(&format!("application:set_env(rabbit, consumer_timeout, {timeout_ms})."));
        rabbit_eval(&format!("application:set_env(rabbit, channel_tick_interval, {tick_ms})."));
        ShortConsumerTimeout { previous }
    }
}

impl Drop for ShortConsumerTimeout {
    fn drop(&mut self) {
        for (key, previous) in &self.previous {
            // `{ok,Value}` or `undefined`.
            let expr = match previous.strip_prefix("{ok,").and_then(|v| v.strip_suffix('}')) {
                Some(value) => format!("application:set_env(rabbit, {key}, {value})."),
                None => format!("application:unset_env(rabbit, {key})."),
            };
            let _ = Command::new("rabbitmqctl").args(["eval", &expr]).status();
        }
    }
}

#[tokio::test]
async fn a_channel_closed_by_the_broker_is_reopened_alone_and_the_job_runs_once() {
    let world = Isolated::new().await;
    let short = ShortConsumerTimeout::set(4_000, 500);
    let id = format!("{}-w", world.namespace);
    // Two S slots: the broker hands the timed-out delivery straight to the other one.
    let env = [
        ("SANDQ__WARM__PER_SKU", "0"),
        ("SANDQ__SKUS__S__SLOTS", "2"),
        ("SANDQ__SKUS__S__CPUS", "1"),
        ("SANDQ__SKUS__S__MEMORY_BYTES", "2147483648"),
    ];
    let mut worker = world.start_worker_ready(&id, &env);
    let mut client = world.client().await;

    // A holds its delivery past the consumer timeout: 9 s from its start.
    let long = python_job(
        "import os, time\nprint('attempt', os.environ['SANDQ_ATTEMPT'], 'start', flush=True)\n\
         time.sleep(9)\nprint('attempt', os.environ['SANDQ_ATTEMPT'], 'end', flush=True)\n",
        Sku::S,
    );
    client.submit(&long).await.expect("submit A");
    wait_for_status(&mut client, &long.job_id, JobStatus::Running, Duration::from_secs(60)).await;
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    // B, on another slot, is taken about 2 s after A: it runs when A's channel is closed (4 to
    // 4.5 s after A's delivery) and is settled within its own 4 s.
    let other = python_job("import time\ntime.sleep(1.5)\nprint('B done')\n", Sku::M);
    client.submit(&other).await.expect("submit B");

    let b = wait(&mut client, &other.job_id).await;
    assert_eq!(b.status, JobStatus::Succeeded, "{b:?}");
    assert_eq!(b.stdout.text, "B done\n");
    let a = wait(&mut client, &long.job_id).await;
    assert_eq!(a.status, JobStatus::Succeeded, "{a:?}");
    // The first attempt's result: the redelivery did not start a second run of the program.
    assert_eq!(a.stdout.text, "attempt 1 start\nattempt 1 end\n", "{a:?}");

    // The worker goes on, on both SKUs, without having reconnected.
    for sku in [Sku::S, Sku::M] {
        let after = python_job("print(6 * 7)\n", sku);
        client.submit(&after).await.expect("submit");
        let c = wait(&mut client, &after.job_id).await;
        assert_eq!(c.status, JobStatus::Succeeded, "{c:?}");
        assert_eq!(c.stdout.text, "42\n");
    }
    drop(short);
    drop(worker.stdin.take());
    let exited = exits_within(&mut worker, Duration::from_secs(60));
    let log = isolated_worker_log(&id);
    assert!(exited, "the worker did not stop: {log}");
    let a_lines: Vec<&str> = log.lines().filter(|l| l.contains(&long.job_id)).collect();
    let containers = a_lines.iter().filter(|l| l.contains("container id")).count();
    assert_eq!(containers, 1, "A ran in {containers} containers:\n{}", a_lines.join("\n"));
    assert!(
        a_lines.iter().any(|l| l.contains("attempt=2") && l.contains("waiting for it to end")),
        "A's channel was not closed under it, or its redelivery did not wait (the test's premise):\n{}",
        a_lines.join("\n")
    );
    assert!(log.contains("a channel closed; reopening it alone"), "{log}");
    assert!(!log.contains("broker connection lost"), "the worker reconnected instead of reopening one channel: {log}");
    world.delete_queues().await;
}
