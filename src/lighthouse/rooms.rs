//! Rooms: one lighthouse serving many jobs, each in its own room.
//!
//! Every request may name a job (`job`, field 15 of each lighthouse request); requests that
//! name none (upstream's clients, older managers) go to the default room, which always
//! exists and is exactly the single-job lighthouse of before. Each room is a whole
//! [`Shared`]: its own quorum engine (quorum ids, progress records, hang and parity verdicts),
//! waiters, sessions, telemetry hub and event feed, and its own part of the state file
//! (`{state_file}.room-{job}`). Nothing of one room reaches another: a room is looked up once
//! per request, and everything after that works on the room alone.
//!
//! A room other than the default one opens on its first request (continuing from its part
//! of the state file when a previous life left one) and expires once it has been idle for
//! [`RoomOptions::expiry`]: no request, no open session and no waiting quorum request for
//! that long. Its part of the state file stays on disk (a job that comes back under the same
//! name continues from it, as after a lighthouse restart). At most
//! [`RoomOptions::max_rooms`] rooms besides the default one are open at once; a request for
//! one more is refused (UNAVAILABLE, naming the limit) and changes nothing.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tracing::{info, warn};

use super::health::hub::{Hub, ObservabilityOptions};
use super::state::{initial_quorum_id, Shared};
use super::LighthouseOptions;
use crate::error::{Error, Result};
use crate::ids::validate_job;
use crate::security::server::Caller;
use crate::security::{RoomTokens, Security};

/// Default of [`RoomOptions::expiry`]: an hour without a request, session or waiter.
pub const DEFAULT_ROOM_EXPIRY: Duration = Duration::from_secs(3600);

/// Default of [`RoomOptions::max_rooms`].
pub const DEFAULT_MAX_ROOMS: usize = 1024;

/// How a lighthouse keeps the rooms of the jobs it serves.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoomOptions {
    /// A room (other than the default one) idle this long is closed.
    pub expiry: Duration,
    /// Most rooms open at once besides the default room.
    pub max_rooms: usize,
    /// `min_replicas` of named rooms; the others use the lighthouse's.
    pub min_replicas: BTreeMap<String, u64>,
}

impl Default for RoomOptions {
    fn default() -> Self {
        Self {
            expiry: DEFAULT_ROOM_EXPIRY,
            max_rooms: DEFAULT_MAX_ROOMS,
            min_replicas: BTreeMap::new(),
        }
    }
}

impl RoomOptions {
    /// Checks the options: a positive expiry and room limit, valid job names, and per-room
    /// `min_replicas` of at least 1.
    pub fn validate(&self) -> Result<()> {
        use crate::error::ensure;
        ensure!(!self.expiry.is_zero(), "room expiry must be positive");
        ensure!(self.max_rooms >= 1, "max_rooms must be at least 1");
        for (job, n) in &self.min_replicas {
            ensure!(
                !job.is_empty(),
                "a per-room min_replicas needs a job name (the default room uses --min_replicas)"
            );
            validate_job(job)?;
            ensure!(*n >= 1, "min_replicas of room {job:?} must be at least 1");
        }
        Ok(())
    }

    /// Parses `JOB=N` (one `--room_min_replicas` flag).
    pub fn parse_min_replicas(spec: &str) -> Result<(String, u64)> {
        let bad = || {
            Error::InvalidArgument(format!(
                "invalid room min_replicas {spec:?}: expected JOB=N with N at least 1"
            ))
        };
        let (job, n) = spec.split_once('=').ok_or_else(bad)?;
        let n: u64 = n.trim().parse().map_err(|_| bad())?;
        let job = job.trim();
        if job.is_empty() || n < 1 {
            return Err(bad());
        }
        validate_job(job)?;
        Ok((job.to_string(), n))
    }
}

/// The part of the state file that holds room `job`.
pub fn room_state_file(state_file: &Path, job: &str) -> PathBuf {
    let mut name = state_file.as_os_str().to_owned();
    name.push(format!(".room-{job}"));
    PathBuf::from(name)
}

struct Room {
    shared: Arc<Shared>,
    /// The last request naming this room.
    active: Instant,
}

/// A room as listed on the status page.
#[derive(Clone)]
pub(crate) struct RoomEntry {
    pub(crate) job: String,
    pub(crate) shared: Arc<Shared>,
    /// Seconds since the room's last request (0 for the default room).
    pub(crate) idle: Duration,
}

/// Every room of a lighthouse.
pub(crate) struct Rooms {
    default: Arc<Shared>,
    others: Mutex<crate::ids::IdMap<Room>>,
    base: LighthouseOptions,
    obs: ObservabilityOptions,
    security: Security,
    opts: RoomOptions,
    tokens: RoomTokens,
}

impl Rooms {
    /// The rooms of a lighthouse whose default room is `default`; other rooms get `base`
    /// (with their own `min_replicas` and part of the state file) and `obs`.
    pub(crate) fn new(
        default: Arc<Shared>,
        base: LighthouseOptions,
        obs: ObservabilityOptions,
        security: Security,
        opts: RoomOptions,
    ) -> Result<Self> {
        opts.validate()?;
        Ok(Self {
            default,
            others: Mutex::new(crate::ids::IdMap::default()),
            base,
            obs,
            security,
            opts,
            tokens: RoomTokens::default(),
        })
    }

    /// These rooms with each job's own token: a room's calls to its managers (the kill
    /// action) present its job's token, which is what its managers accept.
    pub(crate) fn with_tokens(mut self, tokens: RoomTokens) -> Self {
        self.tokens = tokens;
        self
    }

    /// The room of `job` for a request from `caller` (see [`Rooms::room`]); refused when the
    /// caller's token belongs to another job.
    pub(crate) fn room_for(&self, job: &str, caller: &Caller) -> Result<Arc<Shared>> {
        caller.may_act_on(job)?;
        self.room(job)
    }

    fn lock(&self) -> MutexGuard<'_, crate::ids::IdMap<Room>> {
        self.others.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The default room (requests that name no job).
    pub(crate) fn default_room(&self) -> &Arc<Shared> {
        &self.default
    }

    /// The room of `job` for a request, opened if it is not open yet (empty: the default
    /// room). Refused for an invalid job name, while shutting down, and past `max_rooms`.
    pub(crate) fn room(&self, job: &str) -> Result<Arc<Shared>> {
        if job.is_empty() {
            return Ok(self.default.clone());
        }
        let now = Instant::now();
        let mut rooms = self.lock();
        if let Some(room) = rooms.get_mut(job) {
            room.active = now;
            return Ok(room.shared.clone());
        }
        validate_job(job)?;
        if !self.default.serving() {
            return Err(Error::Shutdown);
        }
        if rooms.len() >= self.opts.max_rooms {
            return Err(Error::Unavailable(format!(
                "cannot open a room for job {job:?}: the lighthouse already serves {} rooms \
                 besides the default one (--max_rooms {}); idle rooms close after {:.0}s",
                rooms.len(),
                self.opts.max_rooms,
                self.opts.expiry.as_secs_f64()
            )));
        }
        let shared = Arc::new(self.open(job)?);
        info!(job = %job, min_replicas = shared.min_replicas(), rooms = rooms.len() + 1,
            "room opened");
        rooms.insert(
            job.to_string(),
            Room {
                shared: shared.clone(),
                active: now,
            },
        );
        Ok(shared)
    }

    fn open(&self, job: &str) -> Result<Shared> {
        let min_replicas = self
            .opts
            .min_replicas
            .get(job)
            .copied()
            .unwrap_or(self.base.min_replicas);
        let opts = LighthouseOptions {
            min_replicas,
            state_file: self
                .base
                .state_file
                .as_deref()
                .map(|p| room_state_file(p, job)),
            ..self.base.clone()
        };
        let hub = Hub::for_room(
            self.obs.clone(),
            opts.heartbeat_timeout,
            min_replicas,
            job,
            self.default.hub.log_sink(),
        )?;
        let mut security = self.security.clone();
        if let Some(token) = self.tokens.get(job) {
            security.token = Some(token.clone());
        }
        Shared::with_hub(opts, initial_quorum_id(), hub, security)
    }

    /// The open room of `job` (empty: the default room), without opening one: the status
    /// pages read rooms, they never create them.
    pub(crate) fn existing(&self, job: &str) -> Option<Arc<Shared>> {
        if job.is_empty() {
            return Some(self.default.clone());
        }
        self.lock().get(job).map(|r| r.shared.clone())
    }

    /// Every open room, the default room first, then by job name.
    pub(crate) fn all(&self) -> Vec<RoomEntry> {
        let now = Instant::now();
        let mut out: Vec<RoomEntry> = self
            .lock()
            .iter()
            .map(|(job, r)| RoomEntry {
                job: job.clone(),
                shared: r.shared.clone(),
                idle: now.saturating_duration_since(r.active),
            })
            .collect();
        out.sort_by(|a, b| a.job.cmp(&b.job));
        out.insert(
            0,
            RoomEntry {
                job: String::new(),
                shared: self.default.clone(),
                idle: Duration::ZERO,
            },
        );
        out
    }

    fn shareds(&self) -> Vec<Arc<Shared>> {
        let mut out = vec![self.default.clone()];
        out.extend(self.lock().values().map(|r| r.shared.clone()));
        out
    }

    /// Re-evaluates every room's round (the quorum tick), then closes rooms idle past the
    /// expiry.
    pub(crate) fn tick(&self) {
        for shared in self.shareds() {
            shared.tick();
        }
        self.expire(Instant::now());
    }

    /// Re-derives every room's replica health (the telemetry tick).
    pub(crate) fn telemetry_tick(&self) {
        for shared in self.shareds() {
            shared.telemetry_tick();
        }
    }

    /// Closes the rooms idle since before `now - expiry` with no session and no waiting
    /// request; returns their names.
    pub(crate) fn expire(&self, now: Instant) -> Vec<String> {
        let expiry = self.opts.expiry;
        let closed: Vec<(String, Room)> = {
            let mut rooms = self.lock();
            let idle: Vec<String> = rooms
                .iter()
                .filter(|(_, r)| {
                    now.saturating_duration_since(r.active) >= expiry && r.shared.is_idle()
                })
                .map(|(job, _)| job.clone())
                .collect();
            idle.into_iter()
                .filter_map(|job| rooms.remove(&job).map(|r| (job, r)))
                .collect()
        };
        let mut names = Vec::with_capacity(closed.len());
        for (job, room) in closed {
            info!(job = %job, idle_s = expiry.as_secs_f64(), "room closed: idle past its expiry");
            room.shared.begin_shutdown();
            let shared = room.shared;
            let name = job.clone();
            if let Ok(rt) = tokio::runtime::Handle::try_current() {
                rt.spawn(async move {
                    if let Err(e) = shared.close_state().await {
                        warn!(job = %name, error = %e, "the room's state file may miss its last state");
                    }
                });
            }
            names.push(job);
        }
        names
    }

    /// Stops every room: the named rooms first (their hubs write into the default room's
    /// event log), then the default room.
    pub(crate) fn begin_shutdown(&self) {
        let others: Vec<Arc<Shared>> = self.lock().values().map(|r| r.shared.clone()).collect();
        for shared in others {
            shared.begin_shutdown();
        }
        self.default.begin_shutdown();
    }

    /// Writes every room's pending state and stops the writers.
    pub(crate) async fn close_state(&self) -> Result<()> {
        let mut first_err = None;
        for shared in self.shareds() {
            if let Err(e) = shared.close_state().await {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Waits until every room's state file holds what was handed to its writer.
    pub(crate) async fn flush_state(&self) -> Result<()> {
        for shared in self.shareds() {
            shared.flush_state().await?;
        }
        Ok(())
    }

    /// Open sessions over every room.
    pub(crate) fn num_sessions(&self) -> usize {
        self.shareds().iter().map(|s| s.num_sessions()).sum()
    }

    /// Quorum replies sent over every room: `(full, compact)`.
    pub(crate) fn reply_counts(&self) -> (u64, u64) {
        self.shareds()
            .iter()
            .map(|s| s.reply_counts())
            .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rooms(opts: RoomOptions) -> Rooms {
        let base = LighthouseOptions {
            min_replicas: 2,
            ..Default::default()
        };
        let default = Arc::new(Shared::new(base.clone(), 1));
        Rooms::new(
            default,
            base,
            ObservabilityOptions::default(),
            Security::none(),
            opts,
        )
        .unwrap()
    }

    #[test]
    fn job_names_are_checked() {
        for bad in [".hidden", "a/b", "with space", &"x".repeat(65), "é"] {
            let err = validate_job(bad).unwrap_err();
            assert!(err.to_string().contains("invalid job name"), "{bad}: {err}");
        }
        for good in ["", "a", "job-1.v2_x", &"x".repeat(64)] {
            validate_job(good).unwrap();
        }
        assert_eq!(
            RoomOptions::parse_min_replicas("a=3").unwrap(),
            ("a".to_string(), 3)
        );
        for bad in ["a", "a=0", "=2", "a=x", "a/b=2"] {
            assert!(RoomOptions::parse_min_replicas(bad).is_err(), "{bad}");
        }
        assert_eq!(
            room_state_file(Path::new("/s/state.json"), "a"),
            PathBuf::from("/s/state.json.room-a")
        );
    }

    #[tokio::test]
    async fn rooms_open_on_demand_keep_their_own_settings_and_expire_when_idle() {
        let rooms = rooms(RoomOptions {
            expiry: Duration::from_secs(60),
            max_rooms: 2,
            min_replicas: [("b".to_string(), 5)].into(),
        });
        assert!(Arc::ptr_eq(&rooms.room("").unwrap(), rooms.default_room()));
        assert!(rooms.existing("a").is_none(), "reading never opens a room");
        let a = rooms.room("a").unwrap();
        assert!(Arc::ptr_eq(&a, &rooms.room("a").unwrap()));
        assert_eq!(a.min_replicas(), 2);
        assert_eq!(rooms.room("b").unwrap().min_replicas(), 5);
        let err = rooms.room("c").err().unwrap().to_string();
        assert!(err.contains("--max_rooms 2"), "{err}");
        let err = rooms.room("bad name").err().unwrap().to_string();
        assert!(err.contains("invalid job name"), "{err}");
        let jobs: Vec<String> = rooms.all().into_iter().map(|r| r.job).collect();
        assert_eq!(jobs, ["", "a", "b"]);

        // Not idle long enough: nothing closes. Past the expiry: both close, the default
        // room never does, and a closed room's name opens a fresh room.
        assert!(rooms.expire(Instant::now()).is_empty());
        let later = Instant::now() + Duration::from_secs(61);
        let mut closed = rooms.expire(later);
        closed.sort();
        assert_eq!(closed, ["a", "b"]);
        assert!(!a.serving(), "a closed room stops serving");
        assert!(rooms.default_room().serving());
        let again = rooms.room("a").unwrap();
        assert!(!Arc::ptr_eq(&a, &again));
        assert!(again.serving());
    }
}
