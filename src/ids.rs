//! Collections keyed by replica id.
//!
//! The quorum engine and its health verdicts look a replica id up in several maps on every
//! request and heartbeat, and a lighthouse may serve 10,000 groups. Ids are ~60-byte strings
//! (`{name}:{uuid}`), where std's SipHash costs more than the rest of a join; these maps use
//! foldhash instead: seeded at random per process, so an id set cannot be prepared offline to
//! collide, and several times faster on strings of this length.

use std::collections::{HashMap, HashSet};

/// The hasher of [`IdMap`] and [`IdSet`].
pub type IdHasher = foldhash::fast::RandomState;

/// A map keyed by replica id.
pub type IdMap<V> = HashMap<String, V, IdHasher>;

/// A set of replica ids.
pub type IdSet = HashSet<String, IdHasher>;

/// Longest job (room) name a lighthouse accepts.
pub const MAX_JOB_LEN: usize = 64;

/// Checks a job (room) name: empty (the default room), or 1 to [`MAX_JOB_LEN`] characters of
/// ASCII letters, digits, `-`, `_` and `.`, not starting with `.` (it names the room's part of
/// the state file, so it must be a safe file name suffix).
pub fn validate_job(job: &str) -> crate::error::Result<()> {
    if job.is_empty() {
        return Ok(());
    }
    let ok = job.len() <= MAX_JOB_LEN
        && !job.starts_with('.')
        && job
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'));
    if ok {
        Ok(())
    } else {
        Err(crate::error::Error::InvalidArgument(format!(
            "invalid job name {job:?}: use 1 to {MAX_JOB_LEN} ASCII letters, digits, '-', '_' \
             or '.', not starting with '.' (empty: the default room)"
        )))
    }
}
