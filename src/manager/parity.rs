//! The group's side of runtime state parity: every group rank digests its own committed state
//! every `parity_every` steps and hands the digest over with a commit vote; this collects one
//! digest per group rank and, once a step has all of them, gives the group's digest to the
//! heartbeats until the lighthouse acknowledges it (see `crate::lighthouse::health::parity`).

use std::collections::BTreeMap;

use crate::client::MAX_DIGEST_BYTES;
use crate::error::{Error, Result};
use crate::proto::StateDigest;

/// Bytes checksummed by both sums before the next piece: small enough that the second sum
/// reads them from the first level of cache.
const DIGEST_PIECE_BYTES: usize = 32 << 10;

/// Continues a rank's state digest over `bytes`: zlib's CRC-32 and Adler-32 (the values
/// `zlib.crc32(bytes, crc)` and `zlib.adler32(bytes, adler)` give, so digests taken by any
/// version compare equal), both over each piece while it is in cache, vectorised where the
/// CPU allows. Several GB/s where zlib's two passes make about one.
pub fn digest_update(crc: u32, adler: u32, bytes: &[u8]) -> (u32, u32) {
    let mut c = crc32fast::Hasher::new_with_initial(crc);
    let mut a = simd_adler32::Adler32::from_checksum(adler);
    for piece in bytes.chunks(DIGEST_PIECE_BYTES) {
        c.update(piece);
        a.write(piece);
    }
    (c.finalize(), a.finish())
}

/// Steps kept waiting for the rest of their ranks' digests (the oldest go first).
const MAX_PENDING_STEPS: usize = 8;

/// Collects the group ranks' state digests (see the module docs).
#[derive(Debug)]
pub struct DigestCollector {
    world_size: usize,
    pending: BTreeMap<i64, Vec<Option<Vec<u8>>>>,
    ready: Option<StateDigest>,
    acked: i64,
}

impl DigestCollector {
    /// A collector for a group of `world_size` ranks.
    pub fn new(world_size: u64) -> Self {
        Self {
            world_size: usize::try_from(world_size).unwrap_or(usize::MAX).max(1),
            pending: BTreeMap::new(),
            ready: None,
            acked: 0,
        }
    }

    /// Takes group rank `group_rank`'s digest of its committed state after `step`.
    ///
    /// Errors (`InvalidArgument`, nothing recorded) on a group rank outside the group, a
    /// negative step, or a digest that is empty or longer than [`MAX_DIGEST_BYTES`].
    pub fn offer(&mut self, group_rank: i64, step: i64, digest: Vec<u8>) -> Result<()> {
        let rank = usize::try_from(group_rank)
            .ok()
            .filter(|r| *r < self.world_size)
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "state digest from group rank {group_rank}, outside the group of {}",
                    self.world_size
                ))
            })?;
        if step < 1 {
            return Err(Error::InvalidArgument(format!(
                "a state digest's step must be positive, got {step}"
            )));
        }
        if digest.is_empty() || digest.len() > MAX_DIGEST_BYTES {
            return Err(Error::InvalidArgument(format!(
                "a state digest must be 1 to {MAX_DIGEST_BYTES} bytes, got {}",
                digest.len()
            )));
        }
        let newest = self
            .ready
            .as_ref()
            .map_or(self.acked, |r| r.step.max(self.acked));
        if step <= newest {
            return Ok(());
        }
        let slots = self
            .pending
            .entry(step)
            .or_insert_with(|| vec![None; self.world_size]);
        slots[rank] = Some(digest);
        if slots.iter().all(Option::is_some) {
            let slots = self.pending.remove(&step).expect("present");
            self.ready = Some(StateDigest {
                step,
                ranks: slots.into_iter().map(|d| d.expect("complete")).collect(),
            });
            self.pending = self.pending.split_off(&(step + 1));
        }
        while self.pending.len() > MAX_PENDING_STEPS {
            let oldest = *self.pending.keys().next().expect("not empty");
            self.pending.remove(&oldest);
        }
        Ok(())
    }

    /// The group's newest complete digest the lighthouse has not acknowledged.
    pub fn to_send(&self) -> Option<StateDigest> {
        self.ready.clone()
    }

    /// The lighthouse took the group's digests up to `step`.
    pub fn acknowledged(&mut self, step: i64) {
        self.acked = self.acked.max(step);
        if self.ready.as_ref().is_some_and(|r| r.step <= step) {
            self.ready = None;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Adler-32 as its definition reads (RFC 1950), one byte at a time.
    fn adler_by_definition(adler: u32, bytes: &[u8]) -> u32 {
        let (mut a, mut b) = (adler & 0xffff, adler >> 16);
        for &x in bytes {
            a = (a + u32::from(x)) % 65521;
            b = (b + a) % 65521;
        }
        (b << 16) | a
    }

    #[test]
    fn the_digest_sums_are_zlibs() {
        // zlib.crc32(b"123456789") and zlib.adler32(b"Wikipedia"): the published check values.
        assert_eq!(digest_update(0, 1, b"123456789").0, 0xCBF4_3926);
        assert_eq!(digest_update(0, 1, b"Wikipedia").1, 0x11E6_0398);
        // Nothing digested leaves both sums as they were.
        assert_eq!(digest_update(7, 9, b""), (7, 9));
    }

    proptest! {
        #[test]
        fn a_digest_continued_piece_by_piece_is_the_digest_of_the_whole(
            bytes in proptest::collection::vec(any::<u8>(), 0..200_000),
            cut in any::<prop::sample::Index>(),
        ) {
            let whole = digest_update(0, 1, &bytes);
            let at = cut.index(bytes.len() + 1);
            let (c, a) = digest_update(0, 1, &bytes[..at]);
            prop_assert_eq!(digest_update(c, a, &bytes[at..]), whole);
            prop_assert_eq!(whole.0, crc32fast::hash(&bytes));
            prop_assert_eq!(whole.1, adler_by_definition(1, &bytes));
        }
    }

    #[test]
    fn a_step_is_sent_once_every_rank_gave_its_digest_until_acknowledged() {
        let mut c = DigestCollector::new(3);
        c.offer(0, 10, vec![1; 16]).unwrap();
        c.offer(2, 10, vec![3; 16]).unwrap();
        assert!(c.to_send().is_none());
        c.offer(1, 10, vec![2; 16]).unwrap();
        let d = c.to_send().unwrap();
        assert_eq!(d.step, 10);
        assert_eq!(d.ranks, vec![vec![1; 16], vec![2; 16], vec![3; 16]]);
        assert!(c.to_send().is_some(), "resent until acknowledged");
        c.acknowledged(10);
        assert!(c.to_send().is_none());
        // An old step's digest after the acknowledgement is ignored.
        c.offer(0, 10, vec![9; 16]).unwrap();
        assert!(c.pending.is_empty());
    }

    #[test]
    fn a_newer_complete_step_replaces_an_older_and_drops_incomplete_older_ones() {
        let mut c = DigestCollector::new(2);
        c.offer(0, 10, vec![1; 8]).unwrap();
        c.offer(0, 20, vec![1; 8]).unwrap();
        c.offer(1, 20, vec![1; 8]).unwrap();
        assert_eq!(c.to_send().unwrap().step, 20);
        assert!(c.pending.is_empty(), "step 10 can no longer be sent");
        for s in 30..60 {
            c.offer(0, s, vec![1; 8]).unwrap();
        }
        assert!(c.pending.len() <= MAX_PENDING_STEPS);
    }

    #[test]
    fn bad_digests_are_refused() {
        let mut c = DigestCollector::new(2);
        assert!(c.offer(2, 1, vec![1; 8]).is_err());
        assert!(c.offer(-1, 1, vec![1; 8]).is_err());
        assert!(c.offer(0, 0, vec![1; 8]).is_err());
        assert!(c.offer(0, 1, vec![]).is_err());
        assert!(c.offer(0, 1, vec![1; 65]).is_err());
        assert!(c.pending.is_empty());
    }
}
