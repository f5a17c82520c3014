//! The manager server: one per replica group, hosted by group rank 0.
//!
//! It gathers the group's ranks, asks the lighthouse once per quorum round and tells each
//! rank its role for the step; it also runs the per-step commit vote.
