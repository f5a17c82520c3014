//! The `torchft_lighthouse` daemon.

fn main() {
    eprintln!("torchft_lighthouse: not built yet");
    std::process::exit(1);
}
