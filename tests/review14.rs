//! Tests of the fourteenth security review's fixes (issue 14; the kinds are those of
//! docs/threat-model.md; R14-1 is in `review12.rs`'s ACL test, R14-2 in the worker's
//! `sandbox::cgroup` unit tests, R14-4 in `sandbox::network`'s).
//!
//! - R14-5: every client may write `inputs/sha256/<digest>`, and one that wrote other bytes under
//!   a digest it could guess (a public dataset's) denied that file to everyone: the client
//!   skipped the upload because the key existed, the worker rejected each job on its size or
//!   digest check and left the object. Now the worker removes an object that provably does not
//!   hold the bytes its name says, the Rust client uploads again when the stored size differs,
//!   and a job that merely declares a wrong size removes nothing.

use sandq_schemas::{JobStatus, Sku};
use sandq_submitter::storage;
use sandq_tests::{python_job, Isolated};
use sha2::Digest;

/// The public file's bytes: unique to this run (content-addressed keys are shared by every
/// namespace of the bucket).
fn public_file() -> Vec<u8> {
    format!("id,value\n1,{}\n", uuid::Uuid::new_v4().simple()).into_bytes()
}

#[tokio::test]
async fn a_poisoned_input_object_is_removed_and_uploaded_again() {
    let world = Isolated::new().await;
    let id = format!("{}-w", world.namespace);
    let worker = world.start_worker_ready(&id, &sandq_tests::small_worker_env(&[]));
    let mut client = world.client().await;
    let (s3, bucket) = (storage::client(&world.config.s3), world.config.s3.bucket.clone());
    let dir = tempfile::tempdir().expect("tempdir");
    let job_reading = |input: sandq_schemas::InputFile| {
        let mut spec = python_job("print(open('data.csv').read().splitlines()[1])", Sku::S);
        spec.inputs = vec![input];
        spec
    };

    // 1. Other bytes of another size under the file's digest: the client sees the size differ
    //    and uploads again; the job reads the right bytes.
    let bytes = public_file();
    let digest = hex::encode(sha2::Sha256::digest(&bytes));
    let key = sandq_schemas::names::input_key(&digest);
    storage::put_bytes(&s3, &bucket, &key, b"garbage".to_vec(), "text/plain").await.expect("poison");
    let local = dir.path().join("public.csv");
    std::fs::write(&local, &bytes).expect("write");
    let input = client.upload(&local, "data.csv").await.expect("upload");
    let first = sandq_tests::run(&mut client, &job_reading(input)).await;
    let expected_line = format!("{}\n", String::from_utf8_lossy(&bytes).lines().nth(1).expect("line 2"));

    // 2. Other bytes of the same size: the client cannot tell and skips the upload; the job is
    //    rejected, the worker removes the object, and the job submitted again runs.
    let bytes2 = public_file();
    let digest2 = hex::encode(sha2::Sha256::digest(&bytes2));
    let key2 = sandq_schemas::names::input_key(&digest2);
    let same_size: Vec<u8> = vec![b'x'; bytes2.len()];
    storage::put_bytes(&s3, &bucket, &key2, same_size, "text/plain").await.expect("poison");
    let local2 = dir.path().join("public2.csv");
    std::fs::write(&local2, &bytes2).expect("write");
    let input2 = client.upload(&local2, "data.csv").await.expect("upload");
    let poisoned = sandq_tests::run(&mut client, &job_reading(input2.clone())).await;
    let after_reject = storage::object_size(&s3, &bucket, &key2).await.expect("head");
    let input2 = client.upload(&local2, "data.csv").await.expect("upload again");
    let again = sandq_tests::run(&mut client, &job_reading(input2)).await;
    let expected_line2 = format!("{}\n", String::from_utf8_lossy(&bytes2).lines().nth(1).expect("line 2"));

    // 3. A job that declares a wrong size for a good object: rejected, and the object stays
    //    (the worker hashed it and found it holds its name's bytes).
    let mut wrong = client.upload(&local, "data.csv").await.expect("upload");
    wrong.size += 1;
    let lying = sandq_tests::run(&mut client, &job_reading(wrong)).await;
    let kept = storage::object_size(&s3, &bucket, &key).await.expect("head");

    let log = sandq_tests::isolated_worker_log(&id);
    sandq_tests::stop_worker(worker);
    world.delete_queues().await;
    let _ = storage::delete_keys(&s3, &bucket, &[key.clone(), key2.clone()]).await;
    assert_eq!((first.status, first.stdout.text.as_str()), (JobStatus::Succeeded, expected_line.as_str()), "{first:?}");
    assert_eq!(poisoned.status, JobStatus::Rejected, "{poisoned:?}");
    let reason = poisoned.reason.as_deref().unwrap_or("");
    assert!(reason.contains("was removed: submitting the job again uploads the file afresh"), "{reason}");
    assert_eq!(after_reject, None, "the poisoned object is still there");
    assert_eq!((again.status, again.stdout.text.as_str()), (JobStatus::Succeeded, expected_line2.as_str()), "{again:?}");
    assert_eq!(lying.status, JobStatus::Rejected, "{lying:?}");
    assert!(lying.reason.as_deref().is_some_and(|r| r.contains("does not match the job's declared size")), "{lying:?}");
    assert_eq!(kept, Some(bytes.len() as u64), "a good object was removed on a job's wrong size");
    assert!(!log.contains("panicked"), "{log}");
}
