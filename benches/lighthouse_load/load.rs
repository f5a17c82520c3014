//! The lighthouse wire load generator: many replica groups asking one `torchft_lighthouse`
//! process (started here, bound to 127.0.0.1:0) for quorums over a few HTTP/2 connections,
//! through the Rust lighthouse client, round after round.
//!
//! A repetition starts a fresh daemon with `--min_replicas N` (and no join wait, so a round
//! completes as soon as all N have asked), then measures: the first round (every group knows
//! nothing), steady rounds (every step advances), a membership-change round (one group is
//! replaced by a new incarnation, which knows nothing), and one steady round after it. Groups
//! ask for the sparse form, as managers without a topology file do (each gets its own answer
//! and the few members it names); with `--usual-form` they ask as other clients do (the full
//! member list, then the compact steps-only form or a delta for holders). The floor is the same client work
//! against a trivial server in this process that answers every request at once with the very
//! bytes the lighthouse would send (no round barrier, no quorum engine): what the generator
//! itself costs.
//!
//! The rooms mode runs R rooms of G groups (each room's clients name their job) and compares
//! the steady round of one room among R with the steady round of a lone room of G, in the
//! same run: trials alternate the two, and the median of the trials' ratios is judged. Each room's groups expect their own room's members only; a daemon that keeps one
//! room for every job is detected first, and then the rooms run as one room of R×G.
//!
//! Shared by the bench (`benches/lighthouse_load.rs`) and its smoke test
//! (`tests/lighthouse_load.rs`).

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::pin::Pin;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context as _, Result};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tonic::transport::{Channel, Uri};
use torchft::client::LighthouseClient;
use torchft::proto::{Quorum, QuorumMember};
use torchft::security::Security;

mod floor;
use floor::Floor;

/// What to run, and which targets to judge.
#[derive(Debug, Clone)]
pub struct Options {
    /// Replica groups in the main mode.
    pub groups: usize,
    /// HTTP/2 connections the groups share (0: one per [`GROUPS_PER_CONNECTION`] groups).
    pub connections: usize,
    /// Repetitions (each on a fresh daemon).
    pub reps: usize,
    /// Steady rounds per repetition before the membership change.
    pub steady: usize,
    /// Rooms mode: number of rooms, and groups per room (0 rooms: skip the mode).
    pub rooms: usize,
    pub room_groups: usize,
    /// Rooms mode: trials, each a lone room's run and a many rooms' run back to back (fresh
    /// daemons); the ratio judged is the median of the trials' ratios.
    pub room_trials: usize,
    /// The `torchft_lighthouse` binary.
    pub daemon: PathBuf,
    /// Judge the targets (off in `--quick`: small sizes say nothing about them).
    pub judge: bool,
    /// Deadline of one quorum request.
    pub ask_timeout: Duration,
    /// Groups ask for the sparse form (as managers without a topology file do).
    pub sparse: bool,
}

/// Groups per connection when the count is automatic: each group's request is a long poll
/// holding one HTTP/2 stream, and the lighthouse (hyper's default) serves at most 200
/// concurrent streams per connection; the others would queue in the client.
pub const GROUPS_PER_CONNECTION: usize = 160;

/// First and membership-change rounds at full size must take at most this long.
pub const ROUND_TARGET: Duration = Duration::from_millis(300);
/// The daemon's peak RSS must stay below this.
pub const RSS_TARGET: u64 = 1 << 30;
/// A room among many may take this much longer than a lone room.
pub const ROOMS_RATIO_TARGET: f64 = 1.2;

impl Options {
    /// The full-size run of the issue: 10,000 groups; 100 rooms × 32 groups.
    pub fn full(daemon: PathBuf) -> Self {
        Self {
            groups: 10_000,
            connections: 0,
            reps: 5,
            steady: 3,
            rooms: 100,
            room_groups: 32,
            room_trials: 7,
            daemon,
            judge: true,
            ask_timeout: Duration::from_secs(300),
            sparse: true,
        }
    }

    /// A small run (a few seconds) that exercises every mode; targets are not judged.
    pub fn quick(daemon: PathBuf) -> Self {
        Self {
            groups: 200,
            connections: 0,
            reps: 2,
            steady: 2,
            rooms: 4,
            room_groups: 8,
            room_trials: 1,
            daemon,
            judge: false,
            ask_timeout: Duration::from_secs(20),
            sparse: true,
        }
    }

    /// Parses `--quick`, `--groups N`, `--connections N`, `--reps N`, `--steady N`,
    /// `--rooms N`, `--room-groups N`, `--room-trials N`, `--daemon PATH`, `--no-judge`,
    /// `--usual-form`.
    pub fn parse(args: &[String], daemon: PathBuf) -> Result<Self> {
        let mut opts = if args.iter().any(|a| a == "--quick") {
            Self::quick(daemon)
        } else {
            Self::full(daemon)
        };
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            let mut value = |name: &str| -> Result<String> {
                it.next()
                    .cloned()
                    .ok_or_else(|| anyhow!("{name} needs a value"))
            };
            let mut number = |name: &str| -> Result<usize> {
                let v = value(name)?;
                v.parse()
                    .map_err(|_| anyhow!("{name} takes a number, got {v:?}"))
            };
            match arg.as_str() {
                "--quick" | "--bench" => {}
                "--groups" => opts.groups = number(arg)?,
                "--connections" => opts.connections = number(arg)?,
                "--reps" => opts.reps = number(arg)?,
                "--steady" => opts.steady = number(arg)?,
                "--rooms" => opts.rooms = number(arg)?,
                "--room-groups" => opts.room_groups = number(arg)?,
                "--room-trials" => opts.room_trials = number(arg)?,
                "--daemon" => opts.daemon = PathBuf::from(value(arg)?),
                "--no-judge" => opts.judge = false,
                "--usual-form" => opts.sparse = false,
                other => bail!("unknown argument {other:?}"),
            }
        }
        ensure!(opts.groups >= 2, "--groups must be at least 2");
        ensure!(opts.reps >= 1, "--reps must be at least 1");
        ensure!(
            opts.rooms == 0 || opts.room_groups >= 1,
            "--room-groups must be at least 1"
        );
        ensure!(
            opts.rooms == 0 || opts.room_trials >= 1,
            "--room-trials must be at least 1"
        );
        Ok(opts)
    }

    /// Connections for `groups` groups.
    fn connections_for(&self, groups: usize) -> usize {
        if self.connections > 0 {
            self.connections
        } else {
            groups.div_ceil(GROUPS_PER_CONNECTION).max(1)
        }
    }
}

// ---------------------------------------------------------------------------------------
// The daemon as a separate process.

/// A `torchft_lighthouse` process, killed when dropped (whatever ends the run).
pub struct Daemon {
    child: Child,
    /// `http://127.0.0.1:PORT`.
    pub addr: String,
}

impl Daemon {
    /// Starts the daemon on 127.0.0.1:0 with quorums of `min_replicas` that do not wait
    /// for stragglers, and waits for the address it logs.
    pub fn start(bin: &std::path::Path, min_replicas: usize) -> Result<Self> {
        let mut command = Command::new(bin);
        command
            .args(["--bind", "127.0.0.1:0", "--min_replicas"])
            .arg(min_replicas.to_string())
            .args([
                "--join_timeout_ms",
                "0",
                "--quorum_tick_ms",
                "100",
                // Groups here only ask for quorums (which count as heartbeats); a long first
                // round must not make the early askers unhealthy.
                "--heartbeat_timeout_ms",
                "600000",
            ])
            .env("RUST_LOG", "warn,torchft=info")
            .env_remove("TORCHFT_MIN_REPLICAS")
            .env_remove("TORCHFT_BIND")
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        // Killed with this process, whatever ends it (even SIGKILL, where no drop runs).
        #[cfg(target_os = "linux")]
        unsafe {
            use std::os::unix::process::CommandExt;
            command.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
        let mut child = command
            .spawn()
            .with_context(|| format!("cannot start {}", bin.display()))?;
        let stderr = child.stderr.take().context("no stderr pipe")?;
        let mut daemon = Self {
            child,
            addr: String::new(),
        };
        let (tx, rx) = std::sync::mpsc::channel();
        // Drains the log for the life of the process (a full pipe would stall the daemon).
        std::thread::spawn(move || {
            const MARK: &str = "lighthouse listening on ";
            for line in BufReader::new(stderr).lines().map_while(|l| l.ok()) {
                if let Some(i) = line.find(MARK) {
                    let addr = line[i + MARK.len()..].split_whitespace().next();
                    let _ = tx.send(addr.unwrap_or_default().to_string());
                } else if line.contains("ERROR") || line.contains("WARN") {
                    eprintln!("daemon: {line}");
                }
            }
        });
        daemon.addr = rx
            .recv_timeout(Duration::from_secs(30))
            .context("the daemon logged no address within 30 s")?;
        Ok(daemon)
    }

    /// The daemon's peak resident set (VmHWM), in bytes.
    pub fn peak_rss(&self) -> Result<u64> {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))?;
        let line = status
            .lines()
            .find(|l| l.starts_with("VmHWM:"))
            .context("no VmHWM")?;
        let kib: u64 = line
            .split_whitespace()
            .nth(1)
            .context("bad VmHWM")?
            .parse()?;
        Ok(kib * 1024)
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

// ---------------------------------------------------------------------------------------
// Connections that count the bytes they receive.

/// A TCP stream that adds every byte it reads to a shared counter.
struct Counting {
    inner: TcpStream,
    received: Arc<AtomicU64>,
}

impl AsyncRead for Counting {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        let r = Pin::new(&mut self.inner).poll_read(cx, buf);
        let n = buf.filled().len() - before;
        self.received.fetch_add(n as u64, Ordering::Relaxed);
        r
    }
}

impl AsyncWrite for Counting {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }
    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// `connections` HTTP/2 connections to `addr` (the product's endpoint settings), counting
/// what they receive into `received`.
async fn connect(
    addr: &str,
    connections: usize,
    received: &Arc<AtomicU64>,
) -> Result<Vec<Channel>> {
    let host = addr.trim_start_matches("http://").to_string();
    let mut channels = Vec::new();
    for _ in 0..connections {
        let endpoint =
            torchft::security::client::endpoint(addr, Duration::from_secs(10), &Security::none())?;
        let (host, received) = (host.clone(), received.clone());
        let connector = tower::service_fn(move |_: Uri| {
            let (host, received) = (host.clone(), received.clone());
            async move {
                let inner = TcpStream::connect(host).await?;
                inner.set_nodelay(true)?;
                Ok::<_, std::io::Error>(TokioIo::new(Counting { inner, received }))
            }
        });
        channels.push(endpoint.connect_with_connector(connector).await?);
    }
    Ok(channels)
}

// ---------------------------------------------------------------------------------------
// Simulated replica groups.

/// One replica group: its member record and its client (clones on one connection share
/// the cache of the last quorum, as in one process driving many groups).
struct Group {
    member: QuorumMember,
    client: LighthouseClient,
}

fn member(name: &str, host: usize) -> QuorumMember {
    QuorumMember {
        replica_id: format!("{name}:{}", uuid::Uuid::new_v4()),
        address: format!("http://host-{host}:1234"),
        store_address: format!("host-{host}:29500"),
        step: 0,
        world_size: 1,
        ..Default::default()
    }
}

/// `count` fresh groups of room `job` (empty: the default room) spread over `channels`.
fn groups(job: &str, count: usize, channels: &[Channel], first_host: usize) -> Result<Vec<Group>> {
    let families: Vec<LighthouseClient> = channels
        .iter()
        .map(|c| LighthouseClient::from_channel(c.clone(), None).with_job(job))
        .collect::<torchft::error::Result<_>>()?;
    let prefix = if job.is_empty() { "group" } else { job };
    Ok((0..count)
        .map(|i| Group {
            member: member(&format!("{prefix}-{i:05}"), first_host + i),
            client: families[i % families.len()].clone(),
        })
        .collect())
}

/// What one group saw of its quorum (the quorums themselves are shared or dropped at once:
/// 10,000 full copies would not fit in memory).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Seen {
    quorum_id: i64,
    revision: u64,
    members: usize,
    /// Its replica rank, from a sparse answer (None: it got the full list).
    rank: Option<usize>,
}

/// Whether groups ask for the sparse form (set once per run from [`Options::sparse`]).
static SPARSE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(true);

/// One round: every group asks at once and checks it is in its answer with its step; the
/// time until the last answer, what each group saw, and one of the quorums (None when every
/// group got the sparse form).
async fn round(
    groups: &[Group],
    timeout: Duration,
) -> Result<(Duration, Vec<Seen>, Option<Arc<Quorum>>)> {
    let started = Instant::now();
    let sparse = SPARSE.load(Ordering::Relaxed);
    let tasks: Vec<_> = groups
        .iter()
        .map(|g| {
            let (client, member) = (g.client.clone(), g.member.clone());
            tokio::spawn(async move {
                let q = if sparse {
                    client
                        .quorum_status_sparse(member.clone(), false, timeout)
                        .await
                        .map_err(torchft::error::Error::from)
                } else {
                    client.quorum_shared(member.clone(), timeout).await
                }
                .with_context(|| format!("quorum of {}", member.replica_id))?;
                if let Some(s) = &q.sparse {
                    // What a manager reads of it, without the replica-id list a manager's
                    // answer carries (O(members) per group: O(groups²) for this process,
                    // which plays every group).
                    let me = s
                        .indices
                        .binary_search(&s.replica_rank)
                        .map(|k| &s.members[k]);
                    ensure!(
                        me.is_ok_and(|m| m.replica_id == member.replica_id && m.step == member.step)
                            && s.ranks.len() == 1
                            && s.indices.binary_search(&s.ranks[0].store).is_ok(),
                        "{} (step {}) is not in its sparse answer with its step and store",
                        member.replica_id,
                        member.step
                    );
                    return Ok(Seen {
                        quorum_id: q.quorum_id,
                        revision: q.revision,
                        members: s.count as usize,
                        rank: Some(s.replica_rank as usize),
                    });
                }
                let me = q
                    .participants
                    .binary_search_by(|m| m.replica_id.as_str().cmp(&member.replica_id))
                    .map(|i| &q.participants[i]);
                ensure!(
                    me.is_ok_and(|m| m.step == member.step),
                    "{} (step {}) is not in its quorum with its step",
                    member.replica_id,
                    member.step
                );
                Ok::<_, anyhow::Error>(Seen {
                    quorum_id: q.quorum_id,
                    revision: q.revision,
                    members: q.participants.len(),
                    rank: None,
                })
            })
        })
        .collect();
    let mut seen = Vec::with_capacity(tasks.len());
    for task in tasks {
        seen.push(task.await??);
    }
    let elapsed = started.elapsed();
    // One full copy, from the cache the groups' clients share (a full reply's decoded copy
    // is dropped in its task); none after sparse answers.
    let sample = groups.first().and_then(|g| g.client.known_quorum());
    Ok((elapsed, seen, sample))
}

/// Checks that every group got the same quorum, made of exactly `groups` with their steps:
/// from the full list (`sample`) when groups got it, else from each sparse answer (its own
/// step, the member count, and its replica rank: its place among the groups' sorted ids).
fn check(groups: &[Group], seen: &[Seen], sample: Option<&Quorum>) -> Result<()> {
    let mut expected: Vec<(&str, i64)> = groups
        .iter()
        .map(|g| (g.member.replica_id.as_str(), g.member.step))
        .collect();
    expected.sort_unstable();
    let first = seen.first().context("no groups")?;
    for (s, g) in seen.iter().zip(groups) {
        ensure!(
            (s.quorum_id, s.revision, s.members) == (first.quorum_id, first.revision, groups.len()),
            "{} got {s:?}, another group {first:?}, with {} groups",
            g.member.replica_id,
            groups.len()
        );
        if let Some(rank) = s.rank {
            ensure!(
                expected.get(rank).map(|e| e.0) == Some(g.member.replica_id.as_str()),
                "{} got replica rank {rank}, not its place among the groups",
                g.member.replica_id
            );
        }
    }
    if seen.iter().all(|s| s.rank.is_some()) {
        return Ok(());
    }
    let sample = sample.context("groups got the full list, but no client holds it")?;
    let got: Vec<(&str, i64)> = sample
        .participants
        .iter()
        .map(|m| (m.replica_id.as_str(), m.step))
        .collect();
    ensure!(
        got == expected && (sample.quorum_id, sample.revision) == (first.quorum_id, first.revision),
        "quorum {} has {} members, expected this round's {} groups",
        sample.quorum_id,
        got.len(),
        expected.len()
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------
// Measurements.

/// The kinds of round, in the order a repetition runs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kind {
    First,
    Steady,
    Change,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::First => "first",
            Kind::Steady => "steady",
            Kind::Change => "change",
        }
    }
}

/// Samples of one round kind: latencies and bytes received per round.
#[derive(Debug, Default, Clone)]
pub struct Samples {
    pub times: Vec<Duration>,
    pub bytes: Vec<u64>,
}

impl Samples {
    fn push(&mut self, t: Duration, bytes: u64) {
        self.times.push(t);
        self.bytes.push(bytes);
    }

    /// Median, min and max latency.
    pub fn spread(&self) -> (Duration, Duration, Duration) {
        let mut t = self.times.clone();
        t.sort_unstable();
        if t.is_empty() {
            return Default::default();
        }
        (t[t.len() / 2], t[0], t[t.len() - 1])
    }

    fn median_bytes(&self) -> u64 {
        let mut b = self.bytes.clone();
        b.sort_unstable();
        b.get(b.len() / 2).copied().unwrap_or(0)
    }
}

/// Where the rounds go: the daemon, or the floor server.
enum Target<'a> {
    Daemon(&'a Options),
    Floor(&'a Floor),
}

/// One repetition against `target`: first, steady, change, steady after the change.
/// Returns the samples per kind and, against the daemon, its peak RSS.
async fn repetition(
    opts: &Options,
    target: &Target<'_>,
    rep: usize,
    into: &mut HashMap<Kind, Samples>,
) -> Result<Option<u64>> {
    let daemon = match target {
        Target::Daemon(o) => Some(Daemon::start(&o.daemon, o.groups)?),
        Target::Floor(_) => None,
    };
    let addr = match (target, &daemon) {
        (_, Some(d)) => d.addr.clone(),
        (Target::Floor(f), None) => f.addr.clone(),
        _ => unreachable!("a daemon target starts a daemon"),
    };
    let received = Arc::new(AtomicU64::new(0));
    let channels = connect(&addr, opts.connections_for(opts.groups), &received).await?;
    let mut groups = groups("", opts.groups, &channels, 0)?;
    let (mut quorum_id, mut revision, mut last_id) = (1, 0, 0);
    let mut plan = vec![Kind::First];
    plan.extend(std::iter::repeat_n(Kind::Steady, opts.steady));
    plan.extend([Kind::Change, Kind::Steady]);
    for kind in plan {
        match kind {
            Kind::First => {}
            Kind::Steady => groups.iter_mut().for_each(|g| g.member.step += 1),
            Kind::Change => {
                groups.iter_mut().for_each(|g| g.member.step += 1);
                // A new incarnation of one group: a fresh client that knows nothing.
                let i = (rep * 7919 + 1) % groups.len();
                let name = format!("group-{i:05}");
                let channel = &channels[i % channels.len()];
                groups[i] = Group {
                    member: member(&name, i),
                    client: LighthouseClient::from_channel(channel.clone(), None),
                };
                quorum_id += 1;
            }
        }
        revision += 1;
        if let Target::Floor(f) = target {
            f.set(&groups, quorum_id, revision);
        }
        let before = received.load(Ordering::Relaxed);
        let (elapsed, seen, sample) = round(&groups, opts.ask_timeout).await?;
        let bytes = received.load(Ordering::Relaxed) - before;
        check(&groups, &seen, sample.as_deref())
            .with_context(|| format!("{} round", kind.name()))?;
        let id = seen[0].quorum_id;
        ensure!(
            (kind == Kind::Change) == (id != last_id) || kind == Kind::First,
            "{} round: quorum id {last_id} -> {id}",
            kind.name()
        );
        last_id = id;
        into.entry(kind).or_default().push(elapsed, bytes);
    }
    daemon.as_ref().map(Daemon::peak_rss).transpose()
}

/// The rooms measurement: per-room steady round latency with `rooms` rooms of `per_room`.
#[derive(Default)]
struct RoomsResult {
    steady: Samples,
    first_all: Duration,
}

impl RoomsResult {
    /// Pools another trial's rounds into this one (the slowest first round is kept).
    fn absorb(&mut self, o: RoomsResult) {
        self.steady.times.extend(o.steady.times);
        self.steady.bytes.extend(o.steady.bytes);
        self.first_all = self.first_all.max(o.first_all);
    }
}

/// True if the daemon keeps rooms apart: two groups of two rooms, min_replicas 2, get no
/// quorum together.
async fn rooms_supported(bin: &std::path::Path) -> Result<bool> {
    let daemon = Daemon::start(bin, 2)?;
    let received = Arc::new(AtomicU64::new(0));
    let channels = connect(&daemon.addr, 1, &received).await?;
    let a = groups("probe-a", 2, &channels, 0)?;
    let b = groups("probe-b", 2, &channels, 2)?;
    let (a0, b0) = (&a[0], &b[0]);
    let ask = |g: &Group| {
        let (c, m) = (g.client.clone(), g.member.clone());
        tokio::spawn(async move { c.quorum_shared(m, Duration::from_secs(10)).await })
    };
    let (ta, tb) = (ask(a0), ask(b0));
    tokio::time::sleep(Duration::from_millis(300)).await;
    if ta.is_finished() || tb.is_finished() {
        // One room: the two rooms' first groups made a quorum of two.
        return Ok(false);
    }
    let (ta1, tb1) = (ask(&a[1]), ask(&b[1]));
    for t in [ta, tb, ta1, tb1] {
        let q = t.await??;
        ensure!(
            q.participants.len() == 2,
            "room probe: a quorum of {}",
            q.participants.len()
        );
    }
    Ok(true)
}

async fn run_rooms(
    opts: &Options,
    rooms: usize,
    per_room: usize,
    apart: bool,
    reps: usize,
) -> Result<RoomsResult> {
    let min = if apart { per_room } else { rooms * per_room };
    let daemon = Daemon::start(&opts.daemon, min)?;
    let received = Arc::new(AtomicU64::new(0));
    let channels = connect(
        &daemon.addr,
        opts.connections_for(rooms * per_room),
        &received,
    )
    .await?;
    // Each room's groups share as many connections as a lone room of the same size gets
    // (its own slice of them), so a room's round moves the same traffic over the same number
    // of connections among many rooms as alone.
    let per_room_channels = opts.connections_for(per_room).min(channels.len());
    let mut all: Vec<Vec<Group>> = (0..rooms)
        .map(|r| {
            let own: Vec<Channel> = (0..per_room_channels)
                .map(|j| channels[(r * per_room_channels + j) % channels.len()].clone())
                .collect();
            groups(&format!("room-{r:03}"), per_room, &own, r * per_room)
        })
        .collect::<Result<_>>()?;
    // Every room's first round at once (or the one room's).
    let started = Instant::now();
    let tasks: Vec<_> = all
        .iter()
        .map(|room| {
            let room: Vec<Group> = room
                .iter()
                .map(|g| Group {
                    member: g.member.clone(),
                    client: g.client.clone(),
                })
                .collect();
            let timeout = opts.ask_timeout;
            tokio::spawn(async move {
                let (_, seen, sample) = round(&room, timeout).await?;
                Ok::<_, anyhow::Error>((room, seen, sample))
            })
        })
        .collect();
    let mut firsts = Vec::new();
    for t in tasks {
        firsts.push(t.await??);
    }
    let first_all = started.elapsed();
    for (room, seen, sample) in &firsts {
        if apart {
            check(room, seen, sample.as_deref()).context("rooms: first round")?;
        }
    }
    let mut steady = Samples::default();
    for _ in 0..reps {
        if apart {
            // One room at a time while the others idle: what a room's round costs among many.
            for room in all.iter_mut() {
                room.iter_mut().for_each(|g| g.member.step += 1);
                let before = received.load(Ordering::Relaxed);
                let (t, seen, sample) = round(room, opts.ask_timeout).await?;
                check(room, &seen, sample.as_deref()).context("rooms: steady round")?;
                steady.push(t, received.load(Ordering::Relaxed) - before);
            }
        } else {
            let mut everyone: Vec<Group> = Vec::new();
            for room in all.iter_mut() {
                for g in room.iter_mut() {
                    g.member.step += 1;
                    everyone.push(Group {
                        member: g.member.clone(),
                        client: g.client.clone(),
                    });
                }
            }
            let before = received.load(Ordering::Relaxed);
            let (t, seen, sample) = round(&everyone, opts.ask_timeout).await?;
            check(&everyone, &seen, sample.as_deref())
                .context("rooms as one room: steady round")?;
            steady.push(t, received.load(Ordering::Relaxed) - before);
        }
    }
    Ok(RoomsResult { steady, first_all })
}

// ---------------------------------------------------------------------------------------
// The report.

/// What a run measured, as printed, and the targets it missed.
pub struct Report {
    pub lines: Vec<String>,
    pub missed: Vec<String>,
}

fn ms(d: Duration) -> String {
    format!("{:.1} ms", d.as_secs_f64() * 1e3)
}

fn size(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
        b if b >= 1 << 20 => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        b if b >= 1 << 10 => format!("{:.1} KiB", b as f64 / 1024.0),
        b => format!("{b} B"),
    }
}

/// Runs every measurement of `opts` (printing as it goes) and judges the targets.
pub fn run(opts: &Options) -> Result<Report> {
    SPARSE.store(opts.sparse, Ordering::Relaxed);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let floor = Floor::start()?;
    runtime.block_on(async {
        let mut report = Report {
            lines: Vec::new(),
            missed: Vec::new(),
        };
        let say = |report: &mut Report, line: String| {
            println!("{line}");
            report.lines.push(line);
        };
        say(
            &mut report,
            format!(
                "lighthouse_load: {} groups over {} HTTP/2 connections, {} repetitions \
                 (first, {} steady, change, steady), daemon {} and floor on {} worker \
                 threads each",
                opts.groups,
                opts.connections_for(opts.groups),
                opts.reps,
                opts.steady,
                opts.daemon.display(),
                torchft::runtime::available_cores()
            ),
        );
        let (mut ours, mut floors) = (HashMap::new(), HashMap::new());
        let mut rss = 0u64;
        for rep in 0..opts.reps {
            // Alternate, so drift on the machine hits both alike.
            let peak = repetition(opts, &Target::Daemon(opts), rep, &mut ours).await?;
            rss = rss.max(peak.unwrap_or(0));
            repetition(opts, &Target::Floor(&floor), rep, &mut floors).await?;
        }
        say(
            &mut report,
            format!(
                "{:<8} {:>34} {:>34} {:>12} {:>12}",
                "round",
                "lighthouse median [min, max]",
                "floor median [min, max]",
                "bytes/round",
                "floor bytes"
            ),
        );
        for kind in [Kind::First, Kind::Steady, Kind::Change] {
            let (o, f) = (&ours[&kind], &floors[&kind]);
            let ((om, olo, ohi), (fm, flo, fhi)) = (o.spread(), f.spread());
            say(
                &mut report,
                format!(
                    "{:<8} {:>34} {:>34} {:>12} {:>12}   (n={})",
                    kind.name(),
                    format!("{} [{}, {}]", ms(om), ms(olo), ms(ohi)),
                    format!("{} [{}, {}]", ms(fm), ms(flo), ms(fhi)),
                    size(o.median_bytes()),
                    size(f.median_bytes()),
                    o.times.len()
                ),
            );
            if opts.judge && kind != Kind::Steady && om > ROUND_TARGET {
                report.missed.push(format!(
                    "{} round median {} > {} (floor {})",
                    kind.name(),
                    ms(om),
                    ms(ROUND_TARGET),
                    ms(fm)
                ));
            }
        }
        say(
            &mut report,
            format!(
                "daemon peak RSS (VmHWM, max over repetitions): {} (target {})",
                size(rss),
                size(RSS_TARGET)
            ),
        );
        if opts.judge && rss > RSS_TARGET {
            report.missed.push(format!(
                "daemon peak RSS {} > {}",
                size(rss),
                size(RSS_TARGET)
            ));
        }
        if opts.rooms > 0 {
            let apart = rooms_supported(&opts.daemon).await?;
            if !apart {
                say(
                    &mut report,
                    "rooms: this daemon keeps one room for every job; the rooms run as one \
                     room (each round waits for every group)"
                        .to_string(),
                );
            }
            // As many rounds of the lone room as of one room among many in total, in trials
            // that alternate the two (the machine's load drifts; a ratio is taken within a
            // trial), judged on the median of the trials' ratios.
            let lone_reps = opts.reps * opts.rooms.max(1);
            let (mut lone, mut many) = (RoomsResult::default(), RoomsResult::default());
            let mut ratios = Vec::with_capacity(opts.room_trials);
            for _ in 0..opts.room_trials {
                let l = run_rooms(opts, 1, opts.room_groups, apart, lone_reps).await?;
                let m = run_rooms(opts, opts.rooms, opts.room_groups, apart, opts.reps).await?;
                ratios.push(
                    m.steady.spread().0.as_secs_f64() / l.steady.spread().0.as_secs_f64().max(1e-9),
                );
                lone.absorb(l);
                many.absorb(m);
            }
            ratios.sort_by(f64::total_cmp);
            let ratio = ratios[ratios.len() / 2];
            let ((lm, llo, lhi), (mm, mlo, mhi)) = (lone.steady.spread(), many.steady.spread());
            for (name, r, (m, lo, hi)) in [
                (format!("1×{}", opts.room_groups), &lone, (lm, llo, lhi)),
                (
                    format!("{}×{}", opts.rooms, opts.room_groups),
                    &many,
                    (mm, mlo, mhi),
                ),
            ] {
                say(
                    &mut report,
                    format!(
                        "rooms {name:<8} steady round of one room: {} [{}, {}] (n={}, {} per \
                         round); every room's first round at once: {} (slowest trial)",
                        ms(m),
                        ms(lo),
                        ms(hi),
                        r.steady.times.len(),
                        size(r.steady.median_bytes()),
                        ms(r.first_all)
                    ),
                );
            }
            say(
                &mut report,
                format!(
                    "rooms ratio {ratio:.2}, median of {} trial{} [{:.2}, {:.2}] (target ≤ \
                     {ROOMS_RATIO_TARGET})",
                    ratios.len(),
                    if ratios.len() == 1 { "" } else { "s" },
                    ratios[0],
                    ratios[ratios.len() - 1]
                ),
            );
            if opts.judge && ratio > ROOMS_RATIO_TARGET {
                report.missed.push(format!(
                    "rooms: a room among {} takes {ratio:.2}× a lone room's round",
                    opts.rooms
                ));
            }
        }
        if !opts.judge {
            say(
                &mut report,
                "targets not judged (--quick or --no-judge)".to_string(),
            );
        }
        Ok(report)
    })
}
