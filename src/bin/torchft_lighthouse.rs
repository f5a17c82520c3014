//! The `torchft_lighthouse` daemon: one per job, decides the quorum of every step.
//!
//! All logic lives in `torchft::lighthouse::daemon` so the Python console script behaves the
//! same; see `torchft_lighthouse --help` for the flags.

use std::process::ExitCode;

use clap::Parser;
use torchft::lighthouse::daemon::{run, Args};

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("torchft_lighthouse: {e}");
            ExitCode::FAILURE
        }
    }
}
