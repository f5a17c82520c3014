//! Helpers of the lighthouse state's tests: options, members, rounds, temporary files.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use prost::Message;

use super::*;
use crate::lighthouse::health::telemetry::SnapshotRecord;
use crate::proto::LighthouseQuorumResponse;

pub(super) fn opts() -> LighthouseOptions {
    LighthouseOptions {
        min_replicas: 2,
        // No startup hold: the rounds below are issued at once.
        progress_wait: Duration::ZERO,
        ..Default::default()
    }
}

/// A fresh file path in a new temporary folder (removed with the guard).
pub(super) struct TempFile(pub(super) std::path::PathBuf);

impl TempFile {
    pub(super) fn new() -> Self {
        let dir = std::env::temp_dir().join(format!("torchft-state-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir.join("lighthouse.state"))
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        if let Some(dir) = self.0.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

pub(super) fn record(step: i64) -> SnapshotRecord {
    SnapshotRecord {
        step,
        replica_id: "a".into(),
        incarnation: "a:x".into(),
        path: format!("/ckpt/{step}"),
        bytes: 42,
        stage_s: 0.5,
        write_s: 2.0,
        quorum_id: 7,
        unix_s: 1.7e9,
    }
}

pub(super) use crate::testkit::member;

/// Every member asks; returns what each one's waiter received.
pub(super) fn round(shared: &Shared, members: &[QuorumMember]) -> Vec<Arc<Issued>> {
    let rxs: Vec<_> = members
        .iter()
        .map(|m| shared.join(m.clone(), 0).unwrap().1)
        .collect();
    rxs.into_iter()
        .map(|mut rx| rx.try_recv().unwrap().unwrap())
        .collect()
}

pub(super) fn decode(framed: &Bytes) -> Quorum {
    assert_eq!(framed[0], 0);
    let len = u32::from_be_bytes([framed[1], framed[2], framed[3], framed[4]]) as usize;
    assert_eq!(framed.len(), 5 + len);
    LighthouseQuorumResponse::decode(&framed[5..])
        .unwrap()
        .quorum
        .unwrap()
}
