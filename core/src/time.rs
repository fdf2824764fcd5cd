//! Wall-clock time as the protocol writes it.

use std::time::{SystemTime, UNIX_EPOCH};

/// Unix epoch milliseconds now (0 if the clock reads before 1970). Every `*_at_ms` field of a
/// `JobResult` and every session deadline is in these units (`docs/protocol.md`).
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}
