//! The state file: what the lighthouse must not forget across its own restarts, read at
//! start and written by a writer task, never under the state lock.
//!
//! Handlers hand the writer the latest contents ([`StateWriter::submit`]); the writer
//! coalesces to the latest and writes it atomically (a temporary file, then a rename) on a
//! blocking thread. Whoever must not go on before the contents are on disk (a commit
//! acknowledgement, the members of a changed quorum) awaits [`StateWriter::wait`]; a
//! graceful stop closes the writer, which writes what is pending first.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};

use tokio::runtime::Handle;
use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;
use tracing::warn;

use crate::error::{Error, Result};
use crate::lighthouse::health::telemetry::{EncodedGoodput, SavedGoodput, SnapshotRecord};
use crate::lighthouse::quorum::Durable;

/// What the state file holds: the engine's durable state and, next to its fields, the
/// latest complete durable snapshot the lighthouse heard of (absent in older files).
#[derive(serde::Serialize, serde::Deserialize)]
pub(super) struct StateFile {
    #[serde(flatten)]
    durable: Durable,
    /// Read as any JSON value: a damaged record is dropped alone (it only informs), where a
    /// damaged quorum state refuses the whole file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    snapshot: Option<serde_json::Value>,
    /// The goodput accounts (absent in older files; a damaged value is dropped alone).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    goodput: Option<serde_json::Value>,
}

/// [`StateFile`] as written (borrowing the encoded goodput accounts).
#[derive(serde::Serialize)]
struct StateFileOut<'a> {
    #[serde(flatten)]
    durable: Durable,
    #[serde(skip_serializing_if = "Option::is_none")]
    snapshot: Option<serde_json::Value>,
    #[serde(skip_serializing_if = "Option::is_none")]
    goodput: Option<&'a EncodedGoodput>,
}

/// The goodput accounts a state file keeps, or None (with a warning when they are
/// unusable: they only inform, so the rest of the file still counts).
pub(super) fn load_goodput(path: &Path) -> Option<SavedGoodput> {
    let text = std::fs::read_to_string(path).ok()?;
    let file: StateFile = serde_json::from_str(&text).ok()?;
    let value = file.goodput?;
    match serde_json::from_value::<SavedGoodput>(value) {
        Ok(saved) => Some(saved),
        Err(e) => {
            warn!(path = %path.display(), problem = %e,
                "the state file's goodput accounts are unusable; they start over");
            None
        }
    }
}

/// The snapshot record of a state file, or None (with a warning) when it is unusable.
pub(super) fn snapshot_record(value: serde_json::Value, path: &Path) -> Option<SnapshotRecord> {
    let problem = match serde_json::from_value::<SnapshotRecord>(value) {
        Ok(record) => match record.problem() {
            None => return Some(record),
            Some(problem) => problem,
        },
        Err(e) => e.to_string(),
    };
    warn!(path = %path.display(), problem = %problem,
        "the state file's latest snapshot record is unusable; it is forgotten");
    None
}

/// Reads a state file written by [`save_state`]; None if there is none yet.
pub(super) fn load_state(path: &Path) -> Result<Option<(Durable, Option<SnapshotRecord>)>> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => {
            return Err(Error::InvalidArgument(format!(
                "cannot read the state file {}: {e}",
                path.display()
            )))
        }
    };
    let file: StateFile = serde_json::from_str(&text).map_err(|e| {
        Error::InvalidArgument(format!(
            "the state file {} is not a lighthouse state ({e}); move it away to start from \
             nothing",
            path.display()
        ))
    })?;
    let snapshot = file.snapshot.and_then(|v| snapshot_record(v, path));
    Ok(Some((file.durable, snapshot)))
}

/// Writes `durable` to `path` atomically: a temporary file next to it, then a rename (a
/// reader, or the lighthouse after a crash, sees the old or the new state, never a mix).
pub(super) fn save_state(
    path: &Path,
    durable: Durable,
    snapshot: Option<&SnapshotRecord>,
    goodput: Option<Arc<EncodedGoodput>>,
) -> Result<()> {
    let snapshot = snapshot
        .map(serde_json::to_value)
        .transpose()
        .map_err(|e| Error::Remote(format!("cannot encode the latest snapshot: {e}")))?;
    let text = serde_json::to_vec(&StateFileOut {
        durable,
        snapshot,
        goodput: goodput.as_deref(),
    })
    .map_err(|e| Error::Remote(format!("cannot encode the lighthouse state: {e}")))?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = PathBuf::from(tmp);
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| {
            Error::Unavailable(format!(
                "cannot write the state file {}: {e}",
                path.display()
            ))
        })
}

/// What one write puts in the state file.
#[derive(Debug, Clone)]
pub(super) struct Contents {
    /// The engine's durable state.
    pub(super) durable: Durable,
    /// The latest complete durable snapshot, if any.
    pub(super) snapshot: Option<SnapshotRecord>,
    /// The goodput accounts, encoded.
    pub(super) goodput: Option<Arc<EncodedGoodput>>,
}

/// How far the writer got: the last submission written (with every earlier one, which it
/// supersedes), the error of that write if it failed, and whether the writer has ended.
#[derive(Debug, Clone, Default)]
struct Written {
    seq: u64,
    error: Option<Arc<Error>>,
    ended: bool,
}

/// Submissions not written yet: only the latest is kept (it supersedes the others).
#[derive(Debug, Default)]
struct Pending {
    /// Number of the last submission (0: none yet).
    seq: u64,
    latest: Option<Contents>,
    /// No more submissions: the task writes what is pending and ends.
    closed: bool,
}

/// What the handlers and the writer task share.
#[derive(Debug)]
struct Inner {
    path: PathBuf,
    pending: Mutex<Pending>,
    wake: Notify,
    written: watch::Sender<Written>,
}

impl Inner {
    fn pending(&self) -> MutexGuard<'_, Pending> {
        // Held only to swap a value in or out: a panic elsewhere cannot leave it torn.
        self.pending.lock().unwrap_or_else(|e| e.into_inner())
    }

    async fn wait(&self, seq: u64) -> Result<()> {
        let mut rx = self.written.subscribe();
        let written = rx
            .wait_for(|w| w.seq >= seq || w.ended)
            .await
            .map_err(|_| Error::Shutdown)?
            .clone();
        match written.error {
            _ if written.seq < seq => Err(Error::Shutdown),
            Some(e) => Err(e.duplicate()),
            None => Ok(()),
        }
    }
}

/// The writer of the state file: a task that writes the latest submitted contents, so no
/// handler writes a file (or waits on a disk) under the state lock.
#[derive(Debug)]
pub(crate) struct StateWriter {
    inner: Arc<Inner>,
    task: Mutex<Option<JoinHandle<()>>>,
    runtime: Handle,
}

impl StateWriter {
    /// Starts the writer of `path` on the current tokio runtime.
    pub(super) fn start(path: PathBuf) -> Result<Self> {
        let runtime = Handle::try_current().map_err(|_| {
            Error::Unavailable("the lighthouse state file needs a tokio runtime".into())
        })?;
        let inner = Arc::new(Inner {
            path,
            pending: Mutex::new(Pending::default()),
            wake: Notify::new(),
            written: watch::channel(Written::default()).0,
        });
        let task = runtime.spawn(run(inner.clone()));
        Ok(Self {
            inner,
            task: Mutex::new(Some(task)),
            runtime,
        })
    }

    /// Hands `contents` to the writer (replacing any not written yet); returns the number
    /// to [`StateWriter::wait`] for.
    pub(super) fn submit(&self, contents: Contents) -> u64 {
        let seq = {
            let mut pending = self.inner.pending();
            pending.seq += 1;
            pending.latest = Some(contents);
            pending.seq
        };
        self.inner.wake.notify_one();
        seq
    }

    /// Number of the last submission (0: none yet).
    pub(super) fn submitted(&self) -> u64 {
        self.inner.pending().seq
    }

    /// True when submission `seq` (or a later one) is on disk.
    pub(super) fn written(&self, seq: u64) -> bool {
        let w = self.inner.written.borrow();
        w.seq >= seq && w.error.is_none()
    }

    /// True when the last write failed: the next change is not needed to write again.
    pub(super) fn failed(&self) -> bool {
        self.inner.written.borrow().error.is_some()
    }

    /// Waits until submission `seq` (or a later one) is on disk; the error of that write if
    /// it failed, `Error::Shutdown` if the writer ended first.
    pub(super) fn wait(&self, seq: u64) -> impl std::future::Future<Output = Result<()>> + Send {
        let inner = self.inner.clone();
        async move { inner.wait(seq).await }
    }

    /// Runs `work` on the writer's runtime (work that must follow a write, off the lock).
    pub(super) fn spawn(&self, work: impl std::future::Future<Output = ()> + Send + 'static) {
        self.runtime.spawn(work);
    }

    /// Waits until everything submitted so far is on disk.
    pub(crate) async fn flush(&self) -> Result<()> {
        self.inner.wait(self.submitted()).await
    }

    /// Takes no more submissions, writes what is pending and ends the task.
    pub(crate) async fn close(&self) -> Result<()> {
        let seq = {
            let mut pending = self.inner.pending();
            pending.closed = true;
            pending.seq
        };
        self.inner.wake.notify_one();
        let task = self.task.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(task) = task {
            let _ = task.await;
        }
        self.inner.wait(seq).await
    }
}

impl Drop for StateWriter {
    fn drop(&mut self) {
        // Dropped without `close()`: the task still writes what is pending, then ends.
        self.inner.pending().closed = true;
        self.inner.wake.notify_one();
    }
}

/// The writer task: writes the latest submission on a blocking thread until closed.
async fn run(inner: Arc<Inner>) {
    loop {
        let next = {
            let mut pending = inner.pending();
            match pending.latest.take() {
                Some(contents) => Some((pending.seq, contents)),
                None if pending.closed => break,
                None => None,
            }
        };
        let Some((seq, contents)) = next else {
            inner.wake.notified().await;
            continue;
        };
        let path = inner.path.clone();
        let result = tokio::task::spawn_blocking(move || {
            save_state(
                &path,
                contents.durable,
                contents.snapshot.as_ref(),
                contents.goodput,
            )
        })
        .await
        .unwrap_or_else(|e| {
            Err(Error::Unavailable(format!(
                "the state file writer failed: {e}"
            )))
        });
        let error = result.err().map(|e| {
            warn!(error = %e, "cannot write the lighthouse state file; a restart would forget \
                the job's progress");
            Arc::new(e)
        });
        inner.written.send_modify(|w| {
            w.seq = seq;
            w.error = error;
        });
    }
    inner.written.send_modify(|w| w.ended = true);
}

#[cfg(test)]
mod tests {
    use super::super::testkit::*;
    use super::super::Shared;
    use super::*;
    use crate::lighthouse::health::hub::Hub;
    use crate::lighthouse::LighthouseOptions;
    use crate::security::Security;
    use std::time::Duration;

    #[test]
    fn the_state_file_keeps_the_latest_snapshot_and_older_files_still_load() {
        let file = TempFile::new();
        let durable = Durable {
            quorum_id: Some(5),
            members: vec!["a".into()],
            best_step: Some(3),
            holders: vec!["a".into()],
            others: vec![("b".into(), 1)],
            silent_ms: [("a".to_string(), 2_500)].into(),
        };
        save_state(&file.0, durable.clone(), Some(&record(3)), None).unwrap();
        let (d, snap) = load_state(&file.0).unwrap().unwrap();
        assert_eq!((d, snap), (durable.clone(), Some(record(3))));
        // Flat: the engine's fields as before, the record next to them.
        let raw: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&file.0).unwrap()).unwrap();
        assert_eq!(raw["best_step"], 3);
        assert_eq!(raw["snapshot"]["step"], 3);
        assert_eq!(raw["silent_ms"]["a"], 2_500);
        // A file of an older lighthouse (no record) loads; none is written without one.
        std::fs::write(
            &file.0,
            r#"{"quorum_id":5,"members":["a"],"best_step":3,"holders":["a"]}"#,
        )
        .unwrap();
        let (d, snap) = load_state(&file.0).unwrap().unwrap();
        assert_eq!(d.best_step, Some(3));
        assert!(d.silent_ms.is_empty());
        assert_eq!(snap, None);
        save_state(&file.0, durable, None, None).unwrap();
        assert!(!std::fs::read_to_string(&file.0)
            .unwrap()
            .contains("snapshot"));
    }

    #[test]
    fn a_damaged_snapshot_record_is_dropped_alone() {
        let file = TempFile::new();
        let engine = r#""quorum_id":5,"members":["a"],"best_step":3,"holders":["a"]"#;
        for bad in [
            "7",
            "\"x\"",
            "[]",
            "{}",
            r#"{"step":"ten","replica_id":"a"}"#,
            r#"{"step":-4,"replica_id":"a"}"#,
            r#"{"step":4,"replica_id":""}"#,
            r#"{"step":4,"replica_id":"a","write_s":-1.0}"#,
            r#"{"step":4,"replica_id":"a","bytes":-1}"#,
        ] {
            std::fs::write(&file.0, format!("{{{engine},\"snapshot\":{bad}}}")).unwrap();
            let (d, snap) = load_state(&file.0).unwrap().unwrap();
            assert_eq!(d.quorum_id, Some(5), "{bad}");
            assert_eq!(snap, None, "{bad}");
        }
        // null is no record; a minimal one is a record.
        std::fs::write(&file.0, format!("{{{engine},\"snapshot\":null}}")).unwrap();
        assert_eq!(load_state(&file.0).unwrap().unwrap().1, None);
        std::fs::write(
            &file.0,
            format!("{{{engine},\"snapshot\":{{\"step\":4,\"replica_id\":\"a\"}}}}"),
        )
        .unwrap();
        assert_eq!(
            load_state(&file.0).unwrap().unwrap().1.map(|s| s.step),
            Some(4)
        );
        // A file that is not a lighthouse state still refuses to start (as before).
        std::fs::write(&file.0, "not json").unwrap();
        assert!(load_state(&file.0).is_err());
    }

    #[tokio::test]
    async fn a_restarted_lighthouse_shows_and_keeps_the_remembered_snapshot() {
        let file = TempFile::new();
        save_state(&file.0, Durable::default(), Some(&record(9)), None).unwrap();
        let o = LighthouseOptions {
            state_file: Some(file.0.clone()),
            ..opts()
        };
        let hub = Hub::new(Default::default(), o.heartbeat_timeout, o.min_replicas).unwrap();
        let shared = Shared::with_hub(o, 10, hub, Security::none()).unwrap();
        assert_eq!(shared.hub.read(|t| t.snapshot().cloned()), Some(record(9)));
        // Later writes of the engine's state carry it along, and the members of a changed
        // quorum learn it only once it is on disk.
        let rxs: Vec<_> = [member("a", 12), member("b", 12)]
            .into_iter()
            .map(|m| shared.join(m, 0).unwrap().1)
            .collect();
        for rx in rxs {
            let issued = rx.await.unwrap().unwrap();
            let (d, snap) = load_state(&file.0).unwrap().unwrap();
            assert_eq!(d.quorum_id, Some(issued.quorum.quorum_id));
            assert_eq!(snap, Some(record(9)));
        }
    }

    #[tokio::test]
    async fn the_state_file_keeps_up_with_how_long_the_holders_have_been_silent() {
        // A stalled job changes nothing durable, yet its holders' silences grow: the file
        // says so within about a second, so a restart does not wait for it all over again.
        let file = TempFile::new();
        let o = LighthouseOptions {
            state_file: Some(file.0.clone()),
            ..opts()
        };
        let hub = Hub::new(Default::default(), o.heartbeat_timeout, o.min_replicas).unwrap();
        let shared = Shared::with_hub(o, 10, hub, Security::none()).unwrap();
        let rxs: Vec<_> = [member("a", 12), member("b", 12)]
            .into_iter()
            .map(|m| shared.join(m, 0).unwrap().1)
            .collect();
        for rx in rxs {
            rx.await.unwrap().unwrap();
        }
        let silent = |id: &str| {
            let (d, _) = load_state(&file.0).unwrap().unwrap();
            d.silent_ms.get(id).copied()
        };
        assert!(
            silent("b").is_some(),
            "a holder's silence is saved with the quorum"
        );
        // a heartbeats, b stays silent.
        let started = std::time::Instant::now();
        while started.elapsed() < Duration::from_secs(10) && silent("b") < Some(1_000) {
            shared.heartbeat("a", None, None, None, None).unwrap();
            shared.tick();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        assert!(silent("b") >= Some(1_000), "still {:?} ms", silent("b"));
        assert!(
            silent("a") < Some(500),
            "a heartbeats: {:?} ms",
            silent("a")
        );
    }

    fn contents(step: i64) -> Contents {
        Contents {
            durable: Durable {
                best_step: Some(step),
                ..Durable::default()
            },
            snapshot: None,
            goodput: None,
        }
    }

    fn saved_step(path: &Path) -> Option<i64> {
        load_state(path).unwrap().unwrap().0.best_step
    }

    #[tokio::test]
    async fn the_writer_keeps_the_latest_and_close_writes_what_is_pending() {
        let file = TempFile::new();
        let writer = StateWriter::start(file.0.clone()).unwrap();
        let seqs: Vec<u64> = (1..=50).map(|step| writer.submit(contents(step))).collect();
        writer.wait(seqs[10]).await.unwrap();
        writer.flush().await.unwrap();
        assert!(seqs.iter().all(|&seq| writer.written(seq)));
        assert_eq!(saved_step(&file.0), Some(50));
        // A graceful stop writes what was handed over last.
        let last = writer.submit(contents(51));
        writer.close().await.unwrap();
        assert!(writer.written(last));
        assert_eq!(saved_step(&file.0), Some(51));
        // Nothing is written once closed, and nobody waits for it forever.
        let late = writer.submit(contents(52));
        assert!(matches!(writer.wait(late).await, Err(Error::Shutdown)));
        assert_eq!(saved_step(&file.0), Some(51));
    }

    #[tokio::test]
    async fn a_failed_write_reaches_its_waiters_and_the_next_write_recovers() {
        let dir = TempFile::new();
        let path = dir.0.join("state.json");
        let writer = StateWriter::start(path.clone()).unwrap();
        // The directory does not exist yet: the write fails.
        let seq = writer.submit(contents(1));
        let e = writer.wait(seq).await.unwrap_err();
        assert!(matches!(e, Error::Unavailable(_)), "{e}");
        assert!(writer.failed() && !writer.written(seq));
        std::fs::create_dir_all(&dir.0).unwrap();
        writer.submit(contents(2));
        writer.flush().await.unwrap();
        assert!(!writer.failed());
        assert_eq!(saved_step(&path), Some(2));
    }
}
