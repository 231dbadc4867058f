//! The gRPC client of the worker's second door: `ai-worker/proto/inference.proto` (the Open
//! Inference Protocol's `GRPCInferenceService`, the one file both sides are built from) becomes
//! Rust with `protox` (a protobuf compiler in Rust: no `protoc` to install) and
//! `tonic-prost-build`, client only.

const PROTO: &str = "../ai-worker/proto/inference.proto";

fn main() {
    println!("cargo:rerun-if-changed={PROTO}");
    let descriptors = protox::compile([PROTO], ["../ai-worker/proto"]).unwrap_or_else(|e| panic!("compiling {PROTO}: {e}"));
    tonic_prost_build::configure()
        .build_server(false)
        // Raw tensor contents as `Bytes`: a retry re-sends them without copying.
        .bytes(".inference")
        .compile_fds(descriptors)
        .unwrap_or_else(|e| panic!("generating the gRPC client of {PROTO}: {e}"));
}
