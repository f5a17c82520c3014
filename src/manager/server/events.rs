//! The lost-member events a manager server received from the lighthouse, kept for the ranks'
//! `WatchEvents` long-polls.

use std::collections::VecDeque;
use std::sync::Mutex;

use tokio::sync::watch;
use tokio::time::Instant;

use crate::proto::LostEvent;

/// Lost-member events kept for ranks that poll late (events are rare: one per lost peer).
const EVENT_HISTORY: usize = 64;

/// The lost-member events received from the lighthouse, numbered from 1, with a watch of the
/// last number so long-polls wake up when one arrives.
#[derive(Debug)]
pub(super) struct EventLog {
    events: Mutex<VecDeque<(u64, LostEvent)>>,
    last: watch::Sender<u64>,
}

impl EventLog {
    pub(super) fn new() -> Self {
        Self {
            events: Mutex::new(VecDeque::new()),
            last: watch::channel(0).0,
        }
    }

    pub(super) fn push(&self, event: LostEvent) {
        let mut events = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let seq = *self.last.borrow() + 1;
        events.push_back((seq, event));
        while events.len() > EVENT_HISTORY {
            events.pop_front();
        }
        self.last.send_replace(seq);
    }

    /// Buffered events after `after` and the number of the last one (`after` if none).
    pub(super) fn after(&self, after: u64) -> (Vec<LostEvent>, u64) {
        let events = self.events.lock().unwrap_or_else(|p| p.into_inner());
        let mut last = after;
        let found = events
            .iter()
            .filter(|(seq, _)| *seq > after)
            .map(|(seq, e)| {
                last = *seq;
                e.clone()
            })
            .collect();
        (found, last)
    }

    /// Waits until there are events after `after` or `deadline` passes.
    pub(super) async fn wait(&self, after: u64, deadline: Instant) -> (Vec<LostEvent>, u64) {
        let mut rx = self.last.subscribe();
        let _ = tokio::time::timeout_at(deadline, rx.wait_for(|last| *last > after)).await;
        self.after(after)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    #[tokio::test]
    async fn event_log_numbers_keeps_and_wakes() {
        let log = Arc::new(EventLog::new());
        let ev = |id: &str| LostEvent {
            replica_id: id.into(),
            quorum_id: 7,
        };
        // Nothing yet: the wait ends at its deadline with nothing.
        let (none, last) = log
            .wait(0, Instant::now() + Duration::from_millis(20))
            .await;
        assert!(none.is_empty());
        assert_eq!(last, 0);
        // A waiter wakes when an event arrives.
        let waiter = {
            let log = log.clone();
            tokio::spawn(async move { log.wait(0, Instant::now() + Duration::from_secs(10)).await })
        };
        tokio::time::sleep(Duration::from_millis(20)).await;
        log.push(ev("a"));
        let (got, last) = tokio::time::timeout(Duration::from_secs(5), waiter)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(got, vec![ev("a")]);
        assert_eq!(last, 1);
        log.push(ev("b"));
        assert_eq!(log.after(0), (vec![ev("a"), ev("b")], 2));
        assert_eq!(log.after(1), (vec![ev("b")], 2));
        assert_eq!(log.after(2), (vec![], 2));
        // The history is bounded.
        for _ in 0..2 * EVENT_HISTORY {
            log.push(ev("c"));
        }
        let (kept, last) = log.after(0);
        assert_eq!(kept.len(), EVENT_HISTORY);
        assert_eq!(last, 2 + 2 * EVENT_HISTORY as u64);
    }
}
