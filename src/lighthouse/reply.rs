//! An issued quorum as its members receive it.
//!
//! A member that asked for the sparse form gets its own answer (what each of its group ranks
//! is to do, naming only the members that involves; see [`crate::manager::sparse`]), from
//! plans built once per quorum. A member that holds the previous quorum gets it in compact
//! form (its step vector, or a delta against the previous quorum); anyone else gets the full
//! member list. Each shared form is encoded and framed once per quorum, and every member's
//! reply shares those bytes: a round costs O(members) on the lighthouse, in CPU and in bytes.

use std::sync::OnceLock;

use axum::body::Bytes;

use crate::client::compact;
use crate::manager::sparse::SparsePlans;
use crate::proto::Quorum;

/// A quorum as handed to its members: the full message, and its two gRPC responses (full
/// and compact, see [`compact`]) each framed at most once (5-byte prefix + encoded
/// `LighthouseQuorumResponse`) so every member's reply shares the same bytes instead of
/// cloning and encoding the quorum once per member.
pub(crate) struct Issued {
    pub(crate) quorum: Quorum,
    /// Revision since which only steps changed (see `QuorumEngine::stable_since`).
    stable_since: u64,
    full: OnceLock<Bytes>,
    compact: OnceLock<Bytes>,
    /// The delta reply against the previous quorum, when steps-only compact replies do not
    /// cover holders of that quorum (membership or member fields changed).
    delta: Option<(Quorum, Quorum)>,
    delta_framed: OnceLock<Bytes>,
    /// The plans of the sparse form, built on the first sparse request.
    plans: SparsePlans,
}

/// What a requester already holds: `(known_quorum_id, known_revision)`, zeros for nothing.
pub(crate) type Known = (i64, u64);

/// One gRPC message frame holding `LighthouseQuorumResponse { quorum }`: an uncompressed flag
/// byte, the big-endian length, then the message (its only field, 1, is the quorum).
fn frame(quorum: &Quorum) -> Bytes {
    let len = prost::encoding::message::encoded_len(1, quorum);
    let mut buf = Vec::with_capacity(len + 5);
    buf.push(0u8);
    buf.extend_from_slice(&u32::try_from(len).unwrap_or(u32::MAX).to_be_bytes());
    prost::encoding::message::encode(1, quorum, &mut buf);
    Bytes::from(buf)
}

impl Issued {
    /// `previous` is the quorum issued before this one (revision - 1), if any.
    pub(crate) fn new(quorum: Quorum, stable_since: u64, previous: Option<&Quorum>) -> Self {
        // Holders of the previous quorum get the steps-only form unless something else
        // changed; then they get a delta against it (built here, in O(n), once).
        let delta = previous
            .filter(|_| stable_since == quorum.revision)
            .map(|prev| {
                let base = Quorum {
                    quorum_id: prev.quorum_id,
                    revision: prev.revision,
                    ..Default::default()
                };
                (base, compact::delta_form(prev, &quorum))
            });
        Self {
            quorum,
            stable_since,
            full: OnceLock::new(),
            compact: OnceLock::new(),
            delta,
            delta_framed: OnceLock::new(),
            plans: SparsePlans::default(),
        }
    }

    /// The framed sparse reply for member `replica_id`, planned with `init_sync`; None when
    /// the sparse form does not apply to this quorum (it gets the usual form).
    pub(crate) fn sparse_framed(&self, replica_id: &str, init_sync: bool) -> Option<Bytes> {
        self.plans
            .form(&self.quorum, replica_id, init_sync)
            .map(|q| frame(&q))
    }

    /// True if a requester holding `known` can rebuild this quorum from the compact form.
    fn compact_for(&self, known: Known) -> bool {
        compact::compact_applies(&self.quorum, self.stable_since, known.0, known.1)
    }

    /// The delta reply if a requester holding `known` can rebuild this quorum from it.
    fn delta_for(&self, known: Known) -> Option<&Quorum> {
        self.delta
            .as_ref()
            .filter(|(base, _)| compact::delta_applies(base, known.0, known.1))
            .map(|(_, delta)| delta)
    }

    /// True if the reply to a requester holding `known` is not the full form.
    pub(crate) fn abridged_for(&self, known: Known) -> bool {
        self.compact_for(known) || self.delta_for(known).is_some()
    }

    /// The framed response for a requester holding `known` (shared bytes, encoded once).
    pub(crate) fn framed(&self, known: Known) -> Bytes {
        if self.compact_for(known) {
            self.compact
                .get_or_init(|| frame(&compact::compact_form(&self.quorum)))
                .clone()
        } else if let Some(delta) = self.delta_for(known) {
            self.delta_framed.get_or_init(|| frame(delta)).clone()
        } else {
            self.full.get_or_init(|| frame(&self.quorum)).clone()
        }
    }
}
