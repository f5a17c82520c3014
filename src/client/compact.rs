//! The compact form of a quorum: what a requester that already holds the previous quorum
//! needs to know about the next one.
//!
//! In the steady state the membership of consecutive quorums is unchanged (same quorum_id)
//! and every member only advanced its step. Sending every member the full member list then
//! moves O(n²) bytes per round; the compact form sends the steps only, as a base step (the
//! most common one) plus the members whose step differs, with `participants` left empty.
//!
//! The lighthouse sends it only when the requester can rebuild the full quorum exactly: the
//! requester's known quorum has the same quorum_id and its revision is not older than the
//! last revision at which any field other than `step` changed ([`compact_applies`]). When
//! the membership or a member field did change (a group failed or joined, commit failures),
//! holders of exactly the previous quorum get a delta instead ([`delta_form`]): the steps
//! plus the members that left and the complete members that are new or changed. Anyone else
//! gets the full form. The client rebuilds the full quorum with [`expand`], which refuses
//! anything inconsistent instead of guessing.

use std::collections::HashMap;

use crate::error::{Error, Result};
use crate::proto::{CompactSteps, Quorum, QuorumMember};

/// True when `a` and `b` agree on every field except `step`.
///
/// The destructuring is exhaustive on purpose: a new member field must be considered here.
pub fn same_except_step(a: &QuorumMember, b: &QuorumMember) -> bool {
    let QuorumMember {
        replica_id,
        address,
        store_address,
        step: _,
        world_size,
        shrink_only,
        commit_failures,
        data,
    } = a;
    *replica_id == b.replica_id
        && *address == b.address
        && *store_address == b.store_address
        && *world_size == b.world_size
        && *shrink_only == b.shrink_only
        && *commit_failures == b.commit_failures
        && *data == b.data
}

/// True when two consecutive quorums differ at most in their members' steps (same id, same
/// members in the same order, same other fields). O(n).
pub fn only_steps_changed(previous: &Quorum, next: &Quorum) -> bool {
    previous.quorum_id == next.quorum_id
        && previous.participants.len() == next.participants.len()
        && previous
            .participants
            .iter()
            .zip(&next.participants)
            .all(|(a, b)| same_except_step(a, b))
}

/// The steps of `full`'s members as a [`CompactSteps`]: the most common step as the base,
/// and the members whose step differs from it. O(n).
pub fn compact_steps(full: &Quorum) -> CompactSteps {
    let mut counts: HashMap<i64, usize> = HashMap::new();
    for m in &full.participants {
        *counts.entry(m.step).or_default() += 1;
    }
    // Ties go to the larger step so the choice does not depend on hash order.
    let base_step = counts
        .iter()
        .max_by_key(|(step, count)| (**count, **step))
        .map_or(0, |(step, _)| *step);
    let mut indices = Vec::new();
    let mut steps = Vec::new();
    for (i, m) in full.participants.iter().enumerate() {
        if m.step != base_step {
            indices.push(u32::try_from(i).unwrap_or(u32::MAX));
            steps.push(m.step);
        }
    }
    CompactSteps {
        count: u32::try_from(full.participants.len()).unwrap_or(u32::MAX),
        base_step,
        indices,
        steps,
        ..Default::default()
    }
}

/// The delta reply for `full` to a requester holding exactly `base`: the steps as in
/// [`compact_form`], plus the members of `base` that left and the members of `full` that
/// are new or changed other fields. O(n) in the two member counts.
///
/// Used when the membership (or a member field) changed, e.g. one group out of thousands
/// failed: the requesters then need O(changes) new information, not the whole member list.
pub fn delta_form(base: &Quorum, full: &Quorum) -> Quorum {
    let held: HashMap<&str, &QuorumMember> = base
        .participants
        .iter()
        .map(|m| (m.replica_id.as_str(), m))
        .collect();
    let current: std::collections::HashSet<&str> = full
        .participants
        .iter()
        .map(|m| m.replica_id.as_str())
        .collect();
    let removed = base
        .participants
        .iter()
        .filter(|m| !current.contains(m.replica_id.as_str()))
        .map(|m| m.replica_id.clone())
        .collect();
    let upserts = full
        .participants
        .iter()
        .filter(|m| {
            held.get(m.replica_id.as_str())
                .is_none_or(|h| !same_except_step(h, m))
        })
        .cloned()
        .collect();
    let mut compact = compact_steps(full);
    compact.base_quorum_id = base.quorum_id;
    compact.base_revision = base.revision;
    compact.removed = removed;
    compact.upserts = upserts;
    Quorum {
        quorum_id: full.quorum_id,
        participants: Vec::new(),
        created: full.created,
        revision: full.revision,
        compact: Some(compact),
        sparse: None,
    }
}

/// Whether a requester holding (`known_id`, `known_revision`) gets the delta reply built
/// against `base` (it must hold exactly that quorum).
pub fn delta_applies(base: &Quorum, known_id: i64, known_revision: u64) -> bool {
    known_revision != 0 && known_id == base.quorum_id && known_revision == base.revision
}

/// The compact reply for `full`: same id, revision and timestamp, no participants.
pub fn compact_form(full: &Quorum) -> Quorum {
    Quorum {
        quorum_id: full.quorum_id,
        participants: Vec::new(),
        created: full.created,
        revision: full.revision,
        compact: Some(compact_steps(full)),
        sparse: None,
    }
}

/// Whether a requester holding the full quorum (`known_id`, `known_revision`) can rebuild
/// the quorum `issued` from its compact form.
///
/// `stable_since` is the revision since which every issued quorum had `issued`'s id and the
/// same member fields except steps (see
/// [`QuorumEngine::stable_since`](crate::lighthouse::quorum::QuorumEngine::stable_since)). A requester
/// that knows nothing (`known_revision == 0`), a different id, an older revision or a
/// revision this lighthouse never issued gets the full form.
pub fn compact_applies(
    issued: &Quorum,
    stable_since: u64,
    known_id: i64,
    known_revision: u64,
) -> bool {
    known_revision != 0
        && stable_since != 0
        && known_id == issued.quorum_id
        && known_revision >= stable_since
        && known_revision <= issued.revision
}

/// Rebuilds the full quorum from `reply` and the quorum the requester held when it asked.
///
/// A reply with participants (the full form) is returned unchanged; a sparse one is refused
/// (only [`super::lighthouse::LighthouseClient::quorum_status_sparse`] asks for it, and it
/// does not expand it). A compact reply must
/// match `known` (same quorum_id, no older revision, same member count, well-formed
/// overrides); otherwise this fails with [`Error::FailedPrecondition`] and the caller must
/// ask again for the full form — it never returns a guessed quorum.
pub fn expand(known: Option<&Quorum>, reply: Quorum) -> Result<Quorum> {
    if reply.sparse.is_some() {
        return Err(Error::FailedPrecondition(
            "sparse quorum received by a request that did not ask for it".into(),
        ));
    }
    let Some(compact) = reply.compact else {
        return Ok(reply);
    };
    let known = known.ok_or_else(|| {
        Error::FailedPrecondition("compact quorum received without a known quorum".into())
    })?;
    if compact.base_revision != 0 {
        return expand_delta(
            known,
            reply.quorum_id,
            reply.revision,
            reply.created,
            compact,
        );
    }
    if !compact.removed.is_empty() || !compact.upserts.is_empty() {
        return Err(Error::FailedPrecondition(
            "compact quorum carries member changes without a base".into(),
        ));
    }
    if known.quorum_id != reply.quorum_id || known.revision > reply.revision {
        return Err(Error::FailedPrecondition(format!(
            "compact quorum {} (revision {}) does not extend the known quorum {} (revision {})",
            reply.quorum_id, reply.revision, known.quorum_id, known.revision
        )));
    }
    let count = known.participants.len();
    if usize::try_from(compact.count).ok() != Some(count) {
        return Err(Error::FailedPrecondition(format!(
            "compact quorum has {} members, the known quorum {count}",
            compact.count
        )));
    }
    if compact.indices.len() != compact.steps.len() {
        return Err(Error::FailedPrecondition(
            "compact quorum has mismatched step overrides".into(),
        ));
    }
    let mut participants = known.participants.clone();
    apply_steps(&mut participants, &compact)?;
    Ok(Quorum {
        quorum_id: reply.quorum_id,
        participants,
        created: reply.created,
        revision: reply.revision,
        compact: None,
        sparse: None,
    })
}

/// Sets every member's step from `compact` (base step + overrides), checking the overrides.
fn apply_steps(participants: &mut [QuorumMember], compact: &CompactSteps) -> Result<()> {
    let count = participants.len();
    if compact.indices.len() != compact.steps.len() {
        return Err(Error::FailedPrecondition(
            "compact quorum has mismatched step overrides".into(),
        ));
    }
    for m in participants.iter_mut() {
        m.step = compact.base_step;
    }
    let mut last: Option<usize> = None;
    for (&index, &step) in compact.indices.iter().zip(&compact.steps) {
        let i = usize::try_from(index).unwrap_or(usize::MAX);
        if i >= count || last.is_some_and(|l| i <= l) {
            return Err(Error::FailedPrecondition(format!(
                "compact quorum has an invalid member index {index}"
            )));
        }
        last = Some(i);
        participants[i].step = step;
    }
    Ok(())
}

/// Rebuilds a quorum from a delta against exactly the held quorum `known`.
fn expand_delta(
    known: &Quorum,
    quorum_id: i64,
    revision: u64,
    created: Option<prost_types::Timestamp>,
    compact: CompactSteps,
) -> Result<Quorum> {
    if known.quorum_id != compact.base_quorum_id || known.revision != compact.base_revision {
        return Err(Error::FailedPrecondition(format!(
            "quorum delta applies to quorum {} (revision {}), the known one is {} (revision {})",
            compact.base_quorum_id, compact.base_revision, known.quorum_id, known.revision
        )));
    }
    let removed: std::collections::HashSet<&str> =
        compact.removed.iter().map(String::as_str).collect();
    let replaced: std::collections::HashSet<&str> = compact
        .upserts
        .iter()
        .map(|m| m.replica_id.as_str())
        .collect();
    let held = known.participants.iter().filter(|m| {
        !removed.contains(m.replica_id.as_str()) && !replaced.contains(m.replica_id.as_str())
    });
    let removed_held = known
        .participants
        .iter()
        .filter(|m| removed.contains(m.replica_id.as_str()))
        .count();
    if removed.len() != compact.removed.len()
        || removed_held != removed.len()
        || removed.iter().any(|id| replaced.contains(id))
    {
        return Err(Error::FailedPrecondition(
            "quorum delta removes members the known quorum does not have".into(),
        ));
    }
    let mut participants: Vec<QuorumMember> = held
        .cloned()
        .chain(compact.upserts.iter().cloned())
        .collect();
    participants.sort_unstable_by(|a, b| a.replica_id.cmp(&b.replica_id));
    if participants
        .windows(2)
        .any(|w| w[0].replica_id == w[1].replica_id)
    {
        return Err(Error::FailedPrecondition(
            "quorum delta lists a member twice".into(),
        ));
    }
    if usize::try_from(compact.count).ok() != Some(participants.len()) {
        return Err(Error::FailedPrecondition(format!(
            "quorum delta has {} members, the rebuilt quorum {}",
            compact.count,
            participants.len()
        )));
    }
    apply_steps(&mut participants, &compact)?;
    Ok(Quorum {
        quorum_id,
        participants,
        created,
        revision,
        compact: None,
        sparse: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: &str, step: i64) -> QuorumMember {
        QuorumMember {
            world_size: 2,
            ..crate::testkit::member(id, step)
        }
    }

    fn quorum(id: i64, revision: u64, steps: &[i64]) -> Quorum {
        Quorum {
            quorum_id: id,
            revision,
            participants: steps
                .iter()
                .enumerate()
                .map(|(i, s)| member(&format!("r{i}"), *s))
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn base_is_the_most_common_step() {
        let c = compact_steps(&quorum(1, 1, &[5, 7, 7, 3, 7]));
        assert_eq!(c.count, 5);
        assert_eq!(c.base_step, 7);
        assert_eq!(c.indices, vec![0, 3]);
        assert_eq!(c.steps, vec![5, 3]);
        let c = compact_steps(&quorum(1, 1, &[]));
        assert_eq!((c.count, c.base_step, c.indices.len()), (0, 0, 0));
    }

    #[test]
    fn round_trip_rebuilds_the_full_quorum() {
        let known = quorum(4, 2, &[1, 1, 1, 0]);
        let next = quorum(4, 3, &[2, 2, 0, 1]);
        let reply = compact_form(&next);
        assert!(reply.participants.is_empty());
        assert_eq!(expand(Some(&known), reply).unwrap(), next);
    }

    #[test]
    fn full_replies_pass_through() {
        let next = quorum(4, 3, &[2, 2]);
        assert_eq!(expand(None, next.clone()).unwrap(), next);
    }

    #[test]
    fn inconsistent_compact_replies_are_refused() {
        let known = quorum(4, 2, &[1, 1, 1]);
        let next = quorum(4, 3, &[2, 2, 2]);
        let cases: Vec<(&str, Option<Quorum>, Quorum)> = vec![
            ("no known quorum", None, compact_form(&next)),
            (
                "other id",
                Some(quorum(3, 2, &[1, 1, 1])),
                compact_form(&next),
            ),
            (
                "newer known",
                Some(quorum(4, 9, &[1, 1, 1])),
                compact_form(&next),
            ),
            (
                "other count",
                Some(quorum(4, 2, &[1, 1])),
                compact_form(&next),
            ),
            ("index out of range", Some(known.clone()), {
                let mut r = compact_form(&quorum(4, 3, &[2, 2, 5]));
                r.compact.as_mut().unwrap().indices = vec![3];
                r
            }),
            ("indices not increasing", Some(known.clone()), {
                let mut r = compact_form(&quorum(4, 3, &[2, 5, 5, 2]));
                r.compact.as_mut().unwrap().count = 3;
                r.compact.as_mut().unwrap().indices = vec![1, 1];
                r
            }),
            ("mismatched overrides", Some(known.clone()), {
                let mut r = compact_form(&quorum(4, 3, &[2, 2, 5]));
                r.compact.as_mut().unwrap().steps.clear();
                r
            }),
        ];
        for (name, known, reply) in cases {
            let err = expand(known.as_ref(), reply).expect_err(name);
            assert!(matches!(err, Error::FailedPrecondition(_)), "{name}: {err}");
        }
    }

    #[test]
    fn delta_rebuilds_membership_and_field_changes() {
        let known = quorum(4, 2, &[1, 1, 1, 1]);
        let mut next = quorum(5, 3, &[2, 2, 2, 2]);
        // r1 leaves, r2 changes its address, "r9" joins (sorted last), r0 lags.
        next.participants.remove(1);
        next.participants[1].address = "http://moved:1".into();
        next.participants.push(member("r9", 0));
        next.participants[0].step = 1;
        let reply = delta_form(&known, &next);
        let c = reply.compact.as_ref().unwrap();
        assert_eq!((c.base_quorum_id, c.base_revision), (4, 2));
        assert_eq!(c.removed, vec!["r1".to_string()]);
        let upserts: Vec<&str> = c.upserts.iter().map(|m| m.replica_id.as_str()).collect();
        assert_eq!(upserts, ["r2", "r9"]);
        assert!(reply.participants.is_empty());
        assert!(delta_applies(&known, 4, 2));
        assert!(!delta_applies(&known, 4, 1));
        assert!(!delta_applies(&known, 0, 0));
        assert_eq!(expand(Some(&known), reply.clone()).unwrap(), next);
        // Only against exactly the base it was built for.
        for other in [quorum(4, 1, &[1, 1, 1, 1]), quorum(5, 2, &[1, 1, 1, 1])] {
            let err = expand(Some(&other), reply.clone()).unwrap_err();
            assert!(matches!(err, Error::FailedPrecondition(_)), "{err}");
        }
        // Malformed deltas are refused.
        let mut bad = reply.clone();
        bad.compact.as_mut().unwrap().removed.push("nobody".into());
        assert!(expand(Some(&known), bad).is_err());
        let mut bad = reply.clone();
        bad.compact.as_mut().unwrap().upserts.push(member("r9", 0));
        assert!(expand(Some(&known), bad).is_err());
        let mut bad = reply;
        bad.compact.as_mut().unwrap().count = 9;
        assert!(expand(Some(&known), bad).is_err());
    }

    #[test]
    fn applies_only_to_a_recent_enough_holder_of_the_same_id() {
        let issued = quorum(7, 10, &[1]);
        assert!(compact_applies(&issued, 6, 7, 9));
        assert!(compact_applies(&issued, 6, 7, 6));
        assert!(!compact_applies(&issued, 6, 7, 5), "stale revision");
        assert!(!compact_applies(&issued, 6, 6, 9), "other id");
        assert!(!compact_applies(&issued, 6, 7, 0), "nothing known");
        assert!(!compact_applies(&issued, 6, 0, 0), "old-style request");
        assert!(!compact_applies(&issued, 6, 7, 11), "revision never issued");
    }

    #[test]
    fn only_steps_changed_checks_every_other_field() {
        let a = quorum(1, 1, &[1, 1]);
        assert!(only_steps_changed(&a, &quorum(1, 2, &[2, 3])));
        assert!(!only_steps_changed(&a, &quorum(2, 2, &[1, 1])));
        assert!(!only_steps_changed(&a, &quorum(1, 2, &[1])));
        let edits: Vec<fn(&mut QuorumMember)> = vec![
            |m| m.replica_id.push('x'),
            |m| m.address.push('x'),
            |m| m.store_address.push('x'),
            |m| m.world_size += 1,
            |m| m.shrink_only = true,
            |m| m.commit_failures = 1,
            |m| m.data = "{}".into(),
        ];
        for edit in edits {
            let mut b = quorum(1, 2, &[1, 1]);
            edit(&mut b.participants[1]);
            assert!(!only_steps_changed(&a, &b));
        }
    }
}
