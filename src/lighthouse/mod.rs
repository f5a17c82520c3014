//! The lighthouse: decides, per step, which replica groups take part (the quorum).
//!
//! `quorum` is the pure engine (state, now, options → decision); `service` is the gRPC
//! service around it; `http` the status pages served on the same port; `daemon` the
//! command-line entry point shared by the `torchft_lighthouse` binary and the Python console
//! script.
