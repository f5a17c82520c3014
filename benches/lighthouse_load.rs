//! The lighthouse under load, on the wire: N replica groups against the `torchft_lighthouse`
//! daemon as a separate process (see `lighthouse_load/load.rs` for what is measured).
//!
//! `cargo bench --bench lighthouse_load -- [--quick] [--groups N] [--connections N]
//! (under `cargo test` it runs `--quick`)
//! [--reps N] [--steady N] [--rooms N] [--room-groups N] [--room-trials N] [--daemon PATH]
//! [--no-judge] [--usual-form]` (groups ask for the sparse form, as managers without a
//! topology file do; `--usual-form`: the full list, then compact forms)
//!
//! Exits non-zero when a target is missed: at 10,000 groups the first and membership-change
//! rounds within 300 ms and the daemon's peak RSS within 1 GiB; a room's round among 100
//! rooms of 32 within 1.2× of a lone room of 32 (the median of 7 trials' ratios, each trial
//! running both back to back). `TORCHFT_LIGHTHOUSE_BIN` overrides the
//! daemon binary (default: the one cargo built with this bench).

#[path = "lighthouse_load/load.rs"]
mod load;

use std::process::ExitCode;

fn main() -> ExitCode {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    // `cargo bench` passes --bench; `cargo test --all-targets` runs this target with no
    // arguments (and a debug daemon): then it is the quick smoke run, not the full load.
    if !args.iter().any(|a| a == "--bench") && !args.iter().any(|a| a == "--quick") {
        args.push("--quick".to_string());
    }
    let daemon = std::env::var_os("TORCHFT_LIGHTHOUSE_BIN")
        .map(Into::into)
        .unwrap_or_else(|| env!("CARGO_BIN_EXE_torchft_lighthouse").into());
    let opts = match load::Options::parse(&args, daemon) {
        Ok(o) => o,
        Err(e) => {
            eprintln!("lighthouse_load: {e}");
            return ExitCode::from(2);
        }
    };
    match load::run(&opts) {
        Ok(report) if report.missed.is_empty() => ExitCode::SUCCESS,
        Ok(report) => {
            for m in &report.missed {
                println!("MISSED: {m}");
            }
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("lighthouse_load failed: {e:#}");
            ExitCode::FAILURE
        }
    }
}
