//! The manager server's standing link to the lighthouse: the heartbeat loop (with the
//! commit lease its acknowledgements hold) and the session whose end tells the lighthouse
//! this group died, bringing the lost-member events.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::{Instant, MissedTickBehavior};
use tracing::{info, warn};

use super::Inner;
use crate::net::Backoff;

/// How much longer than one heartbeat interval a shutting-down session waits for the
/// heartbeat loop to end.
const HEARTBEAT_STOP_SLACK: Duration = Duration::from_secs(1);

/// Whether this group may still count itself a live member of its quorum (a fence against
/// committing a step the other members abandoned).
///
/// A group frozen (e.g. SIGSTOP) for the lighthouse's heartbeat timeout is declared lost and
/// the others abort the step; when it resumes it may still complete that step's collectives
/// from data already buffered, so it must not commit it. The lease is held while heartbeat
/// acknowledgements arrive without a gap longer than half the lighthouse's heartbeat timeout
/// (measured from when each acknowledged heartbeat was sent, on the monotonic clock, which a
/// frozen process does not stop).
#[derive(Debug, Default)]
pub(super) struct Lease {
    /// The lighthouse's heartbeat timeout (None until a lighthouse said it).
    timeout: Option<Duration>,
    /// When the last acknowledged heartbeat was sent.
    last_ack_sent: Option<Instant>,
    /// When a gap longer than the lease was last seen.
    broken_at: Option<Instant>,
    /// When the last quorum was received (the start of the current step's membership); for
    /// an answer read late on the hosting rank's own connection, when its request was sent.
    pub(super) quorum_at: Option<Instant>,
}

impl Lease {
    fn lease(timeout: Duration) -> Duration {
        timeout / 2
    }

    /// A heartbeat sent at `sent` was acknowledged by a lighthouse with `timeout`.
    pub(super) fn on_ack(&mut self, sent: Instant, timeout: Option<Duration>) {
        if timeout.is_some() {
            self.timeout = timeout;
        }
        if let (Some(prev), Some(t)) = (self.last_ack_sent, self.timeout) {
            if sent.saturating_duration_since(prev) > Self::lease(t) {
                self.broken_at = Some(sent);
            }
        }
        if self.last_ack_sent.is_none_or(|prev| sent > prev) {
            self.last_ack_sent = Some(sent);
        }
    }

    /// True unless the lease lapsed since the last quorum (or is lapsing now).
    pub(super) fn held(&self, now: Instant) -> bool {
        let Some(t) = self.timeout else {
            return true; // a lighthouse that does not state its timeout: no fence
        };
        let Some(last) = self.last_ack_sent else {
            return true;
        };
        if now.saturating_duration_since(last) > Self::lease(t) {
            return false;
        }
        match (self.broken_at, self.quorum_at) {
            (Some(broken), Some(quorum)) => broken < quorum,
            (Some(_), None) => false,
            (None, _) => true,
        }
    }
}

/// Heartbeats the lighthouse every interval. Each attempt is bounded by the interval, so the
/// period holds while the lighthouse is down; the lazy channel reconnects when it is back.
/// `_running` is dropped when the loop ends (returned, or its task aborted): the session
/// waits for that at shutdown.
pub(super) async fn heartbeat_loop(inner: Arc<Inner>, _running: oneshot::Sender<()>) {
    let period = inner.opts.heartbeat_interval;
    let mut ticker = tokio::time::interval(period);
    ticker.set_missed_tick_behavior(MissedTickBehavior::Delay);
    let mut shutdown = inner.shutdown.clone();
    let mut failing = false;
    loop {
        tokio::select! {
            _ = ticker.tick() => {}
            _ = shutdown.wait_for(|down| *down) => return,
        }
        // A single-rank group's quorum request left undriven since the last tick (its rank
        // busy elsewhere) is driven by a thread of its own until the rank waits for it.
        inner.own_link.drive_unattended(period);
        let sent = Instant::now();
        let step = inner.committed_step.load(Ordering::Relaxed);
        let digest = inner
            .digests
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .to_send();
        let result = inner
            .lighthouse
            .heartbeat_digest(
                &inner.opts.replica_id,
                (step >= 0).then_some(step),
                inner.loop_idle(sent),
                digest,
                period,
            )
            .await;
        if result.is_err() {
            // A reason heard before the lighthouse went silent no longer holds.
            *inner
                .lighthouse_waiting
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = None;
        }
        match result {
            Ok(ack) => {
                inner.note_parity(&ack);
                inner
                    .lease
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .on_ack(sent, ack.timeout);
                *inner
                    .lighthouse_waiting
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = ack.waiting;
                inner.set_hung(ack.hung);
                inner
                    .digests
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .acknowledged(ack.parity_step);
                if let Some(why) = ack.diverged {
                    inner.set_diverged(why);
                }
                if failing {
                    info!(lighthouse = %inner.lighthouse_addr, "lighthouse heartbeat recovered");
                    failing = false;
                }
            }
            Err(status) if status.code() != tonic::Code::DeadlineExceeded => {
                if !failing {
                    warn!(lighthouse = %inner.lighthouse_addr, error = %status.message(),
                        "lighthouse heartbeat failed; retrying every {period:?}");
                    failing = true;
                }
            }
            Err(_) => {
                if !failing {
                    warn!(lighthouse = %inner.lighthouse_addr,
                        "lighthouse heartbeat timed out; retrying every {period:?}");
                    failing = true;
                }
            }
        }
    }
}

/// Holds the session with the lighthouse open for the server's life, reopening it with
/// backoff (a lighthouse restart is not a death), and records the lost-member events it
/// brings. The session ends with the process, which tells the lighthouse at once.
///
/// At shutdown the session ends only after the heartbeat loop has (`heartbeats` resolves
/// when it ends): a heartbeat still in flight when the session ended would reach the
/// lighthouse after the loss and make this group healthy there again until that heartbeat
/// expired, holding the survivors' next quorum for it.
pub(super) async fn session_loop(inner: Arc<Inner>, mut heartbeats: oneshot::Receiver<()>) {
    let mut backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
    let mut shutdown = inner.shutdown.clone();
    let open_timeout = inner.opts.connect_timeout.min(Duration::from_secs(5));
    let mut failing = false;
    loop {
        let opened = tokio::select! {
            r = inner.lighthouse.session(&inner.opts.replica_id, open_timeout) => r,
            _ = shutdown.wait_for(|down| *down) => return,
        };
        let ended = match opened {
            Ok(mut stream) => {
                info!(lighthouse = %inner.lighthouse_addr, "lighthouse session open");
                failing = false;
                backoff = Backoff::new(Duration::from_millis(50), Duration::from_secs(1));
                let ended = loop {
                    let next = tokio::select! {
                        m = stream.message() => Some(m),
                        _ = shutdown.wait_for(|down| *down) => None,
                    };
                    let Some(next) = next else {
                        // Each heartbeat is bounded by the interval: this wait is too.
                        let bound = inner.opts.heartbeat_interval + HEARTBEAT_STOP_SLACK;
                        let _ = tokio::time::timeout(bound, &mut heartbeats).await;
                        drop(stream);
                        return;
                    };
                    match next {
                        Ok(Some(event)) => {
                            if let Some(lost) = event.lost {
                                warn!(lost = %lost.replica_id, quorum_id = lost.quorum_id,
                                    "lighthouse reports a lost replica group");
                                inner.on_lost(lost);
                            }
                        }
                        Ok(None) => break "the lighthouse closed it".to_string(),
                        Err(status) => break status.message().to_string(),
                    }
                };
                // The lighthouse stopping ends its sessions first; a dead connection ends
                // this one too. Either way the hosting rank's own connection, which nothing
                // drives between requests, is closed now (see `own_link`): the lighthouse's
                // graceful stop does not wait on it, a quorum request on it is sent again on
                // the shared connection, and the next commit announcement dials anew.
                inner.own_link.close();
                ended
            }
            Err(status) => {
                if status.code() != tonic::Code::Unimplemented {
                    // The lighthouse is stopping, restarting or unreachable: the own commit
                    // connection is closed as when an open session ends (an upstream
                    // lighthouse, which has no sessions, closes nothing).
                    inner.own_link.close();
                }
                status.message().to_string()
            }
        };
        if !failing {
            warn!(lighthouse = %inner.lighthouse_addr, reason = %ended,
                "lighthouse session ended; reopening");
            failing = true;
        }
        let delay = backoff.next_delay();
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            _ = shutdown.wait_for(|down| *down) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lease_lapses_with_a_heartbeat_gap_during_the_step() {
        let t0 = Instant::now();
        let ms = Duration::from_millis;
        let mut l = Lease::default();
        // No lighthouse timeout known: no fence.
        assert!(l.held(t0));
        l.on_ack(t0, Some(ms(2000)));
        l.quorum_at = Some(t0 + ms(10));
        // Regular acks every 100 ms: held.
        for i in 1..=20 {
            l.on_ack(t0 + ms(100 * i), None);
            assert!(l.held(t0 + ms(100 * i + 50)));
        }
        let last = t0 + ms(2000);
        // Frozen: no ack for more than half the timeout → not held while it lasts ...
        assert!(l.held(last + ms(900)));
        assert!(!l.held(last + ms(1100)));
        // ... nor after a fresh ack, for the rest of this step ...
        l.on_ack(last + ms(3000), None);
        assert!(!l.held(last + ms(3010)));
        // ... until the next quorum.
        l.quorum_at = Some(last + ms(3100));
        assert!(l.held(last + ms(3150)));
        // An ack older than the newest does not move it back.
        l.on_ack(last + ms(2500), None);
        assert_eq!(l.last_ack_sent, Some(last + ms(3000)));
    }
}
