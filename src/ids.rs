//! Collections keyed by replica id.
//!
//! The quorum engine and its health verdicts look a replica id up in several maps on every
//! request and heartbeat, and a lighthouse may serve 10,000 groups. Ids are ~60-byte strings
//! (`{name}:{uuid}`), where std's SipHash costs more than the rest of a join; these maps use
//! foldhash instead: seeded at random per process, so an id set cannot be prepared offline to
//! collide, and several times faster on strings of this length.

use std::collections::{HashMap, HashSet};

/// The hasher of [`IdMap`] and [`IdSet`].
pub type IdHasher = foldhash::fast::RandomState;

/// A map keyed by replica id.
pub type IdMap<V> = HashMap<String, V, IdHasher>;

/// A set of replica ids.
pub type IdSet = HashSet<String, IdHasher>;
