//! A notebook job's rich outputs as `display` events while it runs: the outputs file is read
//! every [`POLL`] for lines completed since ([`crate::outputs::Tail`]), their images stored
//! in S3 where the result will name them (and not uploaded again by collection), their URLs
//! presigned, and each sent as a `display` event.

use std::future::Future;
use std::path::PathBuf;
use std::time::Duration;

use super::Live;
use crate::outputs::{Caps, Sink, Tail};

/// How often the outputs file is read while the job runs.
pub(crate) const POLL: Duration = Duration::from_millis(100);

/// Reads one attempt's outputs file for its live events.
pub(crate) struct Displays<'a> {
    /// Where the events go.
    pub live: &'a Live,
    /// The job and attempt ids (S3 keys).
    pub job_id: &'a str,
    /// The attempt's id.
    pub attempt_id: &'a str,
    /// The job's `out` dir on the host.
    pub out_dir: PathBuf,
    /// The outputs' bounds.
    pub caps: Caps,
    /// Where images go (the objects stored are shared with collection).
    pub sink: Sink<'a>,
    /// Presigned URL validity (zero: none).
    pub url_ttl: Duration,
    /// Where reading has got to.
    pub tail: Tail,
}

impl Displays<'_> {
    /// Reads and sends while `program` runs, then the rest; returns what `program` returned.
    ///
    /// A read under way when the program ends is finished, never dropped: its lines are already
    /// taken from the file, and dropping it would lose them from the live events. That read and
    /// the last one together take at most [`super::FLUSH_WAIT`] (S3 may be slow; the result
    /// keeps every output either way).
    pub(crate) async fn follow<F: Future>(&mut self, program: F) -> F::Output {
        let mut program = std::pin::pin!(program);
        let mut sending = true;
        loop {
            tokio::select! {
                output = &mut program => {
                    if sending {
                        let _ = tokio::time::timeout(super::FLUSH_WAIT, self.once()).await;
                    }
                    return output;
                }
                () = tokio::time::sleep(POLL), if sending => {}
            }
            let mut read = Box::pin(self.once());
            tokio::select! {
                more = &mut read => sending = more,
                output = &mut program => {
                    let deadline = tokio::time::Instant::now() + super::FLUSH_WAIT;
                    let more = tokio::time::timeout_at(deadline, &mut read).await;
                    drop(read);
                    if more == Ok(true) {
                        let _ = tokio::time::timeout_at(deadline, self.once()).await;
                    }
                    return output;
                }
            }
        }
    }

    /// Sends the outputs completed since the last call. Returns false once no more displays
    /// are to be sent (the cap reached). An output whose image S3 did not take is not sent
    /// (collection stores it again; the result is complete).
    pub(crate) async fn once(&mut self) -> bool {
        let outputs = self.tail.next(self.job_id, self.attempt_id, &self.out_dir, self.caps, self.sink).await;
        for (index, mut output) in outputs {
            if !self.url_ttl.is_zero() {
                for value in output.data.values_mut() {
                    if let Some(artifact) = value.artifact.as_mut() {
                        if let Ok(url) = sandq_core::storage::presign_get(self.sink.s3, self.sink.bucket, &artifact.key, self.url_ttl).await
                        {
                            artifact.url = Some(url);
                            artifact.url_expires_at_ms = Some(sandq_core::time::now_ms() + self.url_ttl.as_millis() as u64);
                        }
                    }
                }
            }
            let Ok(json) = serde_json::to_string(&output) else { continue };
            if !self.live.display(index, json) {
                return false;
            }
        }
        true
    }
}
