//! The per-step commit vote of one replica group: a barrier plus an AND over its ranks.
//!
//! Rules (the round mechanics, written once for both barriers, are [`super::round`]'s):
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

use std::future::Future;
use std::time::Duration;

use tokio::time::Instant;

use super::round::{Reply, Round, Wording};
use crate::error::{Error, Result};

/// A rank's vote in a commit round.
#[derive(Debug, Clone, Copy)]
struct Vote(bool);

impl Wording for Vote {
    fn step_mismatch(rank: i64, step: i64, _other_rank: i64, other_step: i64) -> String {
        format!(
            "should_commit step mismatch: group rank {rank} voted for step {step} while step \
             {other_step} is being voted on"
        )
    }

    fn replaced(rank: i64, step: i64) -> String {
        format!("group rank {rank} voted again for step {step}; this earlier vote was replaced")
    }
}

/// Barrier + AND over a replica group's ranks, one round per step.
#[derive(Debug)]
pub struct CommitBarrier {
    round: Round<Vote, bool>,
}

impl CommitBarrier {
    /// A barrier for a group of `world_size` ranks (at least 1).
    pub fn new(world_size: u64) -> Result<Self> {
        Ok(Self {
            round: Round::new(world_size)?,
        })
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
        let deadline = Instant::now() + timeout;
        let mut joined = self
            .round
            .join::<Vote>(group_rank, step, deadline, Vote(vote))?;
        let Some(round) = joined.complete.take() else {
            let what = format!("should_commit for step {step} (group rank {group_rank})");
            return joined.answer(deadline, timeout, &what).await;
        };
        // This rank completed the round: it decides, and answers every voter (itself too).
        let decision = round.members.iter().all(|m| m.value.0);
        let earliest = round
            .members
            .iter()
            .map(|m| m.deadline)
            .min()
            .unwrap_or(deadline);
        let replies: Vec<Reply<bool>> = round.members.into_iter().map(|m| m.reply).collect();
        match (decision, gate) {
            (true, Some(gate)) => {
                let left = earliest.saturating_duration_since(Instant::now());
                Self::run_gate(gate(step, left.mul_f64(0.9)), replies).await
            }
            (decision, _) => {
                for tx in replies {
                    let _ = tx.send(Ok(decision));
                }
                Ok(decision)
            }
        }
    }

    /// Runs a round's gate in its own task and hands its decision to the round's voters.
    /// The gate bounds itself (it is given the round's budget).
    async fn run_gate<F>(gate: F, replies: Vec<Reply<bool>>) -> Result<bool>
    where
        F: Future<Output = bool> + Send + 'static,
    {
        let task = tokio::spawn(async move {
            let decision = gate.await;
            for tx in replies {
                let _ = tx.send(Ok(decision));
            }
            decision
        });
        task.await.map_err(|_| Error::Shutdown)
    }

    /// Number of votes in the round in progress (for tests and status).
    pub fn pending_votes(&self) -> usize {
        self.round.waiting()
    }

    /// Decides the round in progress "no" (a member of the quorum was lost): its waiting
    /// voters get false now, and later votes for the same step get false at once. Returns
    /// the step decided, if a round was in progress.
    pub fn abort_round(&self) -> Option<i64> {
        self.round.close(false)
    }

    /// The group received a new quorum: a step decided "no" by [`CommitBarrier::abort_round`]
    /// in the previous one can be voted on again. Every rank of the group asked for the new
    /// quorum, so each has cast (or given up) its vote of the aborted round by now.
    pub fn new_quorum(&self) {
        self.round.reopen();
    }

    /// Fails every waiting voter with `Shutdown` (the server is going away).
    pub fn fail_all(&self) {
        self.round.fail_all();
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use tokio::sync::oneshot;

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

    /// Ranks 0, 1, … vote `votes` on `step` in tasks left waiting for the rest of the group.
    async fn waiting(
        b: &Arc<CommitBarrier>,
        step: i64,
        votes: &[bool],
    ) -> Vec<tokio::task::JoinHandle<Result<bool>>> {
        let handles = votes
            .iter()
            .enumerate()
            .map(|(rank, &vote)| spawn_vote(b, rank as i64, step, vote, LONG))
            .collect();
        settle().await;
        handles
    }

    /// Every rank's decision of a round on `step` whose ranks vote `votes`, the last rank
    /// once all the others wait.
    async fn round(b: &Arc<CommitBarrier>, step: i64, votes: &[bool]) -> Vec<bool> {
        let (&last, first) = votes.split_last().unwrap();
        let handles = waiting(b, step, first).await;
        let last = b.vote(first.len() as i64, step, last, LONG).await.unwrap();
        let mut decisions = Vec::new();
        for h in handles {
            decisions.push(h.await.unwrap().unwrap());
        }
        decisions.push(last);
        decisions
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
        assert_eq!(round(&b, 1, &[false, true]).await, [false, false]);
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
        let waiters = waiting(&b, 7, &[true, true]).await;
        // Rank 2 is ahead: its vote must not complete step 7's round.
        assert!(b.vote(2, 8, true, LONG).await.is_err());
        for r in waiters {
            assert!(r.await.unwrap().is_err());
        }
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
        assert_eq!(round(&b, 3, &[true, true]).await, [true, true]);
    }

    #[tokio::test(start_paused = true)]
    async fn abort_round_decides_no_for_waiting_and_late_voters_of_that_step_only() {
        let b = Arc::new(CommitBarrier::new(3).unwrap());
        assert_eq!(b.abort_round(), None, "nothing to abort");
        let waiters = waiting(&b, 9, &[true, true]).await;
        assert_eq!(b.abort_round(), Some(9));
        for r in waiters {
            assert!(!r.await.unwrap().unwrap());
        }
        // The rank that was held up votes later: the same decision, at once.
        let start = tokio::time::Instant::now();
        assert!(!b.vote(2, 9, true, LONG).await.unwrap());
        assert_eq!(start.elapsed(), Duration::ZERO);
        // The next step is voted normally.
        assert_eq!(round(&b, 10, &[true; 3]).await, [true; 3]);
    }

    #[tokio::test(start_paused = true)]
    async fn an_aborted_step_is_voted_again_in_the_next_quorum() {
        // The survivors of a lost member retry the step they could not commit: under the
        // new quorum the abort no longer applies (it once did forever, so a two-rank group
        // never committed again after losing its peer mid-vote).
        let b = Arc::new(CommitBarrier::new(2).unwrap());
        let r0 = waiting(&b, 25, &[true]).await.remove(0);
        assert_eq!(b.abort_round(), Some(25));
        assert!(!r0.await.unwrap().unwrap());
        assert!(
            !b.vote(1, 25, true, LONG).await.unwrap(),
            "late voter, same quorum"
        );
        b.new_quorum();
        assert_eq!(round(&b, 25, &[true, true]).await, [true, true]);
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
