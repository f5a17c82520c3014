//! The health side of the lighthouse: what it knows about each replica group beyond the
//! quorum rules, and how it tells people.
//!
//! - [`telemetry`]: the health model derived from the ranks' reports and the lighthouse's own
//!   observations (states, stragglers, snapshots, events).
//! - [`hub`]: the telemetry hub around it (its lock, the live event feed, the event log).
//! - [`metrics`]: the Prometheus exposition of the model.
//! - [`hang`]: which groups are hung (their training loop stopped reaching the manager).
//! - [`parity`]: the runtime state parity check across groups.
//!
//! The quorum engine consults the hang and parity verdicts; nothing here depends on the
//! quorum engine: what it reports (e.g. a [`Regression`]) is defined here.

pub mod hang;
pub mod hub;
pub mod metrics;
pub mod parity;
pub mod telemetry;

/// A quorum was issued behind the best committed step the engine knew of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Regression {
    /// The best committed step known before the quorum.
    pub from_step: i64,
    /// The highest step among the quorum's members (the job continues from here).
    pub to_step: i64,
    /// The quorum that regressed.
    pub quorum_id: i64,
    /// Replicas still alive (or remembered from before a lighthouse restart and not heard
    /// from since) that hold a step above `to_step`, given up on after `progress_wait`
    /// (sorted). Empty when the regression was unavoidable: every holder of
    /// the newer state is gone.
    pub alive_holders: Vec<String>,
    /// A member asked at step 0: a fresh process (holding its start-up state), which
    /// restores any durable snapshot newer than every member's step before it trains, where
    /// a group that has trained takes one only at least two steps ahead (the job then goes
    /// on from that snapshot, not from `to_step`). A process that started from a
    /// checkpoint of its own at a later step holds its start-up state too, but asks at that
    /// step: the lighthouse counts it as trained.
    pub fresh: bool,
}
