//! HTTP pages served next to gRPC on the lighthouse port.
//!
//! `GET /healthz` (liveness), `GET /readyz` (503 while shutting down), `GET /status` (JSON:
//! current quorum, heartbeats, waiting participants, why the next quorum is or is not ready,
//! and the health of every replica group), `GET /metrics` (Prometheus), `GET /events`
//! (server-sent events), `POST /replicas/{id}/kill` (only with `--allow_kill`), `GET /` (the
//! live dashboard) and `GET /dashboard.js` (its script). Anything else is 404. The schema is in docs/telemetry.md.
//!
//! Rooms (see [`super::rooms`]): `/status`, `/events` and the kill action show the default
//! room unless `?job=NAME` names another open room (404 for a room that is not open);
//! `/status` lists every open room in `rooms`, and `/metrics` shows every room at once, the
//! named rooms' samples labelled `job`.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::extract::{Extension, Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures::StreamExt;
use serde::{Deserialize, Serialize};
use serde_json::{json, Value};
use tokio::sync::broadcast;

use super::health::metrics::JobMetrics;
use super::health::telemetry::{GlobalCounters, ReplicaStatus, SnapshotStatus};
use super::quorum::{ParitySnapshot, Snapshot};
use super::rooms::Rooms;
use super::state::Shared;
use crate::client::ManagerClient;
use crate::error::Error;
use crate::security::server::Caller;
use crate::telemetry::EventKind;

/// One member of the current quorum, as shown on the status page.
#[derive(Debug, Serialize)]
pub struct MemberStatus {
    /// The member's replica id.
    pub replica_id: String,
    /// Its committed step when it joined.
    pub step: i64,
    /// Its manager server address.
    pub address: String,
    /// Its rendezvous store address.
    pub store_address: String,
    /// Ranks in the group.
    pub world_size: u64,
}

/// A replica group known from heartbeats or quorum requests.
#[derive(Debug, Serialize)]
pub struct HeartbeatStatus {
    /// The replica id.
    pub replica_id: String,
    /// Seconds since it was last seen.
    pub age_s: f64,
    /// Whether it counts as healthy.
    pub healthy: bool,
}

/// A member of a quorum declared lost (its process died, or it stopped heartbeating).
#[derive(Debug, Serialize)]
pub struct LostStatus {
    /// The lost replica group.
    pub replica_id: String,
    /// The quorum it was lost from.
    pub quorum_id: i64,
    /// Unix time (seconds) it was declared lost.
    pub at_unix_s: f64,
}

/// A restarted lighthouse holding its first quorum (see `--state_file` in the README).
#[derive(Debug, Serialize)]
pub struct StartupHoldStatus {
    /// How the lighthouse knows it restarted (its state file, or a manager holding a
    /// quorum of an earlier life).
    pub why: String,
    /// Seconds until the hold ends at the latest.
    pub remaining_s: f64,
    /// Unix time (seconds) the hold ends at the latest.
    pub ends_unix_s: f64,
}

/// A replica group dropped from the quorum as a lasting straggler.
#[derive(Debug, Serialize)]
pub struct DroppedStatus {
    /// The group's process (replica id with its incarnation).
    pub replica_id: String,
    /// Why (how long it has been a straggler, its busy time against the job's median).
    pub reason: String,
    /// Seconds until it rejoins.
    pub remaining_s: f64,
}

/// A replica group held hung (see `--hang_timeout_ms` in the README).
#[derive(Debug, Serialize)]
pub struct HungStatus {
    /// The hung replica group.
    pub replica_id: String,
    /// Seconds its training loop had been away when it was found hung.
    pub idle_s: f64,
    /// Seconds it has been held hung.
    pub hung_for_s: f64,
    /// The hang timeout it passed, in seconds.
    pub hang_timeout_s: f64,
}

/// One open room, as listed on the status page.
#[derive(Debug, Serialize)]
pub struct RoomStatus {
    /// The job's name (empty: the default room).
    pub job: String,
    /// Id of the room's last issued quorum (null before the first).
    pub quorum_id: Option<i64>,
    /// Members of that quorum.
    pub members: usize,
    /// The room's `min_replicas`.
    pub min_replicas: u64,
    /// Replica groups the room knows from heartbeats or requests.
    pub replicas: usize,
    /// Seconds since the room's last request (0 for the default room, which never expires).
    pub idle_s: f64,
}

/// The body of `GET /status`.
#[derive(Debug, Serialize)]
pub struct StatusBody {
    /// The room this body describes (empty: the default room; `?job=NAME` picks another).
    pub job: String,
    /// Every open room, the default room first.
    pub rooms: Vec<RoomStatus>,
    /// Id of the last issued quorum (null before the first).
    pub quorum_id: Option<i64>,
    /// The configured minimum number of replica groups.
    pub min_replicas: u64,
    /// Members of the last issued quorum.
    pub members: Vec<MemberStatus>,
    /// Known replica groups with their heartbeat age.
    pub heartbeats: Vec<HeartbeatStatus>,
    /// Replica ids waiting in the current round.
    pub participants: Vec<String>,
    /// While a round is open: healthy replica groups that are not asking (whom a round
    /// waiting for stragglers or a majority waits for), sorted, at most 64.
    pub healthy_not_asking: Vec<String>,
    /// Seconds the current round has been open (null while nobody asks).
    pub round_age_s: Option<f64>,
    /// Recent losses of quorum members (bounded history, oldest first).
    pub lost: Vec<LostStatus>,
    /// Replica groups held hung now: alive, but their training loop stayed away past the
    /// hang timeout while a round waited; the quorum rules do not wait for them.
    pub hung: Vec<HungStatus>,
    /// The hang timeout now, in seconds, and how it was chosen.
    pub hang_timeout_s: f64,
    /// How the hang timeout was chosen (configured, or adaptive from the round interval).
    pub hang_timeout_rule: String,
    /// Runtime state parity: steps compared, groups found diverged, and the groups healing
    /// from the majority or stopped (no majority) now.
    pub parity: ParitySnapshot,
    /// Groups dropped from the quorum now as lasting stragglers (`--straggler_drop_after_ms`):
    /// their requests wait until the drop ends, then they rejoin.
    pub dropped: Vec<DroppedStatus>,
    /// Whether the next quorum would be issued now.
    pub ready: bool,
    /// Why the next quorum is, or is not yet, ready.
    pub reason: String,
    /// Set while a restarted lighthouse may still hold its first quorum (null for a fresh
    /// job, whose first quorum is never held, and once the hold is over).
    pub startup_hold: Option<StartupHoldStatus>,
    /// Unix time (seconds) the lighthouse started.
    pub started_unix_s: f64,
    /// The lighthouse's heartbeat timeout in seconds.
    pub heartbeat_timeout_s: f64,
    /// Whether the kill action is enabled.
    pub allow_kill: bool,
    /// One entry per replica group, sorted by replica_id (see docs/telemetry.md).
    pub replicas: Vec<ReplicaStatus>,
    /// Replica groups currently flagged as stragglers.
    pub stragglers: Vec<String>,
    /// Job-wide telemetry counters.
    pub counters: GlobalCounters,
    /// The latest complete durable snapshot heard of (kept across lighthouse restarts with
    /// `--state_file`), with its age; null before the first.
    pub snapshot: Option<SnapshotStatus>,
    /// The most recent events, oldest first.
    pub events: Vec<Value>,
    /// The job's goodput (see docs/telemetry.md): `window_start_unix_s`, `step`, the
    /// accounts and `ratio`; null before its first committed step.
    pub goodput: Option<serde_json::Map<String, Value>>,
}

impl StatusBody {
    fn from_snapshot(s: Snapshot, started_unix_s: f64) -> Self {
        let now = Instant::now();
        Self {
            job: String::new(),
            rooms: Vec::new(),
            quorum_id: s.quorum_id,
            min_replicas: s.min_replicas,
            members: s
                .members
                .into_iter()
                .map(|m| MemberStatus {
                    replica_id: m.replica_id,
                    step: m.step,
                    address: m.address,
                    store_address: m.store_address,
                    world_size: m.world_size,
                })
                .collect(),
            heartbeats: s
                .heartbeats
                .into_iter()
                .map(|(replica_id, age, healthy)| HeartbeatStatus {
                    replica_id,
                    age_s: age.as_secs_f64(),
                    healthy,
                })
                .collect(),
            participants: s.participants,
            healthy_not_asking: s.healthy_not_asking,
            round_age_s: s.round_age.map(|d| d.as_secs_f64()),
            lost: Vec::new(),
            hung: s
                .hung
                .iter()
                .map(|h| HungStatus {
                    replica_id: h.replica_id.clone(),
                    idle_s: h.idle.as_secs_f64(),
                    hung_for_s: now.saturating_duration_since(h.since).as_secs_f64(),
                    hang_timeout_s: h.timeout.as_secs_f64(),
                })
                .collect(),
            hang_timeout_s: s.hang_timeout.0.as_secs_f64(),
            hang_timeout_rule: s.hang_timeout.1.clone(),
            parity: s.parity.clone(),
            dropped: s
                .dropped
                .iter()
                .map(|(id, why, left)| DroppedStatus {
                    replica_id: id.clone(),
                    reason: why.clone(),
                    remaining_s: left.as_secs_f64(),
                })
                .collect(),
            ready: s.verdict.is_ready(),
            reason: s.verdict.to_string(),
            startup_hold: s.startup_hold.map(|(why, remaining)| StartupHoldStatus {
                why: why.to_string(),
                remaining_s: remaining.as_secs_f64(),
                ends_unix_s: super::state::unix_seconds(SystemTime::now() + remaining),
            }),
            started_unix_s,
            heartbeat_timeout_s: 0.0,
            allow_kill: false,
            replicas: Vec::new(),
            stragglers: Vec::new(),
            counters: GlobalCounters::default(),
            snapshot: None,
            events: Vec::new(),
            goodput: None,
        }
    }
}

/// The HTTP routes; merged with the gRPC routes by the server. Bodies larger than
/// `max_request_bytes` are refused with 413.
pub(crate) fn router(rooms: Arc<Rooms>, max_request_bytes: usize) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/status", get(status))
        .route("/metrics", get(metrics))
        .route("/events", get(events))
        .route("/history", get(history))
        .route("/summary", get(summary).post(write_summary))
        .route("/summary.html", get(summary_html))
        .route("/replicas/{replica_id}/kill", post(kill))
        .route("/", get(index))
        .route("/dashboard.js", get(dashboard_script))
        .layer(axum::extract::DefaultBodyLimit::max(max_request_bytes))
        .with_state(rooms)
}

/// `?job=NAME`: the room a page is about (absent or empty: the default room).
#[derive(Debug, Default, Deserialize)]
struct JobQuery {
    job: Option<String>,
}

/// The open room a page asks about: a 403 when the caller's token is another job's, a 404
/// naming the job when the room is not open.
fn room_of(
    rooms: &Rooms,
    query: &JobQuery,
    caller: Option<&Extension<Caller>>,
) -> std::result::Result<Arc<Shared>, Box<Response>> {
    let job = query.job.as_deref().unwrap_or("");
    if let Some(Extension(caller)) = caller {
        if let Err(e) = caller.may_act_on(job) {
            return Err(Box::new(reply(StatusCode::FORBIDDEN, false, e.message())));
        }
    }
    rooms.existing(job).ok_or_else(|| {
        Box::new(reply(
            StatusCode::NOT_FOUND,
            false,
            format!("no open room for job {job:?} (a room opens on its job's first request)"),
        ))
    })
}

/// 404 for every path nobody serves.
pub(crate) async fn not_found() -> Response {
    (StatusCode::NOT_FOUND, "not found\n").into_response()
}

async fn healthz() -> &'static str {
    "ok"
}

async fn readyz(State(rooms): State<Arc<Rooms>>) -> Response {
    if rooms.default_room().serving() {
        (StatusCode::OK, "ready").into_response()
    } else {
        (StatusCode::SERVICE_UNAVAILABLE, "shutting down").into_response()
    }
}

fn status_body(shared: &Shared) -> StatusBody {
    let started = shared
        .started
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs_f64();
    let mut body = StatusBody::from_snapshot(shared.snapshot(), started);
    body.lost = shared
        .recent_lost()
        .into_iter()
        .map(|l| LostStatus {
            replica_id: l.replica_id,
            quorum_id: l.quorum_id,
            at_unix_s: l
                .at
                .duration_since(UNIX_EPOCH)
                .unwrap_or_default()
                .as_secs_f64(),
        })
        .collect();
    let now = Instant::now();
    shared.hub.read(|t| {
        body.heartbeat_timeout_s = t.options().heartbeat_timeout.as_secs_f64();
        body.replicas = t.replicas(now);
        body.counters = t.counters().clone();
        body.snapshot = t.snapshot_status(now);
        body.events = t.recent_events().map(|e| e.to_json()).collect();
        body.goodput = t.goodput_json(now);
    });
    body.allow_kill = shared.hub.opts.allow_kill;
    body.stragglers = body
        .replicas
        .iter()
        .filter(|r| r.straggler)
        .map(|r| r.replica_id.clone())
        .collect();
    body
}

async fn status(
    State(rooms): State<Arc<Rooms>>,
    Query(query): Query<JobQuery>,
    caller: Option<Extension<Caller>>,
) -> Response {
    let shared = match room_of(&rooms, &query, caller.as_ref()) {
        Ok(shared) => shared,
        Err(missing) => return *missing,
    };
    let mut body = status_body(&shared);
    body.job = query.job.unwrap_or_default();
    // A job's own token lists its own room only.
    let own = match caller.as_ref().map(|c| &c.0) {
        Some(Caller::Room(job)) => Some(job.clone()),
        _ => None,
    };
    body.rooms = rooms
        .all()
        .into_iter()
        .filter(|r| own.as_ref().is_none_or(|job| *job == r.job))
        .map(|r| {
            let s = r.shared.snapshot();
            RoomStatus {
                job: r.job,
                quorum_id: s.quorum_id,
                members: s.members.len(),
                min_replicas: s.min_replicas,
                replicas: s.heartbeats.len(),
                idle_s: r.idle.as_secs_f64(),
            }
        })
        .collect();
    Json(body).into_response()
}

/// `GET /history`: the job's step, quorum members and goodput over the whole run (a point
/// a second, compacted as it grows), for a dashboard opened late.
async fn history(
    State(rooms): State<Arc<Rooms>>,
    Query(query): Query<JobQuery>,
    caller: Option<Extension<Caller>>,
) -> Response {
    let shared = match room_of(&rooms, &query, caller.as_ref()) {
        Ok(shared) => shared,
        Err(missing) => return *missing,
    };
    let body = shared.hub.read(|t| {
        let (points, every) = t.history();
        serde_json::json!({"interval_s": every, "points": points})
    });
    ([(header::CACHE_CONTROL, "no-store")], Json(body)).into_response()
}

/// `GET /summary`: the end-of-run report (so far) as JSON.
async fn summary(
    State(rooms): State<Arc<Rooms>>,
    Query(query): Query<JobQuery>,
    caller: Option<Extension<Caller>>,
) -> Response {
    match room_of(&rooms, &query, caller.as_ref()) {
        Ok(shared) => Json(shared.hub.summary()).into_response(),
        Err(missing) => *missing,
    }
}

/// `GET /summary.html`: the end-of-run report (so far) as a self-contained page.
async fn summary_html(
    State(rooms): State<Arc<Rooms>>,
    Query(query): Query<JobQuery>,
    caller: Option<Extension<Caller>>,
) -> Response {
    let shared = match room_of(&rooms, &query, caller.as_ref()) {
        Ok(shared) => shared,
        Err(missing) => return *missing,
    };
    let page = super::health::telemetry::render_html(&shared.hub.summary());
    (
        [
            (header::CACHE_CONTROL, "no-store"),
            // The report is one file: its own inline script and style, nothing fetched.
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; \
                 img-src data:",
            ),
        ],
        Html(page),
    )
        .into_response()
}

/// `POST /summary`: writes the end-of-run report next to the event log now.
async fn write_summary(
    State(rooms): State<Arc<Rooms>>,
    Query(query): Query<JobQuery>,
    caller: Option<Extension<Caller>>,
) -> Response {
    let shared = match room_of(&rooms, &query, caller.as_ref()) {
        Ok(shared) => shared,
        Err(missing) => return *missing,
    };
    let written = tokio::task::spawn_blocking(move || shared.hub.write_summary()).await;
    match written {
        Ok(Ok((json_path, html_path))) => Json(serde_json::json!({
            "ok": true,
            "json": json_path.display().to_string(),
            "html": html_path.display().to_string(),
        }))
        .into_response(),
        Ok(Err(e @ Error::FailedPrecondition(_))) => {
            reply(StatusCode::CONFLICT, false, e.message())
        }
        Ok(Err(e)) => reply(StatusCode::INTERNAL_SERVER_ERROR, false, e.message()),
        Err(e) => reply(StatusCode::INTERNAL_SERVER_ERROR, false, e.to_string()),
    }
}

/// The live dashboard: one page (inline style) and its script, both served from here (no
/// external assets).
const DASHBOARD: &str = include_str!("dashboard.html");
const DASHBOARD_SCRIPT: &str = include_str!("dashboard.js");

async fn index() -> Response {
    (
        [
            (header::CACHE_CONTROL, "no-store"),
            (
                header::CONTENT_SECURITY_POLICY,
                "default-src 'self'; script-src 'self'; style-src 'unsafe-inline'; \
                 img-src 'self' data:; connect-src 'self'",
            ),
        ],
        Html(DASHBOARD),
    )
        .into_response()
}

async fn dashboard_script() -> Response {
    (
        [
            (header::CACHE_CONTROL, "no-store"),
            (header::CONTENT_TYPE, "text/javascript; charset=utf-8"),
        ],
        DASHBOARD_SCRIPT,
    )
        .into_response()
}

async fn metrics(State(rooms): State<Arc<Rooms>>, caller: Option<Extension<Caller>>) -> Response {
    if let Some(Extension(Caller::Room(job))) = &caller {
        return reply(
            StatusCode::FORBIDDEN,
            false,
            format!(
                "/metrics shows every job's room; job {job:?}'s token reads its own: \
                 /status?job={job}"
            ),
        );
    }
    let rooms = rooms.all();
    let measured: Vec<(String, JobMetrics, Vec<ReplicaStatus>)> = rooms
        .iter()
        .map(|r| {
            let (job, replicas) = room_metrics(&r.shared);
            (r.job.clone(), job, replicas)
        })
        .collect();
    let views: Vec<(&str, &JobMetrics, &[ReplicaStatus])> = measured
        .iter()
        .map(|(job, m, replicas)| (job.as_str(), m, replicas.as_slice()))
        .collect();
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        super::health::metrics::render_rooms(&views),
    )
        .into_response()
}

/// What `/metrics` shows of one room.
fn room_metrics(shared: &Shared) -> (JobMetrics, Vec<ReplicaStatus>) {
    let snapshot = shared.snapshot();
    let now = Instant::now();
    let (replicas, counters, latest_snapshot, goodput) = shared.hub.read(|t| {
        (
            t.replicas(now),
            t.counters().clone(),
            t.snapshot_status(now),
            t.goodput(now),
        )
    });
    let job = JobMetrics {
        quorum_id: snapshot.quorum_id,
        quorum_participants: snapshot.members.len(),
        min_replicas: snapshot.min_replicas,
        counters,
        event_log_dropped: shared.hub.log_dropped(),
        replicas_hung: snapshot.hung.len(),
        hang_timeout_s: snapshot.hang_timeout.0.as_secs_f64(),
        parity_checks: snapshot.parity.checks,
        replicas_diverged: snapshot.parity.diverged_total,
        replicas_stopped: snapshot.parity.stopped.len(),
        replicas_dropped: snapshot.dropped.len(),
        snapshot: latest_snapshot,
        goodput,
    };
    (job, replicas)
}

/// `GET /events`: server-sent events, replaying the buffered events after `Last-Event-ID`.
async fn events(
    State(rooms): State<Arc<Rooms>>,
    Query(query): Query<JobQuery>,
    caller: Option<Extension<Caller>>,
    headers: HeaderMap,
) -> Response {
    let shared = match room_of(&rooms, &query, caller.as_ref()) {
        Ok(shared) => shared,
        Err(missing) => return *missing,
    };
    let Some(rx) = shared.hub.subscribe() else {
        return (StatusCode::SERVICE_UNAVAILABLE, "shutting down\n").into_response();
    };
    let after: Option<u64> = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse().ok());
    let replay: Vec<(u64, String)> = match after {
        Some(after) => shared.hub.read(|t| {
            // An id ahead of this lighthouse's events comes from a previous lighthouse on
            // the same address (restart): send everything buffered.
            let newest = t.recent_events().last().map_or(0, |e| e.seq);
            let after = if after > newest { 0 } else { after };
            t.recent_events()
                .filter(|e| e.seq > after)
                .map(|e| (e.seq, e.to_json().to_string()))
                .collect()
        }),
        None => Vec::new(),
    };
    let last = replay.last().map_or(0, |(s, _)| *s);
    let first = futures::stream::iter(replay);
    let live = futures::stream::unfold((rx, last), |(mut rx, last)| async move {
        loop {
            match rx.recv().await {
                Ok(item) if item.0 <= last => continue,
                Ok(item) => {
                    let (seq, text) = (item.0, item.1.clone());
                    return Some(((seq, text), (rx, seq)));
                }
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    let text = json!({"seq": 0, "kind": "feed_lagged", "skipped": n}).to_string();
                    return Some(((0, text), (rx, last)));
                }
                Err(broadcast::error::RecvError::Closed) => return None,
            }
        }
    });
    let stream = first.chain(live).map(|(seq, text)| {
        let ev = SseEvent::default().data(text);
        Ok::<_, Infallible>(if seq > 0 { ev.id(seq.to_string()) } else { ev })
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(15)))
        .into_response()
}

#[derive(Debug, Serialize)]
struct ActionReply {
    ok: bool,
    message: String,
}

fn reply(code: StatusCode, ok: bool, message: String) -> Response {
    (code, Json(ActionReply { ok, message })).into_response()
}

/// `POST /replicas/{replica_id}/kill`: ends the group's manager process (only with
/// `--allow_kill`).
async fn kill(
    State(rooms): State<Arc<Rooms>>,
    Query(query): Query<JobQuery>,
    caller: Option<Extension<Caller>>,
    Path(replica_id): Path<String>,
) -> Response {
    let shared = match room_of(&rooms, &query, caller.as_ref()) {
        Ok(shared) => shared,
        Err(missing) => return *missing,
    };
    if !shared.hub.opts.allow_kill {
        return reply(
            StatusCode::FORBIDDEN,
            false,
            "the kill action is disabled; start the lighthouse with --allow_kill".into(),
        );
    }
    let Some((incarnation, address)) = shared.hub.read(|t| t.manager_address(&replica_id)) else {
        return reply(
            StatusCode::NOT_FOUND,
            false,
            format!("no replica group {replica_id:?} with a known manager address"),
        );
    };
    let now = Instant::now();
    shared.hub.emit(
        now,
        EventKind::KillRequested,
        json!({"replica_id": replica_id, "incarnation": incarnation}),
    );
    let sent = async {
        let client = ManagerClient::connect_with(&address, KILL_TIMEOUT, &shared.security).await?;
        client
            .kill("killed from the lighthouse dashboard", KILL_TIMEOUT)
            .await
    };
    match sent.await {
        Ok(()) => reply(
            StatusCode::OK,
            true,
            format!("kill sent to {incarnation} ({address})"),
        ),
        Err(e) => reply(
            StatusCode::BAD_GATEWAY,
            false,
            format!("kill of {incarnation} ({address}) failed: {e}"),
        ),
    }
}

/// Bound on reaching a manager server for the kill action.
const KILL_TIMEOUT: Duration = Duration::from_secs(5);

#[cfg(test)]
mod tests {
    use super::*;

    use crate::lighthouse::LighthouseOptions;

    #[tokio::test]
    async fn readyz_503_while_shutting_down() {
        let shared = Arc::new(Shared::new(LighthouseOptions::default(), 1));
        let rooms = Arc::new(
            Rooms::new(
                shared,
                LighthouseOptions::default(),
                crate::lighthouse::ObservabilityOptions::default(),
                crate::security::Security::none(),
                crate::lighthouse::RoomOptions::default(),
            )
            .unwrap(),
        );
        assert_eq!(readyz(State(rooms.clone())).await.status(), StatusCode::OK);
        rooms.begin_shutdown();
        assert_eq!(
            readyz(State(rooms.clone())).await.status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        // Liveness is unaffected.
        assert_eq!(healthz().await, "ok");
    }
}
