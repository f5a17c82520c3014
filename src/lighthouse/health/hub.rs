//! Where telemetry meets its readers: the derived state behind its own lock (never the quorum
//! engine's), the live event feed for `/events`, and the append-only event log file.
//!
//! Publishing never blocks: SSE subscribers that fall behind skip events (and are told so),
//! and the event log is written by its own thread from a bounded queue whose overflow is
//! counted.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde_json::json;
use tokio::sync::broadcast;
use tracing::{info, warn};

use super::telemetry::{Event, Telemetry, TelemetryOptions};
use crate::error::{ensure, Error, Result};
use crate::telemetry::EventKind;

/// Events buffered for each SSE subscriber before it starts skipping.
const FEED_CAPACITY: usize = 1024;
/// Lines queued for the event log writer before they are dropped (and counted).
const LOG_QUEUE: usize = 16 * 1024;

/// Settings of the lighthouse's observability features.
#[derive(Debug, Clone, PartialEq)]
pub struct ObservabilityOptions {
    /// Append events as JSON lines to this file.
    pub event_log: Option<PathBuf>,
    /// Serve `POST /replicas/{id}/kill`.
    pub allow_kill: bool,
    /// Straggler thresholds: percent above the median busy time...
    pub straggler_skew_pct: f64,
    /// ... and at least this much above it.
    pub straggler_min: Duration,
    /// A group that stays a straggler this long is dropped from the quorum for as long
    /// again, told why, and then rejoins (None: stragglers are only flagged).
    pub straggler_drop_after: Option<Duration>,
}

impl Default for ObservabilityOptions {
    fn default() -> Self {
        let t = TelemetryOptions::default();
        Self {
            event_log: None,
            allow_kill: false,
            straggler_skew_pct: t.straggler_skew_pct,
            straggler_min: t.straggler_min,
            straggler_drop_after: None,
        }
    }
}

impl ObservabilityOptions {
    /// Checks the thresholds.
    pub fn validate(&self) -> Result<()> {
        let pct = self.straggler_skew_pct;
        ensure!(
            pct.is_finite() && pct > 0.0,
            "straggler_skew_pct must be a positive number, got {pct}"
        );
        Ok(())
    }
}

/// One published event: its number and its JSON text.
pub type FeedItem = Arc<(u64, String)>;

/// Where a hub's events go: the event log it owns (the default room's hub), or the sender
/// of another hub's log (the other rooms' hubs write into the one log, each line naming its
/// job). `None` on the channel tells the writer thread to finish.
enum EventLog {
    Own {
        tx: SyncSender<Option<String>>,
        thread: JoinHandle<()>,
    },
    Shared(SyncSender<Option<String>>),
}

impl EventLog {
    fn tx(&self) -> &SyncSender<Option<String>> {
        match self {
            EventLog::Own { tx, .. } | EventLog::Shared(tx) => tx,
        }
    }
}

/// The sender into a hub's event log, for the hubs of other rooms (see [`Hub::for_room`]).
pub(crate) type LogSink = SyncSender<Option<String>>;

fn write_lines(rx: Receiver<Option<String>>, file: File, path: PathBuf) {
    let mut out = BufWriter::new(file);
    let mut failed = false;
    while let Ok(Some(line)) = rx.recv() {
        let mut res = writeln!(out, "{line}");
        // Write what is queued, then flush, so a crash loses at most the current burst.
        let mut finished = false;
        while let Ok(next) = rx.try_recv() {
            match next {
                Some(line) => res = res.and_then(|_| writeln!(out, "{line}")),
                None => {
                    finished = true;
                    break;
                }
            }
        }
        res = res.and_then(|_| out.flush());
        if let Err(e) = res {
            if !failed {
                warn!(path = %path.display(), error = %e, "cannot write the event log");
                failed = true;
            }
        } else {
            failed = false;
        }
        if finished {
            break;
        }
    }
    let _ = out.flush();
}

/// The telemetry state and its outlets.
pub(crate) struct Hub {
    telemetry: Mutex<Telemetry>,
    feed: Mutex<Option<broadcast::Sender<FeedItem>>>,
    log: Mutex<Option<EventLog>>,
    log_dropped: AtomicU64,
    /// The job (room) this hub belongs to; empty for the default room. Other rooms' events
    /// carry it as `job`.
    job: String,
    /// Where the end-of-run report is written: the event log's directory (None without an
    /// event log).
    summary_dir: Option<PathBuf>,
    pub(crate) opts: ObservabilityOptions,
}

/// The telemetry lock, taken by [`Hub::hold`].
pub(crate) struct Held<'a> {
    hub: &'a Hub,
    telemetry: MutexGuard<'a, Telemetry>,
}

impl Held<'_> {
    /// Runs `f` on the telemetry state, releases the lock, then publishes the events `f`
    /// emitted (as [`Hub::with`]).
    pub(crate) fn with<R>(mut self, f: impl FnOnce(&mut Telemetry) -> R) -> R {
        let r = f(&mut self.telemetry);
        let events = self.telemetry.take_events();
        let hub = self.hub;
        drop(self);
        hub.publish(events);
        r
    }
}

/// The directory of the event log (the end-of-run report goes next to it).
fn log_dir(opts: &ObservabilityOptions) -> Option<PathBuf> {
    let path = opts.event_log.as_ref()?;
    Some(match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    })
}

/// Opens (creating, appending) the event log; a clear error if it cannot be written.
fn open_log(path: &Path) -> Result<File> {
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(|e| {
            Error::InvalidArgument(format!("cannot open event log {}: {e}", path.display()))
        })
}

/// Writes `bytes` to `path` through a temporary file next to it and a rename: a reader
/// never sees a partial file, and nothing is left behind on error.
fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".tmp{}", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let r = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
    if let Err(e) = r {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::Unavailable(format!(
            "cannot write {}: {e}",
            path.display()
        )));
    }
    Ok(())
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

impl Hub {
    /// A hub whose groups are lost after `heartbeat_timeout`; opens the event log if set.
    pub(crate) fn new(
        opts: ObservabilityOptions,
        heartbeat_timeout: Duration,
        min_replicas: u64,
    ) -> Result<Self> {
        opts.validate()?;
        let log = match &opts.event_log {
            Some(path) => {
                let file = open_log(path)?;
                let (tx, rx) = sync_channel(LOG_QUEUE);
                let p = path.clone();
                let thread = std::thread::Builder::new()
                    .name("torchft-event-log".into())
                    .spawn(move || write_lines(rx, file, p))
                    .map_err(|e| Error::Unavailable(format!("cannot start log writer: {e}")))?;
                Some(EventLog::Own { tx, thread })
            }
            None => None,
        };
        let dir = log_dir(&opts);
        Self::build(
            opts,
            heartbeat_timeout,
            min_replicas,
            String::new(),
            log,
            dir,
        )
    }

    /// The hub of room `job` (not the default room): its own telemetry and feed, its events
    /// written into `log` (the default room's event log, if any) with `job` in every line.
    pub(crate) fn for_room(
        opts: ObservabilityOptions,
        heartbeat_timeout: Duration,
        min_replicas: u64,
        job: &str,
        log: Option<LogSink>,
    ) -> Result<Self> {
        opts.validate()?;
        let dir = log_dir(&opts);
        let opts = ObservabilityOptions {
            event_log: None,
            ..opts
        };
        let log = log.map(EventLog::Shared);
        Self::build(
            opts,
            heartbeat_timeout,
            min_replicas,
            job.to_string(),
            log,
            dir,
        )
    }

    /// The sender into this hub's event log (None without one, or once closed).
    pub(crate) fn log_sink(&self) -> Option<LogSink> {
        self.log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|l| l.tx().clone())
    }

    fn build(
        opts: ObservabilityOptions,
        heartbeat_timeout: Duration,
        min_replicas: u64,
        job: String,
        log: Option<EventLog>,
        summary_dir: Option<PathBuf>,
    ) -> Result<Self> {
        let topts = TelemetryOptions {
            heartbeat_timeout,
            straggler_skew_pct: opts.straggler_skew_pct,
            straggler_min: opts.straggler_min,
        };
        let hub = Self {
            telemetry: Mutex::new(Telemetry::new(topts, Instant::now(), unix_now())),
            feed: Mutex::new(Some(broadcast::channel(FEED_CAPACITY).0)),
            log: Mutex::new(log),
            log_dropped: AtomicU64::new(0),
            job,
            summary_dir,
            opts,
        };
        hub.emit(
            Instant::now(),
            EventKind::LighthouseStarted,
            json!({"min_replicas": min_replicas, "pid": std::process::id()}),
        );
        Ok(hub)
    }

    fn lock(&self) -> MutexGuard<'_, Telemetry> {
        self.telemetry.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Runs `f` on the telemetry state, then publishes the events it emitted.
    pub(crate) fn with<R>(&self, f: impl FnOnce(&mut Telemetry) -> R) -> R {
        let (r, events) = {
            let mut t = self.lock();
            let r = f(&mut t);
            (r, t.take_events())
        };
        self.publish(events);
        r
    }

    /// Takes the telemetry lock now, for work done later with [`Held::with`]: a caller that
    /// must order that work before anything another thread does next, but would rather do
    /// it after releasing its own lock.
    pub(crate) fn hold(&self) -> Held<'_> {
        Held {
            hub: self,
            telemetry: self.lock(),
        }
    }

    /// Records one event (see [`Telemetry::emit`]) and publishes it.
    pub(crate) fn emit(&self, now: Instant, kind: EventKind, fields: serde_json::Value) {
        self.with(|t| t.emit(now, kind, fields));
    }

    /// Reads the telemetry state.
    pub(crate) fn read<R>(&self, f: impl FnOnce(&Telemetry) -> R) -> R {
        f(&self.lock())
    }

    fn publish(&self, events: Vec<Event>) {
        if events.is_empty() {
            return;
        }
        let feed = self.feed.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        for e in events {
            let mut json = e.to_json();
            if !self.job.is_empty() {
                json["job"] = serde_json::Value::String(self.job.clone());
            }
            let line = json.to_string();
            if let Some(log) = log.as_ref() {
                match log.tx().try_send(Some(line.clone())) {
                    Ok(()) => {}
                    Err(TrySendError::Full(_)) | Err(TrySendError::Disconnected(_)) => {
                        self.log_dropped.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            if let Some(feed) = &feed {
                // No subscribers is fine.
                let _ = feed.send(Arc::new((e.seq, line)));
            }
        }
    }

    /// Whether the end-of-run report has a place (an event log).
    pub(crate) fn has_summary_dir(&self) -> bool {
        self.summary_dir.is_some()
    }

    /// The end-of-run report now (`job` filled in).
    pub(crate) fn summary(&self) -> serde_json::Value {
        let mut v = self.read(|t| t.summary(Instant::now()));
        v["job"] = serde_json::Value::String(self.job.clone());
        v
    }

    /// Writes the end-of-run report next to the event log (`summary.json` and
    /// `summary.html`, or `summary-JOB.*` for a job's room), each atomically. Returns the
    /// two paths; an error without an event log or when they cannot be written.
    pub(crate) fn write_summary(&self) -> Result<(PathBuf, PathBuf)> {
        let dir = self.summary_dir.as_ref().ok_or_else(|| {
            Error::FailedPrecondition(
                "the lighthouse runs without --event_log: the end-of-run report is written \
                 next to the event log"
                    .into(),
            )
        })?;
        let summary = self.summary();
        let stem = if self.job.is_empty() {
            "summary".to_string()
        } else {
            format!("summary-{}", self.job)
        };
        let json_path = dir.join(format!("{stem}.json"));
        let html_path = dir.join(format!("{stem}.html"));
        let text = serde_json::to_string_pretty(&summary)
            .map_err(|e| Error::Remote(format!("cannot encode the report: {e}")))?;
        write_atomic(&json_path, text.as_bytes())?;
        write_atomic(
            &html_path,
            super::telemetry::render_html(&summary).as_bytes(),
        )?;
        info!(json = %json_path.display(), html = %html_path.display(),
            "end-of-run report written");
        Ok((json_path, html_path))
    }

    /// A live feed of the events published from now on (None once shut down).
    pub(crate) fn subscribe(&self) -> Option<broadcast::Receiver<FeedItem>> {
        self.feed
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|f| f.subscribe())
    }

    /// Event log lines dropped because the writer fell behind.
    pub(crate) fn log_dropped(&self) -> u64 {
        self.log_dropped.load(Ordering::Relaxed)
    }

    /// Ends every feed (SSE streams finish) and flushes and closes the event log.
    pub(crate) fn close(&self) {
        self.feed.lock().unwrap_or_else(|e| e.into_inner()).take();
        let log = self.log.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(EventLog::Own { tx, thread }) = log {
            // Other rooms' hubs may still hold senders: tell the writer to finish after
            // what is queued (their later lines are counted as dropped).
            let _ = tx.send(None);
            drop(tx);
            let _ = thread.join();
        }
    }
}

impl Drop for Hub {
    fn drop(&mut self) {
        self.close();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn event_log_appends_json_lines_and_refuses_bad_paths() {
        let dir = std::env::temp_dir().join(format!("torchft-hub-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("events.jsonl");
        for _ in 0..2 {
            let hub = Hub::new(
                ObservabilityOptions {
                    event_log: Some(path.clone()),
                    ..Default::default()
                },
                Duration::from_secs(5),
                2,
            )
            .unwrap();
            hub.with(|t| {
                t.emit(
                    Instant::now(),
                    EventKind::KillRequested,
                    json!({"replica_id": "a"}),
                )
            });
            hub.close();
        }
        let text = std::fs::read_to_string(&path).unwrap();
        let kinds: Vec<String> = text
            .lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["kind"].to_string())
            .collect();
        assert_eq!(
            kinds,
            [
                "\"lighthouse_started\"",
                "\"kill_requested\"",
                "\"lighthouse_started\"",
                "\"kill_requested\""
            ],
            "appended, not truncated"
        );
        let err = Hub::new(
            ObservabilityOptions {
                event_log: Some(dir.join("missing-dir").join("e.jsonl")),
                ..Default::default()
            },
            Duration::from_secs(5),
            1,
        )
        .err()
        .unwrap();
        assert!(err.to_string().contains("cannot open event log"), "{err}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[tokio::test]
    async fn feed_delivers_and_ends_on_close() {
        let hub = Hub::new(ObservabilityOptions::default(), Duration::from_secs(5), 1).unwrap();
        let mut rx = hub.subscribe().unwrap();
        hub.with(|t| t.emit(Instant::now(), EventKind::LighthouseStarted, json!({})));
        let item = rx.recv().await.unwrap();
        assert!(item.1.contains("\"kind\":\"lighthouse_started\""));
        hub.close();
        assert!(rx.recv().await.is_err());
        assert!(hub.subscribe().is_none());
    }
}
