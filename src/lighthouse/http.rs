//! HTTP pages served next to gRPC on the lighthouse port.
//!
//! `GET /healthz` (liveness), `GET /readyz` (503 while shutting down), `GET /status` (JSON:
//! current quorum, heartbeats, waiting participants and why the next quorum is or is not
//! ready) and `GET /` (the same as a small self-contained HTML page). Anything else is 404.

use std::fmt::Write as _;
use std::sync::Arc;
use std::time::UNIX_EPOCH;

use axum::extract::State;
use axum::http::{header, StatusCode};
use axum::response::{Html, IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use serde::Serialize;

use super::quorum::Snapshot;
use super::service::Shared;

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

/// The body of `GET /status`.
#[derive(Debug, Serialize)]
pub struct StatusBody {
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
    /// Recent losses of quorum members (bounded history, oldest first).
    pub lost: Vec<LostStatus>,
    /// Whether the next quorum would be issued now.
    pub ready: bool,
    /// Why the next quorum is, or is not yet, ready.
    pub reason: String,
    /// Unix time (seconds) the lighthouse started.
    pub started_unix_s: f64,
}

impl StatusBody {
    fn from_snapshot(s: Snapshot, started_unix_s: f64) -> Self {
        Self {
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
            lost: Vec::new(),
            ready: s.verdict.is_ready(),
            reason: s.verdict.to_string(),
            started_unix_s,
        }
    }
}

/// The HTTP routes; merged with the gRPC routes by the server.
pub(crate) fn router(shared: Arc<Shared>) -> Router {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/status", get(status))
        .route("/", get(index))
        .with_state(shared)
}

/// 404 for every path nobody serves.
pub(crate) async fn not_found() -> Response {
    (StatusCode::NOT_FOUND, "not found\n").into_response()
}

async fn healthz() -> &'static str {
    "ok"
}

async fn readyz(State(shared): State<Arc<Shared>>) -> Response {
    if shared.serving() {
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
    body
}

async fn status(State(shared): State<Arc<Shared>>) -> Json<StatusBody> {
    Json(status_body(&shared))
}

/// Escapes text for HTML (replica ids and addresses come from clients).
pub fn escape_html(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// Renders the status as a minimal HTML page (no scripts, no external resources).
pub fn render_html(body: &StatusBody) -> String {
    let mut h = String::new();
    let qid = body
        .quorum_id
        .map_or_else(|| "none yet".to_string(), |q| q.to_string());
    let _ = write!(
        h,
        "<!doctype html><html><head><meta charset=\"utf-8\"><title>torchft lighthouse</title>\
         <style>body{{font-family:sans-serif;margin:2em}}table{{border-collapse:collapse}}\
         td,th{{border:1px solid #ccc;padding:2px 8px;text-align:left}}</style></head><body>\
         <h1>torchft lighthouse</h1><p>quorum_id: <b>{}</b> &middot; min_replicas: {} &middot; \
         next quorum: {}</p>",
        escape_html(&qid),
        body.min_replicas,
        escape_html(&body.reason)
    );
    let _ = write!(h, "<h2>Current quorum ({} members)</h2><table><tr><th>replica_id</th><th>step</th><th>world_size</th><th>address</th><th>store_address</th></tr>", body.members.len());
    for m in &body.members {
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
            escape_html(&m.replica_id),
            m.step,
            m.world_size,
            escape_html(&m.address),
            escape_html(&m.store_address)
        );
    }
    let _ = write!(
        h,
        "</table><h2>Waiting this round ({})</h2><ul>",
        body.participants.len()
    );
    for p in &body.participants {
        let _ = write!(h, "<li>{}</li>", escape_html(p));
    }
    let _ = write!(h, "</ul><h2>Heartbeats</h2><table><tr><th>replica_id</th><th>age (s)</th><th>healthy</th></tr>");
    for b in &body.heartbeats {
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{:.1}</td><td>{}</td></tr>",
            escape_html(&b.replica_id),
            b.age_s,
            if b.healthy { "yes" } else { "no" }
        );
    }
    let _ = write!(
        h,
        "</table><h2>Lost ({})</h2><table><tr><th>replica_id</th><th>quorum_id</th><th>at (unix s)</th></tr>",
        body.lost.len()
    );
    for l in &body.lost {
        let _ = write!(
            h,
            "<tr><td>{}</td><td>{}</td><td>{:.3}</td></tr>",
            escape_html(&l.replica_id),
            l.quorum_id,
            l.at_unix_s
        );
    }
    h.push_str("</table></body></html>\n");
    h
}

async fn index(State(shared): State<Arc<Shared>>) -> Response {
    let page = render_html(&status_body(&shared));
    ([(header::CACHE_CONTROL, "no-store")], Html(page)).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::lighthouse::LighthouseOptions;

    #[tokio::test]
    async fn readyz_503_while_shutting_down() {
        let shared = Arc::new(Shared::new(LighthouseOptions::default(), 1));
        assert_eq!(readyz(State(shared.clone())).await.status(), StatusCode::OK);
        shared.begin_shutdown();
        assert_eq!(
            readyz(State(shared.clone())).await.status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        // Liveness is unaffected.
        assert_eq!(healthz().await, "ok");
    }

    #[test]
    fn escapes_markup() {
        assert_eq!(
            escape_html("<a href=\"x\">&'"),
            "&lt;a href=&quot;x&quot;&gt;&amp;&#39;"
        );
    }

    #[test]
    fn page_escapes_replica_ids() {
        let body = StatusBody {
            quorum_id: Some(7),
            min_replicas: 2,
            members: vec![MemberStatus {
                replica_id: "<script>".into(),
                step: 3,
                address: "http://h:1".into(),
                store_address: "h:2".into(),
                world_size: 1,
            }],
            heartbeats: vec![],
            participants: vec!["p<1>".into()],
            lost: vec![LostStatus {
                replica_id: "<lost>".into(),
                quorum_id: 6,
                at_unix_s: 1.0,
            }],
            ready: false,
            reason: "waiting".into(),
            started_unix_s: 0.0,
        };
        let page = render_html(&body);
        assert!(page.contains("&lt;script&gt;"));
        assert!(!page.contains("<script>"));
        assert!(page.contains("p&lt;1&gt;"));
        assert!(page.contains("&lt;lost&gt;"));
        assert!(page.contains("<b>7</b>"));
    }
}
