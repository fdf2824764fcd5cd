//! Infrastructure faults: the broker restarted while jobs run. Its own test binary, because it
//! restarts the machine's RabbitMQ (cargo runs test binaries one after another).

use std::process::Command;
use std::time::Duration;

use sandq_schemas::{JobStatus, Sku};
use sandq_tests::{exits_within, python_job, wait, wait_for_status, Isolated};

fn rabbitmqctl(args: &[&str]) {
    let status = Command::new("rabbitmqctl").args(args).status().expect("rabbitmqctl");
    assert!(status.success(), "rabbitmqctl {args:?} failed");
}

#[tokio::test]
async fn a_broker_restart_loses_no_job() {
    let world = Isolated::new().await;
    let mut worker = world.start_worker(&format!("{}-w", world.namespace), &[]);
    let mut client = world.client().await;
    let mut jobs = Vec::new();
    for i in 0..10 {
        let sku = if i % 2 == 0 { Sku::S } else { Sku::M };
        let spec = python_job(&format!("import time\ntime.sleep(0.5)\nprint({i})\n"), sku);
        client.submit(&spec).await.expect("submit");
        jobs.push((i, spec.job_id));
    }
    wait_for_status(&mut client, &jobs[0].1, JobStatus::Running, Duration::from_secs(30)).await;
    rabbitmqctl(&["stop_app"]);
    tokio::time::sleep(Duration::from_secs(2)).await;
    rabbitmqctl(&["start_app"]);
    rabbitmqctl(&["await_startup"]);
    for (i, id) in &jobs {
        let result = wait(&mut client, id).await;
        assert_eq!(result.status, JobStatus::Succeeded, "job {i}: {result:?}");
        assert_eq!(result.stdout.text, format!("{i}\n"));
    }
    assert!(matches!(worker.try_wait(), Ok(None)), "the worker died with the broker");
    // The client reconnects by itself too.
    let spec = python_job("print('after the restart')", Sku::S);
    let result = sandq_tests::run(&mut client, &spec).await;
    assert_eq!(result.stdout.text, "after the restart\n");
    drop(worker.stdin.take());
    assert!(exits_within(&mut worker, Duration::from_secs(30)));
    world.delete_queues().await;
}
