//! The telemetry path out of a rank and out of a manager server: a bounded queue that never
//! blocks the caller (a full queue drops the report and counts it) and a forwarder task that
//! sends what is queued in batches, every interval or sooner when the queue fills up.
//!
//! A batch the receiver could not be reached for (it restarts, the network blips) goes back
//! to the front of the queue and is sent again at the next interval, as far as the queue's
//! bound allows (what does not fit is dropped and counted); one the receiver refused as
//! malformed is dropped. Telemetry stays fail-open: nothing on the training path waits.

use std::collections::VecDeque;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::{watch, Notify};
use tokio::task::JoinHandle;
use tracing::debug;

use crate::error::Result;
use crate::proto::{TelemetryBatch, TelemetryReport};

/// Where a queue's batches go: the manager server for a rank, the lighthouse for a manager
/// server.
pub trait ReportSink: Clone + Send + Sync + 'static {
    /// Sends one batch, bounded by `timeout`.
    fn send(
        &self,
        batch: TelemetryBatch,
        timeout: Duration,
    ) -> impl Future<Output = Result<()>> + Send;
}

impl ReportSink for crate::client::ManagerClient {
    async fn send(&self, batch: TelemetryBatch, timeout: Duration) -> Result<()> {
        self.report(batch, timeout).await.map(|_| ())
    }
}

impl ReportSink for crate::client::LighthouseClient {
    async fn send(&self, batch: TelemetryBatch, timeout: Duration) -> Result<()> {
        self.report(batch, timeout).await.map(|_| ())
    }
}

/// Reports queued per queue before new ones are dropped.
pub const QUEUE_CAPACITY: usize = 4096;
/// Reports per batch at most (the lighthouse's limit).
pub const BATCH_MAX: usize = 1024;

#[derive(Debug)]
struct Inner {
    queue: Mutex<VecDeque<TelemetryReport>>,
    capacity: usize,
    /// Reports dropped and not yet announced in a batch.
    dropped: AtomicU64,
    /// Reports dropped over the queue's life.
    dropped_total: AtomicU64,
    wake: Notify,
}

/// A bounded queue of reports; cheap to clone (clones share the queue).
#[derive(Debug, Clone)]
pub struct ReportQueue {
    inner: Arc<Inner>,
}

impl Default for ReportQueue {
    fn default() -> Self {
        Self::new(QUEUE_CAPACITY)
    }
}

impl ReportQueue {
    /// An empty queue holding at most `capacity` reports.
    pub fn new(capacity: usize) -> Self {
        Self {
            inner: Arc::new(Inner {
                queue: Mutex::new(VecDeque::new()),
                capacity: capacity.max(1),
                dropped: AtomicU64::new(0),
                dropped_total: AtomicU64::new(0),
                wake: Notify::new(),
            }),
        }
    }

    /// Queues a report without waiting; false if the queue was full (the report is dropped
    /// and counted).
    pub fn push(&self, report: TelemetryReport) -> bool {
        let len = {
            let mut q = self.inner.queue.lock().unwrap_or_else(|p| p.into_inner());
            if q.len() >= self.inner.capacity {
                drop(q);
                self.count_dropped(1);
                return false;
            }
            q.push_back(report);
            q.len()
        };
        if len >= BATCH_MAX.min(self.inner.capacity / 2).max(1) {
            self.inner.wake.notify_one();
        }
        true
    }

    /// Adds `n` reports dropped elsewhere (e.g. upstream of this queue) to the count the
    /// next batch announces.
    pub fn count_dropped(&self, n: u64) {
        self.inner.dropped.fetch_add(n, Ordering::Relaxed);
        self.inner.dropped_total.fetch_add(n, Ordering::Relaxed);
    }

    /// Reports dropped over the queue's life.
    pub fn dropped_total(&self) -> u64 {
        self.inner.dropped_total.load(Ordering::Relaxed)
    }

    /// Reports waiting.
    pub fn len(&self) -> usize {
        self.inner
            .queue
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .len()
    }

    /// True if no report is waiting.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Takes up to [`BATCH_MAX`] reports (and the drop count, if any report goes with it).
    fn take_batch(&self) -> TelemetryBatch {
        let reports: Vec<TelemetryReport> = {
            let mut q = self.inner.queue.lock().unwrap_or_else(|p| p.into_inner());
            let n = q.len().min(BATCH_MAX);
            q.drain(..n).collect()
        };
        // The receiver attributes drops to the batch's group: only send them with reports.
        let dropped = if reports.is_empty() {
            0
        } else {
            self.inner.dropped.swap(0, Ordering::Relaxed)
        };
        TelemetryBatch {
            reports,
            dropped,
            job: String::new(),
        }
    }

    /// Puts a batch that could not be delivered back at the front of the queue, keeping its
    /// newest reports as far as the capacity allows (the rest are dropped and counted).
    fn requeue(&self, batch: TelemetryBatch) {
        let mut reports = batch.reports;
        let lost = {
            let mut q = self.inner.queue.lock().unwrap_or_else(|p| p.into_inner());
            let room = self.inner.capacity.saturating_sub(q.len());
            let lost = reports.len().saturating_sub(room);
            for r in reports.drain(lost..).rev() {
                q.push_front(r);
            }
            lost
        };
        self.inner
            .dropped
            .fetch_add(batch.dropped, Ordering::Relaxed);
        if lost > 0 {
            self.count_dropped(lost as u64);
        }
    }

    /// Sends everything queued now, batch by batch, with `send`; stops at the first failure
    /// (a batch the receiver could not be reached for goes back to the queue; one it refused
    /// is dropped and counted).
    pub async fn send_pending<S, F>(&self, send: &S)
    where
        S: Fn(TelemetryBatch) -> F,
        F: Future<Output = Result<()>>,
    {
        loop {
            let batch = self.take_batch();
            if batch.reports.is_empty() {
                return;
            }
            let n = batch.reports.len() as u64;
            let dropped = batch.dropped;
            let kept = batch.clone();
            if let Err(e) = send(batch).await {
                if matches!(e, crate::error::Error::InvalidArgument(_)) {
                    debug!(error = %e, reports = n, "telemetry batch refused; dropped");
                    // The batch's own drop count is lost with it: carry it to the next one.
                    self.inner.dropped.fetch_add(dropped, Ordering::Relaxed);
                    self.count_dropped(n);
                } else {
                    debug!(error = %e, reports = n, "telemetry batch not delivered; kept");
                    self.requeue(kept);
                }
                return;
            }
        }
    }

    /// Sends everything queued now to `sink`, waiting at most `timeout` in all.
    pub async fn flush<S: ReportSink>(&self, sink: &S, timeout: Duration) {
        let send = |batch| sink.send(batch, timeout);
        let _ = tokio::time::timeout(timeout, self.send_pending(&send)).await;
    }

    /// Spawns the forwarder: every `interval` (or when the queue fills up) it sends what is
    /// queued to `sink` (each batch bounded by `timeout`); it stops when `stop` turns true or
    /// its sender is dropped.
    pub fn spawn_forwarder<S: ReportSink>(
        &self,
        interval: Duration,
        mut stop: watch::Receiver<bool>,
        sink: S,
        timeout: Duration,
    ) -> JoinHandle<()> {
        let queue = self.clone();
        let send = move |batch| {
            let sink = sink.clone();
            async move { sink.send(batch, timeout).await }
        };
        crate::runtime::get().spawn(async move {
            loop {
                tokio::select! {
                    _ = tokio::time::sleep(interval) => {}
                    _ = queue.inner.wake.notified() => {}
                    _ = stop.wait_for(|s| *s) => return,
                }
                queue.send_pending(&send).await;
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::Error;

    fn report(step: i64) -> TelemetryReport {
        TelemetryReport {
            replica_id: "a".into(),
            step,
            group_world_size: 1,
            ..Default::default()
        }
    }

    #[test]
    fn full_queue_drops_and_counts() {
        let q = ReportQueue::new(2);
        assert!(q.push(report(0)));
        assert!(q.push(report(1)));
        assert!(!q.push(report(2)));
        assert_eq!(q.dropped_total(), 1);
        let b = q.take_batch();
        assert_eq!(b.reports.len(), 2);
        assert_eq!(b.dropped, 1);
        // An empty batch keeps the count for later.
        q.count_dropped(3);
        assert_eq!(q.take_batch().dropped, 0);
        q.push(report(3));
        assert_eq!(q.take_batch().dropped, 3);
    }

    #[tokio::test]
    async fn an_undelivered_batch_is_kept_for_the_next_send_within_the_bound() {
        let q = ReportQueue::new(3);
        for i in 0..3 {
            q.push(report(i));
        }
        q.count_dropped(2);
        q.send_pending(&|_b: TelemetryBatch| async { Err(Error::Unavailable("down".into())) })
            .await;
        assert_eq!(q.len(), 3, "kept, in order");
        assert_eq!(q.dropped_total(), 2);
        // A report queued meanwhile fills the bound: the oldest kept one gives way.
        let b = q.take_batch();
        assert!(q.push(report(3)));
        q.requeue(b);
        assert_eq!(q.dropped_total(), 3);
        let seen = Mutex::new(Vec::new());
        q.send_pending(&|b: TelemetryBatch| {
            let steps: Vec<i64> = b.reports.iter().map(|r| r.step).collect();
            seen.lock().unwrap().push((steps, b.dropped));
            async { Ok(()) }
        })
        .await;
        assert_eq!(*seen.lock().unwrap(), vec![(vec![1, 2, 3], 3)]);
    }

    #[tokio::test]
    async fn a_refused_batch_is_dropped_and_its_count_carried() {
        let q = ReportQueue::new(10);
        q.push(report(0));
        q.count_dropped(2);
        q.send_pending(&|_b: TelemetryBatch| async {
            Err(Error::InvalidArgument("malformed".into()))
        })
        .await;
        assert!(q.is_empty());
        assert_eq!(q.dropped_total(), 3);
        q.push(report(1));
        let seen = Mutex::new(Vec::new());
        q.send_pending(&|b: TelemetryBatch| {
            seen.lock().unwrap().push((b.reports.len(), b.dropped));
            async { Ok(()) }
        })
        .await;
        assert_eq!(*seen.lock().unwrap(), vec![(1, 3)]);
    }

    #[tokio::test]
    async fn large_backlogs_go_in_bounded_batches() {
        let q = ReportQueue::new(QUEUE_CAPACITY);
        for i in 0..(BATCH_MAX as i64 * 2 + 5) {
            q.push(report(i));
        }
        let sizes = Mutex::new(Vec::new());
        q.send_pending(&|b: TelemetryBatch| {
            sizes.lock().unwrap().push(b.reports.len());
            async { Ok(()) }
        })
        .await;
        assert_eq!(*sizes.lock().unwrap(), vec![BATCH_MAX, BATCH_MAX, 5]);
    }
}
