//! Sessions: each manager server holds a `Session` stream open for its life. When the stream
//! ends without the lighthouse shutting down (the manager's process died or its connection
//! broke), the replica group is declared lost at once; a member of the last quorum declared
//! lost (that way, or by heartbeat expiry at tick) is announced on the other members'
//! sessions, so they abort that quorum's collectives instead of waiting for a timeout.

use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::SystemTime;

use tokio::sync::mpsc;
use tonic::Status;
use tracing::{debug, info, warn};

use super::{now_instant, LostRecord, OnDrop, Shared, State, LOST_HISTORY};
use crate::error::{ensure, Error, Result};
use crate::lighthouse::health::hub::Hub;
use crate::lighthouse::quorum::LostMember;
use crate::lighthouse::reply::Issued;
use crate::proto::{LostEvent, SessionEvent};

/// Events buffered per session before the lighthouse drops them (a session that does not
/// read is broken anyway; events are rare: one per lost member).
pub(super) const SESSION_BUFFER: usize = 64;

/// The open session of one replica group.
pub(super) struct Session {
    /// Identifies this session; a replaced session's end must not declare the group lost.
    id: u64,
    tx: mpsc::Sender<std::result::Result<SessionEvent, Status>>,
}

/// The response stream of a session: the events queued for it, and the guard that notices
/// its end.
pub(crate) struct SessionStream {
    rx: mpsc::Receiver<std::result::Result<SessionEvent, Status>>,
    /// Declares the session's replica group lost when the stream is dropped (the client
    /// went away), unless the session was replaced or the lighthouse is shutting down.
    _ended: OnDrop,
}

impl futures::Stream for SessionStream {
    type Item = std::result::Result<SessionEvent, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.rx.poll_recv(cx)
    }
}

impl Shared {
    /// Sends each loss the engine declared to the other members of the quorum it was in.
    /// `before` is the last issued quorum before the engine call that declared the losses
    /// (a quorum issued by that same call no longer has the lost member).
    pub(super) fn announce_lost(hub: &Hub, state: &mut State, before: Option<Arc<Issued>>) {
        for LostMember {
            replica_id,
            quorum_id,
        } in state.engine.take_lost()
        {
            // A group that shut down cleanly left; anything else is a fault worth a WARN.
            if hub.with(|t| t.finished(&replica_id)) {
                info!(replica_id = %replica_id, quorum_id, "replica group left after finishing");
            } else {
                warn!(replica_id = %replica_id, quorum_id, "replica group lost");
            }
            state.lost.push_back(LostRecord {
                replica_id: replica_id.clone(),
                quorum_id,
                at: SystemTime::now(),
            });
            while state.lost.len() > LOST_HISTORY {
                state.lost.pop_front();
            }
            let Some(last) = &before else { continue };
            if last.quorum.quorum_id != quorum_id {
                continue;
            }
            let event = SessionEvent {
                lost: Some(LostEvent {
                    replica_id: replica_id.clone(),
                    quorum_id,
                }),
            };
            for m in &last.quorum.participants {
                if m.replica_id == replica_id {
                    continue;
                }
                if let Some(session) = state.sessions.get(&m.replica_id) {
                    if session.tx.try_send(Ok(event.clone())).is_err() {
                        debug!(replica_id = %m.replica_id, "session not reading; event dropped");
                    }
                }
            }
        }
    }

    /// Opens the session of `replica_id` (replacing an older one) and counts as a heartbeat.
    pub(crate) fn open_session(self: &Arc<Self>, replica_id: &str) -> Result<SessionStream> {
        ensure!(
            !replica_id.trim().is_empty(),
            "replica_id must not be empty"
        );
        let now = now_instant();
        let mut guard = self.lock();
        let state = &mut *guard;
        if state.shutting_down {
            return Err(Error::Shutdown);
        }
        state.engine.session_opened(replica_id, now)?;
        let (tx, rx) = mpsc::channel(SESSION_BUFFER);
        // The first message tells the manager its session is established.
        let _ = tx.try_send(Ok(SessionEvent { lost: None }));
        let id = state.next_session;
        state.next_session += 1;
        if state
            .sessions
            .insert(replica_id.to_string(), Session { id, tx })
            .is_some()
        {
            debug!(replica_id = %replica_id, "session replaced by a newer one");
        }
        debug!(replica_id = %replica_id, "session opened");
        self.hub.with(|t| t.on_session(replica_id, true, now));
        Ok(SessionStream {
            rx,
            _ended: {
                let shared = self.clone();
                let replica_id = replica_id.to_string();
                OnDrop::new(move || shared.session_ended(&replica_id, id))
            },
        })
    }

    /// Called when a session stream ends: unless the lighthouse is shutting down or the
    /// session was replaced, the replica group is lost now.
    pub(super) fn session_ended(&self, replica_id: &str, id: u64) {
        let now = now_instant();
        let mut guard = self.lock();
        let state = &mut *guard;
        if state.shutting_down || state.sessions.get(replica_id).is_none_or(|s| s.id != id) {
            return;
        }
        state.sessions.remove(replica_id);
        info!(replica_id = %replica_id, "session ended");
        self.hub.with(|t| t.on_session(replica_id, false, now));
        let before = state.last.clone();
        state.engine.lost(replica_id, now);
        if let Some(q) = state.engine.poll(now) {
            let told = self.deliver(state, q);
            Self::tell(told);
        }
        Self::announce_lost(&self.hub, state, before);
    }

    /// Number of open sessions.
    pub(crate) fn num_sessions(&self) -> usize {
        self.lock().sessions.len()
    }
}
