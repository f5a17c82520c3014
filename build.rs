//! Compiles `proto/torchft.proto` with a vendored `protoc`, so no system protobuf is needed.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let protoc = protoc_bin_vendored::protoc_bin_path()?;
    let include = protoc_bin_vendored::include_path()?;
    // SAFETY: build scripts are single-threaded; the variables are read by tonic-prost-build.
    unsafe {
        std::env::set_var("PROTOC", protoc);
        std::env::set_var("PROTOC_INCLUDE", &include);
    }
    println!("cargo:rerun-if-changed=proto/torchft.proto");
    tonic_prost_build::configure()
        .build_server(true)
        .build_client(true)
        .compile_protos(
            &["proto/torchft.proto"],
            &["proto", include.to_str().unwrap_or(".")],
        )?;
    Ok(())
}
