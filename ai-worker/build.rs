//! Link-time fixes for libtorch from the PyPI wheel.
//!
//! 1. The linker drops `libtorch_cuda.so` under `--as-needed` because nothing references its
//!    symbols directly (CUDA kernels register themselves from static initialisers); without it
//!    `tch::Cuda::is_available()` is silently false. We force it in when the wheel has it.
//! 2. An rpath to the wheel's `torch/lib` lets the binary run without `LD_LIBRARY_PATH`.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=LIBTORCH");
    println!("cargo:rerun-if-env-changed=LIBTORCH_USE_PYTORCH");
    let Some(lib_dir) = torch_lib_dir() else {
        println!("cargo:warning=could not locate libtorch; binaries need LD_LIBRARY_PATH");
        return;
    };
    println!("cargo:rustc-link-arg=-Wl,-rpath,{}", lib_dir.display());
    if lib_dir.join("libtorch_cuda.so").exists() {
        println!("cargo:rustc-link-search=native={}", lib_dir.display());
        println!("cargo:rustc-link-arg=-Wl,--no-as-needed,-ltorch_cuda,--as-needed");
    }
}

fn torch_lib_dir() -> Option<PathBuf> {
    if let Ok(libtorch) = std::env::var("LIBTORCH") {
        return Some(PathBuf::from(libtorch).join("lib"));
    }
    let python = std::env::var("PYTHON_SYS_EXECUTABLE").unwrap_or_else(|_| "python3".into());
    let out = Command::new(python)
        .args(["-c", "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), 'lib'))"])
        .output()
        .ok()?;
    if !out.status.success() {
        return None;
    }
    let dir = PathBuf::from(String::from_utf8(out.stdout).ok()?.trim());
    dir.is_dir().then_some(dir)
}
