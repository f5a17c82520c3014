//! Wire-level load generator for the lighthouse: N concurrent replica groups (tokio tasks
//! multiplexed over a few HTTP/2 connections) ask a real lighthouse for a quorum; one round
//! ends when every group has its answer.
//!
//! The clients behave like manager servers: each keeps the last quorum it received and sends
//! its id and revision (`known_quorum_id`, `known_revision`), and every group advances its
//! step by one per round, so fast-path rounds are answered in compact form. Reports the first
//! round (no previous quorum, full form) and fast-path rounds as median / max over
//! `--rounds`, next to the targets, with the response bytes of each. Client modes:
//! `bytes` reads each response's header fields only (quorum_id, revision) and counts its
//! bytes (what the lighthouse and the wire cost); `full` uses one `LighthouseClient` per
//! group, which expands compact replies into full quorums (adds each group's own O(n)
//! decode/expansion, all on this machine). `baseline` is an empty-reply RPC round (every
//! group heartbeats once) with the same clients: the floor of the load generator itself.
//!
//! ```text
//! cargo run --release --example lighthouse_load -- --replicas 1000 --replicas 10000
//! cargo run --release --example lighthouse_load -- --replicas 1000 --addr http://host:29510
//! ```
//! With `--addr` the lighthouse must run with `--min_replicas N` for the N being measured.

use std::sync::Arc;
use std::time::{Duration, Instant};

use clap::Parser;
use prost::bytes::Buf;
use prost::Message;
use tonic::codec::{Codec, DecodeBuf, Decoder};
use tonic::codegen::http::uri::PathAndQuery;
use tonic::transport::Channel;
use tonic::Status;
use torchft::lighthouse::{LighthouseClient, LighthouseOptions, LighthouseServer};
use torchft::proto::{LighthouseQuorumRequest, QuorumMember};

/// Lighthouse wire load generator.
#[derive(Debug, Parser)]
struct Args {
    /// Replica groups per round (repeat for several sizes).
    #[arg(long = "replicas", default_values_t = [1000usize])]
    replicas: Vec<usize>,
    /// Rounds per size (the first is the first round, the rest fast-path rounds).
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Concurrent calls per HTTP/2 connection (servers allow ~200 streams each).
    #[arg(long, default_value_t = 100)]
    per_connection: usize,
    /// Client modes to run: bytes, full, baseline or all.
    #[arg(long, default_value = "all")]
    mode: String,
    /// Largest size run in `full` mode under `all` (each group expands O(n) members).
    #[arg(long, default_value_t = 2000)]
    full_decode_max: usize,
    /// Give client connections large HTTP/2 flow-control windows (64 MB / 8 MB per stream)
    /// instead of the defaults of `torchft::net::connect`.
    #[arg(long)]
    big_windows: bool,
    /// Clients send no known quorum (like old clients): every reply is the full form.
    #[arg(long)]
    no_known: bool,
    /// Use this running lighthouse instead of an in-process one.
    #[arg(long)]
    addr: Option<String>,
}

/// The header fields of a `Quorum` (prost skips the participants without building them).
#[derive(Clone, PartialEq, Message)]
struct QuorumHead {
    #[prost(int64, tag = "1")]
    quorum_id: i64,
    #[prost(uint64, tag = "4")]
    revision: u64,
}

/// A `LighthouseQuorumResponse` read for its quorum's header only.
#[derive(Clone, PartialEq, Message)]
struct ResponseHead {
    #[prost(message, optional, tag = "1")]
    quorum: Option<QuorumHead>,
}

/// What one response told a group: its size in bytes and `(quorum_id, revision)`.
type Head = (usize, (i64, u64));

/// A decoder that counts response bytes and reads only the quorum's id and revision.
#[derive(Debug, Clone, Default)]
struct HeadDecoder;

impl Decoder for HeadDecoder {
    type Item = Head;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Head>, Status> {
        let n = buf.remaining();
        let head = ResponseHead::decode(buf)
            .map_err(|e| Status::internal(format!("bad response: {e}")))?;
        let q = head.quorum.unwrap_or_default();
        Ok(Some((n, (q.quorum_id, q.revision))))
    }
}

/// Encodes requests with prost, decodes responses with [`HeadDecoder`].
#[derive(Debug, Clone, Default)]
struct HeadCodec;

impl Codec for HeadCodec {
    type Encode = LighthouseQuorumRequest;
    type Decode = Head;
    type Encoder = tonic_prost::ProstEncoder<LighthouseQuorumRequest>;
    type Decoder = HeadDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        tonic_prost::ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        HeadDecoder
    }
}

fn replica_id(i: usize) -> String {
    format!("rg{i:05}:3f1c9a")
}

/// Group `i` at `step`; `failing` groups report a failed commit (forces a new quorum_id).
fn member(i: usize, step: i64, failing: Option<usize>) -> QuorumMember {
    QuorumMember {
        replica_id: replica_id(i),
        address: format!("http://node{i:05}:29512"),
        store_address: format!("node{i:05}:29500"),
        step,
        world_size: 8,
        commit_failures: i64::from(failing == Some(i)),
        ..Default::default()
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Mode {
    Bytes,
    Full,
    Baseline,
}

/// One round's timings.
struct RoundStats {
    /// From the first request sent to the last reply received.
    total: Duration,
    /// From the first request sent to the first reply (≈ when the quorum was issued).
    first_reply: Duration,
    /// Response bytes (bytes mode), members in the expanded quorums (full mode), 0 otherwise.
    volume: usize,
    /// CPU time of this process during the round (clients, and the lighthouse when it runs
    /// in-process).
    cpu: Option<Duration>,
}

/// Per-group client state kept across rounds, like a manager server's.
enum Groups {
    /// The `(quorum_id, revision)` each group holds.
    Bytes(Vec<(i64, u64)>),
    /// One client per group (each caches its last full quorum).
    Full(Vec<LighthouseClient>),
    /// Stateless heartbeat clients.
    Baseline(Vec<LighthouseClient>),
}

/// One round: every group asks at once (at `step`).
async fn round(
    channels: &[Channel],
    groups: &mut Groups,
    step: i64,
    send_known: bool,
    failing: Option<usize>,
) -> anyhow::Result<RoundStats> {
    let timeout = Duration::from_secs(300);
    let cpu0 = process_cpu();
    let t0 = Instant::now();
    type Out = (Instant, usize, (i64, u64));
    let tasks: Vec<tokio::task::JoinHandle<anyhow::Result<Out>>> = match groups {
        Groups::Bytes(known) => known
            .iter()
            .enumerate()
            .map(|(i, &(known_id, known_rev))| {
                let ch = channels[i % channels.len()].clone();
                tokio::spawn(async move {
                    let mut grpc =
                        tonic::client::Grpc::new(ch).max_decoding_message_size(usize::MAX);
                    grpc.ready().await?;
                    let (known_quorum_id, known_revision) = if send_known {
                        (known_id, known_rev)
                    } else {
                        (0, 0)
                    };
                    let req = torchft::net::with_timeout(
                        LighthouseQuorumRequest {
                            requester: Some(member(i, step, failing)),
                            known_quorum_id,
                            known_revision,
                            ..Default::default()
                        },
                        timeout,
                    );
                    let path = PathAndQuery::from_static("/torchft.LighthouseService/Quorum");
                    let (bytes, head) = grpc.unary(req, path, HeadCodec).await?.into_inner();
                    anyhow::Ok((Instant::now(), bytes, head))
                })
            })
            .collect(),
        Groups::Full(clients) => clients
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let c = c.clone();
                tokio::spawn(async move {
                    if !send_known {
                        c.forget_known_quorum();
                    }
                    let q = c.quorum(member(i, step, failing), timeout).await?;
                    anyhow::Ok((Instant::now(), q.participants.len(), (0, 0)))
                })
            })
            .collect(),
        Groups::Baseline(clients) => clients
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let c = c.clone();
                tokio::spawn(async move {
                    c.heartbeat(&replica_id(i), timeout).await?;
                    anyhow::Ok((Instant::now(), 0, (0, 0)))
                })
            })
            .collect(),
    };
    let mut volume = 0;
    let mut first = None::<Instant>;
    for (i, t) in tasks.into_iter().enumerate() {
        let (at, v, head) = t.await??;
        volume += v;
        first = Some(first.map_or(at, |f| f.min(at)));
        if let Groups::Bytes(known) = groups {
            known[i] = head;
        }
    }
    let total = t0.elapsed();
    let cpu = process_cpu().zip(cpu0).map(|(b, a)| b.saturating_sub(a));
    let first_reply = first.map_or(total, |f| f.duration_since(t0));
    Ok(RoundStats {
        total,
        first_reply,
        volume,
        cpu,
    })
}

/// CPU time used so far by this whole process (all threads), from `/proc/self/stat` (Linux;
/// clock ticks of 10 ms). `None` where unavailable.
fn process_cpu() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the command name (which may contain spaces) start after the last ')'.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let utime: u64 = fields.get(11)?.parse().ok()?;
    let stime: u64 = fields.get(12)?.parse().ok()?;
    Some(Duration::from_millis((utime + stime) * 10))
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

fn target_ms(n: usize) -> Option<f64> {
    match n {
        1_000 => Some(50.0),
        10_000 => Some(500.0),
        _ => None,
    }
}

fn human_bytes(b: usize) -> String {
    match b {
        b if b >= 1_000_000 => format!("{:.1} MB", b as f64 / 1e6),
        b if b >= 1_000 => format!("{:.1} kB", b as f64 / 1e3),
        b => format!("{b} B"),
    }
}

async fn measure(args: &Args, n: usize, mode: Mode) -> anyhow::Result<()> {
    let server = match &args.addr {
        Some(_) => None,
        None => {
            let opts = LighthouseOptions {
                min_replicas: n as u64,
                join_timeout: Duration::from_secs(60),
                quorum_tick: Duration::from_millis(100),
                heartbeat_timeout: Duration::from_secs(60),
                // Not about the no-regression rules: no startup hold, no wait for progress.
                progress_wait: Duration::ZERO,
                state_file: None,
                hang_timeout: None,
            };
            Some(LighthouseServer::bind("127.0.0.1:0", opts).await?)
        }
    };
    let addr = match (&args.addr, &server) {
        (Some(a), _) => a.clone(),
        (None, Some(s)) => s.address(),
        (None, None) => anyhow::bail!("no lighthouse"),
    };
    let conns = n.div_ceil(args.per_connection.max(1)).max(1);
    let mut channels = Vec::with_capacity(conns);
    for _ in 0..conns {
        let channel = if args.big_windows {
            tonic::transport::Endpoint::from_shared(torchft::net::normalize_addr(&addr)?)?
                .tcp_nodelay(true)
                .initial_connection_window_size(64 << 20)
                .initial_stream_window_size(8 << 20)
                .connect()
                .await?
        } else {
            torchft::client::connect(
                &addr,
                Duration::from_secs(10),
                &torchft::security::Security::none(),
            )
            .await?
        };
        channels.push(channel);
    }
    let clients = || {
        (0..n)
            .map(|i| LighthouseClient::from_channel(channels[i % channels.len()].clone(), None))
            .collect::<Vec<_>>()
    };
    let mut groups = match mode {
        Mode::Bytes => Groups::Bytes(vec![(0, 0); n]),
        Mode::Full => Groups::Full(clients()),
        Mode::Baseline => Groups::Baseline(clients()),
    };
    let mut rounds = Vec::new();
    let count = args.rounds.max(2);
    for r in 0..count {
        rounds.push(round(&channels, &mut groups, 100 + r as i64, !args.no_known, None).await?);
    }
    // One more round in which group 0 reports a failed commit: a new quorum_id, so holders
    // of the previous quorum get a delta (one changed member) instead of the steps only.
    let failure = match mode {
        Mode::Baseline => None,
        _ => Some(
            round(
                &channels,
                &mut groups,
                100 + count as i64,
                !args.no_known,
                Some(0),
            )
            .await?,
        ),
    };
    let first = &rounds[0];
    let mut fast: Vec<Duration> = rounds[1..].iter().map(|r| r.total).collect();
    fast.sort();
    let mut issued: Vec<Duration> = rounds[1..].iter().map(|r| r.first_reply).collect();
    issued.sort();
    let fast_volume = rounds.last().map_or(0, |r| r.volume);
    let mut fast_cpu: Vec<Duration> = rounds[1..].iter().filter_map(|r| r.cpu).collect();
    fast_cpu.sort();
    let cpu_note = match (first.cpu, fast_cpu.get(fast_cpu.len() / 2)) {
        (Some(f), Some(m)) => format!(
            "; process CPU: first round {:.0} ms, fast path median {:.0} ms{}",
            ms(f),
            ms(*m),
            if args.addr.is_some() {
                " (clients only)"
            } else {
                " (clients + lighthouse)"
            }
        ),
        _ => String::new(),
    };
    let mode_name = format!(
        "{}{}{}",
        match mode {
            Mode::Bytes => "bytes",
            Mode::Full => "full",
            Mode::Baseline => "baseline: empty-reply heartbeat RPCs",
        },
        if args.big_windows {
            ", big windows"
        } else {
            ""
        },
        if args.no_known && mode != Mode::Baseline {
            ", no known quorum"
        } else {
            ""
        },
    );
    let volume = |v: usize| match mode {
        Mode::Bytes => format!("{} received", human_bytes(v)),
        Mode::Full => format!("{v} members returned"),
        Mode::Baseline => String::new(),
    };
    let target = match (mode, target_ms(n)) {
        (Mode::Baseline, _) | (_, None) => String::new(),
        (_, Some(t)) => format!("  (target ≤ {t:.0} ms)"),
    };
    println!(
        "lighthouse_load/{n} replicas [{mode_name}, {conns} conns]:\n    \
         first round {:.1} ms {}\n    \
         fast path median {:.1} ms, max {:.1} ms over {} rounds; {} per round{target}\n    \
         (fast path: first reply after a median {:.1} ms{cpu_note})",
        ms(first.total),
        if mode == Mode::Baseline {
            String::new()
        } else {
            format!("({})", volume(first.volume))
        },
        ms(fast[fast.len() / 2]),
        ms(fast[fast.len() - 1]),
        fast.len(),
        if mode == Mode::Baseline {
            "no payload".to_string()
        } else {
            volume(fast_volume)
        },
        ms(issued[issued.len() / 2]),
    );
    if let Some(f) = failure {
        println!(
            "    round with a commit failure (new quorum_id): {:.1} ms; {}",
            ms(f.total),
            volume(f.volume)
        );
    }
    if let Some(s) = server {
        s.shutdown().await;
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args = Arc::new(Args::parse());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        for &n in &args.replicas {
            let modes: Vec<Mode> = match args.mode.as_str() {
                "bytes" => vec![Mode::Bytes],
                "full" => vec![Mode::Full],
                "baseline" => vec![Mode::Baseline],
                _ if n <= args.full_decode_max => vec![Mode::Baseline, Mode::Bytes, Mode::Full],
                _ => vec![Mode::Baseline, Mode::Bytes],
            };
            for mode in modes {
                measure(&args, n, mode).await?;
            }
        }
        anyhow::Ok(())
    })
}
