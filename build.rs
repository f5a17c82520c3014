//! Compiles `proto/torchft.proto` with a vendored `protoc`, so no system protobuf is needed.
//!
//! Besides the messages, clients and servers of every service, it generates the server the
//! lighthouse itself mounts: `LighthouseService` without `Quorum` and `QuorumStream`, which the
//! lighthouse serves on routes of its own with pre-framed shared replies (see
//! `src/lighthouse/grpc.rs`). That server is derived from the proto's descriptor, so a method
//! added to the proto is served without anything to keep in step here.

use std::path::PathBuf;

use prost::Message;
use tonic_prost_build::manual;

/// The lighthouse methods served outside the generated server.
const OWN_ROUTES: [&str; 2] = ["Quorum", "QuorumStream"];

fn snake_case(name: &str) -> String {
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_ascii_uppercase() {
            if i > 0 {
                out.push('_');
            }
            out.push(c.to_ascii_lowercase());
        } else {
            out.push(c);
        }
    }
    out
}

/// `.torchft.Foo` → `crate::proto::Foo`.
fn rust_type(proto_type: &str) -> Result<String, String> {
    proto_type
        .strip_prefix(".torchft.")
        .map(|t| format!("crate::proto::{t}"))
        .ok_or_else(|| format!("unexpected type outside the torchft package: {proto_type}"))
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let include = protoc_bin_vendored::include_path()?;
    // SAFETY: build scripts are single-threaded; the variables are read by tonic-prost-build.
    unsafe {
        std::env::set_var("PROTOC", protoc);
        std::env::set_var("PROTOC_INCLUDE", &include);
    }
    println!("cargo:rerun-if-changed=proto/torchft.proto");
    let out_dir = PathBuf::from(std::env::var("OUT_DIR")?);
    let descriptor_path = out_dir.join("torchft.descriptor.bin");
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .file_descriptor_set_path(&descriptor_path)
        .compile_protos(
            &["proto/torchft.proto"],
            &["proto", include.to_str().unwrap_or(".")],
        )?;

    let fds = prost_types::FileDescriptorSet::decode(std::fs::read(&descriptor_path)?.as_slice())?;
    let service = fds
        .file
        .iter()
        .flat_map(|f| f.service.iter())
        .find(|s| s.name() == "LighthouseService")
        .ok_or("proto/torchft.proto has no LighthouseService")?;
    let mut builder = manual::Service::builder()
        .name("LighthouseService")
        .package("torchft");
    let mut own_routes_found = 0;
    for method in &service.method {
        if OWN_ROUTES.contains(&method.name()) {
            own_routes_found += 1;
            continue;
        }
        let mut m = manual::Method::builder()
            .name(snake_case(method.name()))
            .route_name(method.name())
            .input_type(rust_type(method.input_type())?)
            .output_type(rust_type(method.output_type())?)
            .codec_path("tonic_prost::ProstCodec");
        if method.client_streaming() {
            m = m.client_streaming();
        }
        if method.server_streaming() {
            m = m.server_streaming();
        }
        builder = builder.method(m.build());
    }
    if own_routes_found != OWN_ROUTES.len() {
        return Err(format!("LighthouseService lacks one of the methods {OWN_ROUTES:?}").into());
    }
    let served = out_dir.join("served");
    std::fs::create_dir_all(&served)?;
    manual::Builder::new()
        .build_client(false)
        .out_dir(&served)
        .compile(&[builder.build()]);
    Ok(())
}
