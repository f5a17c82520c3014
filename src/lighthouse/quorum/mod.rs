//! The pure quorum engine: `(state, now, options) → decision`, with no I/O and no clock.
//!
//! Every method takes the current time as an argument, so the rules are tested with virtual
//! time. Joins, leaves and heartbeats cost O(1) amortised: the engine keeps incremental
//! counters (participants, participants that were in the previous quorum, shrink-only
//! requests, healthy replicas as of the last prune) and only builds a quorum (O(n)) once it
//! has decided to issue one. Heartbeat expiry and pruning happen in [`QuorumEngine::tick`].
//!
//! Rules (see the design notes, "Lighthouse quorum rules"):
//! - healthy = heartbeated or asked within `heartbeat_timeout` (a waiting participant is
//!   healthy: its request is live);
//! - a quorum needs ≥ `min_replicas` members and a strict majority of all healthy replicas,
//!   on the fast path too;
//! - fast path: every member of the previous quorum asks again → answer at once;
//! - otherwise answer once every healthy replica asks, or `join_timeout` after the round's
//!   first joiner;
//! - `shrink_only` (any participant) keeps only members of the previous quorum;
//! - the id changes when the member set changes or a member reports commit failures.
//!
//! Loss (see the design notes, "Failure detection"): [`QuorumEngine::lost`] records that a
//! replica group died (its session with the lighthouse ended): it stops counting as healthy
//! at once, so the next round does not wait `heartbeat_timeout` for it. At tick time a member
//! of the last quorum whose heartbeat expired (a hang) is declared lost too. Each loss of a
//! member of the last quorum is reported once through [`QuorumEngine::take_lost`].
//!
//! No progress regression (see the design notes, "Lighthouse quorum rules"): the engine knows
//! each replica's committed step (from its requests and heartbeats). A round that is otherwise
//! ready, but whose candidates are all behind a replica that may still come back (heartbeating,
//! or with its session open even if silent), waits for that replica until `progress_wait`
//! after the round's first request. A fresh job's first quorum is issued under the join
//! rules alone, at once. An engine that knows it restarted — it continues a previous life
//! (its durable state), or a replica reported a quorum id it holds from an earlier life —
//! issues no first quorum before `min(heartbeat_timeout, progress_wait)` after its start,
//! so every replica that is still heartbeating has been heard; a restored engine ends that
//! hold early when every member of the quorum it remembers asks at or above the best step
//! it remembers: nobody outside that quorum can be ahead of it then. A quorum issued behind the best step
//! known anyway (the holders died, or the wait ran out) is reported once through
//! [`QuorumEngine::take_regressions`]; a holder given up on at a step is not waited for
//! again at that step.

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::time::{Duration, Instant};

use super::health::hang::{HangWatch, Hung};
use super::health::parity::{Diverged, Parity};
pub use super::health::Regression;
use super::LighthouseOptions;
use crate::client::compact;
use crate::error::{Error, Result};
use crate::proto::{Quorum, QuorumMember};

/// Heartbeat records unseen for this many heartbeat timeouts are forgotten at tick time, so
/// a long-running lighthouse does not accumulate every replica id it ever saw.
pub const PRUNE_AFTER_TIMEOUTS: u32 = 10;

/// One replica group waiting in the current round.
#[derive(Debug, Clone)]
struct Participant {
    member: QuorumMember,
    generation: u64,
}

/// When a replica group was last seen, whether it is counted as healthy, what it last said
/// about its progress, and whether its session is open.
#[derive(Debug, Clone, Copy)]
struct HeartbeatRecord {
    last_seen: Instant,
    counted: bool,
    /// Highest committed step the replica reported (requests, heartbeats); None if unknown.
    step: Option<i64>,
    /// Its session with the lighthouse is open: it may still come back even while silent
    /// (e.g. stopped), so progress it holds is worth waiting for.
    session: bool,
    /// Known from the state of a previous life of the lighthouse and without a session in
    /// this one: it may come back until then (even if heard once and silent since, e.g.
    /// stopped before its manager reopened its session).
    restored_until: Option<Instant>,
    /// Heard from in this life of the lighthouse (false only for restored records).
    heard: bool,
}

impl HeartbeatRecord {
    /// A record not counted as healthy yet (see `QuorumEngine::touch`).
    fn new(now: Instant) -> Self {
        Self {
            last_seen: now,
            counted: false,
            step: None,
            session: false,
            restored_until: None,
            heard: true,
        }
    }

    /// Heard from within `timeout` of `now`, silent with its session still open, or known
    /// from a previous life of the lighthouse and not yet waited out.
    fn may_come_back(&self, now: Instant, timeout: Duration) -> bool {
        self.session
            || (self.heard && now.saturating_duration_since(self.last_seen) <= timeout)
            || self.restored_until.is_some_and(|until| now < until)
    }
}

/// Outcome of [`QuorumEngine::join`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Joined {
    /// Identifies this request; pass it to [`QuorumEngine::leave`] so a stale request of the
    /// same replica cannot remove a newer one.
    pub generation: u64,
    /// The generation of an earlier, still waiting request of the same replica that this one
    /// replaced (that waiter should be told it was superseded).
    pub replaced: Option<u64>,
}

/// A member of an issued quorum that was declared lost.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LostMember {
    /// The lost replica group.
    pub replica_id: String,
    /// The quorum it was a member of (the last issued one when it was declared lost).
    pub quorum_id: i64,
}

/// The lighthouse's answer to a write-ahead commit announcement (see
/// [`QuorumEngine::commit`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CommitVerdict {
    /// The step is recorded as committed by the replica: it may apply it.
    Accepted,
    /// The replica must not commit the step (the reason says why); it rejoins and heals.
    Refused(String),
}

/// What a lighthouse keeps across its own restarts (see [`QuorumEngine::durable`]): enough
/// to refuse a commit under a quorum it had replaced, and to wait for the holders of the
/// best step it knew.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Durable {
    /// Id of the last issued quorum (None before the first).
    pub quorum_id: Option<i64>,
    /// Its members (sorted).
    pub members: Vec<String>,
    /// The best committed step known (None before any report).
    pub best_step: Option<i64>,
    /// Replicas known to hold `best_step` that may still come back (sorted).
    pub holders: Vec<String>,
    /// The other replicas known with a committed step below `best_step` that may still come
    /// back and were not given up on, with that step (best first, at most
    /// [`MAX_DURABLE_OTHERS`]): when every holder of the best step is gone, a restarted
    /// lighthouse still waits for the best of these (absent in older state files).
    #[serde(default)]
    pub others: Vec<(String, i64)>,
}

/// Most replicas below the best step a state file remembers.
pub const MAX_DURABLE_OTHERS: usize = 64;

/// How an engine knows that the job ran before this life of the lighthouse began (so a
/// replica still heartbeating may hold progress it has not heard of yet).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EarlierLife {
    /// The state file held the state of a previous life.
    StateFile {
        /// The last quorum it remembers, if any.
        quorum_id: Option<i64>,
        /// The best committed step it remembers, if any.
        best_step: Option<i64>,
    },
    /// A replica reported holding a quorum this life did not issue.
    Reported {
        /// The replica that reported it.
        replica_id: String,
        /// The quorum id it holds.
        quorum_id: i64,
    },
}

impl fmt::Display for EarlierLife {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EarlierLife::StateFile {
                quorum_id,
                best_step,
            } => {
                write!(f, "its state file remembers")?;
                match quorum_id {
                    Some(id) => write!(f, " quorum {id}")?,
                    None => write!(f, " no quorum")?,
                }
                match best_step {
                    Some(step) => write!(f, " and step {step}"),
                    None => Ok(()),
                }
            }
            EarlierLife::Reported {
                replica_id,
                quorum_id,
            } => write!(
                f,
                "{replica_id} holds quorum {quorum_id} from an earlier life"
            ),
        }
    }
}

/// Why the next quorum is, or is not yet, ready.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Every member of the previous quorum asked again (and min/majority hold).
    FastPath,
    /// Every healthy replica group is asking.
    AllHealthyJoined,
    /// The join timeout of the round passed with enough replica groups.
    JoinTimeout,
    /// Nobody is asking.
    NoParticipants,
    /// Fewer candidates than `min_replicas`.
    BelowMinReplicas {
        /// Candidates after shrink-only filtering.
        candidates: usize,
        /// The configured minimum.
        min_replicas: u64,
    },
    /// The candidates are not a strict majority of the healthy replica groups.
    NoMajority {
        /// Candidates after shrink-only filtering.
        candidates: usize,
        /// Healthy replica groups (as of the last prune).
        healthy: usize,
    },
    /// Enough replica groups, waiting for healthy stragglers until the join timeout.
    WaitingForStragglers {
        /// Healthy replica groups that are not asking yet.
        missing: usize,
        /// Time left until the join timeout.
        remaining: Duration,
    },
    /// The lighthouse (re)started recently: a replica still heartbeating may not have been
    /// heard yet, so the first quorum waits.
    StartupHold {
        /// Time left until the first quorum may be issued.
        remaining: Duration,
        /// How the lighthouse knows it restarted.
        why: EarlierLife,
    },
    /// Every candidate is behind a replica that may still come back: waiting for it.
    WaitingForProgress {
        /// The replica holding the best step.
        holder: String,
        /// Its committed step.
        step: i64,
        /// The best step among the candidates.
        candidates_step: i64,
        /// Time left until the round gives up on it (`progress_wait` after the round began).
        remaining: Duration,
    },
}

impl Verdict {
    /// True when a quorum is issued on this verdict.
    pub fn is_ready(&self) -> bool {
        matches!(
            self,
            Verdict::FastPath | Verdict::AllHealthyJoined | Verdict::JoinTimeout
        )
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Verdict::FastPath => write!(f, "ready: every member of the previous quorum is asking"),
            Verdict::AllHealthyJoined => write!(f, "ready: every healthy replica is asking"),
            Verdict::JoinTimeout => write!(f, "ready: join timeout passed with enough replicas"),
            Verdict::NoParticipants => write!(f, "no replica is asking for a quorum"),
            Verdict::BelowMinReplicas {
                candidates,
                min_replicas,
            } => {
                let more = min_replicas.saturating_sub(*candidates as u64);
                let s = if more == 1 { "" } else { "s" };
                write!(
                    f,
                    "waiting for {more} more replica{s} to reach min_replicas={min_replicas}"
                )
            }
            Verdict::NoMajority {
                candidates,
                healthy,
            } => write!(
                f,
                "waiting for a strict majority: {candidates} asking of {healthy} healthy replicas"
            ),
            Verdict::WaitingForStragglers { missing, remaining } => write!(
                f,
                "waiting up to {:.1}s for {missing} healthy replica(s) not asking yet",
                remaining.as_secs_f64()
            ),
            Verdict::StartupHold { remaining, why } => write!(
                f,
                "lighthouse restarted ({why}): holding the first quorum {:.1}s more so every \
                 replica still heartbeating is heard",
                remaining.as_secs_f64()
            ),
            Verdict::WaitingForProgress {
                holder,
                step,
                candidates_step,
                remaining,
            } => write!(
                f,
                "waiting up to {:.1}s for {holder} (at step {step}): the candidates are \
                 behind, at step {candidates_step}",
                remaining.as_secs_f64()
            ),
        }
    }
}

/// A read-only view of the engine for status pages.
#[derive(Debug, Clone)]
pub struct Snapshot {
    /// Id of the last issued quorum, if any.
    pub quorum_id: Option<i64>,
    /// The configured minimum.
    pub min_replicas: u64,
    /// Members of the last issued quorum.
    pub members: Vec<QuorumMember>,
    /// Known replica ids with the time since they were last seen, and whether healthy.
    pub heartbeats: Vec<(String, Duration, bool)>,
    /// Replica ids asking in the current round (sorted).
    pub participants: Vec<String>,
    /// Why the next quorum is or is not ready.
    pub verdict: Verdict,
    /// While a restarted lighthouse may still hold its first quorum: how it knows it
    /// restarted, and the time left.
    pub startup_hold: Option<(EarlierLife, Duration)>,
    /// While a round is open: healthy replicas not asking (sorted, at most 64).
    pub healthy_not_asking: Vec<String>,
    /// How long the current round has been open (None while nobody asks).
    pub round_age: Option<Duration>,
    /// Replica groups hung now (see [`super::health::hang`]), by id.
    pub hung: Vec<Hung>,
    /// The hang timeout now, and how it was chosen.
    pub hang_timeout: (Duration, String),
    /// The runtime state parity check (see [`super::health::parity`]).
    pub parity: ParitySnapshot,
    /// Groups dropped from the quorum as lasting stragglers: id, why, time left (sorted).
    pub dropped: Vec<(String, String, Duration)>,
}

/// The parity check's state, as shown on the status pages.
#[derive(Debug, Clone, Default)]
pub struct ParitySnapshot {
    /// Steps compared across at least two groups.
    pub checks: u64,
    /// Groups found diverged (each group at each step once).
    pub diverged_total: u64,
    /// The last step compared.
    pub last_checked_step: Option<i64>,
    /// Groups marked to heal from the agreeing majority (sorted).
    pub healing: Vec<String>,
    /// Groups stopped: their state differs with no majority (sorted).
    pub stopped: Vec<String>,
}

/// The lighthouse's quorum state machine. Pure: the caller supplies `now` everywhere.
#[derive(Debug)]
pub struct QuorumEngine {
    opts: LighthouseOptions,
    /// Id given to the next quorum whose membership changed.
    next_id: i64,
    previous: Option<Quorum>,
    previous_ids: HashSet<String>,
    participants: HashMap<String, Participant>,
    round_started: Option<Instant>,
    next_generation: u64,
    /// Participants that are members of the previous quorum.
    prev_participating: usize,
    /// Participants that asked for shrink_only.
    shrink_only: usize,
    heartbeats: HashMap<String, HeartbeatRecord>,
    /// Records with `counted`: a superset of the healthy replicas (exact after a prune).
    healthy: usize,
    /// Revision of the last issued quorum (a counter of issued quorums, 0 before the first).
    revision: u64,
    /// Revision since which every issued quorum had the last one's id and member fields
    /// except steps (0 before the first quorum).
    stable_since: u64,
    /// Members of the last quorum already declared lost (each is reported once).
    lost_reported: HashSet<String>,
    /// Losses not yet collected by [`QuorumEngine::take_lost`].
    pending_lost: Vec<LostMember>,
    /// When this engine started (after a restart, the first quorum is held until it has
    /// heard every replica still heartbeating).
    started: Instant,
    /// How this engine knows the job ran before it started; None for a fresh job, whose
    /// first quorum is not held.
    earlier_life: Option<EarlierLife>,
    /// The best committed step known (quorums, requests, heartbeats), excluding holders given
    /// up on; None before any report.
    high_water: Option<i64>,
    /// Holders given up on: replica id → the step they held then (not waited for again at
    /// that step).
    waived: HashMap<String, i64>,
    /// Regressions not yet collected by [`QuorumEngine::take_regressions`].
    pending_regressions: Vec<Regression>,
    /// The last quorum of the previous life of the lighthouse (id, members), until this life
    /// issues its first.
    restored_quorum: Option<(i64, HashSet<String>)>,
    /// Bumped whenever [`QuorumEngine::durable`] may have changed.
    durable_revision: u64,
    /// The training loops' visits and the groups found hung (see [`super::health::hang`]).
    hang: HangWatch,
    /// The groups' state digests, compared step by step (see [`super::health::parity`]).
    parity: Parity,
    /// Groups dropped from the quorum as lasting stragglers, until when, and why: not
    /// counted as healthy, and their requests wait in `parked` until then.
    dropped: HashMap<String, (Instant, String)>,
    /// Requests of dropped groups, joining the round when their drop ends.
    parked: HashMap<String, Participant>,
}

/// Rejects members the engine cannot reason about; nothing is changed on error.
pub fn validate_member(member: &QuorumMember) -> Result<()> {
    if member.replica_id.trim().is_empty() {
        return Err(Error::InvalidArgument(
            "replica_id must not be empty".into(),
        ));
    }
    if member.step < 0 {
        return Err(Error::InvalidArgument(format!(
            "step must not be negative (replica {:?} sent {})",
            member.replica_id, member.step
        )));
    }
    if member.world_size == 0 {
        return Err(Error::InvalidArgument(format!(
            "world_size must be at least 1 (replica {:?} sent 0)",
            member.replica_id
        )));
    }
    if member.commit_failures < 0 {
        return Err(Error::InvalidArgument(format!(
            "commit_failures must not be negative (replica {:?} sent {})",
            member.replica_id, member.commit_failures
        )));
    }
    if !member.data.is_empty()
        && serde_json::from_str::<serde::de::IgnoredAny>(&member.data).is_err()
    {
        return Err(Error::InvalidArgument(format!(
            "data of replica {:?} is not valid JSON",
            member.replica_id
        )));
    }
    Ok(())
}

impl QuorumEngine {
    /// A fresh engine, started at `now`, whose first quorum gets `initial_quorum_id` (at
    /// least 1).
    ///
    /// Passing e.g. the start time in microseconds keeps ids strictly increasing across
    /// lighthouse restarts while the engine itself stays free of clocks.
    pub fn new(opts: LighthouseOptions, initial_quorum_id: i64, now: Instant) -> Self {
        Self {
            next_id: initial_quorum_id.max(1),
            previous: None,
            previous_ids: HashSet::new(),
            participants: HashMap::new(),
            round_started: None,
            next_generation: 1,
            prev_participating: 0,
            shrink_only: 0,
            heartbeats: HashMap::new(),
            healthy: 0,
            revision: 0,
            stable_since: 0,
            lost_reported: HashSet::new(),
            pending_lost: Vec::new(),
            started: now,
            earlier_life: None,
            high_water: None,
            waived: HashMap::new(),
            pending_regressions: Vec::new(),
            restored_quorum: None,
            durable_revision: 0,
            hang: HangWatch::new(opts.hang_timeout),
            parity: Parity::default(),
            dropped: HashMap::new(),
            parked: HashMap::new(),
            opts,
        }
    }

    /// A fresh engine started at `now` that continues a previous life of the lighthouse,
    /// whose [`QuorumEngine::durable`] state was `durable`: a commit under a quorum other
    /// than its last one is refused, and the holders of its best step are waited for (up to
    /// `progress_wait` from `now`) like silent replicas that may come back.
    pub fn restored(
        opts: LighthouseOptions,
        initial_quorum_id: i64,
        now: Instant,
        durable: Durable,
    ) -> Self {
        let mut e = Self::new(opts, initial_quorum_id, now);
        if durable.quorum_id.is_some() || durable.best_step.is_some() {
            e.earlier_life = Some(EarlierLife::StateFile {
                quorum_id: durable.quorum_id,
                best_step: durable.best_step,
            });
        }
        if let Some(id) = durable.quorum_id {
            e.restored_quorum = Some((id, durable.members.into_iter().collect()));
            // Ids stay strictly increasing even if the clock went back.
            e.next_id = e.next_id.max(id.saturating_add(1));
        }
        if let Some(step) = durable.best_step.filter(|s| *s >= 0) {
            e.high_water = Some(step);
            let until = now.checked_add(e.opts.progress_wait).unwrap_or(now);
            let remembered = durable.holders.into_iter().map(|id| (id, step)).chain(
                durable
                    .others
                    .into_iter()
                    .filter(|(_, s)| *s >= 0 && *s < step),
            );
            for (id, held) in remembered {
                e.heartbeats.entry(id).or_insert_with(|| HeartbeatRecord {
                    step: Some(held),
                    restored_until: Some(until),
                    heard: false,
                    ..HeartbeatRecord::new(now)
                });
            }
        }
        e
    }

    /// The state to keep across a restart of the lighthouse (O(known replicas)).
    pub fn durable(&self) -> Durable {
        let (quorum_id, mut members) = match (&self.previous, &self.restored_quorum) {
            (Some(q), _) => (
                Some(q.quorum_id),
                self.previous_ids.iter().cloned().collect(),
            ),
            (None, Some((id, members))) => (Some(*id), members.iter().cloned().collect()),
            (None, None) => (None, Vec::new()),
        };
        members.sort();
        let mut holders: Vec<String> = match self.high_water {
            Some(hw) => self
                .heartbeats
                .iter()
                .filter(|(_, rec)| rec.step == Some(hw))
                .map(|(id, _)| id.clone())
                .collect(),
            None => Vec::new(),
        };
        holders.sort();
        let mut others: Vec<(String, i64)> = self
            .heartbeats
            .iter()
            .filter_map(|(id, rec)| {
                let step = rec.step?;
                let below = self.high_water.is_some_and(|hw| step < hw);
                let given_up = self.waived.get(id).is_some_and(|w| step <= *w);
                (below && !given_up).then(|| (id.clone(), step))
            })
            .collect();
        others.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        others.truncate(MAX_DURABLE_OTHERS);
        Durable {
            quorum_id,
            members,
            best_step: self.high_water,
            holders,
            others,
        }
    }

    /// Changes whenever [`QuorumEngine::durable`] may have changed (a cheap check before
    /// saving it).
    pub fn durable_revision(&self) -> u64 {
        self.durable_revision
    }

    /// A write-ahead commit: `replica_id`, a member of quorum `quorum_id`, is about to commit
    /// `step` (its committed step count after the commit).
    ///
    /// Refused when that quorum is no longer current for the replica: the lighthouse has
    /// issued a newer quorum (the others went on without it), or declared the replica lost
    /// in it (the others abandoned the step). Two groups then never commit the same step
    /// with different states. Accepted otherwise, and the step is recorded as the replica's
    /// committed step at once, so a round behind it waits for the replica (the
    /// no-regression rule) even if it stops before it heartbeats again. A lighthouse that
    /// has issued no quorum and remembers none accepts (it cannot know better).
    pub fn commit(
        &mut self,
        replica_id: &str,
        quorum_id: i64,
        step: i64,
        now: Instant,
    ) -> Result<CommitVerdict> {
        Self::check_id(replica_id)?;
        if step < 0 {
            return Err(Error::InvalidArgument(format!(
                "step must not be negative (replica {replica_id:?} sent {step})"
            )));
        }
        let current = match (&self.previous, &self.restored_quorum) {
            (Some(q), _) => Some((
                q.quorum_id,
                self.previous_ids.contains(replica_id),
                self.lost_reported.contains(replica_id),
            )),
            (None, Some((id, members))) => Some((*id, members.contains(replica_id), false)),
            (None, None) => None,
        };
        if let Some(why) = self.parity.stopped(replica_id) {
            return Ok(CommitVerdict::Refused(why.to_string()));
        }
        if let Some((current_id, member, lost)) = current {
            if current_id != quorum_id || !member {
                return Ok(CommitVerdict::Refused(format!(
                    "quorum {quorum_id} was replaced by quorum {current_id}{}",
                    if member { "" } else { " without this replica" }
                )));
            }
            if lost {
                return Ok(CommitVerdict::Refused(format!(
                    "this replica was declared lost in quorum {quorum_id}; its other members \
                     abandoned the step"
                )));
            }
        }
        self.note_step(replica_id, Some(step), now);
        Ok(CommitVerdict::Accepted)
    }

    /// The options the engine decides with.
    pub fn options(&self) -> &LighthouseOptions {
        &self.opts
    }

    /// The last issued quorum, if any.
    pub fn previous(&self) -> Option<&Quorum> {
        self.previous.as_ref()
    }

    /// Revision of the last issued quorum (0 before the first): counts issued quorums.
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// The revision since which every issued quorum had the same quorum_id and the same
    /// members with the same fields except `step` as the last one (0 before the first).
    ///
    /// A requester that holds any quorum of revision ≥ this (and the same id) can rebuild the
    /// last quorum from its compact form. Maintained in O(n) per issued quorum, O(1) state.
    pub fn stable_since(&self) -> u64 {
        self.stable_since
    }

    /// When the current round's first request arrived (None while nobody asks).
    pub fn round_started(&self) -> Option<Instant> {
        self.round_started
    }

    /// Replica groups counted as healthy that are not asking in the current round, sorted,
    /// at most `limit` of them (O(records)): whom a round waiting for stragglers or for a
    /// majority waits for.
    pub fn healthy_not_asking(&self, now: Instant, limit: usize) -> Vec<String> {
        let timeout = self.opts.heartbeat_timeout;
        let mut ids: Vec<String> = self
            .heartbeats
            .iter()
            .filter(|(id, rec)| {
                rec.heard
                    && now.saturating_duration_since(rec.last_seen) <= timeout
                    && !self.participants.contains_key(*id)
                    && !self.hang.is_hung(id)
                    && !self.dropped.contains_key(*id)
            })
            .map(|(id, _)| id.clone())
            .collect();
        ids.sort_unstable();
        ids.truncate(limit);
        ids
    }

    /// True if `replica_id` is asking in the current round.
    pub fn is_asking(&self, replica_id: &str) -> bool {
        self.participants.contains_key(replica_id)
    }

    /// Number of replica groups asking in the current round.
    pub fn num_participants(&self) -> usize {
        self.participants.len()
    }

    /// Number of heartbeat records kept (healthy or not yet pruned).
    pub fn num_heartbeat_records(&self) -> usize {
        self.heartbeats.len()
    }

    /// True if `replica_id` is waiting in the current round with this `generation`.
    pub fn is_waiting(&self, replica_id: &str, generation: u64) -> bool {
        self.participants
            .get(replica_id)
            .or_else(|| self.parked.get(replica_id))
            .is_some_and(|p| p.generation == generation)
    }

    fn touch(&mut self, replica_id: &str, now: Instant) -> &mut HeartbeatRecord {
        if !self.heartbeats.contains_key(replica_id) {
            self.forget_superseded(replica_id);
        }
        let healthy = &mut self.healthy;
        let rec = self
            .heartbeats
            .entry(replica_id.to_string())
            .or_insert_with(|| HeartbeatRecord::new(now));
        if now > rec.last_seen {
            rec.last_seen = now;
        }
        rec.heard = true;
        if !rec.counted {
            rec.counted = true;
            *healthy += 1;
        }
        rec
    }

    /// A replica group runs one incarnation at a time (`{name}:{uuid}`): once a new one of
    /// `replica_id`'s group is heard, the group's incarnations remembered only from a
    /// previous life of the lighthouse (not heard in this one) are gone for good. Nobody
    /// waits for them: a lighthouse restarted more often than `progress_wait` would
    /// otherwise wait for a dead incarnation forever.
    fn forget_superseded(&mut self, replica_id: &str) {
        let base = crate::telemetry::base_id(replica_id);
        if base == replica_id {
            return; // no incarnation suffix: nothing to tell incarnations apart by
        }
        let mut gone = Vec::new();
        for (id, rec) in &self.heartbeats {
            if rec.restored_until.is_some()
                && !rec.heard
                && !rec.session
                && crate::telemetry::base_id(id) == base
            {
                gone.push(id.clone());
            }
        }
        for id in gone {
            if let Some(rec) = self.heartbeats.remove(&id) {
                if rec.counted {
                    self.healthy = self.healthy.saturating_sub(1);
                }
                self.hang.forget(&id);
                self.waived.remove(&id);
                self.durable_revision += 1;
            }
        }
    }

    /// Notes that `replica_id` (alive at `now`) committed `step`, raising the best step known
    /// unless the replica was given up on at that step.
    fn note_step(&mut self, replica_id: &str, step: Option<i64>, now: Instant) {
        let rec = self.touch(replica_id, now);
        let Some(step) = step else { return };
        if rec.step.is_none_or(|s| step > s) {
            rec.step = Some(step);
            self.durable_revision += 1;
        }
        if self.waived.get(replica_id).is_some_and(|w| step <= *w) {
            return;
        }
        if self.high_water.is_none_or(|hw| step > hw) {
            self.high_water = Some(step);
            self.durable_revision += 1;
        }
    }

    fn check_id(replica_id: &str) -> Result<()> {
        if replica_id.trim().is_empty() {
            return Err(Error::InvalidArgument(
                "replica_id must not be empty".into(),
            ));
        }
        Ok(())
    }

    /// Records that `replica_id` is alive.
    pub fn heartbeat(&mut self, replica_id: &str, now: Instant) -> Result<()> {
        self.heartbeat_with_step(replica_id, None, now)
    }

    /// Records that `replica_id` is alive and, if given, the step it has committed (heartbeats
    /// carry it, so the engine knows the progress of replicas that are not asking).
    pub fn heartbeat_with_step(
        &mut self,
        replica_id: &str,
        step: Option<i64>,
        now: Instant,
    ) -> Result<()> {
        self.heartbeat_full(replica_id, step, None, now)
    }

    /// [`QuorumEngine::heartbeat_with_step`], plus how long ago the group's training loop
    /// last reached its manager (`loop_idle`, from managers that say; see [`super::health::hang`]).
    pub fn heartbeat_full(
        &mut self,
        replica_id: &str,
        step: Option<i64>,
        loop_idle: Option<Duration>,
        now: Instant,
    ) -> Result<()> {
        Self::check_id(replica_id)?;
        if let Some(step) = step.filter(|s| *s < 0) {
            return Err(Error::InvalidArgument(format!(
                "step must not be negative (replica {replica_id:?} sent {step})"
            )));
        }
        self.note_step(replica_id, step, now);
        if let Some(idle) = loop_idle {
            self.hang.visited(replica_id, idle, now);
        }
        Ok(())
    }

    /// Whether `replica_id` is hung now (see [`super::health::hang`]).
    pub fn is_hung(&self, replica_id: &str) -> Option<&Hung> {
        self.hang.get(replica_id)
    }

    /// The groups hung now, by id (at most `limit`).
    pub fn hung_ids(&self, limit: usize) -> Vec<String> {
        self.hang
            .hung()
            .take(limit)
            .map(|h| h.replica_id.clone())
            .collect()
    }

    /// The hang timeout now and how it was chosen.
    pub fn hang_timeout(&self) -> (Duration, String) {
        (self.hang.timeout(), self.hang.timeout_rule())
    }

    /// Groups found hung since the last call.
    pub fn take_newly_hung(&mut self) -> Vec<Hung> {
        self.hang.take_newly_hung()
    }

    /// Hung groups whose training loop came back since the last call.
    pub fn take_resumed(&mut self) -> Vec<String> {
        self.hang.take_resumed()
    }

    /// Records that the session of `replica_id` opened (counts as a heartbeat). Until it ends
    /// (see [`QuorumEngine::lost`]) the replica may come back even when silent.
    pub fn session_opened(&mut self, replica_id: &str, now: Instant) -> Result<()> {
        Self::check_id(replica_id)?;
        let rec = self.touch(replica_id, now);
        rec.session = true;
        // Its session now says whether it lives.
        rec.restored_until = None;
        Ok(())
    }

    /// Takes the regressions announced since the previous call.
    pub fn take_regressions(&mut self) -> Vec<Regression> {
        std::mem::take(&mut self.pending_regressions)
    }

    /// The best committed step the engine knows of (None before any report).
    pub fn best_known_step(&self) -> Option<i64> {
        self.high_water
    }

    /// Adds `member` to the current round (replacing an earlier request of the same replica).
    ///
    /// Does not decide: call [`QuorumEngine::poll`] afterwards.
    pub fn join(&mut self, member: QuorumMember, now: Instant) -> Result<Joined> {
        validate_member(&member)?;
        if let Some(why) = self.parity.stopped(&member.replica_id) {
            return Err(Error::Diverged(why.to_string()));
        }
        self.note_step(&member.replica_id, Some(member.step), now);
        self.hang.asked(&member.replica_id, now);
        let generation = self.next_generation;
        self.next_generation += 1;
        if self.dropped.contains_key(&member.replica_id) {
            // Dropped as a straggler: the request waits until the drop ends.
            let replaced = self
                .parked
                .insert(
                    member.replica_id.clone(),
                    Participant { member, generation },
                )
                .map(|p| p.generation);
            return Ok(Joined {
                generation,
                replaced,
            });
        }
        Ok(self.enter_round(Participant { member, generation }, now))
    }

    /// Puts a request into the current round (replacing an earlier one of its replica).
    fn enter_round(&mut self, participant: Participant, now: Instant) -> Joined {
        let generation = participant.generation;
        let member = participant.member;
        let shrink = member.shrink_only;
        let in_previous = self.previous_ids.contains(&member.replica_id);
        let replaced = match self.participants.insert(
            member.replica_id.clone(),
            Participant { member, generation },
        ) {
            Some(old) => {
                if old.member.shrink_only {
                    self.shrink_only -= 1;
                }
                Some(old.generation)
            }
            None => {
                if in_previous {
                    self.prev_participating += 1;
                }
                None
            }
        };
        if shrink {
            self.shrink_only += 1;
        }
        if self.round_started.is_none() {
            self.round_started = Some(now);
        }
        Joined {
            generation,
            replaced,
        }
    }

    /// Drops `replica_id` from the quorum for `window` (a lasting straggler, see
    /// `--straggler_drop_after_ms`): it stops counting as healthy, so the others' rounds go
    /// on without it, and its requests wait until the drop ends; then it rejoins (and heals).
    /// Returns false (nothing changed) for a replica not known healthy or already dropped.
    pub fn drop_straggler(
        &mut self,
        replica_id: &str,
        window: Duration,
        why: String,
        now: Instant,
    ) -> bool {
        if self.dropped.contains_key(replica_id)
            || !self.heartbeats.get(replica_id).is_some_and(|r| r.counted)
        {
            return false;
        }
        let until = now.checked_add(window).unwrap_or(now);
        self.dropped.insert(replica_id.to_string(), (until, why));
        if let Some(p) = self.participants.get(replica_id).cloned() {
            // Its waiting request leaves the round (counters kept by `leave`) and waits.
            self.leave(replica_id, p.generation);
            self.parked.insert(replica_id.to_string(), p);
        }
        true
    }

    /// Ends the drops whose time is up: their waiting requests join the round.
    fn end_drops(&mut self, now: Instant) {
        let over: Vec<String> = self
            .dropped
            .iter()
            .filter(|(_, (until, _))| now >= *until)
            .map(|(id, _)| id.clone())
            .collect();
        for id in over {
            self.dropped.remove(&id);
            if let Some(p) = self.parked.remove(&id) {
                self.enter_round(p, now);
            }
        }
    }

    /// Why `replica_id` is dropped from the quorum and for how much longer, if it is.
    pub fn dropped(&self, replica_id: &str, now: Instant) -> Option<(String, Duration)> {
        self.dropped
            .get(replica_id)
            .map(|(until, why)| (why.clone(), until.saturating_duration_since(now)))
    }

    /// Removes the request `generation` of `replica_id` from the round (cancelled or timed
    /// out). Returns false if that request is no longer waiting (answered or replaced).
    pub fn leave(&mut self, replica_id: &str, generation: u64) -> bool {
        if !self.is_waiting(replica_id, generation) {
            return false;
        }
        if self
            .parked
            .get(replica_id)
            .is_some_and(|p| p.generation == generation)
        {
            self.parked.remove(replica_id);
            return true;
        }
        if let Some(p) = self.participants.remove(replica_id) {
            if p.member.shrink_only {
                self.shrink_only -= 1;
            }
            if self.previous_ids.contains(replica_id) {
                self.prev_participating -= 1;
            }
        }
        if self.participants.is_empty() {
            self.round_started = None;
        }
        true
    }

    /// Records that `replica_id` is gone (its process died: its session ended).
    ///
    /// It stops counting as healthy at once (its heartbeat record is dropped) and a request it
    /// still had in the round is withdrawn. If it is a member of the last quorum, the loss is
    /// queued for [`QuorumEngine::take_lost`] (once). Returns true if it was such a member.
    /// A heartbeat or request arriving later makes it healthy again. Call
    /// [`QuorumEngine::poll`] afterwards: the round may now be ready.
    pub fn lost(&mut self, replica_id: &str, now: Instant) -> bool {
        if let Some(rec) = self.heartbeats.remove(replica_id) {
            if rec.counted {
                self.healthy = self.healthy.saturating_sub(1);
            }
            self.durable_revision += 1;
        }
        self.waived.remove(replica_id);
        // A dead group is not hung: the hung count must only hold counted records.
        self.hang.forget(replica_id);
        self.parity.lost(replica_id);
        self.dropped.remove(replica_id);
        self.parked.remove(replica_id);
        if let Some(p) = self.participants.get(replica_id) {
            let generation = p.generation;
            self.leave(replica_id, generation);
        }
        if self.participants.is_empty() {
            self.round_started = None;
        } else if self.round_started.is_none() {
            self.round_started = Some(now);
        }
        self.report_lost(replica_id)
    }

    /// Queues the loss of `replica_id` if it is a member of the last quorum not yet reported.
    fn report_lost(&mut self, replica_id: &str) -> bool {
        let Some(prev) = &self.previous else {
            return false;
        };
        if !self.previous_ids.contains(replica_id) || self.lost_reported.contains(replica_id) {
            return false;
        }
        self.lost_reported.insert(replica_id.to_string());
        self.pending_lost.push(LostMember {
            replica_id: replica_id.to_string(),
            quorum_id: prev.quorum_id,
        });
        true
    }

    /// Takes the losses of last-quorum members declared since the previous call.
    pub fn take_lost(&mut self) -> Vec<LostMember> {
        std::mem::take(&mut self.pending_lost)
    }

    fn shrinking(&self) -> bool {
        self.shrink_only > 0 && self.previous.is_some()
    }

    /// Why the next quorum is or is not ready, from the counters (O(1)).
    pub fn verdict(&self, now: Instant) -> Verdict {
        let asking = self.participants.len();
        if asking == 0 {
            return Verdict::NoParticipants;
        }
        let candidates = if self.shrinking() {
            self.prev_participating
        } else {
            asking
        };
        // Hung groups (alive, training loop away; see `super::health::hang`) and groups dropped as
        // lasting stragglers are not waited for.
        let dropped = self
            .dropped
            .keys()
            .filter(|id| {
                !self.hang.is_hung(id) && self.heartbeats.get(*id).is_some_and(|r| r.counted)
            })
            .count();
        let healthy = self
            .healthy
            .saturating_sub(self.hang.count() + dropped)
            .max(asking);
        if (candidates as u64) < self.opts.min_replicas {
            return Verdict::BelowMinReplicas {
                candidates,
                min_replicas: self.opts.min_replicas,
            };
        }
        if candidates * 2 <= healthy {
            return Verdict::NoMajority {
                candidates,
                healthy,
            };
        }
        let ready = if !self.previous_ids.is_empty()
            && self.prev_participating == self.previous_ids.len()
        {
            Verdict::FastPath
        } else if asking >= healthy {
            Verdict::AllHealthyJoined
        } else {
            let started = self.round_started.unwrap_or(now);
            let missing = healthy - asking;
            match started.checked_add(self.opts.join_timeout) {
                Some(deadline) if now >= deadline => Verdict::JoinTimeout,
                Some(deadline) => {
                    return Verdict::WaitingForStragglers {
                        missing,
                        remaining: deadline - now,
                    }
                }
                None => {
                    return Verdict::WaitingForStragglers {
                        missing,
                        remaining: Duration::MAX,
                    }
                }
            }
        };
        self.hold_for_progress(now).unwrap_or(ready)
    }

    /// How long a restarted engine holds its first quorum: every replica still heartbeating
    /// is heard within a heartbeat timeout; no hold when progress is not waited for at all.
    fn startup_hold(&self) -> Duration {
        self.opts.heartbeat_timeout.min(self.opts.progress_wait)
    }

    /// Notes that `replica_id` holds quorum `quorum_id` (from a request's known quorum or a
    /// heartbeat). Before this life issued its first quorum, any quorum a replica holds is
    /// from an earlier life: the lighthouse restarted, and its first quorum is held like a
    /// restored one's. Ids this life gives out stay above every id a replica reports (a
    /// clock that went back must not reuse one). Returns true when this turned the hold on.
    pub fn holds_quorum(&mut self, replica_id: &str, quorum_id: i64) -> bool {
        if quorum_id <= 0 {
            return false;
        }
        if quorum_id >= self.next_id {
            self.next_id = quorum_id.saturating_add(1);
        }
        if self.previous.is_some() || self.earlier_life.is_some() {
            return false;
        }
        self.earlier_life = Some(EarlierLife::Reported {
            replica_id: replica_id.to_string(),
            quorum_id,
        });
        true
    }

    /// How this engine knows the job ran before it started (None: a fresh job).
    pub fn earlier_life(&self) -> Option<&EarlierLife> {
        self.earlier_life.as_ref()
    }

    /// When the startup hold ends, while it may still delay this life's first quorum (a
    /// restarted engine before its first quorum and before the hold ran out).
    pub fn startup_hold_until(&self, now: Instant) -> Option<Instant> {
        if self.previous.is_some() || self.earlier_life.is_none() {
            return None;
        }
        let hold = self.startup_hold();
        let end = self.started.checked_add(hold)?;
        (!hold.is_zero() && now < end).then_some(end)
    }

    /// The no-regression rules for a round that is otherwise ready: the startup hold of a
    /// restarted engine, then the wait for a live replica ahead of every candidate. None:
    /// issue now.
    fn hold_for_progress(&self, now: Instant) -> Option<Verdict> {
        if let (Some(end), Some(why)) = (self.startup_hold_until(now), &self.earlier_life) {
            if !self.remembered_quorum_asks() {
                return Some(Verdict::StartupHold {
                    remaining: end - now,
                    why: why.clone(),
                });
            }
        }
        if self.opts.progress_wait.is_zero() {
            return None;
        }
        let candidates_step = self.candidates_step();
        let (holder, step) = self
            .holders_ahead(candidates_step, now)
            .max_by_key(|(_, s)| *s)?;
        let deadline = self
            .round_started
            .unwrap_or(now)
            .checked_add(self.opts.progress_wait)?;
        (now < deadline).then(|| Verdict::WaitingForProgress {
            holder: holder.to_string(),
            step,
            candidates_step,
            remaining: deadline - now,
        })
    }

    /// A restored engine's startup hold can end early: every member of the quorum it
    /// remembers asks, at or above the best step it remembers. Only a member of the last
    /// quorum can have committed since it was issued, and a commit acknowledged under the
    /// write-ahead rule raised the remembered best step first, so no replica that is not
    /// heard yet holds more than the round's candidates. (O(members of that quorum), only
    /// while no quorum was issued in this life.)
    fn remembered_quorum_asks(&self) -> bool {
        let Some((_, members)) = &self.restored_quorum else {
            return false;
        };
        !members.is_empty()
            && members.iter().all(|id| self.participants.contains_key(id))
            && self
                .high_water
                .is_none_or(|best| self.candidates_step() >= best)
    }

    fn is_candidate(&self, replica_id: &str) -> bool {
        if self.shrinking() {
            self.participants.contains_key(replica_id) && self.previous_ids.contains(replica_id)
        } else {
            self.participants.contains_key(replica_id)
        }
    }

    /// The best step among the round's candidates (O(participants)).
    fn candidates_step(&self) -> i64 {
        self.participants
            .iter()
            .filter(|(id, _)| self.is_candidate(id))
            .map(|(_, p)| p.member.step)
            .max()
            .unwrap_or(0)
    }

    /// Replicas that are not asking, may still come back, and hold a step above `step` they
    /// were not given up on at (O(records); O(1) when every known replica is asking).
    fn holders_ahead(&self, step: i64, now: Instant) -> impl Iterator<Item = (&str, i64)> + '_ {
        let everyone_asks = self.heartbeats.len() <= self.participants.len();
        let timeout = self.opts.heartbeat_timeout;
        self.heartbeats
            .iter()
            .filter(move |_| !everyone_asks)
            .filter(move |(id, rec)| {
                rec.may_come_back(now, timeout) && !self.participants.contains_key(*id)
            })
            .filter_map(move |(id, rec)| {
                let held = rec.step.filter(|s| *s > step)?;
                let waived = self.waived.get(id).is_some_and(|w| held <= *w);
                (!waived).then_some((id.as_str(), held))
            })
    }

    /// Issues a quorum if the round is ready (call after every join).
    ///
    /// The returned quorum has no `created` timestamp: wall-clock time is the caller's.
    pub fn poll(&mut self, now: Instant) -> Option<Quorum> {
        if self.verdict(now).is_ready() {
            Some(self.issue(now))
        } else {
            None
        }
    }

    /// Expires heartbeats, forgets long-gone replicas, declares members of the last quorum
    /// whose heartbeat expired lost (see [`QuorumEngine::take_lost`]), then decides like
    /// [`QuorumEngine::poll`].
    pub fn tick(&mut self, now: Instant) -> Option<Quorum> {
        self.prune(now);
        self.expire_members();
        self.poll(now)
    }

    /// Declares lost the members of the last quorum that are not healthy as of the last prune
    /// (O(members of the last quorum)).
    fn expire_members(&mut self) {
        let expired: Vec<String> = self
            .previous_ids
            .iter()
            .filter(|id| !self.lost_reported.contains(*id))
            .filter(|id| !self.heartbeats.get(*id).is_some_and(|rec| rec.counted))
            .cloned()
            .collect();
        for id in expired {
            self.report_lost(&id);
        }
    }

    /// Recounts the healthy replicas and drops records older than
    /// [`PRUNE_AFTER_TIMEOUTS`] heartbeat timeouts (O(number of records)).
    pub fn prune(&mut self, now: Instant) {
        let timeout = self.opts.heartbeat_timeout;
        let forget_after = timeout.saturating_mul(PRUNE_AFTER_TIMEOUTS);
        let round_open = self.round_started.is_some();
        // A group ahead of the round's candidates holds progress they would lose: the
        // progress rule waits for it (up to progress_wait, then gives up on it), and it is not
        // held hung meanwhile (its process must not end itself with the only newer state).
        let candidates_step =
            (round_open && !self.participants.is_empty()).then(|| self.candidates_step());
        self.end_drops(now);
        let waived = &self.waived;
        let participants = &self.participants;
        let parked = &self.parked;
        let hang = &mut self.hang;
        let mut healthy = 0;
        self.heartbeats.retain(|id, rec| {
            let waiting = participants.contains_key(id) || parked.contains_key(id);
            let age = now.saturating_duration_since(rec.last_seen);
            rec.counted = waiting || (age <= timeout && rec.heard);
            if rec.counted {
                healthy += 1;
            }
            let ahead = match (candidates_step, rec.step) {
                (Some(c), Some(held)) => held > c && waived.get(id).is_none_or(|w| held > *w),
                _ => false,
            };
            if rec.counted && !waiting && !ahead {
                hang.judge(id, round_open, now);
            } else {
                hang.clear(id);
            }
            // An open session keeps the record (bounded by the open connections), and so
            // does a holder restored from a previous life until it is waited out.
            let keep = waiting
                || rec.session
                || age <= forget_after
                || rec.restored_until.is_some_and(|until| now < until);
            if !keep {
                hang.forget(id);
            }
            keep
        });
        self.healthy = healthy;
        let known = &self.heartbeats;
        self.waived.retain(|id, _| known.contains_key(id));
        self.parity.evaluate(self.previous_ids.len(), now);
    }

    fn issue(&mut self, now: Instant) -> Quorum {
        self.hang.round_issued(now);
        // Decided while the members are still in the round: who is ahead of this quorum.
        let to_step = self.candidates_step();
        let mut ahead: Vec<(String, i64)> = self
            .holders_ahead(to_step, now)
            .map(|(id, s)| (id.to_string(), s))
            .collect();
        // Holders remembered from a previous life and waited out: not known to be dead.
        ahead.extend(self.heartbeats.iter().filter_map(|(id, rec)| {
            let waited_out = rec.restored_until.is_some_and(|until| now >= until)
                && !rec.may_come_back(now, self.opts.heartbeat_timeout);
            let held = rec.step.filter(|s| *s > to_step)?;
            let waived = self.waived.get(id).is_some_and(|w| held <= *w);
            (waited_out && !waived).then(|| (id.clone(), held))
        }));
        ahead.sort();
        let shrinking = self.shrinking();
        let mut members: Vec<QuorumMember> = if shrinking {
            let ids: Vec<String> = self
                .participants
                .keys()
                .filter(|id| self.previous_ids.contains(*id))
                .cloned()
                .collect();
            ids.iter()
                .filter_map(|id| self.participants.remove(id))
                .map(|p| p.member)
                .collect()
        } else {
            self.participants.drain().map(|(_, p)| p.member).collect()
        };
        members.sort_unstable_by(|a, b| a.replica_id.cmp(&b.replica_id));
        self.present_diverged(&mut members);

        let same_members = self.previous.is_some()
            && members.len() == self.previous_ids.len()
            && members
                .iter()
                .all(|m| self.previous_ids.contains(&m.replica_id));
        let failures = members.iter().any(|m| m.commit_failures > 0);
        let quorum_id = match &self.previous {
            Some(prev) if same_members && !failures => prev.quorum_id,
            _ => {
                let id = self.next_id;
                self.next_id += 1;
                id
            }
        };

        if !same_members {
            self.previous_ids = members.iter().map(|m| m.replica_id.clone()).collect();
        }
        // Every member of a new quorum is alive as it is issued.
        self.lost_reported.clear();
        if self.restored_quorum.take().is_some()
            || self.previous.as_ref().map(|q| q.quorum_id) != Some(quorum_id)
        {
            self.durable_revision += 1;
        }
        self.account_progress(quorum_id, to_step, ahead);
        self.revision += 1;
        let quorum = Quorum {
            quorum_id,
            participants: members,
            created: None,
            revision: self.revision,
            compact: None,
        };
        let steps_only = self
            .previous
            .as_ref()
            .is_some_and(|prev| compact::only_steps_changed(prev, &quorum));
        if !steps_only {
            self.stable_since = self.revision;
        }
        self.previous = Some(quorum.clone());

        // Whoever was not selected (newcomers under shrink_only) waits for the next round.
        self.prev_participating = self
            .participants
            .keys()
            .filter(|id| self.previous_ids.contains(*id))
            .count();
        self.shrink_only = self
            .participants
            .values()
            .filter(|p| p.member.shrink_only)
            .count();
        self.round_started = if self.participants.is_empty() {
            None
        } else {
            Some(now)
        };
        quorum
    }

    /// Presents each member marked to heal by the parity check one step behind the best
    /// agreeing member, so every manager (ours or upstream's) makes it heal from an agreeing
    /// group. The mark goes once the group commits a step past the heal it was given.
    fn present_diverged(&mut self, members: &mut [QuorumMember]) {
        let marks = self.parity.heal_marks();
        if marks.is_empty() {
            return;
        }
        let mut cleared = Vec::new();
        for m in members.iter() {
            if let Some(mark) = marks.get(&m.replica_id) {
                if mark.healing_to.is_some_and(|to| m.step > to) {
                    cleared.push(m.replica_id.clone());
                }
            }
        }
        for id in &cleared {
            marks.remove(id);
        }
        let best_agreeing = members
            .iter()
            .filter(|m| !marks.contains_key(&m.replica_id))
            .map(|m| m.step)
            .max();
        let Some(best) = best_agreeing.filter(|b| *b >= 1) else {
            return;
        };
        for m in members.iter_mut() {
            if let Some(mark) = marks.get_mut(&m.replica_id) {
                m.step = m.step.min(best - 1);
                mark.healing_to = Some(best);
            }
        }
    }

    /// Takes group `replica_id`'s digests of its committed state after `step` (see
    /// [`super::health::parity`]) and decides the steps that are ready; returns the step to
    /// acknowledge.
    pub fn offer_digest(
        &mut self,
        replica_id: &str,
        step: i64,
        ranks: Vec<Vec<u8>>,
        now: Instant,
    ) -> Result<i64> {
        Self::check_id(replica_id)?;
        let ack = self.parity.offer(replica_id, step, ranks, now)?;
        self.parity.evaluate(self.previous_ids.len(), now);
        Ok(ack)
    }

    /// The groups found diverged since the last call.
    pub fn take_diverged(&mut self) -> Vec<Diverged> {
        self.parity.take_verdicts()
    }

    /// Why `replica_id` is stopped by the parity check, if it is.
    pub fn parity_stopped(&self, replica_id: &str) -> Option<&str> {
        self.parity.stopped(replica_id)
    }

    /// The parity check's counters and marks.
    pub fn parity(&self) -> &Parity {
        &self.parity
    }

    /// Records the progress of a quorum issued at `to_step`: holders still `ahead` of it are
    /// given up on at their step, and a quorum behind the best step known is reported once.
    fn account_progress(&mut self, quorum_id: i64, to_step: i64, ahead: Vec<(String, i64)>) {
        let alive_holders: Vec<String> = ahead.iter().map(|(id, _)| id.clone()).collect();
        for (id, step) in ahead {
            self.waived.insert(id, step);
        }
        match self.high_water {
            Some(from_step) if from_step > to_step => {
                self.pending_regressions.push(Regression {
                    from_step,
                    to_step,
                    quorum_id,
                    alive_holders,
                });
                self.high_water = Some(to_step);
                self.durable_revision += 1;
            }
            Some(hw) if hw >= to_step => {}
            _ => {
                self.high_water = Some(to_step);
                self.durable_revision += 1;
            }
        }
    }

    /// Every known replica id with the time since it was last seen (O(n)).
    pub fn heartbeat_ages(&self, now: Instant) -> Vec<(String, Duration)> {
        self.heartbeats
            .iter()
            .map(|(id, rec)| (id.clone(), now.saturating_duration_since(rec.last_seen)))
            .collect()
    }

    /// A read-only view for status pages (O(n)).
    pub fn snapshot(&self, now: Instant) -> Snapshot {
        let timeout = self.opts.heartbeat_timeout;
        let mut heartbeats: Vec<(String, Duration, bool)> = self
            .heartbeats
            .iter()
            .map(|(id, rec)| {
                let age = now.saturating_duration_since(rec.last_seen);
                let healthy = age <= timeout || self.participants.contains_key(id);
                (id.clone(), age, healthy)
            })
            .collect();
        heartbeats.sort_by(|a, b| a.0.cmp(&b.0));
        let mut participants: Vec<String> = self.participants.keys().cloned().collect();
        participants.sort();
        Snapshot {
            quorum_id: self.previous.as_ref().map(|q| q.quorum_id),
            min_replicas: self.opts.min_replicas,
            members: self
                .previous
                .as_ref()
                .map(|q| q.participants.clone())
                .unwrap_or_default(),
            heartbeats,
            participants,
            verdict: self.verdict(now),
            startup_hold: self
                .startup_hold_until(now)
                .zip(self.earlier_life.clone())
                .map(|(end, why)| (why, end - now)),
            healthy_not_asking: if self.participants.is_empty() {
                Vec::new()
            } else {
                self.healthy_not_asking(now, 64)
            },
            round_age: self.round_started.map(|t| now.saturating_duration_since(t)),
            hung: self.hang.hung().cloned().collect(),
            hang_timeout: (self.hang.timeout(), self.hang.timeout_rule()),
            parity: ParitySnapshot {
                checks: self.parity.checks,
                diverged_total: self.parity.diverged_total,
                last_checked_step: self.parity.last_checked,
                healing: self.parity.healing(),
                stopped: self.parity.stopped_ids(),
            },
            dropped: {
                let mut d: Vec<(String, String, Duration)> = self
                    .dropped
                    .iter()
                    .map(|(id, (until, why))| {
                        (
                            id.clone(),
                            why.clone(),
                            until.saturating_duration_since(now),
                        )
                    })
                    .collect();
                d.sort();
                d
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lighthouse::health::hang;

    fn opts(min_replicas: u64) -> LighthouseOptions {
        LighthouseOptions {
            min_replicas,
            join_timeout: Duration::from_secs(60),
            quorum_tick: Duration::from_millis(100),
            heartbeat_timeout: Duration::from_secs(5),
            // These scenarios are about the other rules; the no-regression rules have their
            // own tests below.
            progress_wait: Duration::ZERO,
            state_file: None,
            hang_timeout: None,
        }
    }

    fn member(id: &str) -> QuorumMember {
        QuorumMember {
            replica_id: id.to_string(),
            address: format!("http://{id}:1"),
            store_address: format!("{id}:2"),
            step: 1,
            world_size: 1,
            ..Default::default()
        }
    }

    fn ids(q: &Quorum) -> Vec<&str> {
        q.participants
            .iter()
            .map(|m| m.replica_id.as_str())
            .collect()
    }

    /// One scripted event of a table-driven scenario.
    #[derive(Clone)]
    enum Ev {
        Join(&'static str),
        JoinWith(QuorumMember),
        Heartbeat(&'static str),
        Advance(u64),
        Tick,
        /// Expect the last join/tick to have issued a quorum with exactly these members.
        Issued(&'static [&'static str]),
        /// Expect that nothing was issued.
        Nothing,
        /// Expect the last issued quorum id to equal the previous issued id.
        SameId,
        /// Expect the last issued quorum id to be greater than the previous issued id.
        NewId,
    }

    fn run(min: u64, script: &[Ev]) {
        let t0 = Instant::now();
        let mut now = t0;
        let mut engine = QuorumEngine::new(opts(min), 100, Instant::now());
        let mut last: Option<Quorum> = None;
        let mut issued_ids: Vec<i64> = vec![];
        for (i, ev) in script.iter().enumerate() {
            match ev {
                Ev::Join(id) => {
                    engine.join(member(id), now).unwrap();
                    last = engine.poll(now);
                }
                Ev::JoinWith(m) => {
                    engine.join(m.clone(), now).unwrap();
                    last = engine.poll(now);
                }
                Ev::Heartbeat(id) => engine.heartbeat(id, now).unwrap(),
                Ev::Advance(ms) => now += Duration::from_millis(*ms),
                Ev::Tick => last = engine.tick(now),
                Ev::Issued(want) => {
                    let q = last
                        .take()
                        .unwrap_or_else(|| panic!("step {i}: nothing issued"));
                    assert_eq!(ids(&q), want.to_vec(), "step {i}");
                    issued_ids.push(q.quorum_id);
                }
                Ev::Nothing => assert!(last.is_none(), "step {i}: unexpected {last:?}"),
                Ev::SameId => {
                    let n = issued_ids.len();
                    assert_eq!(issued_ids[n - 1], issued_ids[n - 2], "step {i}");
                }
                Ev::NewId => {
                    let n = issued_ids.len();
                    assert!(issued_ids[n - 1] > issued_ids[n - 2], "step {i}");
                }
            }
        }
    }

    fn shrink(id: &str) -> QuorumMember {
        QuorumMember {
            shrink_only: true,
            ..member(id)
        }
    }

    fn failing(id: &str) -> QuorumMember {
        QuorumMember {
            commit_failures: 2,
            ..member(id)
        }
    }

    use Ev::*;

    /// An engine with a fixed hang timeout (and `progress_wait`, if given) whose rounds are
    /// never ended by the join timeout: only the hang rules let a round go on without a group.
    fn hang_engine(
        t0: Instant,
        hang_timeout: Duration,
        progress_wait: Option<Duration>,
    ) -> QuorumEngine {
        let base = opts(1);
        QuorumEngine::new(
            LighthouseOptions {
                hang_timeout: Some(hang_timeout),
                progress_wait: progress_wait.unwrap_or(base.progress_wait),
                join_timeout: Duration::from_secs(600),
                ..base
            },
            1,
            t0,
        )
    }

    #[test]
    fn a_hung_group_is_not_waited_for_and_rejoins_when_its_loop_is_back() {
        let t0 = Instant::now();
        let sec = Duration::from_secs(1);
        let mut e = hang_engine(t0, 5 * sec, None);
        // Both train together; their loops report fresh visits.
        e.join(member("a"), t0).unwrap();
        e.join(member("b"), t0).unwrap();
        let q1 = e.tick(t0).expect("both asked");
        assert_eq!(ids(&q1), vec!["a", "b"]);
        // a asks for the next step; b's process heartbeats but its loop stays away.
        e.join(member("a"), t0 + sec).unwrap();
        let mut t = t0 + sec;
        while t < t0 + 5 * sec {
            e.heartbeat_full("a", None, Some(Duration::ZERO), t)
                .unwrap();
            e.heartbeat_full("b", None, Some(t - t0), t).unwrap();
            assert!(e.tick(t).is_none(), "a strict majority of two needs b");
            t += Duration::from_millis(500);
        }
        assert!(e.take_newly_hung().is_empty());
        // Past the hang timeout b is hung: a goes on alone, at once.
        t = t0 + 5 * sec + Duration::from_millis(100);
        e.heartbeat_full("b", None, Some(t - t0), t).unwrap();
        let q2 = e.tick(t).expect("b is hung: a goes on without it");
        assert_eq!(ids(&q2), vec!["a"]);
        let hung = e.take_newly_hung();
        assert_eq!(hung.len(), 1);
        assert_eq!(hung[0].replica_id, "b");
        assert!(e.is_hung("b").is_some());
        // Whom a round would wait for: a (just answered), never the hung b.
        assert_eq!(e.healthy_not_asking(t, 8), vec!["a"]);
        let snap = e.snapshot(t);
        assert_eq!(snap.hung.len(), 1);
        assert_eq!(snap.hang_timeout.1, "configured");
        // Later rounds do not wait for it either.
        e.join(member("a"), t + sec).unwrap();
        assert!(e.tick(t + sec).is_some());
        // b's loop comes back: it asks, is no longer hung, and the next round has both.
        let back = t + 2 * sec;
        e.join(member("a"), back).unwrap();
        e.join(member("b"), back).unwrap();
        assert!(e.is_hung("b").is_none());
        assert_eq!(e.take_resumed(), vec!["b".to_string()]);
        let q3 = e.tick(back).expect("both ask");
        assert_eq!(ids(&q3), vec!["a", "b"]);
    }

    #[test]
    fn a_hung_group_that_dies_is_not_counted_hung_any_more() {
        let t0 = Instant::now();
        let sec = Duration::from_secs(1);
        let mut e = hang_engine(t0, 2 * sec, None);
        e.join(member("a"), t0).unwrap();
        e.join(member("b"), t0).unwrap();
        assert!(e.tick(t0).is_some());
        e.join(member("a"), t0 + sec).unwrap();
        let t = t0 + 3 * sec;
        e.heartbeat_full("b", None, Some(3 * sec), t).unwrap();
        assert!(e.tick(t).is_some(), "b is hung: a goes on");
        assert!(e.is_hung("b").is_some());
        // b's process dies (its session ends); its restart c and a train on: a round with
        // one of the two healthy groups asking waits (no strict majority), as before.
        e.lost("b", t);
        assert!(e.is_hung("b").is_none());
        e.heartbeat_full("c", None, Some(Duration::ZERO), t)
            .unwrap();
        e.join(member("a"), t + sec).unwrap();
        assert!(
            e.tick(t + sec).is_none(),
            "a alone of a and c is no majority"
        );
        e.join(member("c"), t + sec).unwrap();
        let q = e.tick(t + sec).expect("both ask");
        assert_eq!(ids(&q), vec!["a", "c"]);
    }

    #[test]
    fn a_hung_group_ahead_of_the_round_is_waited_for_not_held_hung() {
        let t0 = Instant::now();
        let sec = Duration::from_secs(1);
        let mut e = hang_engine(t0, 2 * sec, Some(20 * sec));
        // b holds step 9 and hangs; a restarted at step 0 asks.
        e.heartbeat_full("b", Some(9), Some(Duration::ZERO), t0)
            .unwrap();
        e.join(
            QuorumMember {
                step: 0,
                ..member("a")
            },
            t0,
        )
        .unwrap();
        let mut t = t0;
        while t < t0 + 10 * sec {
            e.heartbeat_full("b", Some(9), Some(t - t0), t).unwrap();
            assert!(e.tick(t).is_none(), "a waits for b's newer state");
            t += Duration::from_millis(500);
        }
        // Away far past the hang timeout, but never held hung: it holds the only step 9.
        assert!(e.take_newly_hung().is_empty());
        assert!(e.is_hung("b").is_none());
        // Its loop comes back: it asks, a heals from it.
        e.join(
            QuorumMember {
                step: 9,
                ..member("b")
            },
            t,
        )
        .unwrap();
        let q = e.tick(t).expect("both ask");
        assert_eq!(ids(&q), vec!["a", "b"]);
    }

    #[test]
    fn a_group_that_never_reached_its_loop_or_a_busy_one_is_never_hung() {
        let t0 = Instant::now();
        let sec = Duration::from_secs(1);
        let mut e = hang_engine(t0, 2 * sec, None);
        e.join(member("a"), t0).unwrap();
        // b heartbeats without a loop report (joining, or an upstream manager that never
        // asked), c reports its loop inside torchft (a heal in progress).
        let mut t = t0;
        while t < t0 + 10 * sec {
            e.heartbeat_full("b", None, None, t).unwrap();
            e.heartbeat_full("c", None, Some(Duration::ZERO), t)
                .unwrap();
            assert!(e.tick(t).is_none());
            t += Duration::from_millis(500);
        }
        assert!(e.take_newly_hung().is_empty());
        assert_eq!(e.healthy_not_asking(t, 8), vec!["b", "c"]);
    }

    #[test]
    fn first_round_waits_for_all_healthy() {
        run(
            1,
            &[
                Heartbeat("b"),
                Join("a"),
                Nothing,
                Join("b"),
                Issued(&["a", "b"]),
            ],
        );
    }

    #[test]
    fn min_replicas_blocks_small_rounds() {
        run(
            3,
            &[
                Join("a"),
                Nothing,
                Join("b"),
                Nothing,
                Advance(61_000),
                Tick,
                Nothing,
                Join("c"),
                Issued(&["a", "b", "c"]),
            ],
        );
        run(
            3,
            &[Join("a"), Join("b"), Join("c"), Issued(&["a", "b", "c"])],
        );
    }

    #[test]
    fn join_timeout_issues_without_stragglers() {
        run(
            1,
            &[
                Heartbeat("c"),
                Join("a"),
                Join("b"),
                Nothing,
                Advance(3_000),
                Heartbeat("c"),
                Tick,
                Nothing,
                Advance(3_000),
                Heartbeat("c"),
                Advance(55_000),
                Heartbeat("c"),
                Tick,
                Issued(&["a", "b"]),
            ],
        );
    }

    #[test]
    fn heartbeat_expiry_drops_straggler_at_tick() {
        run(
            1,
            &[
                Heartbeat("c"),
                Join("a"),
                Join("b"),
                Nothing,
                Advance(5_001),
                Tick,
                Issued(&["a", "b"]),
            ],
        );
    }

    /// Issues a quorum of `members` (each joins at `t`) and returns it.
    fn quorum_of(e: &mut QuorumEngine, members: &[&str], t: Instant) -> Quorum {
        let mut last = None;
        for id in members {
            e.heartbeat(id, t).unwrap();
        }
        for id in members {
            e.join(member(id), t).unwrap();
            last = e.poll(t);
        }
        let q = last.expect("a quorum of every healthy replica is issued");
        assert_eq!(ids(&q), members);
        q
    }

    /// Asks with every id at `step` and returns the issued quorum's (id, step) pairs.
    fn round_at(e: &mut QuorumEngine, ids: &[&str], step: i64, t: Instant) -> Vec<(String, i64)> {
        let mut last = None;
        for id in ids {
            let mut m = member(id);
            m.step = step;
            e.join(m, t).unwrap();
            last = e.poll(t).or(last);
        }
        last.expect("issued")
            .participants
            .iter()
            .map(|m| (m.replica_id.clone(), m.step))
            .collect()
    }

    #[test]
    fn a_dropped_straggler_waits_out_its_drop_and_then_rejoins() {
        let t = Instant::now();
        let mut e = QuorumEngine::new(opts(1), 1, t);
        let first = quorum_of(&mut e, &["a", "b"], t);
        let window = Duration::from_secs(10);
        assert!(e.drop_straggler("b", window, "slow".into(), t));
        assert!(!e.drop_straggler("b", window, "slow".into(), t), "once");
        assert!(!e.drop_straggler("zz", window, "unknown".into(), t));
        // b's request waits; a alone is a majority now (b is not counted as healthy).
        let jb = e.join(member("b"), t).unwrap();
        e.join(member("a"), t).unwrap();
        let q = e.poll(t).expect("a goes on without b");
        assert_eq!(ids(&q), vec!["a"]);
        assert_ne!(q.quorum_id, first.quorum_id);
        assert!(e.is_waiting("b", jb.generation));
        let (why, left) = e.dropped("b", t).unwrap();
        assert_eq!((why.as_str(), left), ("slow", window));
        assert_eq!(e.snapshot(t).dropped.len(), 1);
        // When the drop ends, b's waiting request joins the round and both go on.
        let later = t + window;
        e.heartbeat("a", later).unwrap();
        e.heartbeat("b", later).unwrap();
        e.join(member("a"), later).unwrap();
        let q = e.tick(later).expect("both again");
        assert_eq!(ids(&q), vec!["a", "b"]);
        assert!(e.dropped("b", later).is_none());
    }

    #[test]
    fn a_dropped_stragglers_request_can_be_withdrawn_and_its_death_ends_the_drop() {
        let t = Instant::now();
        let mut e = QuorumEngine::new(opts(1), 1, t);
        quorum_of(&mut e, &["a", "b"], t);
        // Dropped while asking: the request is parked, not lost.
        let jb = e.join(member("b"), t).unwrap();
        assert!(e.drop_straggler("b", Duration::from_secs(10), "slow".into(), t));
        assert!(e.is_waiting("b", jb.generation));
        assert!(e.leave("b", jb.generation));
        assert!(!e.is_waiting("b", jb.generation));
        e.join(member("b"), t).unwrap();
        e.lost("b", t);
        assert!(e.dropped("b", t).is_none());
        assert!(e.snapshot(t).dropped.is_empty());
    }

    #[test]
    fn a_diverged_group_is_presented_behind_until_it_commits_past_its_heal() {
        let t = Instant::now();
        let mut e = QuorumEngine::new(opts(1), 1, t);
        quorum_of(&mut e, &["a", "b", "c"], t);
        let good = vec![vec![7u8; 16]];
        e.offer_digest("a", 10, good.clone(), t).unwrap();
        e.offer_digest("b", 10, vec![vec![8u8; 16]], t).unwrap();
        assert!(e.take_diverged().is_empty(), "c has not sent step 10 yet");
        assert_eq!(e.offer_digest("c", 10, good, t).unwrap(), 10);
        let v = e.take_diverged();
        assert_eq!(v.len(), 1);
        assert_eq!((v[0].replica_id.as_str(), v[0].step), ("b", 10));
        // b asks at step 12 like the others: the quorum shows it behind, so it heals.
        let q = round_at(&mut e, &["a", "b", "c"], 12, t);
        assert_eq!(
            q,
            vec![("a".into(), 12), ("b".into(), 11), ("c".into(), 12)]
        );
        // Its heal failed: it asks again at 12 and is shown behind again.
        let q = round_at(&mut e, &["a", "b", "c"], 12, t);
        assert_eq!(q[1], ("b".into(), 11));
        // It committed 13 after the heal: the mark is gone.
        let q = round_at(&mut e, &["a", "b", "c"], 13, t);
        assert_eq!(q[1], ("b".into(), 13));
        assert!(e.snapshot(t).parity.healing.is_empty());
        assert_eq!(e.snapshot(t).parity.diverged_total, 1);
    }

    #[test]
    fn two_groups_that_differ_are_stopped_their_joins_and_commits_refused() {
        let t = Instant::now();
        let mut e = QuorumEngine::new(opts(1), 1, t);
        let q = quorum_of(&mut e, &["a", "b"], t);
        e.offer_digest("a", 5, vec![vec![1u8; 16]], t).unwrap();
        e.offer_digest("b", 5, vec![vec![2u8; 16]], t).unwrap();
        let v = e.take_diverged();
        assert_eq!(v.len(), 2);
        assert!(v
            .iter()
            .all(|d| d.action == super::super::health::parity::Action::Stop));
        assert!(e.parity_stopped("a").unwrap().contains("no majority"));
        assert!(matches!(e.join(member("a"), t), Err(Error::Diverged(_))));
        assert!(matches!(
            e.commit("b", q.quorum_id, 6, t).unwrap(),
            CommitVerdict::Refused(_)
        ));
        assert_eq!(e.snapshot(t).parity.stopped, vec!["a", "b"]);
        // A dead process's stop goes with it (a new process has a new id).
        e.lost("a", t);
        assert_eq!(e.snapshot(t).parity.stopped, vec!["b"]);
    }

    #[test]
    fn lost_member_is_excluded_without_waiting_for_its_heartbeat() {
        let t = Instant::now();
        let mut e = QuorumEngine::new(opts(1), 100, Instant::now());
        let q1 = quorum_of(&mut e, &["a", "b"], t);
        assert!(e.take_lost().is_empty());
        // "a" asks again; "b" is still healthy, so the round waits for it.
        e.join(member("a"), t).unwrap();
        assert!(e.poll(t).is_none());
        // "b" dies: reported once, and the round is ready at once (no heartbeat timeout).
        assert!(e.lost("b", t));
        assert_eq!(
            e.take_lost(),
            vec![LostMember {
                replica_id: "b".into(),
                quorum_id: q1.quorum_id
            }]
        );
        assert!(!e.lost("b", t), "a loss is reported once");
        assert!(e.take_lost().is_empty());
        let q2 = e.poll(t).expect("ready once the lost member is gone");
        assert_eq!(ids(&q2), ["a"]);
        assert!(q2.quorum_id > q1.quorum_id);
        assert_eq!(e.num_heartbeat_records(), 1);
    }

    #[test]
    fn lost_withdraws_a_waiting_request_and_ignores_non_members() {
        let t = Instant::now();
        let mut e = QuorumEngine::new(opts(1), 100, Instant::now());
        // Before any quorum nothing is reported, but the replica stops counting.
        e.heartbeat("x", t).unwrap();
        e.join(member("y"), t).unwrap();
        assert!(e.poll(t).is_none(), "waits for healthy x");
        assert!(!e.lost("x", t));
        assert!(e.take_lost().is_empty());
        assert_eq!(ids(&e.poll(t).unwrap()), ["y"]);
        // A waiting request of a lost replica leaves the round.
        e.join(member("z"), t).unwrap();
        assert_eq!(e.num_participants(), 1);
        e.lost("z", t);
        assert_eq!(e.num_participants(), 0);
        assert_eq!(e.verdict(t), Verdict::NoParticipants);
        // Unknown ids are harmless.
        assert!(!e.lost("nobody", t));
        assert!(e.take_lost().is_empty());
    }

    #[test]
    fn hung_member_is_declared_lost_at_heartbeat_expiry_only() {
        let t0 = Instant::now();
        let mut e = QuorumEngine::new(opts(1), 100, Instant::now());
        let q1 = quorum_of(&mut e, &["a", "b"], t0);
        // Slow but heartbeating (every 100 ms for 20 s): never lost.
        let mut t = t0;
        for _ in 0..200 {
            t += Duration::from_millis(100);
            e.heartbeat("a", t).unwrap();
            e.heartbeat("b", t).unwrap();
            assert!(e.tick(t).is_none());
            assert!(e.take_lost().is_empty());
        }
        // "b" hangs: nothing until heartbeat_timeout, then one loss of quorum q1.
        let hung_at = t;
        while t < hung_at + Duration::from_millis(4_900) {
            t += Duration::from_millis(100);
            e.heartbeat("a", t).unwrap();
            e.tick(t);
            assert!(
                e.take_lost().is_empty(),
                "declared lost too early at {:?}",
                t - hung_at
            );
        }
        t += Duration::from_millis(200);
        e.heartbeat("a", t).unwrap();
        e.tick(t);
        assert_eq!(
            e.take_lost(),
            vec![LostMember {
                replica_id: "b".into(),
                quorum_id: q1.quorum_id
            }]
        );
        t += Duration::from_millis(100);
        e.tick(t);
        assert!(e.take_lost().is_empty(), "reported once");
        // It comes back: the next quorum has it again and it can be lost again.
        e.join(member("a"), t).unwrap();
        e.join(member("b"), t).unwrap();
        assert_eq!(ids(&e.poll(t).unwrap()), ["a", "b"]);
        assert!(e.lost("b", t));
        assert_eq!(e.take_lost().len(), 1);
    }

    #[test]
    fn majority_required() {
        // 2 asking of 4 healthy is not a strict majority, even after the join timeout.
        run(
            1,
            &[
                Heartbeat("c"),
                Heartbeat("d"),
                Join("a"),
                Join("b"),
                Advance(4_000),
                Heartbeat("c"),
                Heartbeat("d"),
                Advance(1_000),
                Tick,
                Nothing,
                Join("c"),
                Nothing,
                Advance(57_000),
                Heartbeat("d"),
                Tick,
                Issued(&["a", "b", "c"]),
            ],
        );
    }

    #[test]
    fn fast_path_answers_at_once_and_keeps_id() {
        run(
            2,
            &[
                Join("a"),
                Join("b"),
                Issued(&["a", "b"]),
                Heartbeat("c"),
                Join("a"),
                Nothing,
                Join("b"),
                Issued(&["a", "b"]),
                SameId,
            ],
        );
    }

    #[test]
    fn fast_path_includes_newcomers_and_changes_id() {
        run(
            1,
            &[
                Join("a"),
                Issued(&["a"]),
                Join("b"),
                Nothing, // b alone is 1 of 2 healthy: no majority yet
                Join("a"),
                Issued(&["a", "b"]),
                NewId,
            ],
        );
    }

    #[test]
    fn fast_path_does_not_bypass_min_replicas_after_shrink() {
        // Previous quorum {a, b, c}; min 3. a and b ask again with shrink_only, c is gone but
        // newcomer d asks: fast path must not fire with 2 < min_replicas members.
        let mut e = QuorumEngine::new(opts(3), 1, Instant::now());
        let t = Instant::now();
        for id in ["a", "b", "c"] {
            e.join(member(id), t).unwrap();
        }
        let q = e.poll(t).unwrap();
        assert_eq!(ids(&q), ["a", "b", "c"]);
        let t = t + Duration::from_secs(6);
        e.join(shrink("a"), t).unwrap();
        e.join(member("b"), t).unwrap();
        e.join(member("d"), t).unwrap();
        assert!(e.tick(t).is_none(), "quorum below min_replicas issued");
        assert!(matches!(
            e.verdict(t),
            Verdict::BelowMinReplicas { candidates: 2, .. }
        ));
    }

    #[test]
    fn fast_path_does_not_bypass_majority() {
        // Previous quorum {a}; now a asks but b, c, d are healthy: 1 of 4 is no majority.
        let mut e = QuorumEngine::new(opts(1), 1, Instant::now());
        let t = Instant::now();
        e.join(member("a"), t).unwrap();
        assert!(e.poll(t).is_some());
        for id in ["b", "c", "d"] {
            e.heartbeat(id, t).unwrap();
        }
        e.join(member("a"), t).unwrap();
        assert!(e.poll(t).is_none());
        assert_eq!(
            e.verdict(t),
            Verdict::NoMajority {
                candidates: 1,
                healthy: 4
            }
        );
    }

    #[test]
    fn shrink_only_keeps_previous_members() {
        run(
            2,
            &[
                Join("a"),
                Join("b"),
                Issued(&["a", "b"]),
                Join("c"),
                Nothing,
                JoinWith(shrink("a")),
                Nothing,
                Join("b"),
                Issued(&["a", "b"]),
                SameId,
            ],
        );
    }

    #[test]
    fn shrink_only_leftover_waits_for_next_round() {
        let mut e = QuorumEngine::new(opts(1), 1, Instant::now());
        let t = Instant::now();
        e.join(member("a"), t).unwrap();
        e.join(member("b"), t).unwrap();
        e.poll(t).unwrap();
        e.join(member("c"), t).unwrap();
        e.join(shrink("a"), t).unwrap();
        e.join(member("b"), t).unwrap();
        let q = e.poll(t).unwrap();
        assert_eq!(ids(&q), ["a", "b"]);
        assert_eq!(e.num_participants(), 1);
        // The next round includes c once a and b ask again.
        e.join(member("a"), t).unwrap();
        e.join(member("b"), t).unwrap();
        let q2 = e.poll(t).unwrap();
        assert_eq!(ids(&q2), ["a", "b", "c"]);
        assert!(q2.quorum_id > q.quorum_id);
    }

    #[test]
    fn lagging_waiter_survives_many_quorums() {
        // A newcomer kept out by shrink_only stays waiting however many quorums are issued,
        // and is included once the previous members stop shrinking.
        let mut e = QuorumEngine::new(opts(2), 1, Instant::now());
        let t = Instant::now();
        e.join(member("b"), t).unwrap();
        e.join(member("c"), t).unwrap();
        let first = e.poll(t).unwrap();
        let a = e.join(member("a"), t).unwrap();
        for _ in 0..1_000 {
            e.join(shrink("b"), t).unwrap();
            e.join(member("c"), t).unwrap();
            let q = e.poll(t).unwrap();
            assert_eq!(ids(&q), ["b", "c"]);
            assert_eq!(q.quorum_id, first.quorum_id);
            assert!(e.is_waiting("a", a.generation));
        }
        e.join(member("b"), t).unwrap();
        e.join(member("c"), t).unwrap();
        assert_eq!(ids(&e.poll(t).unwrap()), ["a", "b", "c"]);
    }

    #[test]
    fn commit_failures_bump_id() {
        run(
            2,
            &[
                Join("a"),
                Join("b"),
                Issued(&["a", "b"]),
                JoinWith(failing("a")),
                Join("b"),
                Issued(&["a", "b"]),
                NewId,
            ],
        );
    }

    #[test]
    fn cancelled_request_leaves_round() {
        let mut e = QuorumEngine::new(opts(2), 1, Instant::now());
        let t = Instant::now();
        let a = e.join(member("a"), t).unwrap();
        assert!(e.poll(t).is_none());
        assert!(e.leave("a", a.generation));
        assert_eq!(e.num_participants(), 0);
        // b alone must not be put in a quorum with the departed a.
        e.join(member("b"), t).unwrap();
        assert!(e.poll(t).is_none());
        e.join(member("c"), t).unwrap();
        // a was seen recently, so the round waits for it as a healthy straggler ...
        assert!(e.poll(t).is_none());
        // ... and once its heartbeat expires the quorum forms without it.
        let q = e.tick(t + Duration::from_secs(6)).unwrap();
        assert_eq!(ids(&q), ["b", "c"]);
    }

    #[test]
    fn stale_leave_does_not_remove_newer_request() {
        let mut e = QuorumEngine::new(opts(2), 1, Instant::now());
        let t = Instant::now();
        let old = e.join(member("a"), t).unwrap();
        let new = e.join(member("a"), t).unwrap();
        assert_eq!(new.replaced, Some(old.generation));
        assert!(!e.leave("a", old.generation));
        assert!(e.is_waiting("a", new.generation));
        assert_eq!(e.num_participants(), 1);
        assert!(e.leave("a", new.generation));
    }

    #[test]
    fn heartbeat_records_pruned() {
        let mut e = QuorumEngine::new(opts(1), 1, Instant::now());
        let t = Instant::now();
        for i in 0..50 {
            e.heartbeat(&format!("r{i}"), t).unwrap();
        }
        e.tick(t + Duration::from_secs(49));
        assert_eq!(e.num_heartbeat_records(), 50);
        e.tick(t + Duration::from_secs(51));
        assert_eq!(e.num_heartbeat_records(), 0);
    }

    #[test]
    fn waiting_participant_not_pruned() {
        let mut e = QuorumEngine::new(opts(2), 1, Instant::now());
        let t = Instant::now();
        e.join(member("a"), t).unwrap();
        e.tick(t + Duration::from_secs(100));
        assert_eq!(e.num_heartbeat_records(), 1);
        assert_eq!(e.num_participants(), 1);
    }

    #[test]
    fn ids_start_at_initial_and_increase_across_restarts() {
        let t = Instant::now();
        let mut e1 = QuorumEngine::new(opts(1), 1_000, Instant::now());
        e1.join(member("a"), t).unwrap();
        let q1 = e1.poll(t).unwrap();
        assert_eq!(q1.quorum_id, 1_000);
        e1.join(member("b"), t).unwrap();
        e1.join(member("a"), t).unwrap();
        let q2 = e1.poll(t).unwrap();
        assert_eq!(q2.quorum_id, 1_001);
        // A restart seeds with a later clock reading.
        let mut e2 = QuorumEngine::new(opts(1), 2_000, Instant::now());
        e2.join(member("a"), t).unwrap();
        assert!(e2.poll(t).unwrap().quorum_id > q2.quorum_id);
        assert_eq!(QuorumEngine::new(opts(1), -5, Instant::now()).next_id, 1);
    }

    #[test]
    fn invalid_members_rejected_state_unchanged() {
        let cases: Vec<(QuorumMember, &str)> = vec![
            (
                QuorumMember {
                    replica_id: String::new(),
                    ..member("x")
                },
                "replica_id",
            ),
            (
                QuorumMember {
                    replica_id: "  ".into(),
                    ..member("x")
                },
                "replica_id",
            ),
            (
                QuorumMember {
                    step: -1,
                    ..member("x")
                },
                "step",
            ),
            (
                QuorumMember {
                    world_size: 0,
                    ..member("x")
                },
                "world_size",
            ),
            (
                QuorumMember {
                    commit_failures: -3,
                    ..member("x")
                },
                "commit_failures",
            ),
            (
                QuorumMember {
                    data: "{not json".into(),
                    ..member("x")
                },
                "JSON",
            ),
        ];
        let t = Instant::now();
        for (m, what) in cases {
            let mut e = QuorumEngine::new(opts(1), 1, Instant::now());
            let err = e.join(m, t).unwrap_err();
            assert!(
                matches!(&err, Error::InvalidArgument(msg) if msg.contains(what)),
                "{err}"
            );
            assert_eq!(e.num_participants(), 0);
            assert_eq!(e.num_heartbeat_records(), 0);
            assert!(e.poll(t).is_none());
        }
        let mut e = QuorumEngine::new(opts(1), 1, Instant::now());
        assert!(e.heartbeat("", t).is_err());
        assert_eq!(e.num_heartbeat_records(), 0);
    }

    #[test]
    fn verdict_messages_are_readable() {
        let v = Verdict::BelowMinReplicas {
            candidates: 1,
            min_replicas: 2,
        };
        assert_eq!(
            v.to_string(),
            "waiting for 1 more replica to reach min_replicas=2"
        );
        let mut e = QuorumEngine::new(opts(2), 1, Instant::now());
        let t = Instant::now();
        assert_eq!(e.snapshot(t).verdict, Verdict::NoParticipants);
        e.join(member("a"), t).unwrap();
        let s = e.snapshot(t);
        assert_eq!(s.participants, ["a"]);
        assert_eq!(
            s.verdict.to_string(),
            "waiting for 1 more replica to reach min_replicas=2"
        );
    }

    /// Options of the no-regression scenarios: 5 s heartbeat timeout (so a 5 s startup hold),
    /// 1 s join timeout, 10 s progress wait.
    fn progress_opts() -> LighthouseOptions {
        LighthouseOptions {
            min_replicas: 1,
            join_timeout: Duration::from_secs(1),
            quorum_tick: Duration::from_millis(100),
            heartbeat_timeout: Duration::from_secs(5),
            progress_wait: Duration::from_secs(10),
            state_file: None,
            hang_timeout: None,
        }
    }

    fn at(id: &str, step: i64) -> QuorumMember {
        QuorumMember { step, ..member(id) }
    }

    /// An engine past its startup hold with a quorum {a, b, c} at `step`, and the time.
    fn running(step: i64) -> (QuorumEngine, Instant) {
        let t0 = Instant::now();
        let mut e = QuorumEngine::new(progress_opts(), 100, t0);
        let t = t0 + Duration::from_secs(6);
        let q = full_round(&mut e, &at_steps(&["a", "b", "c"], step), t);
        assert_eq!(ids(&q), ["a", "b", "c"]);
        assert!(e.take_regressions().is_empty());
        (e, t)
    }

    fn at_steps(ids: &[&str], step: i64) -> Vec<QuorumMember> {
        ids.iter().map(|id| at(id, step)).collect()
    }

    #[test]
    fn round_behind_a_heartbeating_holder_waits_for_it_to_join() {
        let (mut e, mut t) = running(100);
        // a and b die and come back fresh (new incarnations at step 0); c, at step 101, is
        // busy in a blocking call but heartbeats its step.
        e.lost("a", t);
        e.lost("b", t);
        e.heartbeat_with_step("c", Some(101), t).unwrap();
        e.join(at("a2", 0), t).unwrap();
        e.join(at("b2", 0), t).unwrap();
        assert!(e.poll(t).is_none());
        // Past the join timeout, 2 of 3 healthy would be enough: the round waits for c.
        for _ in 0..80 {
            t += Duration::from_millis(100);
            e.heartbeat_with_step("c", Some(101), t).unwrap();
            assert!(e.tick(t).is_none(), "issued behind a live holder");
        }
        match e.verdict(t) {
            Verdict::WaitingForProgress {
                holder,
                step,
                candidates_step,
                remaining,
            } => {
                assert_eq!((holder.as_str(), step, candidates_step), ("c", 101, 0));
                assert!(remaining <= Duration::from_secs(2), "{remaining:?}");
            }
            v => panic!("unexpected verdict {v}"),
        }
        assert!(e.verdict(t).to_string().contains("c (at step 101)"));
        // c asks: everyone takes part, the fresh groups will heal from it; no regression.
        e.join(at("c", 101), t).unwrap();
        let q = e.poll(t).expect("issued once the holder joins");
        assert_eq!(ids(&q), ["a2", "b2", "c"]);
        assert!(e.take_regressions().is_empty());
        assert_eq!(e.best_known_step(), Some(101));
    }

    #[test]
    fn silent_holder_with_open_session_is_waited_for_until_the_bound_then_given_up() {
        let (mut e, t0) = running(50);
        e.session_opened("c", t0).unwrap();
        e.heartbeat_with_step("c", Some(51), t0).unwrap();
        // c is stopped: silent, its session still open. a and b restart fresh.
        e.lost("a", t0);
        e.lost("b", t0);
        let mut t = t0 + Duration::from_secs(6);
        e.tick(t);
        e.join(at("a2", 0), t).unwrap();
        e.join(at("b2", 0), t).unwrap();
        let round = t;
        // c is not healthy (no heartbeat for 6 s), so the round is otherwise ready at once.
        assert!(matches!(
            e.verdict(t),
            Verdict::WaitingForProgress { ref holder, step: 51, .. } if holder == "c"
        ));
        while t < round + Duration::from_millis(9_900) {
            t += Duration::from_millis(100);
            assert!(e.tick(t).is_none(), "gave up too early at {:?}", t - round);
        }
        t += Duration::from_millis(200);
        let q = e.tick(t).expect("the wait is bounded");
        assert_eq!(ids(&q), ["a2", "b2"]);
        assert_eq!(
            e.take_regressions(),
            vec![Regression {
                from_step: 51,
                to_step: 0,
                quorum_id: q.quorum_id,
                alive_holders: vec!["c".into()],
            }]
        );
        // Given up on at step 51: neither its heartbeats nor the next rounds wait for it again.
        e.heartbeat_with_step("c", Some(51), t).unwrap();
        e.join(at("a2", 1), t).unwrap();
        e.join(at("b2", 1), t).unwrap();
        let q2 = e.poll(t).expect("fast path, no second wait");
        assert_eq!(q2.quorum_id, q.quorum_id);
        assert!(e.take_regressions().is_empty(), "reported once");
        // If it reports newer progress it is waited for again.
        e.heartbeat_with_step("c", Some(52), t).unwrap();
        e.join(at("a2", 2), t).unwrap();
        e.join(at("b2", 2), t).unwrap();
        assert!(e.poll(t).is_none());
        assert!(matches!(
            e.verdict(t),
            Verdict::WaitingForProgress { step: 52, .. }
        ));
    }

    #[test]
    fn regression_when_every_holder_is_dead_is_issued_at_once_and_reported_once() {
        let (mut e, t) = running(200);
        for id in ["a", "b", "c"] {
            e.lost(id, t);
        }
        e.join(at("a2", 0), t).unwrap();
        let q = e.poll(t).expect("no live holder: nothing to wait for");
        assert_eq!(ids(&q), ["a2"]);
        let r = e.take_regressions();
        assert_eq!(
            r,
            vec![Regression {
                from_step: 200,
                to_step: 0,
                quorum_id: q.quorum_id,
                alive_holders: vec![],
            }]
        );
        e.join(at("a2", 1), t).unwrap();
        assert!(e.poll(t).is_some());
        assert!(e.take_regressions().is_empty());
        assert_eq!(e.best_known_step(), Some(1));
    }

    #[test]
    fn healthy_groups_not_asking_are_named_while_a_round_waits() {
        let t0 = Instant::now();
        let mut e = QuorumEngine::new(opts(1), 100, t0);
        for id in ["c", "a", "b"] {
            e.heartbeat(id, t0).unwrap();
        }
        e.heartbeat("stale", t0 - Duration::from_secs(10)).unwrap();
        assert!(e.round_started().is_none());
        e.join(member("b"), t0).unwrap();
        assert!(e.poll(t0).is_none(), "1 of 4 healthy is no majority");
        assert_eq!(e.round_started(), Some(t0));
        assert_eq!(e.healthy_not_asking(t0, 8), ["a", "c"]);
        assert_eq!(e.healthy_not_asking(t0, 1), ["a"]);
        let s = e.snapshot(t0 + Duration::from_secs(3));
        assert_eq!(s.round_age, Some(Duration::from_secs(3)));
        assert_eq!(s.healthy_not_asking, ["a", "c"]);
    }

    #[test]
    fn fresh_job_gets_its_first_quorum_at_once() {
        // Nothing says the job ran before: the join rules alone decide (a lone replica at
        // any step, with min_replicas 1, is answered at once).
        let t0 = Instant::now();
        for step in [0, 1, 900] {
            let mut e = QuorumEngine::new(progress_opts(), 100, t0);
            e.join(at("only", step), t0).unwrap();
            assert_eq!(e.verdict(t0), Verdict::AllHealthyJoined);
            assert_eq!(ids(&e.poll(t0).unwrap()), ["only"]);
            assert!(e.earlier_life().is_none());
        }
        // A heartbeat without a quorum id is no evidence either.
        let mut e = QuorumEngine::new(progress_opts(), 100, t0);
        e.heartbeat_with_step("b", Some(3), t0).unwrap();
        assert!(!e.holds_quorum("b", 0));
        e.join(at("a", 3), t0).unwrap();
        e.join(at("b", 3), t0).unwrap();
        assert_eq!(ids(&e.poll(t0).unwrap()), ["a", "b"]);
        // Once this life issued a quorum, a quorum id reported is one of its own.
        assert!(!e.holds_quorum("a", 100));
        assert!(e.startup_hold_until(t0).is_none());
    }

    #[test]
    fn restarted_lighthouse_holds_the_first_quorum_until_heartbeats_are_heard() {
        // The lighthouse restarts at t0 without a state file. A surviving group's manager
        // heartbeats first, saying it holds quorum 42 (from the earlier life): that turns
        // the hold on. A fresh group asks; the group holding step 900 is heard again 2 s
        // later.
        let t0 = Instant::now();
        let mut e = QuorumEngine::new(progress_opts(), 100, t0);
        e.heartbeat_with_step("old", Some(900), t0).unwrap();
        assert!(e.holds_quorum("old", 42));
        assert!(!e.holds_quorum("old", 42), "turned on once");
        let mut t = t0 + Duration::from_millis(100);
        e.join(at("fresh", 0), t).unwrap();
        e.join(at("fresh2", 0), t).unwrap();
        assert!(e.poll(t).is_none());
        // Past the join timeout the round would be ready but for the hold.
        t = t0 + Duration::from_millis(1_200);
        assert!(e.tick(t).is_none());
        assert!(matches!(e.verdict(t), Verdict::StartupHold { .. }));
        let why = e.verdict(t).to_string();
        assert!(
            why.contains("restarted (old holds quorum 42 from an earlier life)"),
            "{why}"
        );
        assert_eq!(e.startup_hold_until(t), Some(t0 + Duration::from_secs(5)));
        t = t0 + Duration::from_secs(2);
        e.heartbeat_with_step("old", Some(900), t).unwrap();
        assert!(e.tick(t).is_none());
        // After the hold the round waits for the holder, which then joins.
        t = t0 + Duration::from_millis(5_100);
        e.heartbeat_with_step("old", Some(900), t).unwrap();
        assert!(e.tick(t).is_none());
        assert!(matches!(
            e.verdict(t),
            Verdict::WaitingForProgress { step: 900, .. }
        ));
        e.join(at("old", 900), t).unwrap();
        let q = e.poll(t).unwrap();
        assert_eq!(ids(&q), ["fresh", "fresh2", "old"]);
        assert!(e.take_regressions().is_empty());

        // A request holding a quorum of an earlier life turns the hold on as well; nobody
        // else alive: the first quorum comes right at the end of the hold.
        let mut e = QuorumEngine::new(progress_opts(), 100, t0);
        e.join(at("only", 7), t0).unwrap();
        assert!(e.holds_quorum("only", 9));
        assert!(e.tick(t0 + Duration::from_millis(4_900)).is_none());
        assert_eq!(ids(&e.tick(t0 + Duration::from_secs(5)).unwrap()), ["only"]);
        // The hold is min(heartbeat timeout, progress wait); no wait at all disables it.
        for (wait, ready_at) in [(Duration::from_secs(2), 2_000), (Duration::ZERO, 0)] {
            let o = LighthouseOptions {
                progress_wait: wait,
                ..progress_opts()
            };
            let mut e = QuorumEngine::new(o, 100, t0);
            e.join(at("only", 7), t0).unwrap();
            e.holds_quorum("only", 9);
            if ready_at > 0 {
                assert!(e.tick(t0 + Duration::from_millis(ready_at - 1)).is_none());
            }
            assert!(e.tick(t0 + Duration::from_millis(ready_at)).is_some());
        }
        // Evidence heard after the hold would have ended changes nothing.
        let mut e = QuorumEngine::new(progress_opts(), 100, t0);
        let late = t0 + Duration::from_secs(6);
        e.join(at("only", 7), late).unwrap();
        assert!(e.holds_quorum("only", 9));
        assert!(e.poll(late).is_some());
    }

    #[test]
    fn ids_stay_above_every_quorum_id_a_replica_reports() {
        // The earlier life's clock was ahead: its ids are above this life's start id.
        let t0 = Instant::now();
        let mut e = QuorumEngine::new(progress_opts(), 100, t0);
        assert!(e.holds_quorum("a", 5_000));
        assert!(!e.holds_quorum("b", 7_000), "the hold is already on");
        e.join(at("a", 1), t0).unwrap();
        e.join(at("b", 1), t0).unwrap();
        let q = e
            .tick(t0 + Duration::from_secs(5))
            .expect("issued after the hold");
        assert_eq!(q.quorum_id, 7_001);
        // Reports of this life's own ids (or older ones) change nothing.
        assert!(!e.holds_quorum("a", 7_001));
        assert!(!e.holds_quorum("a", 3));
        e.join(at("a", 2), t0 + Duration::from_secs(5)).unwrap();
        let q2 = e
            .tick(t0 + Duration::from_secs(7))
            .expect("a alone, after the join timeout");
        assert_eq!(q2.quorum_id, 7_002);
    }

    #[test]
    fn a_state_file_that_remembers_nothing_is_a_fresh_job() {
        let t0 = Instant::now();
        let mut e = QuorumEngine::restored(progress_opts(), 100, t0, Durable::default());
        assert!(e.earlier_life().is_none());
        e.join(at("only", 0), t0).unwrap();
        assert!(e.poll(t0).is_some());
        // One that remembers a step holds, and says what it remembers.
        let durable = Durable {
            best_step: Some(12),
            ..Durable::default()
        };
        let mut e = QuorumEngine::restored(progress_opts(), 100, t0, durable);
        e.join(at("only", 0), t0).unwrap();
        assert!(e.poll(t0).is_none());
        let why = e.verdict(t0).to_string();
        assert!(
            why.contains("its state file remembers no quorum and step 12"),
            "{why}"
        );
    }

    #[test]
    fn holders_not_ahead_and_asking_replicas_never_delay_a_round() {
        let (mut e, t) = running(10);
        // A heartbeating group at the same step, and one behind: no wait.
        e.heartbeat_with_step("d", Some(10), t).unwrap();
        e.heartbeat_with_step("e", Some(3), t).unwrap();
        for id in ["a", "b", "c"] {
            e.join(at(id, 11), t).unwrap();
        }
        assert!(e.poll(t).is_some(), "fast path");
        // A holder ahead that is itself asking is a candidate, not a reason to wait.
        for (id, step) in [("a", 12), ("b", 12), ("c", 12), ("d", 40)] {
            e.join(at(id, step), t).unwrap();
        }
        let q = e.tick(t + Duration::from_secs(1)).unwrap();
        assert_eq!(ids(&q), ["a", "b", "c", "d"]);
        assert!(e.take_regressions().is_empty());
        assert_eq!(e.best_known_step(), Some(40));
    }

    #[test]
    fn shrink_only_round_waits_for_a_live_holder_outside_it() {
        let (mut e, t) = running(5);
        // c went ahead alone?! It cannot, but its heartbeat may say more than a and b know
        // (a commit the others missed). A shrink-only round of a and b waits for it too.
        e.heartbeat_with_step("c", Some(6), t).unwrap();
        e.join(
            QuorumMember {
                shrink_only: true,
                ..at("a", 5)
            },
            t,
        )
        .unwrap();
        e.join(at("b", 5), t).unwrap();
        let later = t + Duration::from_secs(2);
        e.heartbeat_with_step("c", Some(6), later).unwrap();
        assert!(e.tick(later).is_none());
        assert!(matches!(
            e.verdict(later),
            Verdict::WaitingForProgress { step: 6, .. }
        ));
    }

    #[test]
    fn heartbeat_step_and_session_inputs_are_validated() {
        let t = Instant::now();
        let mut e = QuorumEngine::new(progress_opts(), 1, t);
        let err = e.heartbeat_with_step("a", Some(-1), t).unwrap_err();
        assert!(
            err.to_string().contains("step must not be negative"),
            "{err}"
        );
        assert!(e.heartbeat_with_step(" ", Some(1), t).is_err());
        assert!(e.session_opened("", t).is_err());
        assert_eq!(e.num_heartbeat_records(), 0);
        assert_eq!(e.best_known_step(), None);
        // A later, lower step does not lower what is known (steps only grow per incarnation).
        e.heartbeat_with_step("a", Some(9), t).unwrap();
        e.heartbeat_with_step("a", Some(4), t).unwrap();
        assert_eq!(e.best_known_step(), Some(9));
    }

    #[test]
    fn randomized_no_quorum_behind_a_live_unwaived_holder_before_the_bound() {
        for seed in 1..=150u64 {
            let mut rng = XorShift(seed.wrapping_mul(0xA24B_AED4_963E_E407) | 1);
            let o = LighthouseOptions {
                min_replicas: 1,
                join_timeout: Duration::from_millis(200 + rng.below(800)),
                quorum_tick: Duration::from_millis(100),
                heartbeat_timeout: Duration::from_millis(1000 + rng.below(2000)),
                progress_wait: Duration::from_millis(500 + rng.below(4000)),
                state_file: None,
                hang_timeout: None,
            };
            let t0 = Instant::now();
            let mut e = QuorumEngine::new(o.clone(), 1, t0);
            // A restarted lighthouse: a manager says it holds a quorum of the earlier life.
            assert!(e.holds_quorum("r0", 1));
            let mut now = t0;
            // The model: each replica's step, last heartbeat, open session, waiver.
            let mut step: HashMap<String, i64> = HashMap::new();
            let mut seen: HashMap<String, Instant> = HashMap::new();
            let mut session: HashSet<String> = HashSet::new();
            let mut asking: HashMap<String, (i64, Instant)> = HashMap::new();
            let mut round_start: Option<Instant> = None;
            let mut waived: HashMap<String, i64> = HashMap::new();
            let mut first = true;
            for _ in 0..500 {
                let id = format!("r{}", rng.below(5));
                let issued = match rng.below(10) {
                    0..=2 => {
                        let s = *step.entry(id.clone()).or_insert(0);
                        e.join(at(&id, s), now).unwrap();
                        seen.insert(id.clone(), now);
                        asking.insert(id.clone(), (s, now));
                        round_start.get_or_insert(now);
                        e.poll(now)
                    }
                    3 => {
                        let s = step.entry(id.clone()).or_insert(0);
                        *s += rng.below(3) as i64;
                        e.heartbeat_with_step(&id, Some(*s), now).unwrap();
                        seen.insert(id.clone(), now);
                        None
                    }
                    4 => {
                        e.session_opened(&id, now).unwrap();
                        seen.insert(id.clone(), now);
                        session.insert(id.clone());
                        None
                    }
                    5 => {
                        // Dies: a new incarnation will use another id.
                        e.lost(&id, now);
                        seen.remove(&id);
                        session.remove(&id);
                        asking.remove(&id);
                        waived.remove(&id);
                        step.remove(&id);
                        if asking.is_empty() {
                            round_start = None;
                        }
                        e.poll(now)
                    }
                    6 | 7 => {
                        now += Duration::from_millis(rng.below(1200));
                        None
                    }
                    _ => e.tick(now),
                };
                let Some(q) = issued else { continue };
                let members: HashSet<String> = q
                    .participants
                    .iter()
                    .map(|m| m.replica_id.clone())
                    .collect();
                let to = q.participants.iter().map(|m| m.step).max().unwrap();
                let started = round_start.unwrap_or(now);
                if first {
                    let hold = o.heartbeat_timeout.min(o.progress_wait);
                    assert!(
                        now >= t0 + hold,
                        "seed {seed}: first quorum inside the hold"
                    );
                    first = false;
                }
                for (h, s) in &step {
                    let alive = session.contains(h)
                        || seen.get(h).is_some_and(|t| {
                            now.saturating_duration_since(*t) <= o.heartbeat_timeout
                        });
                    let behind = *s > to && !members.contains(h) && !asking.contains_key(h);
                    let given_up = waived.get(h).is_some_and(|w| *s <= *w);
                    if alive && behind && !given_up {
                        assert!(
                            now >= started + o.progress_wait,
                            "seed {seed}: issued at step {to} behind live {h} at {s} \
                             after {:?}",
                            now - started
                        );
                        waived.insert(h.clone(), *s);
                    }
                }
                for m in &q.participants {
                    asking.remove(&m.replica_id);
                }
                round_start = if asking.is_empty() { None } else { Some(now) };
            }
            let _ = e.take_regressions();
        }
    }

    /// Small deterministic PRNG so the randomized test is reproducible without extra crates.
    struct XorShift(u64);
    impl XorShift {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn below(&mut self, n: u64) -> u64 {
            self.next() % n
        }
    }

    #[test]
    fn randomized_invariants() {
        for seed in 1..=200u64 {
            let mut rng = XorShift(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
            let min = 1 + rng.below(3);
            let o = LighthouseOptions {
                min_replicas: min,
                join_timeout: Duration::from_millis(500 + rng.below(2000)),
                quorum_tick: Duration::from_millis(100),
                heartbeat_timeout: Duration::from_millis(1000 + rng.below(3000)),
                progress_wait: Duration::ZERO,
                state_file: None,
                hang_timeout: None,
            };
            let mut e = QuorumEngine::new(o.clone(), 1 + rng.below(1000) as i64, Instant::now());
            let t0 = Instant::now();
            let mut now = t0;
            let mut gens: HashMap<String, u64> = HashMap::new();
            // Exact liveness model, independent of the engine's counters.
            let mut seen: HashMap<String, Instant> = HashMap::new();
            let mut asked_at: HashMap<String, Instant> = HashMap::new();
            let mut sets: HashMap<i64, Vec<String>> = HashMap::new();
            let mut last_id = i64::MIN;
            for _ in 0..400 {
                let id = format!("r{}", rng.below(7));
                let issued = match rng.below(8) {
                    0..=2 => {
                        let m = QuorumMember {
                            shrink_only: rng.below(10) == 0,
                            commit_failures: if rng.below(10) == 0 { 1 } else { 0 },
                            ..member(&id)
                        };
                        let j = e.join(m, now).unwrap();
                        gens.insert(id.clone(), j.generation);
                        seen.insert(id.clone(), now);
                        asked_at.insert(id.clone(), now);
                        e.poll(now)
                    }
                    3 => {
                        if let Some(g) = gens.remove(&id) {
                            e.leave(&id, g);
                        }
                        None
                    }
                    4 => {
                        e.heartbeat(&id, now).unwrap();
                        seen.insert(id.clone(), now);
                        None
                    }
                    5 | 6 => {
                        now += Duration::from_millis(rng.below(1500));
                        None
                    }
                    _ => e.tick(now),
                };
                let Some(q) = issued else { continue };
                let members: Vec<String> = q
                    .participants
                    .iter()
                    .map(|m| m.replica_id.clone())
                    .collect();
                // Issued members no longer wait.
                for m in &members {
                    gens.remove(m);
                }
                assert!(
                    members.len() as u64 >= min,
                    "seed {seed}: below min_replicas"
                );
                // Hung groups (asked before, silent in the loop past the hang timeout since
                // their last request: the only visits this model makes) are not counted.
                let healthy = seen
                    .iter()
                    .filter(|(id, t)| {
                        now.saturating_duration_since(**t) <= o.heartbeat_timeout
                            || e.participants.contains_key(*id)
                            || members.contains(id)
                    })
                    .filter(|(id, _)| {
                        let Some(h) = e.is_hung(id) else {
                            return true;
                        };
                        let away = asked_at.get(*id).map(|t| now.saturating_duration_since(*t));
                        assert!(
                            away.is_some_and(|a| a > h.timeout && h.timeout >= hang::HANG_FLOOR),
                            "seed {seed}: {id} held hung after {away:?} away ({h:?})"
                        );
                        false
                    })
                    .count();
                assert!(
                    members.len() * 2 > healthy,
                    "seed {seed}: no strict majority"
                );
                assert!(q.quorum_id >= last_id, "seed {seed}: id went backwards");
                if let Some(prev) = sets.get(&q.quorum_id) {
                    assert_eq!(prev, &members, "seed {seed}: two member sets for one id");
                    assert_eq!(q.quorum_id, last_id, "seed {seed}: old id reused");
                }
                sets.insert(q.quorum_id, members);
                last_id = q.quorum_id;
            }
        }
    }

    /// Heartbeats `members`, then has them all ask (in order) and returns the quorum.
    fn full_round(e: &mut QuorumEngine, members: &[QuorumMember], now: Instant) -> Quorum {
        for m in members {
            e.heartbeat(&m.replica_id, now).unwrap();
        }
        let mut issued = None;
        for m in members {
            e.join(m.clone(), now).unwrap();
            if let Some(q) = e.poll(now) {
                assert!(issued.is_none(), "two quorums in one round");
                issued = Some(q);
            }
        }
        // A member that left is still healthy: the round then waits for the join timeout.
        let later = now + e.options().join_timeout;
        let q = issued.or_else(|| e.tick(later)).expect("a quorum");
        assert_eq!(q.participants.len(), members.len());
        q
    }

    fn at_step(ids: &[&str], step: i64) -> Vec<QuorumMember> {
        ids.iter()
            .map(|id| QuorumMember { step, ..member(id) })
            .collect()
    }

    #[test]
    fn revision_counts_quorums_and_stable_since_marks_non_step_changes() {
        type Edit = fn(&mut Vec<QuorumMember>);
        // (what changes, edit of the previous round's members, expect the same id,
        //  expect only steps changed)
        let cases: Vec<(&str, Edit, bool, bool)> = vec![
            ("steps advance", |_| {}, true, true),
            ("one member lags", |ms| ms[1].step -= 1, true, true),
            (
                "data changes",
                |ms| ms[0].data = "{\"k\":1}".into(),
                true,
                false,
            ),
            (
                "address changes",
                |ms| ms[2].address = "http://moved:1".into(),
                true,
                false,
            ),
            (
                "store changes",
                |ms| ms[2].store_address = "moved:2".into(),
                true,
                false,
            ),
            ("world size changes", |ms| ms[1].world_size = 3, true, false),
            (
                "commit failures",
                |ms| ms[0].commit_failures = 2,
                false,
                false,
            ),
            (
                "shrink_only asked",
                |ms| ms[0].shrink_only = true,
                true,
                false,
            ),
            (
                "a member joins",
                |ms| ms.insert(0, member("a0")),
                false,
                false,
            ),
            (
                "a member leaves",
                |ms| {
                    ms.pop();
                },
                false,
                false,
            ),
        ];
        for (name, edit, same_id, steps_only) in cases {
            let mut e = QuorumEngine::new(opts(1), 100, Instant::now());
            let t0 = Instant::now();
            let mut ms = at_step(&["b", "c", "d"], 1);
            let q1 = full_round(&mut e, &ms, t0);
            assert_eq!(
                (q1.revision, e.revision(), e.stable_since()),
                (1, 1, 1),
                "{name}"
            );
            for m in &mut ms {
                m.step += 1;
            }
            let q2 = full_round(&mut e, &ms, t0);
            assert_eq!(
                (q2.revision, e.stable_since()),
                (2, 1),
                "{name}: steps only"
            );
            for m in &mut ms {
                m.step += 1;
                m.shrink_only = false;
            }
            edit(&mut ms);
            // Newcomers ask first so the fast path does not leave them out.
            ms.sort_by_key(|m| q2.participants.iter().any(|p| p.replica_id == m.replica_id));
            let q3 = full_round(&mut e, &ms, t0);
            assert_eq!(q3.revision, 3, "{name}");
            assert_eq!(q3.quorum_id == q2.quorum_id, same_id, "{name}: id");
            let expected = if steps_only { 1 } else { 3 };
            assert_eq!(e.stable_since(), expected, "{name}: stable_since");
            // What each holder gets: compact exactly when it rebuilds the quorum.
            for known in [&q1, &q2] {
                let applies = compact::compact_applies(
                    &q3,
                    e.stable_since(),
                    known.quorum_id,
                    known.revision,
                );
                assert_eq!(
                    applies, steps_only,
                    "{name}: compact for revision {}",
                    known.revision
                );
                if applies {
                    let rebuilt = compact::expand(Some(known), compact::compact_form(&q3));
                    assert_eq!(rebuilt.unwrap(), q3, "{name}");
                }
            }
            // A requester without a cache, or an old-style request, gets the full form.
            assert!(
                !compact::compact_applies(&q3, e.stable_since(), 0, 0),
                "{name}"
            );
        }
    }

    #[test]
    fn shrink_only_round_with_unchanged_members_is_not_compact_for_older_holders() {
        let mut e = QuorumEngine::new(opts(1), 1, Instant::now());
        let t0 = Instant::now();
        let q1 = full_round(&mut e, &at_step(&["a", "b"], 1), t0);
        let mut ms = at_step(&["a", "b"], 2);
        ms[1].shrink_only = true;
        let q2 = full_round(&mut e, &ms, t0);
        assert_eq!(q2.quorum_id, q1.quorum_id);
        assert!(!compact::compact_applies(
            &q2,
            e.stable_since(),
            q1.quorum_id,
            q1.revision
        ));
        // The next steady round is compact for a holder of q2, not of q1.
        let q3 = full_round(&mut e, &at_step(&["a", "b"], 3), t0);
        assert!(!compact::compact_applies(
            &q3,
            e.stable_since(),
            q1.quorum_id,
            q1.revision
        ));
        let q4 = full_round(&mut e, &at_step(&["a", "b"], 4), t0);
        assert!(compact::compact_applies(
            &q4,
            e.stable_since(),
            q3.quorum_id,
            q3.revision
        ));
    }

    #[test]
    fn randomized_expanded_quorum_equals_the_full_one() {
        let (mut compact_used, mut delta_used) = (0, 0);
        for seed in 1..=150u64 {
            let mut rng = XorShift(seed.wrapping_mul(0xD1B5_4A32_D192_ED03) | 1);
            let o = LighthouseOptions {
                min_replicas: 1 + rng.below(2),
                join_timeout: Duration::from_millis(300),
                quorum_tick: Duration::from_millis(100),
                heartbeat_timeout: Duration::from_millis(1000),
                progress_wait: Duration::ZERO,
                state_file: None,
                hang_timeout: None,
            };
            let mut e = QuorumEngine::new(o, 1 + rng.below(100) as i64, Instant::now());
            let mut now = Instant::now();
            let mut steps: HashMap<String, i64> = HashMap::new();
            let mut history: Vec<Quorum> = Vec::new();
            for _ in 0..300 {
                let id = format!("r{}", rng.below(6));
                let step = steps.entry(id.clone()).or_insert(0);
                if rng.below(3) > 0 {
                    *step += 1;
                }
                let issued = match rng.below(10) {
                    0..=5 => {
                        let m = QuorumMember {
                            step: *step,
                            data: match rng.below(40) {
                                0 => "{\"x\":1}".into(),
                                _ => String::new(),
                            },
                            address: match rng.below(40) {
                                0 => format!("http://{id}:9"),
                                _ => format!("http://{id}:1"),
                            },
                            world_size: if rng.below(40) == 0 { 2 } else { 1 },
                            shrink_only: rng.below(30) == 0,
                            commit_failures: if rng.below(30) == 0 { 1 } else { 0 },
                            ..member(&id)
                        };
                        e.join(m, now).unwrap();
                        e.poll(now)
                    }
                    6 => {
                        e.heartbeat(&id, now).unwrap();
                        None
                    }
                    7 | 8 => {
                        now += Duration::from_millis(rng.below(700));
                        None
                    }
                    _ => e.tick(now),
                };
                let Some(q) = issued else { continue };
                assert_eq!(q.revision, history.len() as u64 + 1, "seed {seed}");
                let stable = e.stable_since();
                // Every holder: nothing, or any earlier quorum.
                // The service's choice: steps only, else a delta against the previous
                // quorum when only that holder is not covered, else the full form.
                let previous = history.last().filter(|_| stable == q.revision);
                for known in std::iter::once(None).chain(history.iter().map(Some)) {
                    let (kid, krev) = known.map_or((0, 0), |k| (k.quorum_id, k.revision));
                    let reply = if compact::compact_applies(&q, stable, kid, krev) {
                        compact_used += 1;
                        compact::compact_form(&q)
                    } else if let Some(prev) =
                        previous.filter(|p| compact::delta_applies(p, kid, krev))
                    {
                        delta_used += 1;
                        compact::delta_form(prev, &q)
                    } else {
                        q.clone()
                    };
                    let rebuilt = compact::expand(known, reply)
                        .unwrap_or_else(|err| panic!("seed {seed}: {err}"));
                    assert_eq!(rebuilt, q, "seed {seed}: known revision {krev}");
                }
                history.push(q);
            }
        }
        eprintln!("compact form used {compact_used} times, delta {delta_used} times");
        assert!(delta_used > 100, "delta form exercised {delta_used} times");
        assert!(
            compact_used > 100,
            "compact form exercised {compact_used} times"
        );
    }

    // ------------------------------------------------------------------ write-ahead commits

    fn refused(v: CommitVerdict) -> String {
        match v {
            CommitVerdict::Refused(why) => why,
            CommitVerdict::Accepted => panic!("accepted"),
        }
    }

    #[test]
    fn a_commit_under_the_current_quorum_is_accepted_and_waited_for_while_silent() {
        let (mut e, mut t) = running(100);
        let qid = e.previous().unwrap().quorum_id;
        for id in ["a", "b", "c"] {
            e.session_opened(id, t).unwrap();
        }
        // a announces step 101 and stops (SIGSTOP) before it heartbeats again: alive but
        // silent, its session open. b and c abandoned the step and ask at 100.
        assert_eq!(e.commit("a", qid, 101, t).unwrap(), CommitVerdict::Accepted);
        assert_eq!(e.best_known_step(), Some(101));
        t += Duration::from_secs(1);
        e.join(at("b", 100), t).unwrap();
        e.join(at("c", 100), t).unwrap();
        // Past the heartbeat timeout (a is declared lost for its quorum, but its session is
        // open) the round still waits for a, up to progress_wait.
        for _ in 0..80 {
            t += Duration::from_millis(100);
            e.heartbeat("b", t).unwrap();
            e.heartbeat("c", t).unwrap();
            assert!(e.tick(t).is_none(), "issued behind the holder of step 101");
        }
        assert!(matches!(
            e.verdict(t),
            Verdict::WaitingForProgress { ref holder, step: 101, candidates_step: 100, .. }
                if holder == "a"
        ));
        // a resumes and asks at 101: one quorum, nobody regressed.
        e.join(at("a", 101), t).unwrap();
        let q = e.poll(t).expect("a quorum once the holder asks");
        assert_eq!(ids(&q), ["a", "b", "c"]);
        assert!(e.take_regressions().is_empty());
    }

    #[test]
    fn a_commit_under_a_replaced_quorum_is_refused() {
        let (mut e, mut t) = running(100);
        let old = e.previous().unwrap().quorum_id;
        e.session_opened("a", t).unwrap();
        // a stops mid-step; its heartbeats expire, b and c go on without it at 100 ...
        t += Duration::from_secs(6);
        e.heartbeat("b", t).unwrap();
        e.heartbeat("c", t).unwrap();
        assert!(e.tick(t).is_none());
        assert_eq!(e.take_lost().len(), 1);
        e.join(at("b", 100), t).unwrap();
        e.join(at("c", 100), t).unwrap();
        let q = e.poll(t).expect("b and c go on: a holds nothing newer");
        assert_eq!(ids(&q), ["b", "c"]);
        assert_eq!(
            e.commit("b", q.quorum_id, 101, t).unwrap(),
            CommitVerdict::Accepted
        );
        // ... so when a resumes and finishes the step of the old quorum, it may not commit.
        let why = refused(e.commit("a", old, 101, t).unwrap());
        assert!(
            why.contains("replaced") && why.contains("without this replica"),
            "{why}"
        );
        // A member of the current quorum announcing under an old id is refused too.
        assert!(matches!(
            e.commit("c", old, 101, t).unwrap(),
            CommitVerdict::Refused(_)
        ));
        assert_eq!(e.best_known_step(), Some(101));
    }

    #[test]
    fn a_member_declared_lost_may_not_commit_in_that_quorum() {
        let (mut e, mut t) = running(100);
        let qid = e.previous().unwrap().quorum_id;
        t += Duration::from_secs(6);
        e.heartbeat("b", t).unwrap();
        e.heartbeat("c", t).unwrap();
        assert!(e.tick(t).is_none());
        assert_eq!(e.take_lost()[0].replica_id, "a");
        // No newer quorum yet: the others were told a is lost and abandon the step.
        let why = refused(e.commit("a", qid, 101, t).unwrap());
        assert!(why.contains("declared lost"), "{why}");
        assert_eq!(e.best_known_step(), Some(100));
        // The members still alive may.
        assert_eq!(e.commit("b", qid, 101, t).unwrap(), CommitVerdict::Accepted);
    }

    #[test]
    fn bad_commit_announcements_are_refused_and_change_nothing() {
        let (mut e, t) = running(100);
        let qid = e.previous().unwrap().quorum_id;
        let rev = e.durable_revision();
        assert!(matches!(
            e.commit("", qid, 101, t),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            e.commit("a", qid, -1, t),
            Err(Error::InvalidArgument(_))
        ));
        assert_eq!(e.durable_revision(), rev);
        assert_eq!(e.best_known_step(), Some(100));
    }

    #[test]
    fn a_fresh_lighthouse_without_memory_accepts_commits() {
        let t = Instant::now();
        let mut e = QuorumEngine::new(progress_opts(), 100, t);
        assert_eq!(e.commit("a", 7, 12, t).unwrap(), CommitVerdict::Accepted);
        assert_eq!(e.best_known_step(), Some(12));
    }

    /// A lighthouse at quorum {a, b, c} where a announced step 101 (b and c are still at
    /// 100), its durable state, and the time.
    fn before_restart() -> (Durable, i64, Instant) {
        let (mut e, t) = running(100);
        let qid = e.previous().unwrap().quorum_id;
        assert_eq!(e.commit("a", qid, 101, t).unwrap(), CommitVerdict::Accepted);
        let d = e.durable();
        assert_eq!(d.quorum_id, Some(qid));
        assert_eq!(d.members, ["a", "b", "c"]);
        assert_eq!(
            (d.best_step, d.holders.clone()),
            (Some(101), vec!["a".to_string()])
        );
        (d, qid, t)
    }

    #[test]
    fn a_restarted_lighthouse_waits_for_the_holder_of_the_best_step_it_remembers() {
        let (d, _, t0) = before_restart();
        // Restarted while a is stopped: b and c ask at 100; a is silent and has no session.
        let mut t = t0 + Duration::from_secs(1);
        let mut e = QuorumEngine::restored(progress_opts(), 50, t, d);
        assert_eq!(e.best_known_step(), Some(101));
        e.join(at("b", 100), t).unwrap();
        e.join(at("c", 100), t).unwrap();
        // The restored holder is not counted healthy (b and c are a majority) but is waited
        // for, past the startup hold, up to progress_wait after the restart.
        for _ in 0..95 {
            t += Duration::from_millis(100);
            e.heartbeat("b", t).unwrap();
            e.heartbeat("c", t).unwrap();
            assert!(e.tick(t).is_none(), "issued behind the remembered holder");
        }
        assert!(matches!(
            e.verdict(t),
            Verdict::WaitingForProgress { step: 101, .. }
        ));
        // a resumes: its heartbeat (and then its request) end the wait without regression.
        e.heartbeat_with_step("a", Some(101), t).unwrap();
        e.join(at("a", 101), t).unwrap();
        let q = e.poll(t).expect("a quorum");
        assert_eq!(ids(&q), ["a", "b", "c"]);
        assert!(q.quorum_id > 50);
        assert!(e.take_regressions().is_empty());
    }

    #[test]
    fn a_restarted_lighthouse_waits_for_the_best_holder_left_when_the_best_step_holders_died() {
        // a held 101 and died; b (100) is stopped; c died too. The previous life waited for b.
        let (mut e, t0) = running(100);
        let qid = e.previous().unwrap().quorum_id;
        e.commit("a", qid, 101, t0).unwrap();
        e.lost("a", t0);
        e.lost("c", t0);
        let d = e.durable();
        assert_eq!((d.best_step, d.holders.clone()), (Some(101), vec![]));
        assert_eq!(d.others, vec![("b".to_string(), 100)]);
        // Older state files have no `others`: they still load.
        let old: Durable =
            serde_json::from_str(r#"{"quorum_id":5,"members":["a"],"best_step":3,"holders":[]}"#)
                .unwrap();
        assert!(old.others.is_empty());
        // Restarted while b is stopped, a fresh c asks at step 0: the job waits for b, not
        // regresses to 0, and b's return ends the wait.
        let mut t = t0 + Duration::from_secs(1);
        let mut e = QuorumEngine::restored(progress_opts(), 50, t, d);
        e.join(at("c", 0), t).unwrap();
        // Past the startup hold (5 s) and up to progress_wait (10 s) after the restart.
        for _ in 0..90 {
            t += Duration::from_millis(100);
            e.heartbeat("c", t).unwrap();
            assert!(
                e.tick(t).is_none(),
                "issued behind the remembered holder of 100"
            );
        }
        assert!(matches!(
            e.verdict(t),
            Verdict::WaitingForProgress { step: 100, .. }
        ));
        e.heartbeat_with_step("b", Some(100), t).unwrap();
        e.join(at("b", 100), t).unwrap();
        let q = e.poll(t).expect("a quorum");
        assert_eq!(ids(&q), ["b", "c"]);
        let r = e.take_regressions();
        assert_eq!(r.len(), 1, "101 is lost with its holder, 100 is not");
        assert_eq!((r[0].from_step, r[0].to_step), (101, 100));
    }

    #[test]
    fn a_restarted_lighthouse_does_not_wait_for_an_incarnation_its_group_replaced() {
        // g1's old incarnation held 1411 (remembered by the state file); its group now runs
        // a new incarnation at step 0. Waiting for the old one (progress_wait after every
        // restart of the lighthouse) would stall the job for as long as the lighthouse keeps
        // being restarted: the regression is decided at once, as every holder is gone.
        const OLD: &str = "g1:11111111-1111-1111-1111-111111111111";
        const NEW: &str = "g1:22222222-2222-2222-2222-222222222222";
        const G0: &str = "g0:33333333-3333-3333-3333-333333333333";
        let d = Durable {
            quorum_id: Some(40),
            members: vec![OLD.into()],
            best_step: Some(1411),
            holders: vec![OLD.into()],
            others: vec![],
        };
        let t0 = Instant::now();
        let mut e = QuorumEngine::restored(progress_opts(), 50, t0, d);
        // A plain id shares no group with it: still remembered.
        e.heartbeat("g1", t0).unwrap();
        assert!(e.durable().holders.contains(&OLD.to_string()));
        let mut t = t0 + Duration::from_secs(6); // past the startup hold
        e.join(at(NEW, 0), t).unwrap();
        e.join(at(G0, 0), t).unwrap();
        assert!(!e.durable().holders.contains(&OLD.to_string()));
        let q = loop {
            if let Some(q) = e.tick(t) {
                break q;
            }
            t += Duration::from_millis(100);
            assert!(
                t < t0 + progress_opts().progress_wait,
                "waited for the replaced one"
            );
            e.heartbeat(NEW, t).unwrap();
            e.heartbeat(G0, t).unwrap();
        };
        assert_eq!(ids(&q), [G0, NEW]);
        let r = e.take_regressions();
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].from_step, r[0].to_step), (1411, 0));
        assert!(
            r[0].alive_holders.is_empty(),
            "the replaced incarnation is not alive"
        );
    }

    #[test]
    fn a_restarted_lighthouse_gives_up_on_a_remembered_holder_after_progress_wait() {
        let (d, _, t0) = before_restart();
        let t = t0 + Duration::from_secs(1);
        let mut e = QuorumEngine::restored(progress_opts(), 50, t, d);
        e.join(at("b", 100), t).unwrap();
        e.join(at("c", 100), t).unwrap();
        let later = t + progress_opts().progress_wait;
        e.heartbeat("b", later).unwrap();
        e.heartbeat("c", later).unwrap();
        let q = e.tick(later).expect("issued once the holder is waited out");
        assert_eq!(ids(&q), ["b", "c"]);
        let r = e.take_regressions();
        assert_eq!(r.len(), 1);
        assert_eq!((r[0].from_step, r[0].to_step), (101, 100));
        assert_eq!(r[0].alive_holders, ["a"]);
    }

    #[test]
    fn a_restarted_lighthouse_ends_its_startup_hold_once_the_remembered_quorum_asks() {
        let (d, _, t0) = before_restart();
        let t = t0 + Duration::from_secs(1);
        // Every member of the remembered quorum asks, one at the remembered best step: the
        // first quorum is issued at once, not at the end of the startup hold.
        let mut e = QuorumEngine::restored(progress_opts(), 50, t, d.clone());
        e.join(at("b", 100), t).unwrap();
        e.join(at("c", 100), t).unwrap();
        assert!(matches!(e.verdict(t), Verdict::StartupHold { .. }));
        e.join(at("a", 101), t).unwrap();
        let q = e.poll(t).expect("issued without the hold");
        assert_eq!(ids(&q), ["a", "b", "c"]);
        assert!(e.take_regressions().is_empty());

        // A member missing, or every member behind the remembered best step: the hold stays.
        let hold = progress_opts().heartbeat_timeout;
        let mut e = QuorumEngine::restored(progress_opts(), 50, t, d.clone());
        e.join(at("a", 101), t).unwrap();
        e.join(at("b", 100), t).unwrap();
        e.join(at("z", 0), t).unwrap();
        assert!(matches!(e.verdict(t), Verdict::StartupHold { .. }));
        let mut e = QuorumEngine::restored(progress_opts(), 50, t, d.clone());
        for id in ["a", "b", "c"] {
            e.join(at(id, 100), t).unwrap();
        }
        assert!(e.tick(t + hold - Duration::from_millis(1)).is_none());
        assert!(e.tick(t + hold).is_some());

        // A lighthouse that remembers no quorum but was told of one by a manager: the hold
        // runs to its end (no remembered quorum can end it early).
        let mut e = QuorumEngine::new(progress_opts(), 50, t);
        e.join(at("a", 0), t).unwrap();
        e.holds_quorum("a", 7);
        assert!(matches!(e.verdict(t), Verdict::StartupHold { .. }));
        assert!(e.tick(t + hold - Duration::from_millis(1)).is_none());
        assert!(e.tick(t + hold).is_some());
    }

    #[test]
    fn a_restarted_lighthouse_refuses_commits_under_quorums_it_had_replaced() {
        let (d, qid, t0) = before_restart();
        let t = t0 + Duration::from_secs(1);
        let mut e = QuorumEngine::restored(progress_opts(), 50, t, d.clone());
        // Ids stay above the remembered one even with an initial id below it.
        assert!(matches!(
            e.commit("b", qid - 1, 101, t).unwrap(),
            CommitVerdict::Refused(_)
        ));
        assert!(matches!(
            e.commit("z", qid, 101, t).unwrap(),
            CommitVerdict::Refused(_)
        ));
        assert_eq!(e.commit("b", qid, 101, t).unwrap(), CommitVerdict::Accepted);
        // Once this life issues a quorum without c, c's commit under the old one is refused.
        let mut t = t + Duration::from_secs(6);
        e.heartbeat_with_step("a", Some(101), t).unwrap();
        e.join(at("a", 101), t).unwrap();
        e.join(at("b", 101), t).unwrap();
        t += progress_opts().join_timeout;
        let q = e.tick(t).expect("a and b");
        assert!(q.quorum_id > qid);
        assert!(matches!(
            e.commit("c", qid, 101, t).unwrap(),
            CommitVerdict::Refused(_)
        ));
        let d2 = e.durable();
        assert_eq!(
            (d2.quorum_id, d2.members),
            (Some(q.quorum_id), vec!["a".into(), "b".into()])
        );
    }

    #[test]
    fn durable_state_changes_with_progress_and_membership_only() {
        let (mut e, t) = running(100);
        let qid = e.previous().unwrap().quorum_id;
        let r0 = e.durable_revision();
        e.heartbeat_with_step("a", Some(100), t).unwrap();
        assert_eq!(e.durable_revision(), r0, "nothing new");
        e.commit("a", qid, 101, t).unwrap();
        let r1 = e.durable_revision();
        assert!(r1 > r0);
        e.lost("a", t);
        assert!(e.durable_revision() > r1);
        assert_eq!(e.durable().holders, Vec::<String>::new());
    }

    #[test]
    fn a_remembered_holder_heard_once_then_silent_without_a_session_is_still_waited_for() {
        let (d, _, t0) = before_restart();
        let mut t = t0 + Duration::from_secs(1);
        let mut e = QuorumEngine::restored(progress_opts(), 50, t, d);
        // a asks once right after the restart, then stops before its manager reopens its
        // session; its request is answered by a quorum with a fresh b.
        e.join(at("a", 101), t).unwrap();
        e.join(at("b2", 0), t).unwrap();
        t += Duration::from_secs(6);
        let q = e.tick(t).expect("a and b2 past the startup hold");
        assert_eq!(ids(&q), ["a", "b2"]);
        // a is declared lost (silent past the heartbeat timeout) and b2 asks alone at 0: it
        // waits for a, which may still come back, until progress_wait after the restart.
        t += Duration::from_secs(3);
        e.heartbeat("b2", t).unwrap();
        assert!(e.tick(t).is_none());
        assert_eq!(e.take_lost().len(), 1);
        e.join(at("b2", 0), t).unwrap();
        assert!(e.tick(t).is_none(), "issued behind the remembered holder");
        assert!(matches!(
            e.verdict(t),
            Verdict::WaitingForProgress { step: 101, .. }
        ));
        // Once a's session opens, its liveness is the session's.
        e.session_opened("a", t).unwrap();
        e.join(at("a", 101), t).unwrap();
        let q = e.poll(t).expect("a is back");
        assert_eq!(ids(&q), ["a", "b2"]);
        assert!(e.take_regressions().is_empty());
    }
}
