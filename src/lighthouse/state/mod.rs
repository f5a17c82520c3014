//! The lighthouse's live state around the pure engine: waiting quorum requests, open
//! sessions, the last issued quorum, and the clock-driven re-evaluation of a round.
//!
//! Quorum requests long-poll: each waiter gets its own oneshot channel (a lagging waiter can
//! never miss its quorum because many were issued), and a drop guard on the waiting future
//! removes a cancelled or timed-out request from the round. The server's tick task calls
//! [`Shared::tick`] every `quorum_tick` (join timeout, heartbeat expiry).
//!
//! Its pieces: [`sessions`] the managers' session streams and the losses announced on them;
//! [`announce`] what the lighthouse says about a round while it runs (holds, long waits,
//! hangs, drops, divergence); [`file`] the state file and its writer task: handlers hand it
//! what to persist and never write under the state lock.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use super::health::hub::Hub;
use super::health::telemetry::EncodedGoodput;
use super::quorum::{CommitVerdict, QuorumEngine, Snapshot};
use super::reply::Issued;
use super::LighthouseOptions;
use crate::error::{ensure, Error, Result};
use crate::proto::{Quorum, QuorumMember, TelemetryBatch};
use crate::security::Security;
use crate::telemetry::validate_batch;

mod announce;
mod file;
mod sessions;

use file::{load_state, Contents, StateWriter};

/// How often the goodput accounts of a job of more than 256 groups are saved at most.
const GOODPUT_SAVE_EVERY: std::time::Duration = std::time::Duration::from_secs(2);
/// How stale the state file's `silent_ms` may grow while nothing else changes (a stalled
/// job): a restarted lighthouse waits for a remembered holder for what its silence left of
/// the progress wait, so silence it did not save is silence the next life waits for again.
const SILENCE_REFRESH: std::time::Duration = std::time::Duration::from_secs(1);
use sessions::Session;
pub(crate) use sessions::SessionStream;

type Delivery = Result<Arc<Issued>>;

/// A quorum whose members changed, and the telemetry lock taken before they were answered
/// (see [`Shared::deliver`]).
struct Told<'a> {
    issued: Arc<Issued>,
    held: super::health::hub::Held<'a>,
}

struct Waiter {
    generation: u64,
    tx: oneshot::Sender<Delivery>,
}

/// Losses kept for the status pages (most recent last).
const LOST_HISTORY: usize = 32;

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
    /// What the parity checks say of the group's committed states.
    pub(crate) parity_mark: crate::lighthouse::health::parity::ParityMark,
}

/// A replica group declared lost, as shown on the status pages.
#[derive(Debug, Clone)]
pub(crate) struct LostRecord {
    pub(crate) replica_id: String,
    pub(crate) quorum_id: i64,
    pub(crate) at: SystemTime,
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
    /// The engine's durable revision last handed to the state file's writer.
    saved_revision: u64,
    /// When the engine's durable state was last handed to the writer (None: not yet).
    saved_at: Option<std::time::Instant>,
    /// The telemetry's snapshot revision last handed to the state file's writer.
    saved_snapshot_revision: u64,
    /// The goodput accounts last encoded for the state file: their revision, when, and the
    /// encoding.
    saved_goodput: Option<(u64, std::time::Instant, Arc<EncodedGoodput>)>,
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
    /// The writer of the state file (None without one).
    writer: Option<StateWriter>,
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

/// A quorum's members as telemetry sees them: `(lighthouse id, step, manager address)`.
fn telemetry_members(quorum: &Quorum) -> impl Iterator<Item = (&str, i64, &str)> + Clone {
    quorum
        .participants
        .iter()
        .map(|m| (m.replica_id.as_str(), m.step, m.address.as_str()))
}

/// Runs its action once, when dropped: what a handler future or a response stream stood
/// for ends with it, whatever ends it (an answer, a deadline, a client that went away).
struct OnDrop(Option<Box<dyn FnOnce() + Send>>);

impl OnDrop {
    fn new(action: impl FnOnce() + Send + 'static) -> Self {
        Self(Some(Box::new(action)))
    }

    /// The action will not run.
    fn disarm(mut self) {
        self.0 = None;
    }
}

impl Drop for OnDrop {
    fn drop(&mut self) {
        if let Some(action) = self.0.take() {
            action();
        }
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
    // Leaves the round when this future ends unanswered (a no-op once the request was
    // answered or replaced).
    let _leave = {
        let shared = shared.clone();
        OnDrop::new(move || shared.leave(&replica_id, generation))
    };
    let delivered = match timeout {
        Some(t) => match tokio::time::timeout(t, rx).await {
            Ok(d) => d,
            Err(_) => return Err(Error::timeout("lighthouse quorum", t)),
        },
        None => rx.await,
    };
    // Answered, replaced or shut down: the request is out of the round already, and leaving
    // would only take the state lock once more per member as a round's answers go out.
    _leave.disarm();
    delivered.unwrap_or(Err(Error::Shutdown))
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
        if let Some(saved) = opts.state_file.as_deref().and_then(file::load_goodput) {
            let dropped = hub.with(|t| t.restore_goodput(saved));
            info!("the state file's goodput accounts continue");
            if !dropped.is_empty() {
                warn!(groups = ?dropped, "damaged goodput accounts in the state file are dropped");
            }
        }
        let writer = opts
            .state_file
            .clone()
            .map(StateWriter::start)
            .transpose()?;
        let engine = match durable {
            Some(durable) => {
                let (quorum_id, best_step) = (durable.quorum_id, durable.best_step);
                let holders = durable.holders.len();
                let engine = QuorumEngine::restored(opts, initial_id, now, durable);
                let wait = engine.remembered_wait(now);
                info!(
                    quorum_id = ?quorum_id,
                    best_step = ?best_step,
                    holders,
                    remembered_waited_for = wait.len(),
                    longest_wait_s = wait
                        .iter()
                        .map(|(_, left)| left.as_secs_f64())
                        .fold(0.0, f64::max),
                    "continuing from the state file (a remembered replica is waited for what \
                     its silence, while a lighthouse ran, left of the progress wait)"
                );
                engine
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
            saved_at: None,
            saved_snapshot_revision: 0,
            saved_goodput: None,
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
            writer,
        })
    }

    /// Hands the engine's durable state and the latest snapshot record to the state file's
    /// writer if either changed since the last hand-over (or the last write failed). Returns
    /// the submission that makes the file current, to wait for; None without a state file.
    fn persist(&self, state: &mut State) -> Option<u64> {
        let writer = self.writer.as_ref()?;
        let revision = state.engine.durable_revision();
        let now = now_instant();
        let (snapshot_revision, goodput_revision, groups) = self
            .hub
            .read(|t| (t.snapshot_revision(), t.goodput_revision(), t.num_groups()));
        // The goodput accounts change with every report and commit: saved with every write
        // for a job of up to 256 groups (a commit is durable with its announcement), at most
        // every GOODPUT_SAVE_EVERY above.
        let every = if groups <= 256 {
            std::time::Duration::ZERO
        } else {
            GOODPUT_SAVE_EVERY
        };
        let goodput_due = match &state.saved_goodput {
            None => goodput_revision > 0,
            Some((rev, at, _)) => *rev != goodput_revision && now.duration_since(*at) >= every,
        };
        // The replicas' silences grow without a revision.
        let heard_due = state
            .saved_at
            .is_none_or(|at| now.duration_since(at) >= SILENCE_REFRESH);
        if revision == state.saved_revision
            && snapshot_revision == state.saved_snapshot_revision
            && !goodput_due
            && !heard_due
            && !writer.failed()
        {
            return Some(writer.submitted());
        }
        if goodput_due {
            let (rev, saved) = self
                .hub
                .with(|t| (t.goodput_revision(), t.encode_goodput()));
            match saved {
                Ok(v) => state.saved_goodput = Some((rev, now, Arc::new(v))),
                Err(e) => warn!("cannot encode the goodput accounts for the state file: {e}"),
            }
        }
        let (snapshot_revision, snapshot) = self
            .hub
            .read(|t| (t.snapshot_revision(), t.snapshot().cloned()));
        let seq = writer.submit(Contents {
            durable: state.engine.durable(now),
            snapshot,
            goodput: state.saved_goodput.as_ref().map(|(_, _, v)| v.clone()),
        });
        state.saved_revision = revision;
        state.saved_at = Some(now);
        state.saved_snapshot_revision = snapshot_revision;
        Some(seq)
    }

    /// A write-ahead commit announcement (see [`QuorumEngine::commit`]): `Ok(None)` when
    /// accepted (and saved to the state file, if any), `Ok(Some(reason))` when refused.
    /// `quorum_wait_s`: group rank 0's quorum wait in the step (0: not known).
    pub(crate) async fn commit(
        &self,
        replica_id: &str,
        quorum_id: i64,
        step: i64,
        quorum_wait_s: f64,
    ) -> Result<Option<String>> {
        ensure!(
            quorum_wait_s.is_finite() && quorum_wait_s >= 0.0,
            "quorum_wait_s must be a finite number of seconds, not negative, got {quorum_wait_s}"
        );
        let wait = (quorum_wait_s > 0.0).then_some(quorum_wait_s);
        let saved = {
            let now = now_instant();
            let mut guard = self.lock();
            let state = &mut *guard;
            if state.shutting_down {
                return Err(Error::Shutdown);
            }
            match state.engine.commit(replica_id, quorum_id, step, now)? {
                CommitVerdict::Accepted => {
                    self.hub.with(|t| t.on_commit(replica_id, step, wait, now));
                    self.persist(state)
                }
                CommitVerdict::Refused(reason) => {
                    warn!(replica_id = %replica_id, quorum_id, step, reason = %reason,
                        "commit refused");
                    self.hub.with(|t| t.commit_refused());
                    return Ok(Some(reason));
                }
            }
        };
        // Durable before the group applies the commit, or not accepted at all.
        self.written(saved).await?;
        Ok(None)
    }

    /// Waits until submission `saved` of the state file's writer (from [`Self::persist`])
    /// is on disk; at once without a state file.
    async fn written(&self, saved: Option<u64>) -> Result<()> {
        match (&self.writer, saved) {
            (Some(writer), Some(seq)) => writer.wait(seq).await,
            _ => Ok(()),
        }
    }

    /// Waits until everything handed to the state file's writer so far is on disk (at once
    /// without a state file).
    pub(crate) async fn flush_state(&self) -> Result<()> {
        match &self.writer {
            Some(writer) => writer.flush().await,
            None => Ok(()),
        }
    }

    /// Writes what is pending to the state file and stops its writer (graceful stop).
    pub(crate) async fn close_state(&self) -> Result<()> {
        match &self.writer {
            Some(writer) => writer.close().await,
            None => Ok(()),
        }
    }

    /// Counts one quorum reply: `abridged` (compact, delta or sparse) or full.
    pub(crate) fn count_reply(&self, abridged: bool) {
        let counter = if abridged {
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

    /// Hands an issued quorum to each of its members' waiters. Returns it when its members
    /// changed, for [`Self::tell`], with the telemetry lock taken before the members were
    /// answered: whatever they or anyone else do next (a status page, another quorum, a
    /// shutdown) waits for telemetry to know this quorum, yet the caller may tell it after
    /// releasing the state lock (at 10,000 groups that is tens of milliseconds the answers
    /// and the next requests need not wait for).
    #[must_use]
    fn deliver<'a>(&'a self, state: &mut State, mut quorum: Quorum) -> Option<Told<'a>> {
        quorum.created = Some(timestamp(SystemTime::now()));
        let stable_since = state.engine.stable_since();
        let changed = state.last.as_ref().map(|l| l.quorum.quorum_id) != Some(quorum.quorum_id);
        // A new quorum is news; the same one again (every step of a steady job) is not.
        if changed {
            info!(
                quorum_id = quorum.quorum_id,
                revision = quorum.revision,
                members = quorum.participants.len(),
                "quorum issued"
            );
        } else {
            debug!(
                quorum_id = quorum.quorum_id,
                revision = quorum.revision,
                members = quorum.participants.len(),
                "quorum issued again"
            );
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
        let saved = self.persist(state);
        let previous = state.last.as_ref().map(|l| &l.quorum);
        let issued = Arc::new(Issued::new(quorum, stable_since, previous));
        state.last = Some(issued.clone());
        let told = changed.then(|| Told {
            issued: issued.clone(),
            held: self.hub.hold(),
        });
        let waiters: Vec<Waiter> = issued
            .quorum
            .participants
            .iter()
            .filter_map(|m| state.waiters.remove(&m.replica_id))
            .collect();
        let answer = move || {
            for w in waiters {
                // The receiver may be gone if the handler is just being cancelled.
                let _ = w.tx.send(Ok(issued.clone()));
            }
        };
        match (&self.writer, saved) {
            // A changed quorum is durable before its members learn it (a failed write is
            // logged by the writer; the members are answered anyway, as a restart would
            // only forget, never fork).
            (Some(writer), Some(seq)) if !writer.written(seq) => {
                let saved = writer.wait(seq);
                writer.spawn(async move {
                    let _ = saved.await;
                    answer();
                });
            }
            _ => answer(),
        }
        told
    }

    /// Tells telemetry of a quorum whose members changed: an event now (steps-only rounds
    /// are synced by the telemetry tick, off the quorum path, and telemetry ignores a quorum
    /// no newer than the last one told).
    fn tell(told: Option<Told<'_>>) {
        if let Some(Told { issued, held }) = told {
            let now = now_instant();
            let q = &issued.quorum;
            held.with(|t| t.on_quorum(q.quorum_id, q.revision, telemetry_members(q), now));
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
        let told = state.engine.poll(now).and_then(|q| self.deliver(state, q));
        drop(guard);
        Self::tell(told);
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
        if let Some(q) = quorum_id {
            ensure!(
                q >= 0,
                "quorum_id must not be negative (replica {replica_id:?} sent {q})"
            );
        }
        state
            .engine
            .heartbeat_full(replica_id, step, loop_idle, now)?;
        let parity_step = match digest {
            Some(d) => {
                let step = d.step;
                // A bad digest must not fail the heartbeat (the group's lease): it is refused
                // alone, and acknowledged so the manager stops resending it.
                let ack = match state.engine.offer_digest(replica_id, d, now) {
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
            parity_mark: state.engine.parity_mark(replica_id),
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
            let told = self.deliver(state, q);
            Self::tell(told);
        }
        Self::announce_hold_end(state, now);
        self.announce_hangs(state, now);
        self.announce_diverged(state, now);
        Self::explain_wait(state, now);
        Self::announce_lost(&self.hub, state, before);
        // Steps heard in heartbeats, losses and a new latest snapshot reach the state file
        // within a tick.
        self.persist(state);
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

    /// Waits until the goodput accounts as they are now are in the state file (at once
    /// without one): a report batch is acknowledged only once what it changed is durable,
    /// so a batch a killed lighthouse had accepted is not lost with it (an unacknowledged
    /// batch is sent again; a copy of one already counted is ignored by the accounts).
    pub(crate) async fn save_reports(&self) -> Result<()> {
        let saved = {
            let mut guard = self.lock();
            if guard.shutting_down {
                return Err(Error::Shutdown);
            }
            self.persist(&mut guard)
        };
        self.written(saved).await
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
        self.hub.with(|t| {
            if let Some(last) = &last {
                // The last quorum's steps (at once when telemetry was told of it already).
                let q = &last.quorum;
                t.on_quorum(q.quorum_id, q.revision, telemetry_members(q), now);
            }
            t.evaluate(now, &ages);
        });
        if self.hub.with(|t| t.take_ended()) && self.hub.has_summary_dir() {
            // Every group finished: the end-of-run report goes next to the event log.
            if let Err(e) = self.hub.write_summary() {
                warn!("cannot write the end-of-run report: {e}");
            }
        }
    }

    /// Recent losses of quorum members, oldest first.
    pub(crate) fn recent_lost(&self) -> Vec<LostRecord> {
        self.lock().lost.iter().cloned().collect()
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

    /// The room's `min_replicas`.
    pub(crate) fn min_replicas(&self) -> u64 {
        self.lock().engine.options().min_replicas
    }

    /// True when no session is open and no quorum request waits (a room may then expire).
    pub(crate) fn is_idle(&self) -> bool {
        let state = self.lock();
        state.sessions.is_empty() && state.waiters.is_empty()
    }

    /// False once shutdown has begun.
    pub(crate) fn serving(&self) -> bool {
        !self.lock().shutting_down
    }
}

#[cfg(test)]
mod testkit;

#[cfg(test)]
mod tests {
    use super::testkit::*;
    use super::*;
    use crate::client::compact;

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
        // No durable snapshot: the job goes on from the quorum's own step.
        assert_eq!(event["resumes_from"], 0);
        assert_eq!(event["steps_lost"], 40);
        assert_eq!(event["unavoidable"], true);
        assert_eq!(event["quorum_id"], issued[0].quorum.quorum_id);
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
