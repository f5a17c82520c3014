//! Helpers of the quorum engine's tests: options, members, scripted scenarios, a small PRNG.

use std::time::{Duration, Instant};

use super::*;
use crate::lighthouse::LighthouseOptions;
use crate::proto::{Quorum, QuorumMember, StateDigest};

pub(super) fn opts(min_replicas: u64) -> LighthouseOptions {
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

pub(super) fn member(id: &str) -> QuorumMember {
    crate::testkit::member(id, 1)
}

/// The members of `q`, in its order.
pub(super) fn ids(q: &Quorum) -> Vec<String> {
    q.participants
        .iter()
        .map(|m| m.replica_id.clone())
        .collect()
}

/// One scripted event of a table-driven scenario.
#[derive(Clone)]
pub(super) enum Ev {
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

pub(super) fn run(min: u64, script: &[Ev]) {
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

pub(super) fn shrink(id: &str) -> QuorumMember {
    QuorumMember {
        shrink_only: true,
        ..member(id)
    }
}

pub(super) fn failing(id: &str) -> QuorumMember {
    QuorumMember {
        commit_failures: 2,
        ..member(id)
    }
}

/// An engine with a fixed hang timeout (and `progress_wait`, if given) whose rounds are
/// never ended by the join timeout: only the hang rules let a round go on without a group.
/// Returns it with the time it was created.
pub(super) fn hang_engine(
    hang_timeout: Duration,
    progress_wait: Option<Duration>,
) -> (QuorumEngine, Instant) {
    let t0 = Instant::now();
    let base = opts(1);
    let opts = LighthouseOptions {
        hang_timeout: Some(hang_timeout),
        progress_wait: progress_wait.unwrap_or(base.progress_wait),
        join_timeout: Duration::from_secs(600),
        ..base
    };
    (QuorumEngine::new(opts, 1, t0), t0)
}

/// Runs `f` every 500 ms from `from` while before `until`; returns the first time past it.
pub(super) fn every_half_second(
    from: Instant,
    until: Instant,
    mut f: impl FnMut(Instant),
) -> Instant {
    let mut t = from;
    while t < until {
        f(t);
        t += Duration::from_millis(500);
    }
    t
}

/// Issues a quorum of `members` (each joins at `t`) and returns it.
pub(super) fn quorum_of(e: &mut QuorumEngine, members: &[&str], t: Instant) -> Quorum {
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
pub(super) fn round_at(
    e: &mut QuorumEngine,
    ids: &[&str],
    step: i64,
    t: Instant,
) -> Vec<(String, i64)> {
    let mut last = None;
    for m in at_steps(ids, step) {
        e.join(m, t).unwrap();
        last = e.poll(t).or(last);
    }
    last.expect("issued")
        .participants
        .iter()
        .map(|m| (m.replica_id.clone(), m.step))
        .collect()
}

/// Options of the no-regression scenarios: 5 s heartbeat timeout (so a 5 s startup hold),
/// 1 s join timeout, 10 s progress wait.
pub(super) fn progress_opts() -> LighthouseOptions {
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

pub(super) fn at(id: &str, step: i64) -> QuorumMember {
    QuorumMember { step, ..member(id) }
}

/// An engine past its startup hold with a quorum {a, b, c} at `step`, and the time.
pub(super) fn running(step: i64) -> (QuorumEngine, Instant) {
    let t0 = Instant::now();
    let mut e = QuorumEngine::new(progress_opts(), 100, t0);
    let t = t0 + Duration::from_secs(6);
    let q = full_round(&mut e, &at_steps(&["a", "b", "c"], step), t);
    assert_eq!(ids(&q), ["a", "b", "c"]);
    assert!(e.take_regressions().is_empty());
    (e, t)
}

pub(super) fn at_steps(ids: &[&str], step: i64) -> Vec<QuorumMember> {
    ids.iter().map(|id| at(id, step)).collect()
}

/// The group the round waits for at `t`; the round must be waiting for a holder of `step`
/// (a newer state than the askers').
#[track_caller]
pub(super) fn waiting_for(e: &QuorumEngine, t: Instant, step: i64) -> String {
    match e.verdict(t) {
        Verdict::WaitingForProgress {
            holder, step: s, ..
        } if s == step => holder,
        v => panic!("not waiting for a holder of step {step}: {v:?}"),
    }
}

/// A one-rank group's state digest of `step`: 16 bytes of `byte`.
pub(super) fn digest(step: i64, byte: u8) -> StateDigest {
    StateDigest {
        step,
        ranks: vec![vec![byte; 16]],
    }
}

/// Groups `ids` ask at `step`, in order.
pub(super) fn join_at(e: &mut QuorumEngine, ids: &[&str], step: i64, t: Instant) {
    for m in at_steps(ids, step) {
        e.join(m, t).unwrap();
    }
}

/// For `ticks` quorum ticks of 100 ms after `t`, the groups `alive` heartbeat and no quorum
/// is issued; returns the last tick's time.
#[track_caller]
pub(super) fn waits(e: &mut QuorumEngine, mut t: Instant, ticks: u32, alive: &[&str]) -> Instant {
    for tick in 1..=ticks {
        t += Duration::from_millis(100);
        for id in alive {
            e.heartbeat(id, t).unwrap();
        }
        if let Some(q) = e.tick(t) {
            panic!("issued at tick {tick} of {ticks}: {q:?}");
        }
    }
    t
}

/// Small deterministic PRNG so the randomized test is reproducible without extra crates.
pub(super) struct XorShift(pub(super) u64);
impl XorShift {
    pub(super) fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    pub(super) fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// Heartbeats `members`, then has them all ask (in order) and returns the quorum.
pub(super) fn full_round(e: &mut QuorumEngine, members: &[QuorumMember], now: Instant) -> Quorum {
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

pub(super) fn refused(v: CommitVerdict) -> String {
    match v {
        CommitVerdict::Refused(why) => why,
        CommitVerdict::Accepted => panic!("accepted"),
    }
}

/// A lighthouse at quorum {a, b, c} where a announced step 101 (b and c are still at
/// 100), its durable state, and the time.
pub(super) fn before_restart() -> (Durable, i64, Instant) {
    let (mut e, t) = running(100);
    let qid = e.previous().unwrap().quorum_id;
    assert_eq!(e.commit("a", qid, 101, t).unwrap(), CommitVerdict::Accepted);
    let d = e.durable(t);
    assert_eq!(d.quorum_id, Some(qid));
    assert_eq!(d.members, ["a", "b", "c"]);
    assert_eq!(
        (d.best_step, d.holders.clone()),
        (Some(101), vec!["a".to_string()])
    );
    (d, qid, t)
}
