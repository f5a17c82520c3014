//! The wire load generator (`cargo bench --bench lighthouse_load`) in its `--quick` mode, so
//! the bench keeps working: every round kind and the rooms mode against the real daemon.

#[path = "../benches/lighthouse_load/load.rs"]
#[allow(dead_code)]
mod load;

#[test]
fn quick_load_runs_every_round_kind() {
    let started = std::time::Instant::now();
    let opts = load::Options::quick(env!("CARGO_BIN_EXE_torchft_lighthouse").into());
    let report = load::run(&opts).expect("the quick load run fails");
    let text = report.lines.join("\n");
    for needle in ["first", "steady", "change", "peak RSS", "rooms ratio"] {
        assert!(text.contains(needle), "no {needle:?} in:\n{text}");
    }
    assert!(report.missed.is_empty(), "quick mode judges nothing");
    assert!(
        started.elapsed() < std::time::Duration::from_secs(60),
        "the quick run took {:?}",
        started.elapsed()
    );
}
