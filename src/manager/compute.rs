//! Turns a lighthouse quorum into one group rank's answer: its replica rank, whether it heals
//! and from whom, whom it serves, and which store to rendezvous on.
//!
//! Pure: no I/O, no clocks. Every group of the quorum computes the same assignment from the same
//! quorum, so the sources and destinations agree without talking to each other.

use super::topology::{assign_sources, Topology};
use crate::error::{Error, Result};
use crate::proto::{ManagerQuorumResponse, Quorum, QuorumMember};

/// Computes the answer for group rank `group_rank` of replica group `replica_id`.
///
/// - Participants are ordered by replica_id; our index is the replica rank.
/// - Members at the highest step are up to date; the others heal. With `init_sync` and every
///   member at step 0, only the first of them (the primary) is a source and everyone else heals,
///   so all groups start from identical state.
/// - Each healer gets the best connected source ([`assign_sources`]: the topology file when
///   `topology` is given and every member announced the same one, else same host when every
///   member announced that it chooses so, else exactly the round-robin of older and upstream
///   managers), and several healers are spread over the sources; with no locality difference
///   this is round-robin, offset by `group_rank`, so the ranks of one healthy group do not all
///   serve everyone (each group rank heals independently).
/// - The rendezvous store is an up-to-date group's store, chosen per group rank to spread load;
///   every group computes the same choice for a given group rank.
///
/// Errors (`FailedPrecondition`) when `replica_id` is not in the quorum, when the quorum is empty,
/// or when the groups do not all have the same world size (their group ranks could not be
/// paired for healing or rendezvous). A negative `group_rank` is an `InvalidArgument`.
pub fn compute_quorum_results(
    replica_id: &str,
    group_rank: i64,
    quorum: &Quorum,
    init_sync: bool,
    topology: Option<&Topology>,
) -> Result<ManagerQuorumResponse> {
    if group_rank < 0 {
        return Err(Error::InvalidArgument(format!(
            "group_rank must not be negative, got {group_rank}"
        )));
    }
    let plan = Plan::new(quorum, group_rank as u64, init_sync, topology)?;
    let replica_rank = plan.rank_of(quorum, replica_id).ok_or_else(|| {
        Error::FailedPrecondition(format!(
            "replica {replica_id} is not a participant of quorum {}",
            quorum.quorum_id
        ))
    })?;
    Ok(plan.answer(quorum, replica_rank))
}

/// One quorum's answers for one group rank, for every member at once (see
/// [`compute_quorum_results`] for the rules): O(members) to build (plus the source choice),
/// then O(1) per member besides the healers a source serves. The lighthouse builds one per
/// group rank to answer every member in the sparse form; a manager builds one per rank.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Indices into the quorum's `participants`, in replica-rank order (by replica_id).
    order: Vec<usize>,
    max_step: i64,
    /// Per replica rank: its position among the members at `max_step` (None: behind).
    max_pos: Vec<Option<u32>>,
    max_world_size: u32,
    /// Per replica rank: the replica rank it heals from (None: it does not heal).
    source: Vec<Option<u32>>,
    /// Per replica rank: the replica ranks healing from it, ascending.
    serves: Vec<Vec<u32>>,
    /// Replica rank of the member whose store this group rank rendezvous on.
    store: u32,
    commit_failures: i64,
}

impl Plan {
    /// The plan of `quorum` for group rank `group_rank`.
    ///
    /// Errors (`FailedPrecondition`) when the quorum is empty or its groups do not all have
    /// the same world size.
    pub fn new(
        quorum: &Quorum,
        group_rank: u64,
        init_sync: bool,
        topology: Option<&Topology>,
    ) -> Result<Plan> {
        let mut order: Vec<usize> = (0..quorum.participants.len()).collect();
        order.sort_by(|&a, &b| {
            quorum.participants[a]
                .replica_id
                .cmp(&quorum.participants[b].replica_id)
        });
        let participants: Vec<&QuorumMember> =
            order.iter().map(|&i| &quorum.participants[i]).collect();

        let first = participants.first().ok_or_else(|| {
            Error::FailedPrecondition(format!("quorum {} has no participants", quorum.quorum_id))
        })?;
        if let Some(other) = participants
            .iter()
            .find(|p| p.world_size != first.world_size)
        {
            return Err(Error::FailedPrecondition(format!(
                "quorum {} mixes replica groups of different world sizes ({} has {}, {} has {}); \
                 group ranks cannot be paired for healing",
                quorum.quorum_id,
                first.replica_id,
                first.world_size,
                other.replica_id,
                other.world_size
            )));
        }

        let n = participants.len();
        let max_step = participants.iter().map(|p| p.step).max().unwrap_or(0);
        // Replica ranks of the up-to-date members, in replica-rank order.
        let max_ranks: Vec<usize> = (0..n)
            .filter(|&i| participants[i].step == max_step)
            .collect();
        let mut max_pos = vec![None; n];
        for (k, &i) in max_ranks.iter().enumerate() {
            max_pos[i] = Some(k as u32);
        }
        let primary = max_ranks.first().copied().unwrap_or(0);

        // With init_sync at step 0 only the primary serves; otherwise every up-to-date member
        // does.
        let sync_from_primary = init_sync && max_step == 0;
        let sources: Vec<usize> = if sync_from_primary {
            vec![primary]
        } else {
            max_ranks.clone()
        };
        let mut is_source = vec![false; n];
        for &s in &sources {
            is_source[s] = true;
        }
        let destinations: Vec<usize> = (0..n).filter(|&i| !is_source[i]).collect();
        let assigned = assign_sources(&participants, &sources, &destinations, group_rank, topology);

        let mut source = vec![None; n];
        let mut serves = vec![Vec::new(); n];
        for (&dst, &src) in destinations.iter().zip(&assigned) {
            source[dst] = Some(src as u32);
            serves[src].push(dst as u32);
        }
        let offset = (group_rank % max_ranks.len() as u64) as usize;
        Ok(Plan {
            order,
            max_step,
            max_pos,
            max_world_size: max_ranks.len() as u32,
            source,
            serves,
            store: max_ranks[offset] as u32,
            commit_failures: participants
                .iter()
                .map(|p| p.commit_failures)
                .max()
                .unwrap_or(0),
        })
    }

    /// Number of members.
    pub fn count(&self) -> usize {
        self.order.len()
    }

    /// The member at replica rank `rank` of `quorum` (the quorum the plan was built from).
    pub fn member<'q>(&self, quorum: &'q Quorum, rank: usize) -> &'q QuorumMember {
        &quorum.participants[self.order[rank]]
    }

    /// The replica rank of `replica_id` in `quorum` (the quorum the plan was built from).
    pub fn rank_of(&self, quorum: &Quorum, replica_id: &str) -> Option<usize> {
        self.order
            .binary_search_by(|&i| quorum.participants[i].replica_id.as_str().cmp(replica_id))
            .ok()
    }

    /// The replica rank member `rank` heals from, if it heals.
    pub fn source_of(&self, rank: usize) -> Option<u32> {
        self.source[rank]
    }

    /// The replica ranks healing from member `rank`, ascending.
    pub fn served_by(&self, rank: usize) -> &[u32] {
        &self.serves[rank]
    }

    /// The replica rank whose store this group rank rendezvous on.
    pub fn store(&self) -> u32 {
        self.store
    }

    pub fn max_step(&self) -> i64 {
        self.max_step
    }

    pub fn max_world_size(&self) -> u32 {
        self.max_world_size
    }

    /// Member `rank`'s position among the up-to-date members (None: behind).
    pub fn max_replica_rank(&self, rank: usize) -> Option<u32> {
        self.max_pos[rank]
    }

    pub fn commit_failures(&self) -> i64 {
        self.commit_failures
    }

    /// The full answer of member `rank` (`quorum`: the quorum the plan was built from).
    pub fn answer(&self, quorum: &Quorum, rank: usize) -> ManagerQuorumResponse {
        let src = self.source[rank];
        ManagerQuorumResponse {
            quorum_id: quorum.quorum_id,
            recover_src_manager_address: src
                .map(|s| self.member(quorum, s as usize).address.clone())
                .unwrap_or_default(),
            recover_src_replica_rank: src.map(i64::from),
            recover_dst_replica_ranks: self.serves[rank].iter().map(|&d| i64::from(d)).collect(),
            store_address: self
                .member(quorum, self.store as usize)
                .store_address
                .clone(),
            max_step: self.max_step,
            max_replica_rank: self.max_pos[rank].map(i64::from),
            max_world_size: i64::from(self.max_world_size),
            replica_rank: rank as i64,
            replica_world_size: self.count() as i64,
            heal: src.is_some(),
            commit_failures: self.commit_failures,
            replica_ids: self
                .order
                .iter()
                .map(|&i| quorum.participants[i].replica_id.clone())
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(id: &str, step: i64, world_size: u64) -> QuorumMember {
        QuorumMember {
            world_size,
            ..crate::testkit::member(id, step)
        }
    }

    fn quorum(members: Vec<QuorumMember>) -> Quorum {
        Quorum {
            quorum_id: 7,
            participants: members,
            ..Default::default()
        }
    }

    /// Steps [0,1,0,1,0] over groups a..e (given out of order): b and d are sources.
    fn mixed() -> Quorum {
        quorum(vec![
            member("e", 0, 2),
            member("b", 1, 2),
            member("a", 0, 2),
            member("d", 1, 2),
            member("c", 0, 2),
        ])
    }

    /// Groups a, b, c of one rank each at step 0 (given out of order): a fresh job.
    fn fresh() -> Quorum {
        quorum(vec![
            member("b", 0, 1),
            member("a", 0, 1),
            member("c", 0, 1),
        ])
    }

    fn results(q: &Quorum, group_rank: i64, init_sync: bool) -> Vec<ManagerQuorumResponse> {
        ["a", "b", "c", "d", "e"]
            .iter()
            .map(|id| compute_quorum_results(id, group_rank, q, init_sync, None).unwrap())
            .collect()
    }

    #[test]
    fn ranks_and_ids_follow_replica_id_order() {
        let r = results(&mixed(), 0, true);
        for (i, res) in r.iter().enumerate() {
            assert_eq!(res.replica_rank, i as i64);
            assert_eq!(res.replica_world_size, 5);
            assert_eq!(res.replica_ids, vec!["a", "b", "c", "d", "e"]);
            assert_eq!(res.quorum_id, 7);
            assert_eq!(res.max_step, 1);
            assert_eq!(res.max_world_size, 2);
        }
        let max_ranks: Vec<_> = r.iter().map(|x| x.max_replica_rank).collect();
        assert_eq!(max_ranks, vec![None, Some(0), None, Some(1), None]);
    }

    #[test]
    fn behind_groups_heal_from_sources_round_robin_offset_by_group_rank() {
        let q = mixed();
        // Group rank 0: destinations a,c,e → sources b,d,b.
        let r0 = results(&q, 0, true);
        let heal0: Vec<_> = r0.iter().map(|x| x.heal).collect();
        assert_eq!(heal0, vec![true, false, true, false, true]);
        assert_eq!(r0[0].recover_src_replica_rank, Some(1));
        assert_eq!(r0[0].recover_src_manager_address, "http://b:1");
        assert_eq!(r0[2].recover_src_replica_rank, Some(3));
        assert_eq!(r0[2].recover_src_manager_address, "http://d:1");
        assert_eq!(r0[4].recover_src_replica_rank, Some(1));
        assert_eq!(r0[1].recover_dst_replica_ranks, vec![0, 4]);
        assert_eq!(r0[3].recover_dst_replica_ranks, vec![2]);
        // Group rank 1: the offset flips it: a,c,e → d,b,d.
        let r1 = results(&q, 1, true);
        assert_eq!(r1[0].recover_src_replica_rank, Some(3));
        assert_eq!(r1[2].recover_src_replica_rank, Some(1));
        assert_eq!(r1[4].recover_src_replica_rank, Some(3));
        assert_eq!(r1[1].recover_dst_replica_ranks, vec![2]);
        assert_eq!(r1[3].recover_dst_replica_ranks, vec![0, 4]);
        // Sources and healers never have the other role's fields.
        for r in r0.iter().chain(r1.iter()) {
            if r.heal {
                assert!(r.recover_dst_replica_ranks.is_empty());
                assert!(r.recover_src_replica_rank.is_some());
            } else {
                assert!(r.recover_src_replica_rank.is_none());
                assert!(r.recover_src_manager_address.is_empty());
            }
        }
    }

    #[test]
    fn every_destination_is_served_exactly_once() {
        let q = mixed();
        for group_rank in 0..4 {
            let r = results(&q, group_rank, true);
            let mut served: Vec<i64> = r
                .iter()
                .flat_map(|x| x.recover_dst_replica_ranks.clone())
                .collect();
            served.sort();
            assert_eq!(served, vec![0, 2, 4]);
            for (i, x) in r.iter().enumerate() {
                if let Some(src) = x.recover_src_replica_rank {
                    assert!(r[src as usize]
                        .recover_dst_replica_ranks
                        .contains(&(i as i64)));
                }
            }
        }
    }

    #[test]
    fn store_is_an_up_to_date_group_spread_by_group_rank() {
        let q = mixed();
        for (group_rank, store) in [(0, "b:2"), (1, "d:2"), (2, "b:2")] {
            for r in results(&q, group_rank, true) {
                assert_eq!(r.store_address, store, "group rank {group_rank}");
            }
        }
    }

    #[test]
    fn init_sync_at_step_zero_heals_all_but_the_primary() {
        let q = fresh();
        let r = results_of(&q, &["a", "b", "c"], 0, true);
        assert_eq!(
            r.iter().map(|x| x.heal).collect::<Vec<_>>(),
            vec![false, true, true]
        );
        assert_eq!(r[0].recover_dst_replica_ranks, vec![1, 2]);
        assert_eq!(r[1].recover_src_replica_rank, Some(0));
        assert_eq!(r[2].recover_src_manager_address, "http://a:1");
        assert_eq!(r[0].max_world_size, 3);
    }

    #[test]
    fn without_init_sync_nobody_heals_at_step_zero() {
        let q = fresh();
        for r in results_of(&q, &["a", "b", "c"], 0, false) {
            assert!(!r.heal);
            assert!(r.recover_dst_replica_ranks.is_empty());
            assert!(r.recover_src_replica_rank.is_none());
        }
    }

    #[test]
    fn init_sync_does_not_matter_past_step_zero() {
        let q = quorum(vec![member("a", 3, 1), member("b", 3, 1)]);
        for init_sync in [true, false] {
            for r in results_of(&q, &["a", "b"], 0, init_sync) {
                assert!(!r.heal);
                assert!(r.recover_dst_replica_ranks.is_empty());
            }
        }
    }

    #[test]
    fn commit_failures_are_the_max_over_participants() {
        let mut a = member("a", 1, 1);
        a.commit_failures = 2;
        let mut b = member("b", 1, 1);
        b.commit_failures = 5;
        let q = quorum(vec![a, b, member("c", 1, 1)]);
        for r in results_of(&q, &["a", "b", "c"], 0, true) {
            assert_eq!(r.commit_failures, 5);
        }
    }

    #[test]
    fn unequal_world_sizes_are_refused() {
        let q = quorum(vec![member("a", 1, 2), member("b", 1, 3)]);
        let err = compute_quorum_results("a", 0, &q, true, None).unwrap_err();
        assert!(matches!(err, Error::FailedPrecondition(_)), "{err}");
        assert!(err.to_string().contains("world size"), "{err}");
    }

    #[test]
    fn missing_replica_and_bad_input_are_refused() {
        let q = quorum(vec![member("a", 1, 1)]);
        assert!(matches!(
            compute_quorum_results("zz", 0, &q, true, None),
            Err(Error::FailedPrecondition(_))
        ));
        assert!(matches!(
            compute_quorum_results("a", -1, &q, true, None),
            Err(Error::InvalidArgument(_))
        ));
        assert!(matches!(
            compute_quorum_results("a", 0, &quorum(vec![]), true, None),
            Err(Error::FailedPrecondition(_))
        ));
    }

    #[test]
    fn single_group_is_its_own_source() {
        let q = quorum(vec![member("a", 4, 1)]);
        let r = compute_quorum_results("a", 0, &q, true, None).unwrap();
        assert!(!r.heal);
        assert_eq!(r.max_replica_rank, Some(0));
        assert_eq!(r.store_address, "a:2");
        assert_eq!(r.replica_world_size, 1);
    }

    fn results_of(
        q: &Quorum,
        ids: &[&str],
        group_rank: i64,
        init_sync: bool,
    ) -> Vec<ManagerQuorumResponse> {
        ids.iter()
            .map(|id| compute_quorum_results(id, group_rank, q, init_sync, None).unwrap())
            .collect()
    }
}
