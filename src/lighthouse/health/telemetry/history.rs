//! The job's history on the server, so a dashboard opened late still draws the whole run:
//! a point every interval; when [`CAPACITY`] points are held, every other one is dropped
//! and the interval doubles. Memory stays bounded (a day at one point a second is held at
//! about a minute and a half between points) and the whole run stays covered.

use std::time::{Duration, Instant};

use serde::Serialize;

/// Points held at most (before compaction halves them).
pub const CAPACITY: usize = 1024;

/// One point of the job's history.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Point {
    /// Unix time (seconds).
    pub t: f64,
    /// The job's best committed step (None before any).
    pub step: Option<i64>,
    /// Members of the last quorum.
    pub members: usize,
    /// The job's goodput ratio so far (None before its first committed step).
    pub ratio: Option<f64>,
    /// Committed steps accounted so far (all groups).
    pub steps_committed: u64,
    /// The job's productive and wall time so far (seconds; None before its first
    /// committed step).
    pub productive_s: Option<f64>,
    pub wall_s: Option<f64>,
}

/// A compacting series of [`Point`]s.
#[derive(Debug)]
pub struct History {
    points: Vec<Point>,
    every: Duration,
    due: Option<Instant>,
}

impl History {
    /// An empty history taking a point every `every` until compacted.
    pub fn new(every: Duration) -> Self {
        Self {
            points: Vec::new(),
            every,
            due: None,
        }
    }

    /// Whether a point is due at `now`.
    pub fn due(&self, now: Instant) -> bool {
        self.due.is_none_or(|d| now >= d)
    }

    /// Adds a point (taken at `now`) and schedules the next.
    pub fn push(&mut self, now: Instant, p: Point) {
        self.points.push(p);
        if self.points.len() >= CAPACITY {
            let mut i = 0;
            self.points.retain(|_| {
                i += 1;
                i % 2 == 1
            });
            self.every *= 2;
        }
        self.due = now.checked_add(self.every);
    }

    /// The points, oldest first.
    pub fn points(&self) -> &[Point] {
        &self.points
    }

    /// The interval between points now.
    pub fn every(&self) -> Duration {
        self.every
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compaction_keeps_the_whole_run_in_bounded_memory() {
        let t0 = Instant::now();
        let mut h = History::new(Duration::from_secs(1));
        let mut now = t0;
        for i in 0..10 * CAPACITY {
            if h.due(now) {
                h.push(
                    now,
                    Point {
                        t: i as f64,
                        step: Some(i as i64),
                        members: 2,
                        ratio: None,
                        steps_committed: 0,
                        productive_s: None,
                        wall_s: None,
                    },
                );
            }
            now += Duration::from_secs(1);
        }
        assert!(h.points().len() < CAPACITY);
        assert_eq!(h.points()[0].t, 0.0, "the start is kept");
        let last = h.points().last().unwrap().t;
        assert!(
            last >= (10 * CAPACITY) as f64 - 2.0 * h.every().as_secs_f64(),
            "{last}"
        );
        assert!(h.points().windows(2).all(|w| w[0].t < w[1].t));
    }
}
