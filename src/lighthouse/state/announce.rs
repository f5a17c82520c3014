//! What the lighthouse says about a round while it runs: the startup hold of a restarted
//! lighthouse and its end, long waits (in the log and in the asking groups' heartbeat
//! replies), hung groups, lasting stragglers dropped, diverged groups.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use serde_json::json;
use tracing::{error, info, warn};

use super::{unix_seconds, Shared, State};
use crate::error::Error;
use crate::lighthouse::quorum::EarlierLife;
use crate::telemetry::EventKind;

/// A round waiting longer than this says why in the log.
pub(super) const EXPLAIN_WAIT_AFTER: Duration = Duration::from_secs(2);

/// ... and again this often while it keeps waiting.
pub(super) const EXPLAIN_WAIT_EVERY: Duration = Duration::from_secs(10);

impl Shared {
    /// Logs that a restarted lighthouse holds its first quorum (once), saying how it knows
    /// it restarted and when the hold ends; a fresh job's lighthouse logs nothing.
    pub(super) fn announce_hold(state: &mut State, now: std::time::Instant) {
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
    pub(super) fn explain_wait(state: &mut State, now: std::time::Instant) {
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
    pub(super) fn announce_hangs(&self, state: &mut State, now: std::time::Instant) {
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
            self.hub.emit(
                now,
                EventKind::ReplicaHung,
                json!({
                    "replica_id": h.replica_id,
                    "idle_s": h.idle.as_secs_f64(),
                    "hang_timeout_s": h.timeout.as_secs_f64(),
                    "rule": rule,
                }),
            );
        }
        for id in state.engine.take_resumed() {
            info!(replica_id = %id, "replica group {id} is no longer hung: its training loop is back");
            self.hub
                .emit(now, EventKind::ReplicaResumed, json!({ "replica_id": id }));
        }
    }

    /// Drops the groups that stayed stragglers for `--straggler_drop_after_ms` from the
    /// quorum for as long again (logged, `straggler_dropped`); their heartbeat replies say why.
    pub(super) fn drop_lasting_stragglers(&self, state: &mut State, now: std::time::Instant) {
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
            self.hub.emit(
                now,
                EventKind::StragglerDropped,
                json!({
                    "replica_id": crate::telemetry::base_id(&incarnation),
                    "incarnation": incarnation,
                    "reason": why,
                    "for_s": window.as_secs_f64(),
                }),
            );
        }
    }

    /// Logs and records (`replica_diverged`) the groups the parity check found diverged.
    pub(super) fn announce_diverged(&self, state: &mut State, now: std::time::Instant) {
        for d in state.engine.take_diverged() {
            match d.action {
                crate::lighthouse::health::parity::Action::Heal => warn!(
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
                crate::lighthouse::health::parity::Action::Stop => error!(
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
            if d.action == crate::lighthouse::health::parity::Action::Stop {
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
            self.hub.emit(
                now,
                EventKind::ReplicaDiverged,
                json!({
                    "replica_id": d.replica_id,
                    "step": d.step,
                    "action": d.action.as_str(),
                    "majority": d.majority,
                    "compared": d.compared,
                    "ranks": d.ranks,
                }),
            );
        }
    }

    /// Logs the end of an announced startup hold (once).
    pub(super) fn announce_hold_end(state: &mut State, now: std::time::Instant) {
        if state.hold_announced && state.engine.startup_hold_until(now).is_none() {
            state.hold_announced = false;
            info!(
                asking = state.engine.num_participants(),
                "startup hold over: the first quorum is decided by the join rules"
            );
        }
    }
}
