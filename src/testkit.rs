//! Fixtures the unit tests of several areas share: replica groups as they present themselves
//! to the lighthouse, and the lighthouse's check of them.

use crate::error::Result;
use crate::proto::QuorumMember;

/// Replica group `id` on machine `host` at committed `step`: one rank, its manager server at
/// `http://{host}:1`, its store at `{host}:2`, nothing else set.
pub(crate) fn member_on(id: &str, host: &str, step: i64) -> QuorumMember {
    QuorumMember {
        replica_id: id.into(),
        address: format!("http://{host}:1"),
        store_address: format!("{host}:2"),
        step,
        world_size: 1,
        ..Default::default()
    }
}

/// [`member_on`] a machine named like the group.
pub(crate) fn member(id: &str, step: i64) -> QuorumMember {
    member_on(id, id, step)
}

/// What the lighthouse answers a quorum request of `member` with before it reasons about it
/// (a member a manager announces must pass).
pub(crate) fn lighthouse_accepts(member: &QuorumMember) -> Result<()> {
    crate::lighthouse::quorum::validate_member(member)
}
