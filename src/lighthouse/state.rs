//! The lighthouse's live state around the pure engine: waiting quorum requests, open
//! sessions, the last issued quorum, and the clock-driven re-evaluation of a round.
//!
//! Quorum requests long-poll: each waiter gets its own oneshot channel (a lagging waiter can
//! never miss its quorum because many were issued), and a drop guard on the waiting future
//! removes a cancelled or timed-out request from the round. The server's tick task calls
//! [`Shared::tick`] every `quorum_tick` (join timeout, heartbeat expiry).
//!
//! Sessions: each manager server holds a `Session` stream open for its life. When the stream
//! ends without the lighthouse shutting down (the manager's process died or its connection
//! broke), the replica group is declared lost at once; a member of the last quorum declared
//! lost (that way, or by heartbeat expiry at tick) is announced on the other members'
//! sessions, so they abort that quorum's collectives instead of waiting for a timeout.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::{mpsc, oneshot};
use tonic::Status;
use tracing::{debug, error, info, warn};

use super::health::hub::Hub;
use super::health::telemetry::SnapshotRecord;
use super::quorum::{CommitVerdict, Durable, EarlierLife, LostMember, QuorumEngine, Snapshot};
use super::reply::{Issued, Known};
use super::LighthouseOptions;
use crate::error::{Error, Result};
use crate::proto::{LostEvent, Quorum, QuorumMember, SessionEvent, TelemetryBatch};
use crate::security::Security;
use crate::telemetry::validate_batch;

type Delivery = Result<Arc<Issued>>;

struct Waiter {
    generation: u64,
    tx: oneshot::Sender<Delivery>,
}

/// Events buffered per session before the lighthouse drops them (a session that does not
/// read is broken anyway; events are rare: one per lost member).
const SESSION_BUFFER: usize = 64;

/// Losses kept for the status pages (most recent last).
const LOST_HISTORY: usize = 32;

/// A round waiting longer than this says why in the log.
const EXPLAIN_WAIT_AFTER: Duration = Duration::from_secs(2);

/// ... and again this often while it keeps waiting.
const EXPLAIN_WAIT_EVERY: Duration = Duration::from_secs(10);

/// What a heartbeat is answered with.
#[derive(Debug, Clone)]
pub(crate) struct HeartbeatReply {
    /// The heartbeat timeout (the caller's lease).
    pub(crate) timeout: Duration,
    /// While the group asks in a round that has waited long: why it waits.
    pub(crate) waiting: Option<Arc<str>>,
    /// While the group is held hung: why.
    pub(crate) hung: Option<String>,
    /// The step of the digest taken from this heartbeat (0 when it carried none).
    pub(crate) parity_step: i64,
    /// When the parity check stopped the group: why.
    pub(crate) diverged: Option<String>,
}

/// A replica group declared lost, as shown on the status pages.
#[derive(Debug, Clone)]
pub(crate) struct LostRecord {
    pub(crate) replica_id: String,
    pub(crate) quorum_id: i64,
    pub(crate) at: SystemTime,
}

/// The open session of one replica group.
struct Session {
    /// Identifies this session; a replaced session's end must not declare the group lost.
    id: u64,
    tx: mpsc::Sender<std::result::Result<SessionEvent, Status>>,
}

struct State {
    engine: QuorumEngine,
    waiters: HashMap<String, Waiter>,
    sessions: HashMap<String, Session>,
    next_session: u64,
    /// Recent losses of quorum members (bounded), for the status pages.
    lost: std::collections::VecDeque<LostRecord>,
    shutting_down: bool,
    /// The last issued quorum (the base of the next one's delta reply).
    last: Option<Arc<Issued>>,
    /// The engine's durable revision last written to the state file.
    saved_revision: u64,
    /// The telemetry's snapshot revision last written to the state file.
    saved_snapshot_revision: u64,
    /// The startup hold was announced in the log and its end is still to be logged.
    hold_announced: bool,
    /// The last long wait explained in the log: the round (its start) and when.
    explained: Option<(std::time::Instant, std::time::Instant)>,
    /// Why the current round waits, once it has waited past [`EXPLAIN_WAIT_AFTER`] (refreshed
    /// every tick): told to the asking groups in their heartbeat replies.
    wait_reason: Option<Arc<str>>,
}

/// State shared by the gRPC handlers, the tick task and the HTTP pages.
pub(crate) struct Shared {
    state: Mutex<State>,
    /// Wall-clock start, reported on the status page.
    pub(crate) started: SystemTime,
    /// Quorum replies sent in full form.
    replies_full: AtomicU64,
    /// Quorum replies sent in compact form (steps only, or a delta).
    replies_compact: AtomicU64,
    /// Replica health, the event feed and the event log (own lock, taken after `state`).
    pub(crate) hub: Hub,
    /// Token and TLS for the lighthouse's own calls to manager servers (the kill action).
    pub(crate) security: Security,
}

/// The id the first quorum of a lighthouse started now gets: the wall clock in microseconds,
/// so a restarted lighthouse never reuses an id of its previous life.
pub fn initial_quorum_id() -> i64 {
    let micros = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| i64::try_from(d.as_micros()).unwrap_or(i64::MAX / 2))
        .unwrap_or(1);
    micros.max(1)
}

/// Seconds since the Unix epoch (0 for times before it).
pub(crate) fn unix_seconds(t: SystemTime) -> f64 {
    t.duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64()
}

fn now_instant() -> std::time::Instant {
    tokio::time::Instant::now().into_std()
}

fn timestamp(t: SystemTime) -> prost_types::Timestamp {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    prost_types::Timestamp {
        seconds: i64::try_from(d.as_secs()).unwrap_or(i64::MAX),
        nanos: i32::try_from(d.subsec_nanos()).unwrap_or(0),
    }
}

/// What the state file holds: the engine's durable state and, next to its fields, the
/// latest complete durable snapshot the lighthouse heard of (absent in older files).
#[derive(serde::Serialize, serde::Deserialize)]
struct StateFile {
    #[serde(flatten)]
    durable: Durable,
    /// Read as any JSON value: a damaged record is dropped alone (it only informs), where a
    /// damaged quorum state refuses the whole file.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    snapshot: Option<serde_json::Value>,
}

/// The snapshot record of a state file, or None (with a warning) when it is unusable.
fn snapshot_record(value: serde_json::Value, path: &std::path::Path) -> Option<SnapshotRecord> {
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
fn load_state(path: &std::path::Path) -> Result<Option<(Durable, Option<SnapshotRecord>)>> {
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
fn save_state(
    path: &std::path::Path,
    durable: Durable,
    snapshot: Option<&SnapshotRecord>,
) -> Result<()> {
    let snapshot = snapshot
        .map(serde_json::to_value)
        .transpose()
        .map_err(|e| Error::Remote(format!("cannot encode the latest snapshot: {e}")))?;
    let text = serde_json::to_vec(&StateFile { durable, snapshot })
        .map_err(|e| Error::Remote(format!("cannot encode the lighthouse state: {e}")))?;
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(".tmp");
    let tmp = std::path::PathBuf::from(tmp);
    std::fs::write(&tmp, text)
        .and_then(|()| std::fs::rename(&tmp, path))
        .map_err(|e| {
            Error::Unavailable(format!(
                "cannot write the state file {}: {e}",
                path.display()
            ))
        })
}

impl Shared {
    /// Fresh state around a new engine, without event log or kill action.
    #[cfg(test)]
    pub(crate) fn new(opts: LighthouseOptions, initial_id: i64) -> Self {
        let hub = Hub::new(
            super::health::hub::ObservabilityOptions::default(),
            opts.heartbeat_timeout,
            opts.min_replicas,
        )
        .expect("default observability options are valid");
        Self::with_hub(opts, initial_id, hub, Security::none()).expect("no state file")
    }

    /// State around a new engine and the given telemetry hub; the engine continues from the
    /// options' state file when it holds the state of a previous life. A state file that
    /// exists but cannot be read is an error (starting from nothing could fork the job).
    pub(crate) fn with_hub(
        opts: LighthouseOptions,
        initial_id: i64,
        hub: Hub,
        security: Security,
    ) -> Result<Self> {
        let now = now_instant();
        let (durable, snapshot) = match opts.state_file.as_deref().map(load_state).transpose()? {
            Some(Some((durable, snapshot))) => (Some(durable), snapshot),
            _ => (None, None),
        };
        if let Some(record) = snapshot {
            info!(step = record.step, replica_id = %record.replica_id, path = %record.path,
                "the state file remembers the latest complete snapshot");
            hub.with(|t| t.restore_snapshot(record));
        }
        let engine = match durable {
            Some(durable) => {
                info!(
                    quorum_id = ?durable.quorum_id,
                    best_step = ?durable.best_step,
                    holders = durable.holders.len(),
                    "continuing from the state file"
                );
                QuorumEngine::restored(opts, initial_id, now, durable)
            }
            None => QuorumEngine::new(opts, initial_id, now),
        };
        let mut state = State {
            engine,
            waiters: HashMap::new(),
            sessions: HashMap::new(),
            next_session: 1,
            lost: std::collections::VecDeque::new(),
            shutting_down: false,
            last: None,
            saved_revision: 0,
            saved_snapshot_revision: 0,
            hold_announced: false,
            explained: None,
            wait_reason: None,
        };
        Self::announce_hold(&mut state, now);
        Ok(Self {
            state: Mutex::new(state),
            started: SystemTime::now(),
            replies_full: AtomicU64::new(0),
            replies_compact: AtomicU64::new(0),
            hub,
            security,
        })
    }

    /// Writes the engine's durable state and the latest snapshot record to the state file
    /// if either changed since the last write (no-op without a state file).
    fn persist(&self, state: &mut State) -> Result<()> {
        let revision = state.engine.durable_revision();
        let snapshot_revision = self.hub.read(|t| t.snapshot_revision());
        if revision == state.saved_revision && snapshot_revision == state.saved_snapshot_revision {
            return Ok(());
        }
        let Some(path) = state.engine.options().state_file.clone() else {
            return Ok(());
        };
        let (snapshot_revision, snapshot) = self
            .hub
            .read(|t| (t.snapshot_revision(), t.snapshot().cloned()));
        save_state(&path, state.engine.durable(), snapshot.as_ref())?;
        state.saved_revision = revision;
        state.saved_snapshot_revision = snapshot_revision;
        Ok(())
    }

    /// [`Shared::persist`] where a failure cannot refuse anything: logged loudly.
    fn persist_or_warn(&self, state: &mut State) {
        if let Err(e) = self.persist(state) {
            warn!(error = %e, "cannot write the lighthouse state file; a restart would forget \
                the job's progress");
        }
    }

    /// A write-ahead commit announcement (see [`QuorumEngine::commit`]): `Ok(None)` when
    /// accepted (and saved to the state file, if any), `Ok(Some(reason))` when refused.
    pub(crate) fn commit(
        &self,
        replica_id: &str,
        quorum_id: i64,
        step: i64,
    ) -> Result<Option<String>> {
        let now = now_instant();
        let mut guard = self.lock();
        let state = &mut *guard;
        if state.shutting_down {
            return Err(Error::Shutdown);
        }
        match state.engine.commit(replica_id, quorum_id, step, now)? {
            CommitVerdict::Accepted => {
                // Durable before the group applies the commit, or not accepted at all.
                self.persist(state)?;
                Ok(None)
            }
            CommitVerdict::Refused(reason) => {
                warn!(replica_id = %replica_id, quorum_id, step, reason = %reason,
                    "commit refused");
                self.hub.with(|t| t.commit_refused());
                Ok(Some(reason))
            }
        }
    }

    /// Counts one quorum reply to a requester holding `known`.
    pub(crate) fn count_reply(&self, issued: &Issued, known: Known) {
        let counter = if issued.abridged_for(known) {
            &self.replies_compact
        } else {
            &self.replies_full
        };
        counter.fetch_add(1, Ordering::Relaxed);
    }

    /// Quorum replies sent so far: `(full, compact)`.
    pub(crate) fn reply_counts(&self) -> (u64, u64) {
        (
            self.replies_full.load(Ordering::Relaxed),
            self.replies_compact.load(Ordering::Relaxed),
        )
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the engine half-updated in a way that
        // matters more than stopping the lighthouse would; keep serving.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Logs that a restarted lighthouse holds its first quorum (once), saying how it knows
    /// it restarted and when the hold ends; a fresh job's lighthouse logs nothing.
    fn announce_hold(state: &mut State, now: std::time::Instant) {
        if state.hold_announced {
            return;
        }
        let (Some(end), Some(why)) = (
            state.engine.startup_hold_until(now),
            state.engine.earlier_life(),
        ) else {
            return;
        };
        let ends_in = end - now;
        let ends_at = SystemTime::now() + ends_in;
        let early = match why {
            EarlierLife::StateFile {
                quorum_id: Some(_), ..
            } => {
                " (ends early once every member of the remembered quorum asks at the \
                   remembered step)"
            }
            _ => "",
        };
        warn!(
            why = %why,
            hold_s = ends_in.as_secs_f64(),
            ends_unix_s = unix_seconds(ends_at),
            "lighthouse restarted ({why}): holding the first quorum for {:.1}s more, until \
             every replica still heartbeating is heard{early}",
            ends_in.as_secs_f64()
        );
        state.hold_announced = true;
    }

    /// Says at WARN why a round has waited longer than [`EXPLAIN_WAIT_AFTER`]: the verdict
    /// (what it waits for and when that wait ends), who asks, and the healthy groups that do
    /// not; again every [`EXPLAIN_WAIT_EVERY`] while it goes on.
    fn explain_wait(state: &mut State, now: std::time::Instant) {
        state.wait_reason = None;
        let Some(started) = state.engine.round_started() else {
            return;
        };
        let waited = now.saturating_duration_since(started);
        if waited < EXPLAIN_WAIT_AFTER {
            return;
        }
        let verdict = state.engine.verdict(now);
        if verdict.is_ready() {
            return;
        }
        let asking = state.engine.num_participants();
        let not_asking = state.engine.healthy_not_asking(now, 8);
        let hung = state.engine.hung_ids(8);
        state.wait_reason = Some(Arc::from(format!(
            "the round has waited {:.1}s: {verdict} ({asking} asking; healthy, not asking: \
             {}{})",
            waited.as_secs_f64(),
            if not_asking.is_empty() {
                "none".to_string()
            } else {
                not_asking.join(", ")
            },
            if hung.is_empty() {
                String::new()
            } else {
                format!("; hung, not waited for: {}", hung.join(", "))
            }
        )));
        if let Some((round, at)) = state.explained {
            if round == started && now.saturating_duration_since(at) < EXPLAIN_WAIT_EVERY {
                return;
            }
        }
        warn!(
            waited_s = waited.as_secs_f64(),
            asking,
            healthy_not_asking = ?not_asking,
            "quorum round waiting {:.1}s: {verdict}",
            waited.as_secs_f64()
        );
        state.explained = Some((started, now));
    }

    /// Logs and records (`replica_hung`, `replica_resumed`) the groups found hung or back
    /// since the last tick.
    fn announce_hangs(&self, state: &mut State, now: std::time::Instant) {
        let (timeout, rule) = state.engine.hang_timeout();
        for h in state.engine.take_newly_hung() {
            warn!(
                replica_id = %h.replica_id,
                idle_s = h.idle.as_secs_f64(),
                hang_timeout_s = h.timeout.as_secs_f64(),
                "replica group {} is hung: its process heartbeats but its training loop has \
                 not reached its manager for {:.1}s (hang timeout {:.1}s: {rule}); the round \
                 goes on without it, and it heals when it comes back",
                h.replica_id,
                h.idle.as_secs_f64(),
                timeout.as_secs_f64()
            );
            self.hub.with(|t| {
                t.emit(
                    now,
                    crate::telemetry::EventKind::ReplicaHung,
                    serde_json::json!({
                        "replica_id": h.replica_id,
                        "idle_s": h.idle.as_secs_f64(),
                        "hang_timeout_s": h.timeout.as_secs_f64(),
                        "rule": rule,
                    }),
                )
            });
        }
        for id in state.engine.take_resumed() {
            info!(replica_id = %id, "replica group {id} is no longer hung: its training loop is back");
            self.hub.with(|t| {
                t.emit(
                    now,
                    crate::telemetry::EventKind::ReplicaResumed,
                    serde_json::json!({ "replica_id": id }),
                )
            });
        }
    }

    /// Drops the groups that stayed stragglers for `--straggler_drop_after_ms` from the
    /// quorum for as long again (logged, `straggler_dropped`); their heartbeat replies say why.
    fn drop_lasting_stragglers(&self, state: &mut State, now: std::time::Instant) {
        let Some(window) = self.hub.opts.straggler_drop_after else {
            return;
        };
        let long = self.hub.with(|t| t.take_long_stragglers(now, window));
        for (incarnation, why) in long {
            if !state
                .engine
                .drop_straggler(&incarnation, window, why.clone(), now)
            {
                continue;
            }
            warn!(replica_id = %incarnation,
                "{why}: dropped from the quorum for {:.1}s; the others go on without it, \
                 then it rejoins and heals",
                window.as_secs_f64());
            self.hub.with(|t| {
                t.emit(
                    now,
                    crate::telemetry::EventKind::StragglerDropped,
                    serde_json::json!({
                        "replica_id": crate::telemetry::base_id(&incarnation),
                        "incarnation": incarnation,
                        "reason": why,
                        "for_s": window.as_secs_f64(),
                    }),
                )
            });
        }
    }

    /// Logs and records (`replica_diverged`) the groups the parity check found diverged.
    fn announce_diverged(&self, state: &mut State, now: std::time::Instant) {
        for d in state.engine.take_diverged() {
            match d.action {
                super::health::parity::Action::Heal => warn!(
                    replica_id = %d.replica_id,
                    step = d.step,
                    ranks = ?d.ranks,
                    majority = ?d.majority,
                    "replica group {}'s committed state at step {} differs from the majority's \
                     ({} of {} groups agree); it heals from them at its next quorum",
                    d.replica_id,
                    d.step,
                    d.majority.len(),
                    d.compared
                ),
                super::health::parity::Action::Stop => error!(
                    replica_id = %d.replica_id,
                    step = d.step,
                    "replica group {}'s committed state at step {} differs from the others' \
                     and no majority of the {} groups compared agrees on one: the group stops; \
                     restore a known good state and restart it",
                    d.replica_id,
                    d.step,
                    d.compared
                ),
            }
            if d.action == super::health::parity::Action::Stop {
                // A request it has in the round must not make it a member of a quorum.
                if let Some(w) = state.waiters.remove(&d.replica_id) {
                    state.engine.leave(&d.replica_id, w.generation);
                    let why = state
                        .engine
                        .parity_stopped(&d.replica_id)
                        .unwrap_or("its state diverged")
                        .to_string();
                    let _ = w.tx.send(Err(Error::Diverged(why)));
                }
            }
            self.hub.with(|t| {
                t.emit(
                    now,
                    crate::telemetry::EventKind::ReplicaDiverged,
                    serde_json::json!({
                        "replica_id": d.replica_id,
                        "step": d.step,
                        "action": d.action.as_str(),
                        "majority": d.majority,
                        "compared": d.compared,
                        "ranks": d.ranks,
                    }),
                )
            });
        }
    }

    /// Logs the end of an announced startup hold (once).
    fn announce_hold_end(state: &mut State, now: std::time::Instant) {
        if state.hold_announced && state.engine.startup_hold_until(now).is_none() {
            state.hold_announced = false;
            info!(
                asking = state.engine.num_participants(),
                "startup hold over: the first quorum is decided by the join rules"
            );
        }
    }

    /// Hands an issued quorum to each of its members' waiters.
    fn deliver(&self, state: &mut State, mut quorum: Quorum) {
        quorum.created = Some(timestamp(SystemTime::now()));
        let stable_since = state.engine.stable_since();
        info!(
            quorum_id = quorum.quorum_id,
            revision = quorum.revision,
            members = quorum.participants.len(),
            "quorum issued"
        );
        if state.last.as_ref().map(|l| l.quorum.quorum_id) != Some(quorum.quorum_id) {
            // A membership change is an event now; steps-only rounds (every step) are
            // synced by the telemetry tick, off the quorum path.
            let members = telemetry_members(&quorum);
            let now = now_instant();
            self.hub
                .with(|t| t.on_quorum(quorum.quorum_id, &members, now));
        }
        for r in state.engine.take_regressions() {
            // Loud: the job's progress went back (see the no-regression rule).
            warn!(
                quorum_id = r.quorum_id,
                from_step = r.from_step,
                to_step = r.to_step,
                alive_holders = ?r.alive_holders,
                "progress regressed: the quorum continues from an older step{}",
                if r.alive_holders.is_empty() {
                    " (every holder of the newer state is gone)"
                } else {
                    " (gave up waiting for the holders of the newer state)"
                }
            );
            let now = now_instant();
            self.hub.with(|t| t.on_progress_regressed(&r, now));
        }
        // A changed quorum is durable before its members learn it.
        self.persist_or_warn(state);
        let previous = state.last.as_ref().map(|l| &l.quorum);
        let issued = Arc::new(Issued::new(quorum, stable_since, previous));
        state.last = Some(issued.clone());
        for m in &issued.quorum.participants {
            if let Some(w) = state.waiters.remove(&m.replica_id) {
                // The receiver may be gone if the handler is just being cancelled.
                let _ = w.tx.send(Ok(issued.clone()));
            }
        }
    }

    /// Adds `member` to the round; `known_quorum_id` is the quorum its request says it
    /// holds (0: none), which tells a lighthouse with no quorum yet that it restarted.
    pub(crate) fn join(
        &self,
        member: QuorumMember,
        known_quorum_id: i64,
    ) -> Result<(u64, oneshot::Receiver<Delivery>)> {
        let now = now_instant();
        let mut guard = self.lock();
        let state = &mut *guard;
        if state.shutting_down {
            return Err(Error::Shutdown);
        }
        let replica_id = member.replica_id.clone();
        let joined = state.engine.join(member, now)?;
        if state.engine.holds_quorum(&replica_id, known_quorum_id) {
            Self::announce_hold(state, now);
        }
        let (tx, rx) = oneshot::channel();
        let old = state.waiters.insert(
            replica_id.clone(),
            Waiter {
                generation: joined.generation,
                tx,
            },
        );
        if let Some(old) = old {
            debug!(replica_id = %replica_id, "quorum request superseded by a newer one");
            let _ = old.tx.send(Err(Error::FailedPrecondition(format!(
                "superseded by a newer quorum request from replica {replica_id:?}"
            ))));
        }
        if let Some(q) = state.engine.poll(now) {
            self.deliver(state, q);
        }
        Ok((joined.generation, rx))
    }

    fn leave(&self, replica_id: &str, generation: u64) {
        let mut state = self.lock();
        if state.engine.leave(replica_id, generation) {
            debug!(replica_id = %replica_id, "quorum request left the round");
        }
        if state
            .waiters
            .get(replica_id)
            .is_some_and(|w| w.generation == generation)
        {
            state.waiters.remove(replica_id);
        }
    }

    /// Records a heartbeat (and the group's committed step and the quorum it holds, if
    /// sent); returns the heartbeat timeout (the caller's lease) and, while the group asks
    /// in a round that has waited long, why that round waits.
    pub(crate) fn heartbeat(
        &self,
        replica_id: &str,
        step: Option<i64>,
        quorum_id: Option<i64>,
        loop_idle: Option<Duration>,
        digest: Option<crate::proto::StateDigest>,
    ) -> Result<HeartbeatReply> {
        let now = now_instant();
        let mut guard = self.lock();
        let state = &mut *guard;
        if state.shutting_down {
            return Err(Error::Shutdown);
        }
        if let Some(q) = quorum_id.filter(|q| *q < 0) {
            return Err(Error::InvalidArgument(format!(
                "quorum_id must not be negative (replica {replica_id:?} sent {q})"
            )));
        }
        state
            .engine
            .heartbeat_full(replica_id, step, loop_idle, now)?;
        let parity_step = match digest {
            Some(d) => {
                let step = d.step;
                // A bad digest must not fail the heartbeat (the group's lease): it is refused
                // alone, and acknowledged so the manager stops resending it.
                let ack = match state.engine.offer_digest(replica_id, step, d.ranks, now) {
                    Ok(ack) => ack,
                    Err(e) => {
                        warn!(replica_id = %replica_id, "state digest refused: {e}");
                        step.max(0)
                    }
                };
                self.announce_diverged(state, now);
                ack
            }
            None => 0,
        };
        if state
            .engine
            .holds_quorum(replica_id, quorum_id.unwrap_or(0))
        {
            Self::announce_hold(state, now);
        }
        let waiting = match state.engine.dropped(replica_id, now) {
            Some((why, remaining)) => Some(Arc::<str>::from(format!(
                "dropped from the quorum: {why}; it rejoins in {:.1}s",
                remaining.as_secs_f64()
            ))),
            None => state
                .wait_reason
                .as_ref()
                .filter(|_| state.engine.is_asking(replica_id))
                .cloned(),
        };
        let hung = state.engine.is_hung(replica_id).map(|h| {
            format!(
                "this group's training loop has not reached its manager for {:.1}s (hang \
                 timeout {:.1}s): the others go on without it",
                h.idle.as_secs_f64(),
                h.timeout.as_secs_f64()
            )
        });
        Ok(HeartbeatReply {
            timeout: state.engine.options().heartbeat_timeout,
            waiting,
            hung,
            parity_step,
            diverged: state.engine.parity_stopped(replica_id).map(str::to_string),
        })
    }

    pub(crate) fn tick(&self) {
        let now = now_instant();
        let mut guard = self.lock();
        let state = &mut *guard;
        if state.shutting_down {
            return;
        }
        let before = state.last.clone();
        self.drop_lasting_stragglers(state, now);
        if let Some(q) = state.engine.tick(now) {
            self.deliver(state, q);
        }
        Self::announce_hold_end(state, now);
        self.announce_hangs(state, now);
        self.announce_diverged(state, now);
        Self::explain_wait(state, now);
        Self::announce_lost(&self.hub, state, before);
        // Steps heard in heartbeats, losses and a new latest snapshot reach the state file
        // within a tick.
        self.persist_or_warn(state);
    }

    /// Sends each loss the engine declared to the other members of the quorum it was in.
    /// `before` is the last issued quorum before the engine call that declared the losses
    /// (a quorum issued by that same call no longer has the lost member).
    fn announce_lost(hub: &Hub, state: &mut State, before: Option<Arc<Issued>>) {
        for LostMember {
            replica_id,
            quorum_id,
        } in state.engine.take_lost()
        {
            // A group that shut down cleanly left; anything else is a fault worth a WARN.
            if hub.with(|t| t.finished(&replica_id)) {
                info!(replica_id = %replica_id, quorum_id, "replica group left after finishing");
            } else {
                warn!(replica_id = %replica_id, quorum_id, "replica group lost");
            }
            state.lost.push_back(LostRecord {
                replica_id: replica_id.clone(),
                quorum_id,
                at: SystemTime::now(),
            });
            while state.lost.len() > LOST_HISTORY {
                state.lost.pop_front();
            }
            let Some(last) = &before else { continue };
            if last.quorum.quorum_id != quorum_id {
                continue;
            }
            let event = SessionEvent {
                lost: Some(LostEvent {
                    replica_id: replica_id.clone(),
                    quorum_id,
                }),
            };
            for m in &last.quorum.participants {
                if m.replica_id == replica_id {
                    continue;
                }
                if let Some(session) = state.sessions.get(&m.replica_id) {
                    if session.tx.try_send(Ok(event.clone())).is_err() {
                        debug!(replica_id = %m.replica_id, "session not reading; event dropped");
                    }
                }
            }
        }
    }

    /// Opens the session of `replica_id` (replacing an older one) and counts as a heartbeat.
    pub(crate) fn open_session(self: &Arc<Self>, replica_id: &str) -> Result<SessionStream> {
        if replica_id.trim().is_empty() {
            return Err(Error::InvalidArgument(
                "replica_id must not be empty".into(),
            ));
        }
        let now = now_instant();
        let mut guard = self.lock();
        let state = &mut *guard;
        if state.shutting_down {
            return Err(Error::Shutdown);
        }
        state.engine.session_opened(replica_id, now)?;
        let (tx, rx) = mpsc::channel(SESSION_BUFFER);
        // The first message tells the manager its session is established.
        let _ = tx.try_send(Ok(SessionEvent { lost: None }));
        let id = state.next_session;
        state.next_session += 1;
        if state
            .sessions
            .insert(replica_id.to_string(), Session { id, tx })
            .is_some()
        {
            debug!(replica_id = %replica_id, "session replaced by a newer one");
        }
        debug!(replica_id = %replica_id, "session opened");
        self.hub.with(|t| t.on_session(replica_id, true, now));
        Ok(SessionStream {
            rx,
            _guard: SessionGuard {
                shared: self.clone(),
                replica_id: replica_id.to_string(),
                id,
            },
        })
    }

    /// Called when a session stream ends: unless the lighthouse is shutting down or the
    /// session was replaced, the replica group is lost now.
    fn session_ended(&self, replica_id: &str, id: u64) {
        let now = now_instant();
        let mut guard = self.lock();
        let state = &mut *guard;
        if state.shutting_down || state.sessions.get(replica_id).is_none_or(|s| s.id != id) {
            return;
        }
        state.sessions.remove(replica_id);
        info!(replica_id = %replica_id, "session ended");
        self.hub.with(|t| t.on_session(replica_id, false, now));
        let before = state.last.clone();
        state.engine.lost(replica_id, now);
        if let Some(q) = state.engine.poll(now) {
            self.deliver(state, q);
        }
        Self::announce_lost(&self.hub, state, before);
    }

    /// Applies a batch of telemetry reports from a manager server (refused whole if any
    /// report is malformed).
    pub(crate) fn report(&self, batch: &TelemetryBatch) -> Result<u32> {
        if !self.serving() {
            return Err(Error::Shutdown);
        }
        if let Err(e) = validate_batch(batch) {
            let n = batch.reports.len() as u64;
            self.hub.with(|t| t.rejected(n.max(1)));
            return Err(e);
        }
        let now = now_instant();
        self.hub.with(|t| {
            for r in &batch.reports {
                t.on_report(r, now);
            }
            if let Some(first) = batch.reports.first() {
                t.on_dropped(&first.replica_id, batch.dropped);
            }
        });
        Ok(u32::try_from(batch.reports.len()).unwrap_or(u32::MAX))
    }

    /// Re-derives replica health from the heartbeat ages (periodic).
    pub(crate) fn telemetry_tick(&self) {
        let now = now_instant();
        let (ages, last) = {
            let state = self.lock();
            if state.shutting_down {
                return;
            }
            (state.engine.heartbeat_ages(now), state.last.clone())
        };
        let members = last.as_ref().map(|l| telemetry_members(&l.quorum));
        self.hub.with(|t| {
            if let (Some(last), Some(members)) = (&last, &members) {
                t.on_quorum(last.quorum.quorum_id, members, now);
            }
            t.evaluate(now, &ages);
        });
    }

    /// Recent losses of quorum members, oldest first.
    pub(crate) fn recent_lost(&self) -> Vec<LostRecord> {
        self.lock().lost.iter().cloned().collect()
    }

    /// Number of open sessions.
    pub(crate) fn num_sessions(&self) -> usize {
        self.lock().sessions.len()
    }

    /// Stops accepting requests and ends every pending long-poll with `Error::Shutdown`.
    pub(crate) fn begin_shutdown(&self) {
        let mut state = self.lock();
        state.shutting_down = true;
        for (_, w) in state.waiters.drain() {
            let _ = w.tx.send(Err(Error::Shutdown));
        }
        // Ends every session stream (managers reconnect to the next lighthouse); a shutdown
        // is not a death of every group.
        state.sessions.clear();
        drop(state);
        // Ends the SSE streams and flushes the event log.
        self.hub.close();
    }

    /// A view of the engine for the status pages.
    pub(crate) fn snapshot(&self) -> Snapshot {
        let now = now_instant();
        self.lock().engine.snapshot(now)
    }

    /// False once shutdown has begun.
    pub(crate) fn serving(&self) -> bool {
        !self.lock().shutting_down
    }
}

/// A quorum's members as telemetry sees them: `(lighthouse id, step, manager address)`.
fn telemetry_members(quorum: &Quorum) -> Vec<(String, i64, String)> {
    quorum
        .participants
        .iter()
        .map(|m| (m.replica_id.clone(), m.step, m.address.clone()))
        .collect()
}

/// Removes a waiting request from the round when its handler future ends for any reason
/// (answered, deadline, client cancel). A no-op once the request was answered or replaced.
struct LeaveGuard {
    shared: Arc<Shared>,
    replica_id: String,
    generation: u64,
}

impl Drop for LeaveGuard {
    fn drop(&mut self) {
        self.shared.leave(&self.replica_id, self.generation);
    }
}

/// Joins the round and long-polls until `requester` is in an issued quorum, the deadline
/// passes (the request then leaves the round) or the server shuts down.
pub(crate) async fn wait_for_quorum(
    shared: &Arc<Shared>,
    requester: Option<QuorumMember>,
    known_quorum_id: i64,
    timeout: Option<Duration>,
) -> Result<Arc<Issued>> {
    let requester =
        requester.ok_or_else(|| Error::InvalidArgument("requester is missing".into()))?;
    let replica_id = requester.replica_id.clone();
    let (generation, rx) = shared.join(requester, known_quorum_id)?;
    let _guard = LeaveGuard {
        shared: shared.clone(),
        replica_id,
        generation,
    };
    let delivered = match timeout {
        Some(t) => match tokio::time::timeout(t, rx).await {
            Ok(d) => d,
            Err(_) => return Err(Error::timeout("lighthouse quorum", t)),
        },
        None => rx.await,
    };
    delivered.unwrap_or(Err(Error::Shutdown))
}

/// Declares the session's replica group lost when the stream is dropped (the client went
/// away), unless the session was replaced or the lighthouse is shutting down.
struct SessionGuard {
    shared: Arc<Shared>,
    replica_id: String,
    id: u64,
}

impl Drop for SessionGuard {
    fn drop(&mut self) {
        self.shared.session_ended(&self.replica_id, self.id);
    }
}

/// The response stream of a session: the events queued for it, and the guard that notices
/// its end.
pub(crate) struct SessionStream {
    rx: mpsc::Receiver<std::result::Result<SessionEvent, Status>>,
    _guard: SessionGuard,
}

impl futures::Stream for SessionStream {
    type Item = std::result::Result<SessionEvent, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use axum::body::Bytes;
    use prost::Message;

    use crate::client::compact;
    use crate::proto::LighthouseQuorumResponse;

    fn opts() -> LighthouseOptions {
        LighthouseOptions {
            min_replicas: 2,
            // No startup hold: the rounds below are issued at once.
            progress_wait: Duration::ZERO,
            ..Default::default()
        }
    }

    #[test]
    fn a_regression_is_counted_and_announced() {
        let shared = Shared::new(opts(), 10);
        let mut feed = shared.hub.subscribe().unwrap();
        round(&shared, &[member("a", 40), member("b", 40)]);
        let now = now_instant();
        {
            let mut state = shared.lock();
            state.engine.lost("a", now);
            state.engine.lost("b", now);
        }
        let issued = round(&shared, &[member("c", 0), member("d", 0)]);
        assert_eq!(issued[0].quorum.participants.len(), 2);
        let counted = shared.hub.read(|t| t.counters().progress_regressions);
        assert_eq!(counted, 1);
        let mut found = None;
        while let Ok(item) = feed.try_recv() {
            if item.1.contains("progress_regressed") {
                found = Some(item.1.clone());
            }
        }
        let event: serde_json::Value = serde_json::from_str(&found.expect("event")).unwrap();
        assert_eq!(event["from_step"], 40);
        assert_eq!(event["to_step"], 0);
        assert_eq!(event["steps_lost"], 40);
        assert_eq!(event["unavoidable"], true);
        assert_eq!(event["quorum_id"], issued[0].quorum.quorum_id);
    }

    /// A fresh file path in a new temporary folder (removed with the guard).
    struct TempFile(std::path::PathBuf);

    impl TempFile {
        fn new() -> Self {
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

    fn record(step: i64) -> SnapshotRecord {
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

    #[test]
    fn the_state_file_keeps_the_latest_snapshot_and_older_files_still_load() {
        let file = TempFile::new();
        let durable = Durable {
            quorum_id: Some(5),
            members: vec!["a".into()],
            best_step: Some(3),
            holders: vec!["a".into()],
            others: vec![("b".into(), 1)],
        };
        save_state(&file.0, durable.clone(), Some(&record(3))).unwrap();
        let (d, snap) = load_state(&file.0).unwrap().unwrap();
        assert_eq!((d, snap), (durable.clone(), Some(record(3))));
        // Flat: the engine's fields as before, the record next to them.
        let raw: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&file.0).unwrap()).unwrap();
        assert_eq!(raw["best_step"], 3);
        assert_eq!(raw["snapshot"]["step"], 3);
        // A file of an older lighthouse (no record) loads; none is written without one.
        std::fs::write(
            &file.0,
            r#"{"quorum_id":5,"members":["a"],"best_step":3,"holders":["a"]}"#,
        )
        .unwrap();
        let (d, snap) = load_state(&file.0).unwrap().unwrap();
        assert_eq!(d.best_step, Some(3));
        assert_eq!(snap, None);
        save_state(&file.0, durable, None).unwrap();
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

    #[test]
    fn a_restarted_lighthouse_shows_and_keeps_the_remembered_snapshot() {
        let file = TempFile::new();
        save_state(&file.0, Durable::default(), Some(&record(9))).unwrap();
        let o = LighthouseOptions {
            state_file: Some(file.0.clone()),
            ..opts()
        };
        let hub = Hub::new(Default::default(), o.heartbeat_timeout, o.min_replicas).unwrap();
        let shared = Shared::with_hub(o, 10, hub, Security::none()).unwrap();
        assert_eq!(shared.hub.read(|t| t.snapshot().cloned()), Some(record(9)));
        // Later writes of the engine's state carry it along.
        round(&shared, &[member("a", 12), member("b", 12)]);
        let (d, snap) = load_state(&file.0).unwrap().unwrap();
        assert!(d.quorum_id.is_some());
        assert_eq!(snap, Some(record(9)));
    }

    fn member(id: &str, step: i64) -> QuorumMember {
        QuorumMember {
            replica_id: id.into(),
            address: format!("http://{id}:1"),
            store_address: format!("{id}:2"),
            step,
            world_size: 1,
            ..Default::default()
        }
    }

    /// Every member asks; returns what each one's waiter received.
    fn round(shared: &Shared, members: &[QuorumMember]) -> Vec<Arc<Issued>> {
        let rxs: Vec<_> = members
            .iter()
            .map(|m| shared.join(m.clone(), 0).unwrap().1)
            .collect();
        rxs.into_iter()
            .map(|mut rx| rx.try_recv().unwrap().unwrap())
            .collect()
    }

    fn decode(framed: &Bytes) -> Quorum {
        assert_eq!(framed[0], 0);
        let len = u32::from_be_bytes([framed[1], framed[2], framed[3], framed[4]]) as usize;
        assert_eq!(framed.len(), 5 + len);
        LighthouseQuorumResponse::decode(&framed[5..])
            .unwrap()
            .quorum
            .unwrap()
    }

    #[tokio::test]
    async fn replies_are_compact_only_for_holders_of_a_rebuildable_quorum() {
        let shared = Shared::new(opts(), 10);
        let q1 = round(&shared, &[member("a", 1), member("b", 1)]);
        let q1 = q1[0].quorum.clone();
        let issued = round(&shared, &[member("a", 2), member("b", 2)]);
        assert!(
            Arc::ptr_eq(&issued[0], &issued[1]),
            "one issued quorum per round"
        );
        let issued = &issued[0];

        // Holder of the previous quorum: compact, and it rebuilds the full quorum.
        let known = (q1.quorum_id, q1.revision);
        let compact_reply = decode(&issued.framed(known));
        assert!(compact_reply.participants.is_empty());
        assert_eq!(compact_reply.compact.as_ref().unwrap().base_step, 2);
        assert_eq!(
            compact::expand(Some(&q1), compact_reply).unwrap(),
            issued.quorum
        );
        // Nothing known (old-style request), another id, a future revision: full form.
        for known in [(0, 0), (q1.quorum_id + 1, q1.revision), (q1.quorum_id, 99)] {
            let reply = decode(&issued.framed(known));
            assert_eq!(reply, issued.quorum, "known {known:?}");
        }
        // Each form is encoded once and its bytes are shared by every reply.
        assert_eq!(issued.framed(known).as_ptr(), issued.framed(known).as_ptr());
        assert_eq!(
            issued.framed((0, 0)).as_ptr(),
            issued.framed((0, 0)).as_ptr()
        );
        assert!(issued.framed(known).len() * 2 < issued.framed((0, 0)).len());

        // Membership change: the holder of the previous quorum gets a delta (the newcomer in
        // full), the holder of an older one the full form.
        let q2 = issued.quorum.clone();
        let grown = round(&shared, &[member("c", 3), member("a", 3), member("b", 3)]);
        let grown = &grown[0];
        assert_ne!(grown.quorum.quorum_id, q2.quorum_id);
        let reply = decode(&grown.framed((q2.quorum_id, q2.revision)));
        assert!(reply.participants.is_empty());
        let delta = reply.compact.clone().unwrap();
        assert_eq!(delta.upserts, vec![member("c", 3)]);
        assert!(delta.removed.is_empty());
        assert_eq!(compact::expand(Some(&q2), reply).unwrap(), grown.quorum);
        let reply = decode(&grown.framed((q1.quorum_id, q1.revision)));
        assert_eq!(reply, grown.quorum, "older holder: full form");

        // Commit failures: new id, a delta with the failing member; the next steady round is
        // compact again.
        let mut failing = member("a", 4);
        failing.commit_failures = 1;
        let failed = round(&shared, &[failing.clone(), member("b", 4), member("c", 4)]);
        let failed_reply =
            decode(&failed[0].framed((grown.quorum.quorum_id, grown.quorum.revision)));
        assert_eq!(
            failed_reply.compact.as_ref().unwrap().upserts,
            vec![failing]
        );
        let failed = failed[0].quorum.clone();
        assert_eq!(
            compact::expand(Some(&grown.quorum), failed_reply).unwrap(),
            failed
        );
        assert_ne!(failed.quorum_id, grown.quorum.quorum_id);
        let healed = round(&shared, &[member("a", 5), member("b", 5), member("c", 5)]);
        let healed = &healed[0];
        assert_eq!(
            healed.quorum.quorum_id, failed.quorum_id,
            "same members, same id"
        );
        // commit_failures went back to 0: not steps only, a delta for the failed round's holders.
        let reply = decode(&healed.framed((failed.quorum_id, failed.revision)));
        assert_eq!(reply.compact.as_ref().unwrap().upserts.len(), 1);
        assert_eq!(
            compact::expand(Some(&failed), reply).unwrap(),
            healed.quorum
        );
        let steady = round(&shared, &[member("a", 6), member("b", 6), member("c", 6)]);
        let reply = decode(&steady[0].framed((healed.quorum.quorum_id, healed.quorum.revision)));
        assert!(reply.participants.is_empty());
        assert_eq!(
            compact::expand(Some(&healed.quorum), reply).unwrap(),
            steady[0].quorum
        );
    }
}
