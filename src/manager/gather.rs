//! Gathers the quorum requests of a replica group's ranks into one round.
//!
//! The manager server asks the lighthouse once per round, after all `world_size` group ranks
//! have arrived. This module owns that bookkeeping (no I/O): who is waiting, whether they agree
//! on the step, the OR/max of their flags, the longest deadline, and each rank's reply channel.
//!
//! Rules (the round mechanics are [`super::round`]'s):
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

use super::round::{self, Round, Wording};
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

/// What a rank contributes to a quorum round: its flags.
#[derive(Debug, Clone, Copy)]
pub struct Flags {
    shrink_only: bool,
    init_sync: bool,
    commit_failures: i64,
}

impl Wording for Flags {
    fn step_mismatch(rank: i64, step: i64, other_rank: i64, other_step: i64) -> String {
        format!(
            "quorum step mismatch in the replica group: group rank {rank} is at step {step} but \
             group rank {other_rank} is at step {other_step}"
        )
    }

    fn replaced(rank: i64, _step: i64) -> String {
        format!("group rank {rank} asked for a quorum again; this earlier request was replaced")
    }
}

/// A rank's place in a quorum round (leaves the round when dropped before the answer).
pub type Joined<'a> = round::Joined<'a, Flags, ManagerQuorumResponse>;

/// The quorum round in progress of one replica group.
#[derive(Debug)]
pub struct QuorumGather {
    round: Round<Flags, ManagerQuorumResponse>,
    checkpoint_metadata: Mutex<HashMap<i64, String>>,
}

impl QuorumGather {
    /// Bookkeeping for a group of `world_size` ranks (at least 1).
    pub fn new(world_size: u64) -> Result<Self> {
        Ok(Self {
            round: Round::new(world_size)?,
            checkpoint_metadata: Mutex::new(HashMap::new()),
        })
    }

    fn metadata(&self) -> std::sync::MutexGuard<'_, HashMap<i64, String>> {
        // A plain map: recover it after a panic elsewhere.
        self.checkpoint_metadata
            .lock()
            .unwrap_or_else(|p| p.into_inner())
    }

    /// Checks a rank's request without changing anything.
    pub fn validate(&self, req: &ManagerQuorumRequest) -> Result<()> {
        self.round.validate(req.group_rank, req.step)?;
        if req.commit_failures < 0 {
            return Err(Error::InvalidArgument(format!(
                "commit_failures must not be negative, got {}",
                req.commit_failures
            )));
        }
        Ok(())
    }

    /// Adds a rank to the round in progress; it waits until `deadline`. The rank that
    /// completes the round gets the [`ReadyRound`] (including its own reply channel) and must
    /// see that it is answered. Dropping the returned [`Joined`] leaves the round.
    pub fn join(
        &self,
        req: &ManagerQuorumRequest,
        deadline: Instant,
    ) -> Result<(Joined<'_>, Option<ReadyRound>)> {
        self.validate(req)?;
        self.metadata()
            .insert(req.group_rank, req.checkpoint_metadata.clone());
        let flags = Flags {
            shrink_only: req.shrink_only,
            init_sync: req.init_sync,
            commit_failures: req.commit_failures,
        };
        let mut joined = self
            .round
            .join::<Flags>(req.group_rank, req.step, deadline, flags)?;
        let ready = joined.complete.take().map(|round| {
            let mut ready = ReadyRound {
                step: round.step,
                shrink_only: false,
                init_sync: false,
                commit_failures: 0,
                deadline,
                replies: Vec::with_capacity(round.members.len()),
            };
            for m in round.members {
                ready.shrink_only |= m.value.shrink_only;
                ready.init_sync |= m.value.init_sync;
                ready.commit_failures = ready.commit_failures.max(m.value.commit_failures);
                ready.deadline = ready.deadline.max(m.deadline);
                ready.replies.push((m.rank, m.reply));
            }
            ready
        });
        Ok((joined, ready))
    }

    /// Number of ranks waiting in the round in progress.
    pub fn waiting(&self) -> usize {
        self.round.waiting()
    }

    /// The checkpoint metadata `group_rank` sent with its latest quorum request.
    pub fn checkpoint_metadata(&self, group_rank: i64) -> Result<String> {
        let known = self.metadata();
        known.get(&group_rank).cloned().ok_or_else(|| {
            let mut ranks: Vec<_> = known.keys().copied().collect();
            ranks.sort_unstable();
            Error::InvalidArgument(format!(
                "no checkpoint metadata for group rank {group_rank}: it has not asked this \
                 manager for a quorum (ranks seen: {ranks:?})"
            ))
        })
    }

    /// Fails every waiting rank with `Shutdown` (the server is going away).
    pub fn fail_all(&self) {
        self.round.fail_all();
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
        let (_j0, ready) = g.join(&r0, now + Duration::from_secs(5)).unwrap();
        assert!(ready.is_none());
        let (_j2, ready) = g.join(&r2, now + Duration::from_secs(9)).unwrap();
        assert!(ready.is_none());
        assert_eq!(g.waiting(), 2);
        let (_j1, ready) = g.join(&req(1, 2), now + Duration::from_secs(1)).unwrap();
        let round = ready.unwrap();
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
    async fn step_mismatch_names_both_ranks_and_steps() {
        let g = QuorumGather::new(2).unwrap();
        let dl = Instant::now() + Duration::from_secs(5);
        let (j0, _) = g.join(&req(0, 4), dl).unwrap();
        let err = g.join(&req(1, 5), dl).unwrap_err();
        assert!(matches!(err, Error::FailedPrecondition(_)), "{err}");
        let msg = err.to_string();
        assert!(msg.contains("group rank 1 is at step 5"), "{msg}");
        assert!(msg.contains("group rank 0 is at step 4"), "{msg}");
        let got = j0.answer(dl, Duration::from_secs(5), "quorum").await;
        assert!(matches!(got, Err(Error::FailedPrecondition(_))));
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
