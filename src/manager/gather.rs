//! Gathers the quorum requests of a replica group's ranks into one round.
//!
//! The manager server asks the lighthouse once per round, after all `world_size` group ranks
//! have arrived. This module owns that bookkeeping (no I/O): who is waiting, whether they agree
//! on the step, the OR/max of their flags, the longest deadline, and each rank's reply channel.
//!
//! Rules:
//! - A rank whose step differs from the ranks already waiting fails the round: the newcomer and
//!   every waiting rank get `FailedPrecondition` at once (the group is inconsistent).
//! - `shrink_only` and `init_sync` are OR-ed over the ranks, `commit_failures` max-ed.
//! - A rank that asks twice replaces its earlier request (the earlier caller gets an error).
//! - A rank whose wait ends (deadline, cancel) before the round is complete leaves the round.
//! - Each rank's `checkpoint_metadata` is recorded for `CheckpointMetadata` lookups.

use std::collections::HashMap;
use std::sync::Mutex;

use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::error::{Error, Result};
use crate::proto::{ManagerQuorumRequest, ManagerQuorumResponse};

/// The reply channel of one waiting rank.
pub type Reply = oneshot::Sender<Result<ManagerQuorumResponse>>;

/// A complete round, ready to be sent to the lighthouse.
#[derive(Debug)]
pub struct ReadyRound {
    /// The step every rank agreed on.
    pub step: i64,
    /// OR over the ranks.
    pub shrink_only: bool,
    /// OR over the ranks.
    pub init_sync: bool,
    /// Max over the ranks.
    pub commit_failures: i64,
    /// The latest deadline among the ranks: the lighthouse request may run until then.
    pub deadline: Instant,
    /// Every rank's reply channel, by group rank.
    pub replies: Vec<(i64, Reply)>,
}

/// What a rank gets when it joins a round.
#[derive(Debug)]
pub struct Joined {
    /// Identifies this request (a later request of the same rank gets another ticket).
    pub ticket: u64,
    /// Where this rank's answer arrives.
    pub rx: oneshot::Receiver<Result<ManagerQuorumResponse>>,
    /// Set for the rank that completed the round: it must get the round answered.
    pub ready: Option<ReadyRound>,
}

/// The quorum round in progress of one replica group.
#[derive(Debug)]
pub struct QuorumGather {
    world_size: u64,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    waiters: HashMap<i64, Waiter>,
    next_ticket: u64,
    checkpoint_metadata: HashMap<i64, String>,
}

#[derive(Debug)]
struct Waiter {
    ticket: u64,
    step: i64,
    shrink_only: bool,
    init_sync: bool,
    commit_failures: i64,
    deadline: Instant,
    tx: Reply,
}

impl QuorumGather {
    /// Bookkeeping for a group of `world_size` ranks (at least 1).
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
        // The state stays consistent between statements; recover it after a panic elsewhere.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks a rank's request without changing anything.
    pub fn validate(&self, req: &ManagerQuorumRequest) -> Result<()> {
        if req.group_rank < 0 || req.group_rank as u64 >= self.world_size {
            return Err(Error::InvalidArgument(format!(
                "group_rank {} is outside [0, {})",
                req.group_rank, self.world_size
            )));
        }
        if req.step < 0 {
            return Err(Error::InvalidArgument(format!(
                "step must not be negative, got {}",
                req.step
            )));
        }
        if req.commit_failures < 0 {
            return Err(Error::InvalidArgument(format!(
                "commit_failures must not be negative, got {}",
                req.commit_failures
            )));
        }
        Ok(())
    }

    /// Adds a rank to the round in progress. The rank that completes the round gets the
    /// [`ReadyRound`] (including its own reply channel) and must see that it is answered.
    pub fn join(&self, req: &ManagerQuorumRequest, deadline: Instant) -> Result<Joined> {
        self.validate(req)?;
        let mut state = self.lock();
        state
            .checkpoint_metadata
            .insert(req.group_rank, req.checkpoint_metadata.clone());

        if let Some((&other_rank, other)) = state.waiters.iter().find(|(_, w)| w.step != req.step) {
            let msg = format!(
                "quorum step mismatch in the replica group: group rank {} is at step {} but \
                 group rank {other_rank} is at step {}",
                req.group_rank, req.step, other.step
            );
            for (_, w) in state.waiters.drain() {
                let _ = w.tx.send(Err(Error::FailedPrecondition(msg.clone())));
            }
            return Err(Error::FailedPrecondition(msg));
        }

        state.next_ticket += 1;
        let ticket = state.next_ticket;
        let (tx, rx) = oneshot::channel();
        let waiter = Waiter {
            ticket,
            step: req.step,
            shrink_only: req.shrink_only,
            init_sync: req.init_sync,
            commit_failures: req.commit_failures,
            deadline,
            tx,
        };
        if let Some(old) = state.waiters.insert(req.group_rank, waiter) {
            let _ = old.tx.send(Err(Error::FailedPrecondition(format!(
                "group rank {} asked for a quorum again; this earlier request was replaced",
                req.group_rank
            ))));
        }

        let ready = if state.waiters.len() as u64 == self.world_size {
            let mut round = ReadyRound {
                step: req.step,
                shrink_only: false,
                init_sync: false,
                commit_failures: 0,
                deadline,
                replies: Vec::with_capacity(state.waiters.len()),
            };
            for (rank, w) in state.waiters.drain() {
                round.shrink_only |= w.shrink_only;
                round.init_sync |= w.init_sync;
                round.commit_failures = round.commit_failures.max(w.commit_failures);
                round.deadline = round.deadline.max(w.deadline);
                round.replies.push((rank, w.tx));
            }
            round.replies.sort_by_key(|(rank, _)| *rank);
            Some(round)
        } else {
            None
        };
        Ok(Joined { ticket, rx, ready })
    }

    /// Removes `group_rank`'s request `ticket` from the round if it is still waiting there.
    pub fn leave(&self, group_rank: i64, ticket: u64) {
        let mut state = self.lock();
        if state
            .waiters
            .get(&group_rank)
            .is_some_and(|w| w.ticket == ticket)
        {
            state.waiters.remove(&group_rank);
        }
    }

    /// Number of ranks waiting in the round in progress.
    pub fn waiting(&self) -> usize {
        self.lock().waiters.len()
    }

    /// The checkpoint metadata `group_rank` sent with its latest quorum request.
    pub fn checkpoint_metadata(&self, group_rank: i64) -> Result<String> {
        let state = self.lock();
        state
            .checkpoint_metadata
            .get(&group_rank)
            .cloned()
            .ok_or_else(|| {
                let mut known: Vec<_> = state.checkpoint_metadata.keys().copied().collect();
                known.sort_unstable();
                Error::InvalidArgument(format!(
                    "no checkpoint metadata for group rank {group_rank}: it has not asked this \
                     manager for a quorum (ranks seen: {known:?})"
                ))
            })
    }

    /// Fails every waiting rank with `Shutdown` (the server is going away).
    pub fn fail_all(&self) {
        for (_, w) in self.lock().waiters.drain() {
            let _ = w.tx.send(Err(Error::Shutdown));
        }
    }
}

/// Leaves the round when dropped, unless disarmed (the answer arrived).
pub(crate) struct LeaveGuard<'a> {
    pub(crate) gather: &'a QuorumGather,
    pub(crate) group_rank: i64,
    pub(crate) ticket: u64,
}

impl Drop for LeaveGuard<'_> {
    fn drop(&mut self) {
        self.gather.leave(self.group_rank, self.ticket);
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn req(rank: i64, step: i64) -> ManagerQuorumRequest {
        ManagerQuorumRequest {
            group_rank: rank,
            step,
            checkpoint_metadata: format!("meta-{rank}"),
            shrink_only: false,
            init_sync: false,
            commit_failures: 0,
        }
    }

    #[tokio::test(start_paused = true)]
    async fn round_completes_with_the_last_rank_and_merges_flags() {
        let g = QuorumGather::new(3).unwrap();
        let now = Instant::now();
        let mut r0 = req(0, 2);
        r0.shrink_only = true;
        r0.commit_failures = 3;
        let mut r2 = req(2, 2);
        r2.init_sync = true;
        r2.commit_failures = 1;
        let j0 = g.join(&r0, now + Duration::from_secs(5)).unwrap();
        assert!(j0.ready.is_none());
        let j2 = g.join(&r2, now + Duration::from_secs(9)).unwrap();
        assert!(j2.ready.is_none());
        assert_eq!(g.waiting(), 2);
        let j1 = g.join(&req(1, 2), now + Duration::from_secs(1)).unwrap();
        let round = j1.ready.unwrap();
        assert_eq!(round.step, 2);
        assert!(round.shrink_only);
        assert!(round.init_sync);
        assert_eq!(round.commit_failures, 3);
        assert_eq!(round.deadline, now + Duration::from_secs(9));
        let ranks: Vec<_> = round.replies.iter().map(|(r, _)| *r).collect();
        assert_eq!(ranks, vec![0, 1, 2]);
        assert_eq!(g.waiting(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn step_mismatch_fails_everyone_at_once() {
        let g = QuorumGather::new(3).unwrap();
        let dl = Instant::now() + Duration::from_secs(5);
        let j0 = g.join(&req(0, 4), dl).unwrap();
        let j1 = g.join(&req(1, 4), dl).unwrap();
        let err = g.join(&req(2, 5), dl).unwrap_err();
        assert!(matches!(err, Error::FailedPrecondition(_)), "{err}");
        for j in [j0, j1] {
            let got = j.rx.await.unwrap();
            assert!(matches!(got, Err(Error::FailedPrecondition(_))));
        }
        assert_eq!(g.waiting(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn leaving_rank_does_not_count() {
        let g = QuorumGather::new(2).unwrap();
        let dl = Instant::now() + Duration::from_secs(5);
        let j0 = g.join(&req(0, 1), dl).unwrap();
        g.leave(0, j0.ticket);
        assert_eq!(g.waiting(), 0);
        let j1 = g.join(&req(1, 1), dl).unwrap();
        assert!(j1.ready.is_none(), "rank 0 left, the round is not complete");
    }

    #[tokio::test(start_paused = true)]
    async fn stale_ticket_does_not_remove_a_newer_request() {
        let g = QuorumGather::new(2).unwrap();
        let dl = Instant::now() + Duration::from_secs(5);
        let old = g.join(&req(0, 1), dl).unwrap();
        let new = g.join(&req(0, 1), dl).unwrap();
        assert!(matches!(
            old.rx.await.unwrap(),
            Err(Error::FailedPrecondition(_))
        ));
        g.leave(0, old.ticket);
        assert_eq!(g.waiting(), 1);
        g.leave(0, new.ticket);
        assert_eq!(g.waiting(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn bad_requests_are_refused_and_change_nothing() {
        let g = QuorumGather::new(2).unwrap();
        let dl = Instant::now() + Duration::from_secs(5);
        let mut neg_failures = req(0, 1);
        neg_failures.commit_failures = -1;
        for r in [req(-1, 0), req(2, 0), req(0, -3), neg_failures] {
            assert!(matches!(g.join(&r, dl), Err(Error::InvalidArgument(_))));
        }
        assert_eq!(g.waiting(), 0);
        assert!(g.checkpoint_metadata(0).is_err());
        assert!(QuorumGather::new(0).is_err());
    }

    #[tokio::test(start_paused = true)]
    async fn checkpoint_metadata_is_recorded_per_rank() {
        let g = QuorumGather::new(2).unwrap();
        let dl = Instant::now() + Duration::from_secs(5);
        let _j = g.join(&req(1, 0), dl).unwrap();
        assert_eq!(g.checkpoint_metadata(1).unwrap(), "meta-1");
        let err = g.checkpoint_metadata(0).unwrap_err();
        assert!(err.to_string().contains("group rank 0"), "{err}");
    }
}
