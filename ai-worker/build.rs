//! Link-time fixes for libtorch from the PyPI wheel, the CUDA caching-allocator shim, and the
//! gRPC front door's code.
//!
//! 0. `proto/inference.proto` (the Open Inference Protocol's gRPC service) becomes Rust with
//!    `protox` (a protobuf compiler in Rust: no `protoc` to install) and `tonic-prost-build`.
//! 1. The linker drops `libtorch_cuda.so` under `--as-needed` because nothing references its
//!    symbols directly (CUDA kernels register themselves from static initialisers); without it
//!    `tch::Cuda::is_available()` is silently false. We force it in when the wheel has it.
//! 2. An rpath to the wheel's `torch/lib` lets the binary run without `LD_LIBRARY_PATH`.
//! 3. `csrc/cuda_memory.cpp` gives `src/cuda_memory.rs` the CUDA caching allocator, which tch does
//!    not expose. It is compiled, linked against `libc10_cuda.so` and announced with
//!    `cfg(vramgate_cuda_shim)` only when the torch headers, the CUDA runtime headers and that
//!    library are all there; otherwise one `cargo:warning` says why and the build goes on (the
//!    Rust wrapper then returns errors). `VRAMGATE_NO_CUDA_SHIM=1` turns it off;
//!    `VRAMGATE_CUDA_INCLUDE` (a `:`-separated list of dirs) names the CUDA headers instead of the
//!    search: the venv's `nvidia/cu*/include` and `nvidia/cuda_runtime/include`, then
//!    `/usr/local/cuda/include`.

use std::path::{Path, PathBuf};
use std::process::Command;

const SHIM_SOURCE: &str = "csrc/cuda_memory.cpp";

/// What a host-side (non-nvcc) compile of the `c10/cuda` headers needs from CUDA:
/// `cuda_runtime_api.h` and the `crt/` headers it and `cuda_runtime.h` include. The PyPI runtime
/// wheel for CUDA 13 (`nvidia-cuda-runtime`) ships the former but not `crt/`, which comes in
/// `nvidia-cuda-crt`, so all three are checked rather than letting the compile fail.
const CUDA_HEADERS: [&str; 3] = [
    "cuda_runtime_api.h",
    "crt/host_defines.h",
    "crt/host_config.h",
];

struct Torch {
    lib: PathBuf,
    include: PathBuf,
    /// The directory holding the `torch` package, where the wheel's `nvidia/*` packages live
    /// too; only meaningful for a wheel, harmless otherwise.
    site_packages: Option<PathBuf>,
    /// `_GLIBCXX_USE_CXX11_ABI` libtorch was built with, "0" or "1".
    cxx11_abi: String,
}

const PROTO: &str = "proto/inference.proto";

fn main() {
    println!("cargo:rerun-if-changed={PROTO}");
    let descriptors = protox::compile([PROTO], ["proto"]).unwrap_or_else(|e| panic!("compiling {PROTO}: {e}"));
    tonic_prost_build::configure()
        .build_client(false)
        // Raw tensor contents as `Bytes`: slices of the received message, not copies.
        .bytes(".inference")
        .compile_fds(descriptors)
        .unwrap_or_else(|e| panic!("generating the gRPC code of {PROTO}: {e}"));
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_USE_PYTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_CXX11_ABI");
    println!("cargo:rerun-if-env-changed=PYTHON_SYS_EXECUTABLE");
    println!("cargo:rerun-if-env-changed=VRAMGATE_CUDA_INCLUDE");
    println!("cargo:rerun-if-env-changed=VRAMGATE_NO_CUDA_SHIM");
    println!("cargo:rerun-if-changed={SHIM_SOURCE}");
    println!("cargo::rustc-check-cfg=cfg(vramgate_cuda_shim)");

    let Some(torch) = locate_torch() else {
        println!(
            "cargo:warning=could not locate libtorch; binaries need LD_LIBRARY_PATH, and the CUDA \
             allocator shim was not built"
        );
        return;
    };
    let lib_dir = &torch.lib;
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
    if lib_dir.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-search=native={}", lib_dir.display());
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
    }

    if shim_disabled() {
        return;
    }
    if let Err(why) = build_cuda_shim(&torch) {
        println!(
            "cargo:warning=CUDA allocator shim not built ({why}); \
             vramgate_worker::cuda_memory will return errors"
        );
    }
}

/// `VRAMGATE_NO_CUDA_SHIM` set to anything but "" or "0".
fn shim_disabled() -> bool {
    std::env::var_os("VRAMGATE_NO_CUDA_SHIM").is_some_and(|v| !v.is_empty() && v != "0")
}

/// libtorch as torch-sys sees it: `$LIBTORCH`, else the torch package of the python on PATH (or
/// `$PYTHON_SYS_EXECUTABLE`), whose ABI flag python reports.
fn locate_torch() -> Option<Torch> {
    if let Ok(libtorch) = std::env::var("LIBTORCH") {
        let root = PathBuf::from(libtorch);
        return Some(Torch {
            lib: root.join("lib"),
            include: root.join("include"),
            site_packages: root.parent().map(Path::to_path_buf),
            // torch-sys's own default for a LIBTORCH install.
            cxx11_abi: std::env::var("LIBTORCH_CXX11_ABI").unwrap_or_else(|_| "1".into()),
        });
    }
    let python = std::env::var("PYTHON_SYS_EXECUTABLE").unwrap_or_else(|_| "python3".into());
    let out = Command::new(python)
        .args([
            "-c",
            "import os, torch\n\
             print('VRAMGATE_TORCH_DIR=' + os.path.dirname(torch.__file__))\n\
             print('VRAMGATE_TORCH_ABI=' + str(int(torch._C._GLIBCXX_USE_CXX11_ABI)))",
        ])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let stdout = String::from_utf8(out.stdout).ok()?;
    let field = |key: &str| {
        stdout
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .map(str::trim)
    };
    let torch_dir = PathBuf::from(field("VRAMGATE_TORCH_DIR=")?);
    let lib = torch_dir.join("lib");
    if !lib.is_dir() {
        return None;
    }
    Some(Torch {
        lib,
        include: torch_dir.join("include"),
        site_packages: torch_dir.parent().map(Path::to_path_buf),
        cxx11_abi: field("VRAMGATE_TORCH_ABI=").unwrap_or("1").to_owned(),
    })
}

/// Compiles and links the shim and sets `cfg(vramgate_cuda_shim)`, or says why it could not.
fn build_cuda_shim(torch: &Torch) -> Result<(), String> {
    let c10_cuda = torch.lib.join("libc10_cuda.so");
    if !c10_cuda.is_file() {
        return Err(format!(
            "{} not found: CPU-only libtorch",
            c10_cuda.display()
        ));
    }
    // A new libtorch in the same place needs the shim rebuilt against its headers.
    println!("cargo:rerun-if-changed={}", c10_cuda.display());
    let allocator_header = torch.include.join("c10/cuda/CUDACachingAllocator.h");
    if !allocator_header.is_file() {
        return Err(format!(
            "torch headers not found: no {}",
            allocator_header.display()
        ));
    }
    let cuda_include = cuda_include_dirs(torch)?;

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .pic(true)
        .warnings(false)
        .extra_warnings(false)
        .define("_GLIBCXX_USE_CXX11_ABI", torch.cxx11_abi.as_str())
        .define("GLOG_USE_GLOG_EXPORT", None)
        .file(SHIM_SOURCE);
    // The torch and CUDA headers are not ours to keep warning-free: -isystem, and warnings off.
    let torch_include = [
        torch.include.clone(),
        torch.include.join("torch/csrc/api/include"),
    ];
    for dir in torch_include.iter().chain(&cuda_include) {
        build.flag("-isystem").flag(dir);
    }
    build
        .try_compile("vramgate_cuda_memory")
        .map_err(|e| format!("compiling {SHIM_SOURCE} failed: {e}"))?;

    // After cc's `static=vramgate_cuda_memory`, so that under --as-needed the shim's references
    // are what keeps these two.
    println!("cargo:rustc-link-search=native={}", torch.lib.display());
    println!("cargo:rustc-link-lib=dylib=c10_cuda");
    println!("cargo:rustc-link-lib=dylib=c10");
    println!("cargo:rustc-cfg=vramgate_cuda_shim");
    Ok(())
}

/// The include dir(s) that hold every header in [`CUDA_HEADERS`].
fn cuda_include_dirs(torch: &Torch) -> Result<Vec<PathBuf>, String> {
    if let Some(list) = std::env::var_os("VRAMGATE_CUDA_INCLUDE").filter(|v| !v.is_empty()) {
        let dirs: Vec<PathBuf> = std::env::split_paths(&list).collect();
        dirs.iter().for_each(|dir| watch(dir));
        return match missing_header(&dirs) {
            None => Ok(dirs),
            Some(header) => Err(format!(
                "VRAMGATE_CUDA_INCLUDE={} has no {header}",
                list.to_string_lossy()
            )),
        };
    }

    let mut candidates = Vec::new();
    if let Some(nvidia) = torch.site_packages.as_ref().map(|sp| sp.join("nvidia")) {
        // CUDA 13 wheels share one `nvidia/cu13/include`; CUDA 12 ones had per-package dirs.
        let mut versioned: Vec<(u32, PathBuf)> = std::fs::read_dir(&nvidia)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|entry| {
                let name = entry.file_name();
                let major = name.to_str()?.strip_prefix("cu")?.parse::<u32>().ok()?;
                Some((major, entry.path().join("include")))
            })
            .collect();
        versioned.sort_by_key(|(major, _)| std::cmp::Reverse(*major));
        candidates.extend(versioned.into_iter().map(|(_, dir)| dir));
        candidates.push(nvidia.join("cuda_runtime/include"));
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    // So that installing the missing headers (say, `nvidia-cuda-crt`) rebuilds with the shim.
    candidates.iter().for_each(|dir| watch(dir));

    if let Some(dir) = candidates
        .iter()
        .find(|dir| missing_header(std::slice::from_ref(*dir)).is_none())
    {
        return Ok(vec![dir.clone()]);
    }
    let searched = candidates
        .iter()
        .map(|d| d.display().to_string())
        .collect::<Vec<_>>()
        .join(", ");
    let partial = candidates
        .iter()
        .find(|dir| dir.join(CUDA_HEADERS[0]).is_file());
    Err(match partial {
        Some(dir) => format!(
            "{} has {} but no {}: install the `nvidia-cuda-crt` wheel matching the CUDA \
             runtime, or set VRAMGATE_CUDA_INCLUDE",
            dir.display(),
            CUDA_HEADERS[0],
            missing_header(std::slice::from_ref(dir)).unwrap_or("crt/"),
        ),
        None => format!(
            "no {} in {searched}; set VRAMGATE_CUDA_INCLUDE",
            CUDA_HEADERS[0]
        ),
    })
}

/// Reruns the build script when anything under `dir` changes. Only for an existing dir: cargo
/// would rerun on every build for a missing one.
fn watch(dir: &Path) {
    if dir.is_dir() {
        println!("cargo:rerun-if-changed={}", dir.display());
    }
}

/// The first of [`CUDA_HEADERS`] that none of `dirs` holds.
fn missing_header(dirs: &[PathBuf]) -> Option<&'static str> {
    CUDA_HEADERS
        .into_iter()
        .find(|header| !dirs.iter().any(|dir| dir.join(header).is_file()))
}
