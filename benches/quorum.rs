//! Benchmarks of the pure quorum engine: one full round (every replica group joins, the
//! engine polls after each join, the quorum is issued) at 100 / 1,000 / 10,000 groups.
//!
//! Two cases per size: the first round (no previous quorum: answered once every healthy group
//! asks) and a fast-path round (every member of the previous quorum asks again).

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use torchft::lighthouse::quorum::QuorumEngine;
use torchft::lighthouse::LighthouseOptions;
use torchft::proto::QuorumMember;

fn members(n: usize) -> Vec<QuorumMember> {
    (0..n)
        .map(|i| QuorumMember {
            replica_id: format!("replica_{i:05}:5f0c2a1e-8d7b-4c11-9a3e-0b6f2d4c8e17"),
            address: format!("http://host-{i:05}.cluster.local:29512"),
            store_address: format!("host-{i:05}.cluster.local:29500"),
            step: 1234,
            world_size: 8,
            ..Default::default()
        })
        .collect()
}

fn opts(n: usize) -> LighthouseOptions {
    LighthouseOptions {
        min_replicas: n as u64,
        join_timeout: Duration::from_secs(60),
        quorum_tick: Duration::from_millis(100),
        heartbeat_timeout: Duration::from_secs(5),
        ..Default::default()
    }
}

/// A start time past the startup hold (the rounds measured are those of a running lighthouse).
fn started() -> Instant {
    let hold = opts(1).heartbeat_timeout * 2;
    Instant::now()
        .checked_sub(hold)
        .unwrap_or_else(Instant::now)
}

/// Every member joins and the engine polls after each join; returns the issued quorum size.
fn round(engine: &mut QuorumEngine, ms: &[QuorumMember], now: Instant) -> usize {
    let mut issued = 0;
    for m in ms {
        engine.join(m.clone(), now).ok();
        if let Some(q) = engine.poll(now) {
            issued = q.participants.len();
        }
    }
    issued
}

fn bench_quorum(c: &mut Criterion) {
    let mut group = c.benchmark_group("quorum");
    for n in [100usize, 1_000, 10_000] {
        let ms = members(n);
        group.throughput(Throughput::Elements(n as u64));
        if n >= 10_000 {
            group.sample_size(20);
        }
        group.bench_with_input(
            BenchmarkId::new("first round", format!("{n} replicas")),
            &ms,
            |b, ms| {
                b.iter_batched(
                    || QuorumEngine::new(opts(n), 1, started()),
                    |mut e| {
                        let issued = round(&mut e, ms, Instant::now());
                        assert_eq!(issued, n);
                        black_box(e)
                    },
                    criterion::BatchSize::LargeInput,
                )
            },
        );
        group.bench_with_input(
            BenchmarkId::new("fast path", format!("{n} replicas")),
            &ms,
            |b, ms| {
                b.iter_batched(
                    || {
                        let mut e = QuorumEngine::new(opts(n), 1, started());
                        let issued = round(&mut e, ms, Instant::now());
                        assert_eq!(issued, n);
                        e
                    },
                    |mut e| {
                        let issued = round(&mut e, ms, Instant::now());
                        assert_eq!(issued, n);
                        black_box(e)
                    },
                    criterion::BatchSize::LargeInput,
                )
            },
        );
    }
    group.finish();
}

criterion_group!(benches, bench_quorum);
criterion_main!(benches);
