//! The sparse form of a quorum (proto `SparseQuorum`): instead of every member, what each
//! group rank of one requester is to do, and only the members that names.
//!
//! The lighthouse builds one [`Plan`] per group rank for a whole quorum (once, shared by every
//! member's reply) and answers each requester with [`sparse_form`]; the manager turns it back
//! into each rank's answer with [`sparse_answer`]. Both sides use the same plan, so a rank's
//! answer is the one [`super::compute::compute_quorum_results`] gives from the full list
//! (without a topology file: managers that have one never ask for this form), except that
//! `replica_ids` names only the members the form carries (the group itself, its heal sources,
//! the groups healing from it and its stores; empty strings elsewhere).
//!
//! A first round of 10,000 groups sends each group a few members instead of all of them: the
//! round's bytes stop growing with the square of the job's size.

use std::collections::BTreeSet;
use std::sync::OnceLock;

use super::compute::Plan;
use crate::error::{Error, Result};
use crate::proto::{ManagerQuorumResponse, Quorum, SparseQuorum, SparseRank};

/// Most group ranks × members the lighthouse plans for in the sparse form (the plans' memory
/// is proportional); a larger quorum is answered in the usual form.
pub const MAX_PLANNED: usize = 1 << 24;

/// The plans of `quorum` for every group rank (`0..world_size` of its members), or None when
/// the sparse form does not apply: the members' world sizes differ (every manager refuses
/// that quorum from the full list, saying why) or the plans would be too large.
pub fn plans_for(quorum: &Quorum, init_sync: bool) -> Option<Vec<Plan>> {
    let world_size = usize::try_from(quorum.participants.first()?.world_size).ok()?;
    if world_size == 0 || world_size.saturating_mul(quorum.participants.len()) > MAX_PLANNED {
        return None;
    }
    (0..world_size as u64)
        .map(|g| Plan::new(quorum, g, init_sync, None).ok())
        .collect()
}

/// The plans of one quorum for the sparse form, built on the first request that needs them
/// (one set per `init_sync` setting of the requesters) and shared by every member's reply.
#[derive(Debug, Default)]
pub struct SparsePlans([OnceLock<Option<Vec<Plan>>>; 2]);

impl SparsePlans {
    /// The sparse form of `quorum` (the quorum these plans are for) for member `replica_id`,
    /// planned with `init_sync`; None where the form does not apply (see [`plans_for`]) or
    /// `replica_id` is not a member.
    pub fn form(&self, quorum: &Quorum, replica_id: &str, init_sync: bool) -> Option<Quorum> {
        let plans = self.0[usize::from(init_sync)]
            .get_or_init(|| plans_for(quorum, init_sync))
            .as_ref()?;
        let rank = plans.first()?.rank_of(quorum, replica_id)?;
        Some(sparse_form(quorum, plans, rank))
    }
}

/// The sparse form of `quorum` for the member at replica rank `rank`, from `plans` (one per
/// group rank, in order, all of `quorum`): it names the member, its heal sources, the
/// members healing from it and its stores.
pub fn sparse_form(quorum: &Quorum, plans: &[Plan], rank: usize) -> Quorum {
    let mut named = BTreeSet::from([rank as u32]);
    let ranks: Vec<SparseRank> = plans
        .iter()
        .map(|p| {
            let src = p.source_of(rank);
            named.extend(src);
            named.insert(p.store());
            named.extend(p.served_by(rank));
            SparseRank {
                recover_src: src,
                recover_dst: p.served_by(rank).to_vec(),
                store: p.store(),
            }
        })
        .collect();
    let plan = &plans[0];
    Quorum {
        quorum_id: quorum.quorum_id,
        participants: Vec::new(),
        created: quorum.created,
        revision: quorum.revision,
        compact: None,
        sparse: Some(SparseQuorum {
            count: plan.count() as u32,
            replica_rank: rank as u32,
            max_step: plan.max_step(),
            max_world_size: plan.max_world_size(),
            max_replica_rank: plan.max_replica_rank(rank),
            commit_failures: plan.commit_failures(),
            ranks,
            members: named
                .iter()
                .map(|&r| plan.member(quorum, r as usize).clone())
                .collect(),
            indices: named.into_iter().collect(),
        }),
    }
}

fn malformed(quorum_id: i64, what: impl std::fmt::Display) -> Error {
    Error::FailedPrecondition(format!(
        "the lighthouse's sparse form of quorum {quorum_id} is inconsistent: {what}"
    ))
}

/// The answer of group rank `group_rank` of `replica_id` from `quorum`'s sparse form.
///
/// Errors (`FailedPrecondition`) when the form is missing or inconsistent (a position out of
/// range, a named member it does not carry, another requester's form, no entry for this
/// group rank); a negative `group_rank` is an `InvalidArgument`.
pub fn sparse_answer(
    replica_id: &str,
    group_rank: i64,
    quorum: &Quorum,
) -> Result<ManagerQuorumResponse> {
    let id = quorum.quorum_id;
    let s = quorum
        .sparse
        .as_ref()
        .ok_or_else(|| malformed(id, "it is missing"))?;
    let g = usize::try_from(group_rank).map_err(|_| {
        Error::InvalidArgument(format!("group_rank must not be negative, got {group_rank}"))
    })?;
    let count = s.count as usize;
    if s.indices.len() != s.members.len() {
        return Err(malformed(id, "indices and members differ in length"));
    }
    if s.indices.windows(2).any(|w| w[0] >= w[1]) || s.indices.last() >= Some(&s.count) {
        return Err(malformed(id, "positions not increasing or out of range"));
    }
    let member = |pos: u32| {
        s.indices
            .binary_search(&pos)
            .ok()
            .map(|k| &s.members[k])
            .ok_or_else(|| malformed(id, format!("member {pos} is named but not carried")))
    };
    if member(s.replica_rank)?.replica_id != replica_id {
        return Err(malformed(id, format!("it is not the form of {replica_id}")));
    }
    let r = s.ranks.get(g).ok_or_else(|| {
        malformed(
            id,
            format!("no entry for group rank {g} ({} given)", s.ranks.len()),
        )
    })?;
    if r.recover_dst.iter().any(|&d| d >= s.count) {
        return Err(malformed(id, "a healer's position is out of range"));
    }
    let src = r.recover_src.map(member).transpose()?;
    let mut replica_ids = vec![String::new(); count];
    for (&pos, m) in s.indices.iter().zip(&s.members) {
        replica_ids[pos as usize] = m.replica_id.clone();
    }
    Ok(ManagerQuorumResponse {
        quorum_id: id,
        recover_src_manager_address: src.map(|m| m.address.clone()).unwrap_or_default(),
        recover_src_replica_rank: r.recover_src.map(i64::from),
        recover_dst_replica_ranks: r.recover_dst.iter().map(|&d| i64::from(d)).collect(),
        store_address: member(r.store)?.store_address.clone(),
        max_step: s.max_step,
        max_replica_rank: s.max_replica_rank.map(i64::from),
        max_world_size: i64::from(s.max_world_size),
        replica_rank: i64::from(s.replica_rank),
        replica_world_size: count as i64,
        heal: r.recover_src.is_some(),
        commit_failures: s.commit_failures,
        replica_ids,
    })
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::manager::compute::compute_quorum_results;
    use crate::proto::QuorumMember;

    /// A member announcing `heal_sources` (so hosts decide the sources) or nothing (plain
    /// round-robin), on one of three hosts.
    fn member(i: usize, step: i64, world_size: u64, hosts: bool) -> QuorumMember {
        QuorumMember {
            replica_id: format!("g{i:03}:{}", 1000 + i * 7 % 13),
            address: format!("http://host{}:{}", i % 3, 1000 + i),
            store_address: format!("host{}:{}", i % 3, 2000 + i),
            step,
            world_size,
            data: if hosts {
                r#"{"heal_sources":1}"#.into()
            } else {
                String::new()
            },
            commit_failures: (i % 4) as i64,
            ..Default::default()
        }
    }

    fn quorum(steps: &[i64], world_size: u64, hosts: bool) -> Quorum {
        Quorum {
            quorum_id: 42,
            // Given out of replica_id order, as any lighthouse may.
            participants: steps
                .iter()
                .enumerate()
                .rev()
                .map(|(i, &s)| member(i, s, world_size, hosts))
                .collect(),
            revision: 9,
            ..Default::default()
        }
    }

    /// Every rank of every member answers from its sparse form exactly as from the full list,
    /// but for the replica ids the form does not carry; and the form carries exactly the
    /// member itself, its sources, its healers and its stores.
    fn check_same(q: &Quorum, init_sync: bool) {
        let plans = plans_for(q, init_sync).expect("plannable");
        let ws = q.participants[0].world_size as i64;
        for m in &q.participants {
            let rank = plans[0].rank_of(q, &m.replica_id).unwrap();
            let form = sparse_form(q, &plans, rank);
            let s = form.sparse.as_ref().unwrap();
            let mut named = BTreeSet::from([rank as i64]);
            for g in 0..ws {
                let a = compute_quorum_results(&m.replica_id, g, q, init_sync, None).unwrap();
                named.extend(a.recover_src_replica_rank);
                named.extend(a.recover_dst_replica_ranks);
                let store = q
                    .participants
                    .iter()
                    .find(|p| p.store_address == a.store_address);
                named.insert(plans[0].rank_of(q, &store.unwrap().replica_id).unwrap() as i64);
            }
            let carried: Vec<i64> = s.indices.iter().map(|&i| i64::from(i)).collect();
            assert_eq!(carried, named.into_iter().collect::<Vec<_>>());
            let bytes = prost::Message::encode_to_vec(&form);
            let form: Quorum = prost::Message::decode(bytes.as_slice()).unwrap();
            for g in 0..ws {
                let want = compute_quorum_results(&m.replica_id, g, q, init_sync, None).unwrap();
                let mut got = sparse_answer(&m.replica_id, g, &form).unwrap();
                for (i, id) in got.replica_ids.iter_mut().enumerate() {
                    if id.is_empty() {
                        *id = want.replica_ids[i].clone();
                    }
                }
                assert_eq!(got, want, "{} group rank {g}", m.replica_id);
            }
        }
    }

    #[test]
    fn a_fresh_job_with_init_sync_heals_everyone_from_the_primary() {
        let q = quorum(&[0; 7], 2, true);
        check_same(&q, true);
        check_same(&q, false);
        let plans = plans_for(&q, true).unwrap();
        let primary = sparse_form(&q, &plans, 0);
        assert_eq!(
            primary.sparse.unwrap().ranks[0].recover_dst,
            (1..7).collect::<Vec<u32>>()
        );
    }

    #[test]
    fn mixed_world_sizes_and_huge_plans_fall_back_to_the_full_form() {
        let mut q = quorum(&[3, 3], 2, false);
        q.participants[1].world_size = 3;
        assert!(plans_for(&q, true).is_none());
        let q = quorum(&[3, 3], (MAX_PLANNED / 2 + 1) as u64, false);
        assert!(plans_for(&q, true).is_none());
        assert!(plans_for(&Quorum::default(), true).is_none());
    }

    #[test]
    fn inconsistent_forms_are_refused_naming_why() {
        let q = quorum(&[5, 3, 5, 1], 2, true);
        let plans = plans_for(&q, true).unwrap();
        let rank = 1;
        let id = plans[0].member(&q, rank).replica_id.clone();
        let good = sparse_form(&q, &plans, rank);
        assert!(sparse_answer(&id, 1, &good).is_ok());
        type Mutation = Box<dyn Fn(&mut SparseQuorum)>;
        let cases: Vec<(&str, Mutation, &str)> = vec![
            ("missing", Box::new(|_| {}), "missing"),
            ("rank", Box::new(|_| {}), "no entry for group rank 2"),
            (
                "other",
                Box::new(|s| {
                    s.replica_rank = *s.indices.iter().find(|&&p| p != s.replica_rank).unwrap()
                }),
                "not the form",
            ),
            ("range", Box::new(|s| s.count = 2), "out of range"),
            ("order", Box::new(|s| s.indices.reverse()), "not increasing"),
            (
                "lengths",
                Box::new(|s| {
                    s.members.pop();
                }),
                "differ in length",
            ),
            (
                "uncarried",
                Box::new(|s| s.ranks[0].recover_src = Some(3)),
                "member 3 is named but not carried",
            ),
        ];
        for (name, mutate, said) in cases {
            let mut form = good.clone();
            let g = if name == "rank" { 2 } else { 0 };
            if name == "missing" {
                form.sparse = None;
            } else {
                mutate(form.sparse.as_mut().unwrap());
            }
            let err = sparse_answer(&id, g, &form).unwrap_err();
            assert!(matches!(err, Error::FailedPrecondition(_)), "{name}: {err}");
            assert!(err.to_string().contains(said), "{name}: {err}");
        }
        assert!(matches!(
            sparse_answer(&id, -1, &good),
            Err(Error::InvalidArgument(_))
        ));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn every_answer_matches_the_full_list(
            steps in proptest::collection::vec(0i64..4, 1..24),
            world_size in 1u64..4,
            hosts in any::<bool>(),
            init_sync in any::<bool>(),
        ) {
            check_same(&quorum(&steps, world_size, hosts), init_sync);
        }
    }
}
