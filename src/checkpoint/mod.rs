//! The native checkpoint data path: the bulk bytes of a live heal, from tensor memory to
//! tensor memory.
//!
//! The Python `HTTPTransport` keeps the control exchange (it serves the JSON header over HTTP,
//! with the job's token and TLS); when both sides run this core and the link is not TLS, the
//! tensor bytes move here instead: a [`server::DataServer`] streams ranges of the offered
//! tensors straight from their memory (or, for memory the core cannot read directly, through
//! a bounded staging buffer filled by a hook), and a [`client::Fetch`] pulls disjoint ranges
//! over several TCP connections and writes each piece straight into the destination tensor,
//! verifying a CRC32 per tensor and one over the range. Neither side holds a copy of the
//! state; everything runs on plain threads with blocking sockets and per-call deadlines.

pub mod client;
pub mod server;
pub mod wire;
