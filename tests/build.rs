//! The test binaries that link the worker's library (`tests/fuzz_seeds.rs` runs the
//! `worker_config` fuzz target's seeds through `WorkerConfig::load`) load libtorch at start. The
//! worker's own build script gives its binaries an rpath to it, but a build script's link
//! arguments reach only its own package, so this one does the same for this package's tests,
//! from where torch-sys found libtorch (its `links = "tch"` metadata).

fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    match std::env::var("DEP_TCH_LIBTORCH_LIB") {
        Ok(lib) => println!("cargo:rustc-link-arg-tests=-Wl,-rpath,{lib}"),
        Err(_) => println!("cargo:warning=torch-sys did not say where libtorch is; tests linking the worker need LD_LIBRARY_PATH"),
    }
}
