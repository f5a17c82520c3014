//! The per-step commit vote of one replica group: a barrier plus an AND over its ranks.
//!
//! Rules:
//! - A round is keyed by its step. It completes when all `world_size` group ranks have voted;
//!   everyone then gets the same decision: true only if every rank voted true.
//! - A vote for another step than the round in progress means the group's ranks disagree on
//!   the step. Nothing sensible can be committed, so the whole round fails: the caller AND every
//!   rank already waiting get `FailedPrecondition` naming both steps, and the round is cleared.
//!   The waiting ranks learn it at once instead of hanging until their deadline, and no vote of
//!   one step is ever counted in another step's round.
//! - A rank that votes twice in one round replaces its earlier vote; the earlier caller gets
//!   `FailedPrecondition` (it would otherwise never be answered).
//! - A voter whose deadline passes (or whose request is dropped) leaves the round, so a later
//!   vote by the same rank counts once and a decision never includes a vote nobody waits on.
//! - [`CommitBarrier::abort_round`] (a member of the group's quorum was declared lost) decides
//!   the round in progress "no" at once: the waiting ranks get false now, and so do the ranks
//!   of that step that vote later, instead of waiting on a rank held up by the lost peer.
//! - [`CommitBarrier::vote_gated`]: a "yes" round only stands if its gate (the write-ahead
//!   commit announcement to the lighthouse) says so. The gate runs once per round, started by
//!   the rank that completes it, in a task of its own (a cancelled caller cannot leave the
//!   others waiting); every rank gets the gated decision. The gate's budget runs to the
//!   earliest deadline among the round's voters (less a tenth, for the answer to travel),
//!   so a rank that voted long before the last one is still answered in time.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::error::{Error, Result};

/// Barrier + AND over a replica group's ranks, one round per step.
#[derive(Debug)]
pub struct CommitBarrier {
    world_size: u64,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    round: Option<Round>,
    next_ticket: u64,
    /// A step decided "no" by `abort_round`: its remaining votes get false at once, until
    /// the group has a new quorum (`new_quorum`), in which the step is retried.
    aborted_step: Option<i64>,
}

#[derive(Debug)]
struct Round {
    step: i64,
    voters: HashMap<i64, Voter>,
}

#[derive(Debug)]
struct Voter {
    vote: bool,
    ticket: u64,
    /// When this voter stops waiting.
    deadline: Instant,
    tx: oneshot::Sender<Result<bool>>,
}

/// Removes a voter from its round when its wait ends without a decision (timeout, cancel).
struct LeaveGuard<'a> {
    barrier: &'a CommitBarrier,
    group_rank: i64,
    ticket: u64,
}

impl Drop for LeaveGuard<'_> {
    fn drop(&mut self) {
        let mut state = self.barrier.lock();
        if let Some(round) = state.round.as_mut() {
            if round
                .voters
                .get(&self.group_rank)
                .is_some_and(|v| v.ticket == self.ticket)
            {
                round.voters.remove(&self.group_rank);
                if round.voters.is_empty() {
                    state.round = None;
                }
            }
        }
    }
}

impl CommitBarrier {
    /// A barrier for a group of `world_size` ranks (at least 1).
    pub fn new(world_size: u64) -> Result<Self> {
        if world_size == 0 {
            return Err(Error::InvalidArgument(
                "world_size must be at least 1".into(),
            ));
        }
        Ok(Self {
            world_size,
            state: Mutex::new(State::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        // A panic while holding the lock cannot leave the state half-updated in a way that
        // matters more than losing the round, so recover the guard instead of propagating.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Casts `group_rank`'s vote for `step` and waits (up to `timeout`) for the group's decision.
    pub async fn vote(
        &self,
        group_rank: i64,
        step: i64,
        vote: bool,
        timeout: Duration,
    ) -> Result<bool> {
        self.vote_inner(
            group_rank,
            step,
            vote,
            timeout,
            None::<fn(i64, Duration) -> std::future::Ready<bool>>,
        )
        .await
    }

    /// Like [`CommitBarrier::vote`], but a "yes" decision only stands if `gate(step, budget)`
    /// resolves to true; the gate must answer within `budget` (the time left before the
    /// round's earliest voter stops waiting, less a margin). The rank completing the round
    /// runs the gate (once, in its own task); every rank of the round gets the gated decision.
    pub async fn vote_gated<G, F>(
        &self,
        group_rank: i64,
        step: i64,
        vote: bool,
        timeout: Duration,
        gate: G,
    ) -> Result<bool>
    where
        G: FnOnce(i64, Duration) -> F,
        F: Future<Output = bool> + Send + 'static,
    {
        self.vote_inner(group_rank, step, vote, timeout, Some(gate))
            .await
    }

    async fn vote_inner<G, F>(
        &self,
        group_rank: i64,
        step: i64,
        vote: bool,
        timeout: Duration,
        gate: Option<G>,
    ) -> Result<bool>
    where
        G: FnOnce(i64, Duration) -> F,
        F: Future<Output = bool> + Send + 'static,
    {
        if group_rank < 0 || group_rank as u64 >= self.world_size {
            return Err(Error::InvalidArgument(format!(
                "group_rank {group_rank} is outside [0, {})",
                self.world_size
            )));
        }
        if step < 0 {
            return Err(Error::InvalidArgument(format!(
                "step must not be negative, got {step}"
            )));
        }
        // Ok: this rank waits for the round; Err: it completed the round (decision, the
        // other voters to answer).
        #[allow(clippy::type_complexity)]
        let waiting: std::result::Result<
            (u64, oneshot::Receiver<Result<bool>>),
            (bool, Instant, Vec<oneshot::Sender<Result<bool>>>),
        > = {
            let deadline = Instant::now() + timeout;
            let mut state = self.lock();
            match state.aborted_step {
                Some(aborted) if aborted == step => return Ok(false),
                Some(_) => state.aborted_step = None,
                None => {}
            }
            if let Some(round) = state.round.as_ref() {
                if round.step != step {
                    let msg = format!(
                        "should_commit step mismatch: group rank {group_rank} voted for step \
                         {step} while step {} is being voted on",
                        round.step
                    );
                    if let Some(round) = state.round.take() {
                        for (_, v) in round.voters {
                            let _ = v.tx.send(Err(Error::FailedPrecondition(msg.clone())));
                        }
                    }
                    return Err(Error::FailedPrecondition(msg));
                }
            }
            state.next_ticket += 1;
            let ticket = state.next_ticket;
            let world_size = self.world_size;
            let round = state.round.get_or_insert_with(|| Round {
                step,
                voters: HashMap::new(),
            });
            let (tx, rx) = oneshot::channel();
            if let Some(old) = round.voters.insert(
                group_rank,
                Voter {
                    vote,
                    ticket,
                    deadline,
                    tx,
                },
            ) {
                let _ = old.tx.send(Err(Error::FailedPrecondition(format!(
                    "group rank {group_rank} voted again for step {step}; this earlier vote \
                     was replaced"
                ))));
            }
            if round.voters.len() as u64 == world_size {
                let decision = round.voters.values().all(|v| v.vote);
                let earliest = round
                    .voters
                    .values()
                    .map(|v| v.deadline)
                    .min()
                    .unwrap_or(deadline);
                let others: Vec<oneshot::Sender<Result<bool>>> = state
                    .round
                    .take()
                    .map(|round| {
                        round
                            .voters
                            .into_iter()
                            .filter(|(rank, _)| *rank != group_rank)
                            .map(|(_, v)| v.tx)
                            .collect()
                    })
                    .unwrap_or_default();
                Err((decision, earliest, others))
            } else {
                Ok((ticket, rx))
            }
        };
        let (ticket, rx) = match (waiting, gate) {
            (Ok(waiting), _) => waiting,
            (Err((true, earliest, others)), Some(gate)) => {
                let left = earliest.saturating_duration_since(Instant::now());
                return Self::run_gate(gate(step, left.mul_f64(0.9)), others).await;
            }
            (Err((decision, _, others)), _) => {
                for tx in others {
                    let _ = tx.send(Ok(decision));
                }
                return Ok(decision);
            }
        };
        let _guard = LeaveGuard {
            barrier: self,
            group_rank,
            ticket,
        };
        match tokio::time::timeout(timeout, rx).await {
            Ok(Ok(result)) => result,
            Ok(Err(_)) => Err(Error::Shutdown),
            Err(_) => Err(Error::timeout(
                &format!("should_commit for step {step} (group rank {group_rank})"),
                timeout,
            )),
        }
    }

    /// Runs a round's gate in its own task and hands its decision to the round's other
    /// voters. The gate bounds itself (it is given the round's budget).
    async fn run_gate<F>(gate: F, others: Vec<oneshot::Sender<Result<bool>>>) -> Result<bool>
    where
        F: Future<Output = bool> + Send + 'static,
    {
        let task = tokio::spawn(async move {
            let decision = gate.await;
            for tx in others {
                let _ = tx.send(Ok(decision));
            }
            decision
        });
        task.await.map_err(|_| Error::Shutdown)
    }

    /// Number of votes in the round in progress (for tests and status).
    pub fn pending_votes(&self) -> usize {
        self.lock().round.as_ref().map_or(0, |r| r.voters.len())
    }

    /// Decides the round in progress "no" (a member of the quorum was lost): its waiting
    /// voters get false now, and later votes for the same step get false at once. Returns
    /// the step decided, if a round was in progress.
    pub fn abort_round(&self) -> Option<i64> {
        let mut state = self.lock();
        let round = state.round.take()?;
        state.aborted_step = Some(round.step);
        for (_, v) in round.voters {
            let _ = v.tx.send(Ok(false));
        }
        Some(round.step)
    }

    /// The group received a new quorum: a step decided "no" by [`CommitBarrier::abort_round`]
    /// in the previous one can be voted on again. Every rank of the group asked for the new
    /// quorum, so each has cast (or given up) its vote of the aborted round by now.
    pub fn new_quorum(&self) {
        self.lock().aborted_step = None;
    }

    /// Fails every waiting voter with `Shutdown` (the server is going away).
    pub fn fail_all(&self) {
        if let Some(round) = self.lock().round.take() {
            for (_, v) in round.voters {
                let _ = v.tx.send(Err(Error::Shutdown));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    const LONG: Duration = Duration::from_secs(30);

    async fn settle() {
        for _ in 0..10 {
            tokio::task::yield_now().await;
        }
    }

    fn spawn_vote(
        b: &Arc<CommitBarrier>,
        rank: i64,
        step: i64,
        vote: bool,
        timeout: Duration,
    ) -> tokio::task::JoinHandle<Result<bool>> {
        let b = b.clone();
        tokio::spawn(async move { b.vote(rank, step, vote, timeout).await })
    }

    #[tokio::test(start_paused = true)]
    async fn decision_is_the_and_of_all_votes() {
        for (votes, expected) in [
            (vec![true, true, true], true),
            (vec![true, false, true], false),
            (vec![false, false, false], false),
        ] {
            let b = Arc::new(CommitBarrier::new(3).unwrap());
            let handles: Vec<_> = votes
                .iter()
                .enumerate()
                .map(|(r, &v)| spawn_vote(&b, r as i64, 5, v, LONG))
                .collect();
            for h in handles {
                assert_eq!(h.await.unwrap().unwrap(), expected);
            }
            assert_eq!(b.pending_votes(), 0);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn single_rank_group_decides_at_once() {
        let b = CommitBarrier::new(1).unwrap();
        assert!(b.vote(0, 0, true, LONG).await.unwrap());
        assert!(!b.vote(0, 1, false, LONG).await.unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn step_mismatch_fails_the_caller_and_the_waiting_ranks() {
        let b = Arc::new(CommitBarrier::new(3).unwrap());
        let r0 = spawn_vote(&b, 0, 4, true, LONG);
        settle().await;
        let err = b.vote(1, 5, true, LONG).await.unwrap_err();
        assert!(matches!(err, Error::FailedPrecondition(_)), "{err}");
        assert!(err.to_string().contains("step 4"), "{err}");
        let err0 = r0.await.unwrap().unwrap_err();
        assert!(matches!(err0, Error::FailedPrecondition(_)), "{err0}");
        assert_eq!(b.pending_votes(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn votes_never_leak_into_the_next_round() {
        let b = Arc::new(CommitBarrier::new(2).unwrap());
        // Step 1: rank 0 votes false, rank 1 true → false for both.
        let r0 = spawn_vote(&b, 0, 1, false, LONG);
        settle().await;
        assert!(!b.vote(1, 1, true, LONG).await.unwrap());
        assert!(!r0.await.unwrap().unwrap());
        // Step 2 starts clean: nothing of step 1 is counted.
        assert_eq!(b.pending_votes(), 0);
        let r0 = spawn_vote(&b, 0, 2, true, LONG);
        settle().await;
        assert_eq!(b.pending_votes(), 1);
        assert!(b.vote(1, 2, true, LONG).await.unwrap());
        assert!(r0.await.unwrap().unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn a_vote_for_the_next_step_is_not_counted_in_this_round() {
        let b = Arc::new(CommitBarrier::new(3).unwrap());
        let r0 = spawn_vote(&b, 0, 7, true, LONG);
        let r1 = spawn_vote(&b, 1, 7, true, LONG);
        settle().await;
        // Rank 2 is ahead: its vote must not complete step 7's round.
        assert!(b.vote(2, 8, true, LONG).await.is_err());
        assert!(r0.await.unwrap().is_err());
        assert!(r1.await.unwrap().is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn timed_out_voter_leaves_the_round() {
        let b = Arc::new(CommitBarrier::new(2).unwrap());
        let start = tokio::time::Instant::now();
        let err = b
            .vote(0, 3, false, Duration::from_millis(100))
            .await
            .unwrap_err();
        assert!(err.is_timeout(), "{err}");
        assert_eq!(start.elapsed(), Duration::from_millis(100));
        assert_eq!(b.pending_votes(), 0);
        // Its false vote is gone: the next two votes decide alone.
        let r0 = spawn_vote(&b, 0, 3, true, LONG);
        settle().await;
        assert!(b.vote(1, 3, true, LONG).await.unwrap());
        assert!(r0.await.unwrap().unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn cancelled_voter_leaves_the_round() {
        let b = Arc::new(CommitBarrier::new(2).unwrap());
        let r0 = spawn_vote(&b, 0, 3, false, LONG);
        settle().await;
        assert_eq!(b.pending_votes(), 1);
        r0.abort();
        let _ = r0.await;
        assert_eq!(b.pending_votes(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn revote_replaces_the_earlier_vote() {
        let b = Arc::new(CommitBarrier::new(2).unwrap());
        let first = spawn_vote(&b, 0, 3, false, LONG);
        settle().await;
        let second = spawn_vote(&b, 0, 3, true, LONG);
        settle().await;
        assert!(first.await.unwrap().is_err());
        assert_eq!(b.pending_votes(), 1);
        assert!(b.vote(1, 3, true, LONG).await.unwrap());
        assert!(second.await.unwrap().unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn bad_input_is_refused_and_changes_nothing() {
        let b = CommitBarrier::new(2).unwrap();
        for (rank, step) in [(-1, 0), (2, 0), (0, -1)] {
            assert!(matches!(
                b.vote(rank, step, true, LONG).await,
                Err(Error::InvalidArgument(_))
            ));
        }
        assert_eq!(b.pending_votes(), 0);
        assert!(CommitBarrier::new(0).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn abort_round_decides_no_for_waiting_and_late_voters_of_that_step_only() {
        let b = Arc::new(CommitBarrier::new(3).unwrap());
        assert_eq!(b.abort_round(), None, "nothing to abort");
        let r0 = spawn_vote(&b, 0, 9, true, LONG);
        let r1 = spawn_vote(&b, 1, 9, true, LONG);
        settle().await;
        assert_eq!(b.abort_round(), Some(9));
        assert!(!r0.await.unwrap().unwrap());
        assert!(!r1.await.unwrap().unwrap());
        // The rank that was held up votes later: the same decision, at once.
        let start = tokio::time::Instant::now();
        assert!(!b.vote(2, 9, true, LONG).await.unwrap());
        assert_eq!(start.elapsed(), Duration::ZERO);
        // The next step is voted normally.
        let r0 = spawn_vote(&b, 0, 10, true, LONG);
        let r1 = spawn_vote(&b, 1, 10, true, LONG);
        settle().await;
        assert!(b.vote(2, 10, true, LONG).await.unwrap());
        assert!(r0.await.unwrap().unwrap() && r1.await.unwrap().unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn an_aborted_step_is_voted_again_in_the_next_quorum() {
        // The survivors of a lost member retry the step they could not commit: under the
        // new quorum the abort no longer applies (it once did forever, so a two-rank group
        // never committed again after losing its peer mid-vote).
        let b = Arc::new(CommitBarrier::new(2).unwrap());
        let r0 = spawn_vote(&b, 0, 25, true, LONG);
        settle().await;
        assert_eq!(b.abort_round(), Some(25));
        assert!(!r0.await.unwrap().unwrap());
        assert!(
            !b.vote(1, 25, true, LONG).await.unwrap(),
            "late voter, same quorum"
        );
        b.new_quorum();
        let r0 = spawn_vote(&b, 0, 25, true, LONG);
        settle().await;
        assert!(b.vote(1, 25, true, LONG).await.unwrap());
        assert!(r0.await.unwrap().unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn fail_all_answers_waiters() {
        let b = Arc::new(CommitBarrier::new(2).unwrap());
        let r0 = spawn_vote(&b, 0, 3, true, LONG);
        settle().await;
        b.fail_all();
        assert!(matches!(r0.await.unwrap(), Err(Error::Shutdown)));
    }

    #[tokio::test(start_paused = true)]
    async fn a_gated_round_gives_every_rank_the_gate_decision_once() {
        for gate_says in [true, false] {
            let b = Arc::new(CommitBarrier::new(3).unwrap());
            let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
            let gated = |rank: i64| {
                let b = b.clone();
                let calls = calls.clone();
                tokio::spawn(async move {
                    b.vote_gated(rank, 4, true, LONG, move |step, _| {
                        calls.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        async move {
                            assert_eq!(step, 4);
                            tokio::time::sleep(Duration::from_millis(50)).await;
                            gate_says
                        }
                    })
                    .await
                })
            };
            let handles: Vec<_> = (0..3).map(gated).collect();
            for h in handles {
                assert_eq!(h.await.unwrap().unwrap(), gate_says);
            }
            assert_eq!(calls.load(std::sync::atomic::Ordering::SeqCst), 1);
        }
    }

    #[tokio::test(start_paused = true)]
    async fn the_gate_budget_ends_before_the_earliest_voter_stops_waiting() {
        let b = Arc::new(CommitBarrier::new(2).unwrap());
        // Rank 0 waits at most 1 s; rank 1 completes the round 600 ms later with a long
        // timeout: the gate gets what rank 0 has left, less the margin.
        let r0 = spawn_vote(&b, 0, 4, true, Duration::from_secs(1));
        settle().await;
        tokio::time::advance(Duration::from_millis(600)).await;
        let (budget_tx, budget_rx) = oneshot::channel();
        let decided = b
            .vote_gated(1, 4, true, LONG, move |_, budget| {
                let _ = budget_tx.send(budget);
                async { true }
            })
            .await
            .unwrap();
        assert!(decided);
        assert!(r0.await.unwrap().unwrap(), "rank 0 was answered in time");
        let budget = budget_rx.await.unwrap();
        assert_eq!(budget, Duration::from_millis(360));
    }

    #[tokio::test(start_paused = true)]
    async fn a_no_round_never_runs_the_gate() {
        let b = Arc::new(CommitBarrier::new(2).unwrap());
        let r0 = spawn_vote(&b, 0, 4, false, LONG);
        settle().await;
        let decided = b
            .vote_gated(1, 4, true, LONG, |_, _| async {
                panic!("gate run on a no")
            })
            .await
            .unwrap();
        assert!(!decided);
        assert!(!r0.await.unwrap().unwrap());
    }

    #[tokio::test(start_paused = true)]
    async fn a_cancelled_completer_still_answers_the_others() {
        let b = Arc::new(CommitBarrier::new(2).unwrap());
        let r0 = spawn_vote(&b, 0, 4, true, LONG);
        settle().await;
        let completer = {
            let b = b.clone();
            tokio::spawn(async move {
                b.vote_gated(1, 4, true, LONG, |_, _| async {
                    tokio::time::sleep(Duration::from_secs(1)).await;
                    true
                })
                .await
            })
        };
        settle().await;
        completer.abort();
        assert!(r0.await.unwrap().unwrap());
    }
}
