//! torchft: per-step fault tolerance for PyTorch training.
//!
//! The Rust core holds the lighthouse (quorum engine and daemon service), the per replica group
//! manager server and the clients of both. Everything here is plain Rust; the Python module
//! `torchft._torchft` lives in `bindings` behind the `python` feature.

pub mod checkpoint;
pub mod client;
pub mod error;
pub mod ids;
pub mod lighthouse;
pub mod logging;
pub mod manager;
pub mod net;
pub mod runtime;
pub mod security;
pub mod telemetry;
#[cfg(test)]
mod testkit;

#[cfg(feature = "python")]
pub mod bindings;

/// Generated protobuf messages and gRPC stubs (see `proto/torchft.proto`).
#[allow(missing_docs, clippy::all, clippy::pedantic)]
pub mod proto {
    tonic::include_proto!("torchft");

    /// The server the lighthouse mounts: `LighthouseService` without `Quorum` and
    /// `QuorumStream`, which the lighthouse serves on routes of its own (with pre-framed
    /// shared replies).
    pub mod served {
        include!(concat!(
            env!("OUT_DIR"),
            "/served/torchft.LighthouseService.rs"
        ));
    }
}
