//! The manager server's requests to the lighthouse: one quorum request per complete round
//! (retried with backoff within the ranks' deadlines, its long waits explained in the log),
//! whose answer becomes each rank's role, and the write-ahead commit announcement.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use tokio::time::Instant;
use tracing::{debug, info, warn};

use super::own_link::Attempt;
use super::{shutting_down, Inner};
use crate::client::LighthouseClient;
use crate::error::{Error, Result};
use crate::manager::compute::compute_quorum_results;
use crate::manager::gather::ReadyRound;
use crate::manager::rpc_error;
use crate::manager::sparse::sparse_answer;
use crate::manager::topology::{member_data, source_choice, SourceChoice};
use crate::net::Backoff;
use crate::proto::{Quorum, QuorumMember};

/// A quorum request waiting at the lighthouse longer than this says why in the log (a
/// second after the lighthouse starts to say why its round waits, so heartbeat replies
/// have brought the reason by then) ...
const QUORUM_WAIT_NOTE_AFTER: Duration = Duration::from_secs(3);

/// ... and again this often while it keeps waiting.
const QUORUM_WAIT_NOTE_EVERY: Duration = Duration::from_secs(10);

tokio::task_local! {
    /// Set while a single-rank group's quorum runs on its hosting rank's thread (see
    /// [`super::ManagerServer::quorum_start_blocking`]): the lighthouse request goes on the
    /// rank's own connection first.
    pub(super) static OWN_QUORUM: Attempt;
}

/// How a write-ahead commit announcement ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Announced {
    /// The lighthouse recorded it (or takes no announcements): the group may commit.
    Accepted,
    /// Refused, by the lighthouse or before asking it: the group does not commit.
    Refused,
    /// No answer before the deadline: the group does not commit, and the connection it
    /// went on may be dead.
    Unreached,
}

impl Inner {
    /// The write-ahead commit: tells the lighthouse this group is about to commit `step + 1`
    /// under its quorum; true if the lighthouse accepted (or predates announcements). A
    /// refusal (the quorum was replaced, or the group was declared lost in it) and a
    /// lighthouse unreachable until `timeout` are a "no": the group rejoins and heals.
    pub(super) async fn announce_commit(&self, step: i64, timeout: Duration) -> bool {
        let announced = self
            .announce_commit_via(&self.lighthouse, step, timeout)
            .await;
        if announced == Announced::Unreached {
            self.warn_unreached(step);
        }
        announced == Announced::Accepted
    }

    /// Says that the announcement of `step` found no lighthouse before its deadline.
    pub(super) fn warn_unreached(&self, step: i64) {
        warn!(step, quorum_id = self.quorum_id.load(Ordering::Relaxed),
            lighthouse = %self.lighthouse_addr,
            "cannot reach the lighthouse to announce the commit; not committing");
    }

    /// [`Inner::announce_commit`] over `lighthouse` (this server's shared connection, or
    /// the hosting rank's own: see `own_link`), saying how it ended (an unreached lighthouse
    /// is the caller's to log).
    pub(super) async fn announce_commit_via(
        &self,
        lighthouse: &LighthouseClient,
        step: i64,
        timeout: Duration,
    ) -> Announced {
        if self.commit_unsupported.load(Ordering::Relaxed) {
            return Announced::Accepted;
        }
        let quorum_id = self.quorum_id.load(Ordering::Relaxed);
        let wait = match *self.step_wait.lock().unwrap_or_else(|e| e.into_inner()) {
            Some((noted, seconds)) if noted == step => seconds,
            _ => 0.0,
        };
        let deadline = Instant::now() + timeout;
        let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_secs(1));
        loop {
            let remaining = deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Announced::Unreached;
            }
            let answer = lighthouse
                .commit(&self.opts.replica_id, quorum_id, step + 1, wait, remaining)
                .await;
            let status = match answer {
                Ok(None) => return Announced::Accepted,
                Ok(Some(reason)) => {
                    warn!(step, quorum_id, reason = %reason,
                        "the lighthouse refused the commit; rejoining to heal");
                    return Announced::Refused;
                }
                Err(status) => status,
            };
            match status.code() {
                tonic::Code::Unimplemented => {
                    if !self.commit_unsupported.swap(true, Ordering::Relaxed) {
                        warn!(lighthouse = %self.lighthouse_addr,
                            "the lighthouse does not take commit announcements (an older or \
                             upstream lighthouse): committing without them, so a group frozen \
                             mid-step may commit a step the others redid");
                    }
                    return Announced::Accepted;
                }
                tonic::Code::InvalidArgument
                | tonic::Code::Unauthenticated
                | tonic::Code::PermissionDenied => {
                    warn!(step, error = %status.message(), "commit announcement refused");
                    return Announced::Refused;
                }
                _ => {
                    let delay = backoff.next_delay();
                    debug!(step, error = %status.message(),
                        "commit announcement failed; retrying in {delay:?}");
                    let remaining = deadline.saturating_duration_since(Instant::now());
                    tokio::time::sleep(delay.min(remaining)).await;
                }
            }
        }
    }

    /// Warns (once per manager) when this group has a topology file that `quorum` does not
    /// use for choosing heal sources.
    fn warn_if_topology_unused(&self, quorum: &Quorum) {
        let Some(placement) = &self.opts.placement else {
            return;
        };
        let participants: Vec<&QuorumMember> = quorum.participants.iter().collect();
        let choice = source_choice(&participants, Some(&*placement.topology));
        if choice != SourceChoice::TopologyFile
            && !self.topology_unused.swap(true, Ordering::Relaxed)
        {
            let fallback = match choice {
                SourceChoice::Hosts => "host locality",
                _ => "round-robin (a member of an older or upstream build)",
            };
            warn!(
                quorum_id = quorum.quorum_id,
                digest = placement.topology.digest(),
                "the quorum's members do not all announce this topology file (a member without \
                 one, with another file, or with the same replica group index); heal sources \
                 are chosen by {fallback} (warned once)"
            );
        }
    }

    /// Asks the lighthouse for the quorum of `round`, retrying with backoff. Returns the
    /// quorum and when the request it answers was sent.
    ///
    /// Inside [`OWN_QUORUM`], the first request goes on the hosting rank's own connection,
    /// with the whole deadline (a quorum may rightly wait long for its members: no shorter
    /// try is cut off). If it fails in its transport, or the connection is closed under it
    /// (the lighthouse session ended: the lighthouse stopped, or the shared connection found
    /// it dead), the request goes again at once on the shared connection (not counted as a
    /// retry: nothing says the lighthouse failed). If it times out, its starter closes the
    /// connection, which may have gone silent: the next request dials anew.
    async fn lighthouse_quorum(&self, round: &ReadyRound) -> Result<(Quorum, Instant)> {
        let member = QuorumMember {
            replica_id: self.opts.replica_id.clone(),
            address: self.address.clone(),
            store_address: self.opts.store_addr.clone(),
            step: round.step,
            world_size: self.opts.world_size,
            shrink_only: round.shrink_only,
            commit_failures: round.commit_failures,
            data: member_data(self.opts.placement.as_ref()),
        };
        let mut own = OWN_QUORUM.try_with(Attempt::clone).ok();
        let mut backoff = Backoff::new(Duration::from_millis(20), Duration::from_secs(1));
        let mut attempt: u64 = 0;
        let asked = Instant::now();
        let mut next_note = asked + QUORUM_WAIT_NOTE_AFTER;
        loop {
            let remaining = round.deadline.saturating_duration_since(Instant::now());
            if remaining.is_zero() {
                return Err(Error::Timeout(format!(
                    "lighthouse quorum at {} did not answer before the ranks' deadline",
                    self.lighthouse_addr
                )));
            }
            let started = Instant::now();
            let via_own = own.take();
            let lighthouse = match &via_own {
                Some(o) => &o.lighthouse,
                None => &self.lighthouse,
            };
            // Without a topology file, the lighthouse can answer in the sparse form: a few
            // members per group instead of all of them (see `manager::sparse`).
            let call = async {
                if self.opts.placement.is_none() && self.opts.sparse_quorum {
                    lighthouse
                        .quorum_status_sparse(member.clone(), round.init_sync, remaining)
                        .await
                        .map(Arc::unwrap_or_clone)
                } else {
                    lighthouse.quorum_status(member.clone(), remaining).await
                }
            };
            let closed = async {
                match &via_own {
                    Some(o) => o.closed().await,
                    None => std::future::pending().await,
                }
            };
            tokio::pin!(call, closed);
            let answer = loop {
                // An answer that is in wins, even when the connection was driven late.
                tokio::select! {
                    biased;
                    answer = &mut call => break Some(answer),
                    _ = &mut closed => break None,
                    _ = tokio::time::sleep_until(next_note) => {
                        self.note_quorum_wait(round, asked.elapsed());
                        next_note += QUORUM_WAIT_NOTE_EVERY;
                    }
                }
            };
            // A status tonic made from a transport error carries it as its source; one the
            // lighthouse sent has none.
            let (err, link_failed) = match answer {
                Some(Ok(quorum)) => return Ok((quorum, started)),
                Some(Err(status)) => {
                    let transport = std::error::Error::source(&status).is_some();
                    (rpc_error(status, started, remaining), transport)
                }
                None => (
                    Error::Unavailable("the rank's own connection was closed".into()),
                    true,
                ),
            };
            // (One that timed out is closed by its starter, whichever deadline ended it: see
            // `ManagerServer::quorum_start_blocking`.)
            if let Some(o) = via_own.as_ref().filter(|_| link_failed) {
                if !*self.shutdown.borrow() {
                    self.own_link.close_for(o);
                    info!(step = round.step, error = %err,
                        "the quorum request's own connection failed or was closed; sending it \
                         again on the shared connection");
                    continue;
                }
            }
            match err {
                Error::Timeout(_) | Error::InvalidArgument(_) | Error::FailedPrecondition(_) => {
                    return Err(err)
                }
                Error::Diverged(why) => {
                    self.set_diverged(why.clone());
                    return Err(Error::Diverged(why));
                }
                _ => {}
            }
            if attempt >= self.opts.quorum_retries {
                return Err(Error::Unavailable(format!(
                    "lighthouse quorum request to {} failed after {} attempt(s): {}",
                    self.lighthouse_addr,
                    attempt + 1,
                    err.message()
                )));
            }
            attempt += 1;
            let delay = backoff.next_delay();
            warn!(
                lighthouse = %self.lighthouse_addr, attempt, error = %err,
                "lighthouse quorum request failed; retrying in {delay:?}"
            );
            let remaining = round.deadline.saturating_duration_since(Instant::now());
            tokio::time::sleep(delay.min(remaining)).await;
        }
    }

    /// Says at WARN that this group's quorum request has waited `waited` at the lighthouse,
    /// and why, as the lighthouse's heartbeat replies tell it.
    fn note_quorum_wait(&self, round: &ReadyRound, waited: Duration) {
        let why = self
            .lighthouse_waiting
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
            .unwrap_or_else(|| {
                "the lighthouse has not said why (it is not reachable, predates this report, \
                 or its round is about to end)"
                    .to_string()
            });
        let deadline_in = round.deadline.saturating_duration_since(Instant::now());
        warn!(
            step = round.step,
            lighthouse = %self.lighthouse_addr,
            "quorum request waiting {:.1}s (deadline in {:.1}s): {why}",
            waited.as_secs_f64(),
            deadline_in.as_secs_f64()
        );
    }

    /// Runs the lighthouse request of a complete round and answers every rank of it.
    pub(super) async fn answer_round(self: Arc<Self>, round: ReadyRound) {
        self.committed_step.store(round.step, Ordering::Relaxed);
        let result = tokio::select! {
            r = self.lighthouse_quorum(&round) => r,
            _ = shutting_down(self.shutdown.clone()) => Err(Error::Shutdown),
        };
        match result {
            Ok((quorum, sent)) => {
                self.quorum_id.store(quorum.quorum_id, Ordering::Relaxed);
                // A step whose vote was ended by a lost member is retried in this quorum.
                self.barrier.new_quorum();
                // The commit lease counts a lapse after this time against the quorum. On the
                // hosting rank's thread the answer is read when the rank next waits, maybe
                // well after it came: then the request's sending is the bound known to be
                // no later than the answer (a lapse while it was asked for fences the step).
                let at = if OWN_QUORUM.try_with(|_| ()).is_ok() {
                    sent
                } else {
                    Instant::now()
                };
                self.lease
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .quorum_at = Some(at);
                let sparse = quorum.sparse.is_some();
                debug!(
                    quorum_id = quorum.quorum_id,
                    step = round.step,
                    participants = quorum
                        .sparse
                        .as_ref()
                        .map_or(quorum.participants.len(), |s| s.count as usize),
                    sparse,
                    "quorum received"
                );
                if !sparse {
                    self.warn_if_topology_unused(&quorum);
                }
                for (rank, tx) in round.replies {
                    let answer = if sparse {
                        sparse_answer(&self.opts.replica_id, rank, &quorum)
                    } else {
                        compute_quorum_results(
                            &self.opts.replica_id,
                            rank,
                            &quorum,
                            round.init_sync,
                            self.opts.placement.as_ref().map(|p| &*p.topology),
                        )
                    };
                    let _ = tx.send(answer);
                }
            }
            Err(e) => {
                warn!(step = round.step, error = %e, "quorum round failed");
                for (_, tx) in round.replies {
                    let _ = tx.send(Err(e.duplicate()));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn duplicate_keeps_the_kind() {
        assert!(Error::Timeout("x".into()).duplicate().is_timeout());
        assert!(matches!(
            Error::Unavailable("x".into()).duplicate(),
            Error::Unavailable(m) if m == "x"
        ));
    }
}
