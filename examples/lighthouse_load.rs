//! Wire-level load generator for the lighthouse: N concurrent replica groups (tokio tasks
//! multiplexed over a few HTTP/2 connections) ask a real lighthouse for a quorum; one round
//! ends when every group has its answer.
//!
//! Reports the first round (no previous quorum) and fast-path rounds (every member asks
//! again) as median / max over `--rounds`, next to the targets. Two client modes:
//! `bytes` reads each response without decoding it (what the lighthouse costs), `full`
//! decodes every response into a `Quorum` (adds the clients' own O(n) decode per group, all
//! on this machine).
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
    /// How clients read responses: bytes, full or both.
    #[arg(long, default_value = "both")]
    decode: String,
    /// Largest size decoded fully in `both` mode (full decoding is O(n) per group).
    #[arg(long, default_value_t = 2000)]
    full_decode_max: usize,
    /// Use this running lighthouse instead of an in-process one.
    #[arg(long)]
    addr: Option<String>,
}

/// A decoder that counts response bytes without building messages.
#[derive(Debug, Clone, Default)]
struct CountDecoder;

impl Decoder for CountDecoder {
    type Item = usize;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<usize>, Status> {
        let n = buf.remaining();
        buf.advance(n);
        Ok(Some(n))
    }
}

/// Encodes requests with prost, decodes responses with [`CountDecoder`].
#[derive(Debug, Clone, Default)]
struct CountCodec;

impl Codec for CountCodec {
    type Encode = LighthouseQuorumRequest;
    type Decode = usize;
    type Encoder = tonic_prost::ProstEncoder<LighthouseQuorumRequest>;
    type Decoder = CountDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        tonic_prost::ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        CountDecoder
    }
}

fn member(i: usize) -> QuorumMember {
    QuorumMember {
        replica_id: format!("rg{i:05}:3f1c9a"),
        address: format!("http://node{i:05}:29512"),
        store_address: format!("node{i:05}:29500"),
        step: 100,
        world_size: 8,
        ..Default::default()
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    Bytes,
    Full,
}

/// One round: every group asks at once; returns (wall time, total response bytes or members).
async fn round(channels: &[Channel], n: usize, mode: Mode) -> anyhow::Result<(Duration, usize)> {
    let t0 = Instant::now();
    let mut tasks = Vec::with_capacity(n);
    for i in 0..n {
        let ch = channels[i % channels.len()].clone();
        tasks.push(tokio::spawn(async move {
            let timeout = Duration::from_secs(120);
            match mode {
                Mode::Full => {
                    let q = LighthouseClient::from_channel(ch)
                        .quorum(member(i), timeout)
                        .await?;
                    anyhow::Ok(q.participants.len())
                }
                Mode::Bytes => {
                    let mut grpc =
                        tonic::client::Grpc::new(ch).max_decoding_message_size(usize::MAX);
                    grpc.ready().await?;
                    let req = torchft::net::with_timeout(
                        LighthouseQuorumRequest {
                            requester: Some(member(i)),
                        },
                        timeout,
                    );
                    let path = PathAndQuery::from_static("/torchft.LighthouseService/Quorum");
                    let resp = grpc.unary(req, path, CountCodec).await?;
                    anyhow::Ok(resp.into_inner())
                }
            }
        }));
    }
    let mut total = 0;
    for t in tasks {
        total += t.await??;
    }
    Ok((t0.elapsed(), total))
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

async fn measure(args: &Args, n: usize, mode: Mode) -> anyhow::Result<()> {
    let server = match &args.addr {
        Some(_) => None,
        None => {
            let opts = LighthouseOptions {
                min_replicas: n as u64,
                join_timeout: Duration::from_secs(60),
                quorum_tick: Duration::from_millis(100),
                heartbeat_timeout: Duration::from_secs(60),
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
        channels.push(torchft::net::connect(&addr, Duration::from_secs(10)).await?);
    }
    let mut times = Vec::new();
    let mut volume = 0;
    for _ in 0..args.rounds.max(1) {
        let (t, v) = round(&channels, n, mode).await?;
        times.push(t);
        volume = v;
    }
    let first = times[0];
    let mut fast: Vec<Duration> = times[1..].to_vec();
    fast.sort();
    let what = match mode {
        Mode::Bytes => format!("{:.1} MB received", volume as f64 / 1e6),
        Mode::Full => format!("{volume} members decoded"),
    };
    let target = target_ms(n).map_or_else(String::new, |t| format!("  (target ≤ {t:.0} ms)"));
    let mode_name = if mode == Mode::Bytes { "bytes" } else { "full" };
    println!(
        "lighthouse_load/{n} replicas [{mode_name}, {conns} conns]: first round {:.1} ms; \
         fast path median {:.1} ms, max {:.1} ms over {} rounds; {what}{target}",
        ms(first),
        fast.get(fast.len() / 2).map_or(f64::NAN, |d| ms(*d)),
        fast.last().map_or(f64::NAN, |d| ms(*d)),
        fast.len(),
    );
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
            let modes: Vec<Mode> = match args.decode.as_str() {
                "bytes" => vec![Mode::Bytes],
                "full" => vec![Mode::Full],
                _ if n <= args.full_decode_max => vec![Mode::Bytes, Mode::Full],
                _ => vec![Mode::Bytes],
            };
            for mode in modes {
                measure(&args, n, mode).await?;
            }
        }
        anyhow::Ok(())
    })
}
