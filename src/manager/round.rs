//! A round of a replica group's ranks: every rank contributes a value for one step and waits
//! until the round is complete (all `world_size` ranks are in) or fails.
//!
//! Both per-step barriers of the manager server stand on it: the quorum gather
//! ([`super::gather`]) and the commit vote ([`super::commit`]). The protocols decide what a
//! complete round means; this module owns the mechanics they share (no I/O):
//!
//! - A rank whose step differs from the round in progress fails the round: the newcomer and
//!   every waiting rank get `FailedPrecondition` at once (the group's ranks disagree on the
//!   step), and the round is cleared. No contribution of one step is counted in another's round.
//! - A rank that joins twice replaces its earlier entry; the earlier caller gets
//!   `FailedPrecondition` (it would otherwise never be answered).
//! - A rank whose wait ends (deadline, cancel) before the round is complete leaves the round,
//!   so a later entry of the same rank counts once and a complete round never includes an
//!   entry nobody waits on. Each entry has a ticket, so a stale leave never removes a newer one.
//! - [`Round::close`] answers the round in progress at once with a fixed answer, and every later
//!   entry of that step too, until [`Round::reopen`].
//! - [`Round::fail_all`] answers every waiting rank `Shutdown` (the server is going away).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::oneshot;
use tokio::time::Instant;

use crate::error::{Error, Result};

/// What a protocol built on a [`Round`] says when its ranks disagree.
pub trait Wording {
    /// Why the round failed: `rank` joined for `step` while `other_rank` waits at `other_step`.
    fn step_mismatch(rank: i64, step: i64, other_rank: i64, other_step: i64) -> String;
    /// What the earlier caller of `rank` is told when the rank joined again for `step`.
    fn replaced(rank: i64, step: i64) -> String;
}

/// The channel a rank's answer arrives on.
pub type Reply<A> = oneshot::Sender<Result<A>>;

/// One rank's entry in a complete round.
#[derive(Debug)]
pub struct Member<V, A> {
    /// The rank's group rank.
    pub rank: i64,
    /// When the rank stops waiting.
    pub deadline: Instant,
    /// What the rank contributed.
    pub value: V,
    /// Where the rank's answer goes.
    pub reply: Reply<A>,
}

/// A complete round, handed to the rank that completed it: that rank must see that every
/// member is answered.
#[derive(Debug)]
pub struct Complete<V, A> {
    /// The step every member joined for.
    pub step: i64,
    /// Every member, by group rank.
    pub members: Vec<Member<V, A>>,
}

/// What a rank gets when it joins a round. Dropping it leaves the round (unless the round
/// completed or failed meanwhile).
#[derive(Debug)]
pub struct Joined<'a, V, A> {
    /// Identifies this entry (a later entry of the same rank gets another ticket).
    pub ticket: u64,
    /// Set for the rank that completed the round.
    pub complete: Option<Complete<V, A>>,
    rx: oneshot::Receiver<Result<A>>,
    _leave: LeaveGuard<'a, V, A>,
}

impl<V, A> Joined<'_, V, A> {
    /// Waits for this rank's answer until `deadline` (`timeout` after the rank asked, as
    /// named in the error with `what`); the rank leaves the round when the wait ends without
    /// one.
    pub async fn answer(self, deadline: Instant, timeout: Duration, what: &str) -> Result<A> {
        match tokio::time::timeout_at(deadline, self.rx).await {
            Ok(Ok(answer)) => answer,
            Ok(Err(_)) => Err(Error::Shutdown),
            Err(_) => Err(Error::timeout(what, timeout)),
        }
    }
}

/// Removes a rank's entry from its round when its wait ends without an answer.
#[derive(Debug)]
struct LeaveGuard<'a, V, A> {
    round: &'a Round<V, A>,
    rank: i64,
    ticket: u64,
}

impl<V, A> Drop for LeaveGuard<'_, V, A> {
    fn drop(&mut self) {
        self.round.leave(self.rank, self.ticket);
    }
}

/// The round in progress of one replica group's ranks.
#[derive(Debug)]
pub struct Round<V, A> {
    world_size: u64,
    state: Mutex<State<V, A>>,
}

#[derive(Debug)]
struct State<V, A> {
    entries: HashMap<i64, Entry<V, A>>,
    next_ticket: u64,
    /// A step answered by [`Round::close`]: its later entries get this answer at once.
    closed: Option<(i64, A)>,
}

#[derive(Debug)]
struct Entry<V, A> {
    ticket: u64,
    step: i64,
    deadline: Instant,
    value: V,
    reply: Reply<A>,
}

impl<V, A> Round<V, A> {
    /// A round of `world_size` ranks (at least 1).
    pub fn new(world_size: u64) -> Result<Self> {
        if world_size == 0 {
            return Err(Error::InvalidArgument(
                "world_size must be at least 1".into(),
            ));
        }
        Ok(Self {
            world_size,
            state: Mutex::new(State {
                entries: HashMap::new(),
                next_ticket: 0,
                closed: None,
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State<V, A>> {
        // The state is consistent between statements; a panic elsewhere while holding the
        // lock costs at most the round, so recover the guard instead of propagating.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Checks a rank and step without changing anything.
    pub fn validate(&self, rank: i64, step: i64) -> Result<()> {
        if rank < 0 || rank as u64 >= self.world_size {
            return Err(Error::InvalidArgument(format!(
                "group_rank {rank} is outside [0, {})",
                self.world_size
            )));
        }
        if step < 0 {
            return Err(Error::InvalidArgument(format!(
                "step must not be negative, got {step}"
            )));
        }
        Ok(())
    }

    /// Adds `rank`'s `value` for `step` to the round in progress; the rank waits until
    /// `deadline`. The rank that completes the round gets it in [`Joined::complete`].
    pub fn join<W: Wording>(
        &self,
        rank: i64,
        step: i64,
        deadline: Instant,
        value: V,
    ) -> Result<Joined<'_, V, A>>
    where
        A: Clone,
    {
        self.validate(rank, step)?;
        let (tx, rx) = oneshot::channel();
        let mut state = self.lock();
        state.next_ticket += 1;
        let ticket = state.next_ticket;
        let joined = |complete| Joined {
            ticket,
            complete,
            rx,
            _leave: LeaveGuard {
                round: self,
                rank,
                ticket,
            },
        };
        match &state.closed {
            Some((closed, answer)) if *closed == step => {
                let _ = tx.send(Ok(answer.clone()));
                return Ok(joined(None));
            }
            Some(_) => state.closed = None,
            None => {}
        }
        if let Some((&other_rank, other)) = state.entries.iter().find(|(_, e)| e.step != step) {
            let msg = W::step_mismatch(rank, step, other_rank, other.step);
            for (_, e) in state.entries.drain() {
                let _ = e.reply.send(Err(Error::FailedPrecondition(msg.clone())));
            }
            return Err(Error::FailedPrecondition(msg));
        }
        let entry = Entry {
            ticket,
            step,
            deadline,
            value,
            reply: tx,
        };
        if let Some(old) = state.entries.insert(rank, entry) {
            let _ = old
                .reply
                .send(Err(Error::FailedPrecondition(W::replaced(rank, step))));
        }
        if state.entries.len() as u64 != self.world_size {
            return Ok(joined(None));
        }
        let mut members: Vec<Member<V, A>> = state
            .entries
            .drain()
            .map(|(rank, e)| Member {
                rank,
                deadline: e.deadline,
                value: e.value,
                reply: e.reply,
            })
            .collect();
        members.sort_by_key(|m| m.rank);
        Ok(joined(Some(Complete { step, members })))
    }

    /// Removes `rank`'s entry `ticket` from the round if it is still waiting there.
    pub fn leave(&self, rank: i64, ticket: u64) {
        let mut state = self.lock();
        if state.entries.get(&rank).is_some_and(|e| e.ticket == ticket) {
            state.entries.remove(&rank);
        }
    }

    /// Number of ranks waiting in the round in progress.
    pub fn waiting(&self) -> usize {
        self.lock().entries.len()
    }

    /// Answers the round in progress with `answer` now, and every later entry of its step
    /// too, until [`Round::reopen`]. Returns the step, if a round was in progress.
    pub fn close(&self, answer: A) -> Option<i64>
    where
        A: Clone,
    {
        let mut state = self.lock();
        let step = state.entries.values().next()?.step;
        for (_, e) in state.entries.drain() {
            let _ = e.reply.send(Ok(answer.clone()));
        }
        state.closed = Some((step, answer));
        Some(step)
    }

    /// Lifts a [`Round::close`]: its step can be joined again.
    pub fn reopen(&self) {
        self.lock().closed = None;
    }

    /// Fails every waiting rank with `Shutdown` (the server is going away).
    pub fn fail_all(&self) {
        for (_, e) in self.lock().entries.drain() {
            let _ = e.reply.send(Err(Error::Shutdown));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Plain;

    impl Wording for Plain {
        fn step_mismatch(rank: i64, step: i64, other_rank: i64, other_step: i64) -> String {
            format!("rank {rank} at step {step}, rank {other_rank} at step {other_step}")
        }
        fn replaced(rank: i64, step: i64) -> String {
            format!("rank {rank} joined step {step} again")
        }
    }

    type R = Round<&'static str, u32>;

    const LONG: Duration = Duration::from_secs(30);

    fn dl() -> Instant {
        Instant::now() + LONG
    }

    #[tokio::test(start_paused = true)]
    async fn the_last_rank_completes_the_round_with_every_member_by_rank() {
        let r = R::new(3).unwrap();
        let early = Instant::now() + Duration::from_secs(1);
        let j2 = r.join::<Plain>(2, 5, dl(), "c").unwrap();
        let j0 = r.join::<Plain>(0, 5, early, "a").unwrap();
        assert!(j2.complete.is_none() && j0.complete.is_none());
        assert_eq!(r.waiting(), 2);
        let j1 = r.join::<Plain>(1, 5, dl(), "b").unwrap();
        let round = j1.complete.unwrap();
        assert_eq!(round.step, 5);
        let got: Vec<_> = round.members.iter().map(|m| (m.rank, m.value)).collect();
        assert_eq!(got, vec![(0, "a"), (1, "b"), (2, "c")]);
        assert_eq!(round.members[0].deadline, early);
        assert_eq!(r.waiting(), 0);
        for m in round.members {
            m.reply.send(Ok(m.rank as u32)).unwrap();
        }
        assert_eq!(j0.answer(dl(), LONG, "x").await.unwrap(), 0);
        assert_eq!(j2.answer(dl(), LONG, "x").await.unwrap(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn step_mismatch_fails_the_newcomer_and_everyone_waiting() {
        let r = R::new(3).unwrap();
        let j0 = r.join::<Plain>(0, 4, dl(), "a").unwrap();
        let j1 = r.join::<Plain>(1, 4, dl(), "b").unwrap();
        let err = r.join::<Plain>(2, 5, dl(), "c").unwrap_err();
        assert!(matches!(err, Error::FailedPrecondition(_)), "{err}");
        assert!(err.to_string().contains("at step 4"), "{err}");
        for j in [j0, j1] {
            let got = j.answer(dl(), LONG, "x").await;
            assert!(matches!(got, Err(Error::FailedPrecondition(_))));
        }
        assert_eq!(r.waiting(), 0);
        // The next step starts clean.
        let j = r.join::<Plain>(0, 5, dl(), "a").unwrap();
        assert!(j.complete.is_none());
        assert_eq!(r.waiting(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_rank_joining_again_replaces_its_earlier_entry() {
        let r = R::new(2).unwrap();
        let old = r.join::<Plain>(0, 1, dl(), "old").unwrap();
        let new = r.join::<Plain>(0, 1, dl(), "new").unwrap();
        assert_ne!(old.ticket, new.ticket);
        let err = old.answer(dl(), LONG, "x").await.unwrap_err();
        assert!(err.to_string().contains("joined step 1 again"), "{err}");
        // The stale entry's leave (its drop above) did not remove the newer one.
        assert_eq!(r.waiting(), 1);
        let done = r.join::<Plain>(1, 1, dl(), "b").unwrap().complete.unwrap();
        let values: Vec<_> = done.members.iter().map(|m| m.value).collect();
        assert_eq!(values, vec!["new", "b"]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_rank_whose_wait_ends_leaves_the_round() {
        let r = R::new(2).unwrap();
        // Deadline.
        let j0 = r.join::<Plain>(0, 3, dl(), "a").unwrap();
        let start = Instant::now();
        let t = Duration::from_millis(100);
        let err = j0.answer(start + t, t, "the test").await.unwrap_err();
        assert!(err.is_timeout(), "{err}");
        assert_eq!(start.elapsed(), t);
        assert_eq!(r.waiting(), 0);
        // Cancel: the waiting future is dropped.
        let j0 = r.join::<Plain>(0, 3, dl(), "a").unwrap();
        drop(j0);
        assert_eq!(r.waiting(), 0);
        // Explicit leave with a stale ticket changes nothing.
        let j0 = r.join::<Plain>(0, 3, dl(), "a").unwrap();
        r.leave(0, j0.ticket - 1);
        assert_eq!(r.waiting(), 1);
        r.leave(0, j0.ticket);
        assert_eq!(r.waiting(), 0);
        assert!(r.join::<Plain>(1, 3, dl(), "b").unwrap().complete.is_none());
    }

    #[tokio::test(start_paused = true)]
    async fn close_answers_the_waiting_and_later_entries_of_that_step_until_reopened() {
        let r = R::new(3).unwrap();
        assert_eq!(r.close(9), None, "nothing to close");
        let j0 = r.join::<Plain>(0, 9, dl(), "a").unwrap();
        assert_eq!(r.close(7), Some(9));
        assert_eq!(j0.answer(dl(), LONG, "x").await.unwrap(), 7);
        let late = r.join::<Plain>(1, 9, dl(), "b").unwrap();
        assert_eq!(r.waiting(), 0);
        assert_eq!(late.answer(dl(), LONG, "x").await.unwrap(), 7);
        r.reopen();
        let j = r.join::<Plain>(1, 9, dl(), "b").unwrap();
        assert_eq!(r.waiting(), 1);
        drop(j);
        // Another step lifts the close as well.
        assert_eq!(r.close(7), None);
        let j0 = r.join::<Plain>(0, 10, dl(), "a").unwrap();
        assert_eq!(r.close(3), Some(10));
        let next = r.join::<Plain>(0, 11, dl(), "a").unwrap();
        assert_eq!(r.waiting(), 1);
        assert_eq!(j0.answer(dl(), LONG, "x").await.unwrap(), 3);
        drop(next);
    }

    #[tokio::test(start_paused = true)]
    async fn fail_all_answers_every_waiter_shutdown() {
        let r = R::new(3).unwrap();
        let j0 = r.join::<Plain>(0, 1, dl(), "a").unwrap();
        let j1 = r.join::<Plain>(1, 1, dl(), "b").unwrap();
        r.fail_all();
        assert_eq!(r.waiting(), 0);
        for j in [j0, j1] {
            assert!(matches!(
                j.answer(dl(), LONG, "x").await,
                Err(Error::Shutdown)
            ));
        }
    }

    #[tokio::test(start_paused = true)]
    async fn bad_input_is_refused_and_changes_nothing() {
        let r = R::new(2).unwrap();
        for (rank, step) in [(-1, 0), (2, 0), (0, -1)] {
            assert!(matches!(
                r.join::<Plain>(rank, step, dl(), "a"),
                Err(Error::InvalidArgument(_))
            ));
        }
        assert_eq!(r.waiting(), 0);
        assert!(R::new(0).is_err());
    }
}
