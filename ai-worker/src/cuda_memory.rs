//! libtorch's CUDA caching allocator, which `tch` does not expose.
//!
//! Every CUDA tensor libtorch creates is carved out of blocks that its caching allocator
//! (`c10::cuda::CUDACachingAllocator`) obtained with `cudaMalloc` and keeps after the tensor is
//! dropped, for reuse. So what the driver (or NVML) reports as used is the allocator's
//! *reserved* bytes, while the tensors alive right now hold only its *allocated* bytes; the
//! peaks of both, the per-process cap (`setMemoryFraction`) and handing cached blocks back
//! (`emptyCache`) live only in that allocator, behind C++ API that tch 0.24 does not bind. A
//! small C++ shim, `csrc/cuda_memory.cpp`, wraps the four calls the worker needs in `extern "C"`
//! functions that catch every C++ exception, and this module wraps those.
//!
//! `build.rs` compiles the shim only when it finds the torch headers, the CUDA runtime headers
//! (`cuda_runtime_api.h` and `crt/`) and `libc10_cuda.so`; it then sets `cfg(vramgate_cuda_shim)`
//! and [`BUILT`] is true. Otherwise (a CPU-only libtorch, missing headers, or
//! `VRAMGATE_NO_CUDA_SHIM=1`) every function here returns an error saying so.
//!
//! Call these only when the worker's device is CUDA. They act on process-wide state; on a
//! CPU-only process the allocator has nothing to report, and anything that made it do work would
//! try to initialise CUDA.
//!
//! libtorch sets the allocator up lazily, on the first CUDA tensor (loading a model onto the GPU
//! does it). Before that, [`stats`] reports zeros and [`reset_peak`] and [`empty_cache`] do
//! nothing, as PyTorch's own `torch.cuda.memory_*` functions do, but [`set_memory_fraction`]
//! fails ("... did you call init?"), so apply a cap after the models are on the device.

/// The caching allocator's counters for one device, all pools together, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AllocatorStats {
    /// Held by live tensors.
    pub allocated: u64,
    /// Obtained from the driver: `allocated` plus cached, unused blocks.
    pub reserved: u64,
    /// Highest `allocated` since start-up or the last [`reset_peak`].
    pub peak_allocated: u64,
    /// Highest `reserved` since start-up or the last [`reset_peak`].
    pub peak_reserved: u64,
}

/// Whether the C++ shim was compiled in; when false every function returns an error.
pub const BUILT: bool = cfg!(vramgate_cuda_shim);

/// The allocator's current and peak bytes on CUDA device `device`. Zeros before libtorch has
/// set the allocator up (no CUDA tensor yet).
pub fn stats(device: i32) -> Result<AllocatorStats, String> {
    imp::stats(device)
}

/// Resets both peaks of `device` to the current values, so that the next [`stats`] reports the
/// peak since now.
pub fn reset_peak(device: i32) -> Result<(), String> {
    imp::reset_peak(device)
}

/// Returns every cached, unused block, on all devices, to the driver (`torch.cuda.empty_cache`).
/// Memory held by live tensors is untouched. May wait for streams that still use freed blocks.
pub fn empty_cache() -> Result<(), String> {
    imp::empty_cache()
}

/// Caps what the allocator may reserve on `device` at `fraction` (in `[0, 1]`) of the device's
/// total memory; an allocation that would exceed it fails as a CUDA out-of-memory error, after
/// the allocator has freed its cache trying. Fails for a fraction outside `[0, 1]` and before
/// libtorch has set the allocator up (see the module docs).
pub fn set_memory_fraction(fraction: f64, device: i32) -> Result<(), String> {
    imp::set_memory_fraction(fraction, device)
}

/// Makes the calling thread's current CUDA stream on `device` one of libtorch's pool streams
/// for the rest of the thread's life (the current stream is thread-local): each batch thread
/// queues its copies and kernels on its own stream, so instances overlap on the card.
pub fn use_pool_stream(device: i32) -> Result<(), String> {
    imp::use_pool_stream(device)
}

/// Waits until everything the calling thread queued on its current stream of `device` is done.
pub fn sync_current_stream(device: i32) -> Result<(), String> {
    imp::sync_current_stream(device)
}

/// `c10::InferenceMode` on the calling thread while it lives: libtorch keeps no autograd
/// state at all (cheaper than `no_grad`, which still counts versions and tracks views). Not
/// `Send`: it must end on the thread that entered it. The shim is in the same C++ file as the
/// allocator's calls, so a build without it has no guard ([`InferenceMode::enter`] is `None`)
/// and callers fall back to `no_grad`.
pub struct InferenceMode {
    #[cfg_attr(not(vramgate_cuda_shim), allow(dead_code))]
    guard: *mut std::ffi::c_void,
}

impl InferenceMode {
    /// Enters inference mode on this thread, or `None` where the shim is not built (or the
    /// guard could not be made).
    pub fn enter() -> Option<InferenceMode> {
        imp::inference_mode_enter().map(|guard| InferenceMode { guard })
    }
}

impl Drop for InferenceMode {
    fn drop(&mut self) {
        imp::inference_mode_exit(self.guard);
    }
}

#[cfg(vramgate_cuda_shim)]
mod imp {
    use std::ffi::{c_char, c_int, CStr};

    use super::AllocatorStats;

    // Defined in csrc/cuda_memory.cpp, linked in by build.rs. Each returns 0 on success, or
    // non-zero after writing a NUL-terminated message of at most `err_len` bytes into `err`; none
    // lets a C++ exception out.
    unsafe extern "C" {
        fn vg_cuda_memory_stats(
            device: c_int,
            allocated: *mut u64,
            reserved: *mut u64,
            peak_allocated: *mut u64,
            peak_reserved: *mut u64,
            err: *mut c_char,
            err_len: usize,
        ) -> c_int;
        fn vg_cuda_reset_peak(device: c_int, err: *mut c_char, err_len: usize) -> c_int;
        fn vg_cuda_empty_cache(err: *mut c_char, err_len: usize) -> c_int;
        fn vg_cuda_set_memory_fraction(
            fraction: f64,
            device: c_int,
            err: *mut c_char,
            err_len: usize,
        ) -> c_int;
        fn vg_cuda_use_pool_stream(device: c_int, err: *mut c_char, err_len: usize) -> c_int;
        fn vg_cuda_sync_current_stream(device: c_int, err: *mut c_char, err_len: usize) -> c_int;
        fn vg_inference_mode_enter() -> *mut std::ffi::c_void;
        fn vg_inference_mode_exit(guard: *mut std::ffi::c_void);
    }

    const ERR_LEN: usize = 512;

    /// Runs one shim call with a fresh error buffer: `Ok` when it returns 0, else its message.
    fn call(f: impl FnOnce(*mut c_char, usize) -> c_int) -> Result<(), String> {
        let mut buf = [0u8; ERR_LEN];
        let rc = f(buf.as_mut_ptr().cast::<c_char>(), buf.len());
        if rc == 0 {
            return Ok(());
        }
        let message = CStr::from_bytes_until_nul(&buf)
            .map(|m| m.to_string_lossy().into_owned())
            .unwrap_or_default();
        Err(if message.is_empty() {
            format!("CUDA caching allocator call failed (code {rc})")
        } else {
            message
        })
    }

    pub(super) fn stats(device: i32) -> Result<AllocatorStats, String> {
        let mut s = AllocatorStats::default();
        call(|err, err_len| {
            // SAFETY: the four out-pointers are to distinct fields of `s`, alive and exclusively
            // borrowed for the call; `err` points to `err_len` writable bytes. The shim writes
            // only through these, only during the call, and never unwinds.
            unsafe {
                vg_cuda_memory_stats(
                    device,
                    &mut s.allocated,
                    &mut s.reserved,
                    &mut s.peak_allocated,
                    &mut s.peak_reserved,
                    err,
                    err_len,
                )
            }
        })?;
        Ok(s)
    }

    pub(super) fn reset_peak(device: i32) -> Result<(), String> {
        // SAFETY: `err` points to `err_len` writable bytes for the call; the shim never unwinds.
        call(|err, err_len| unsafe { vg_cuda_reset_peak(device, err, err_len) })
    }

    pub(super) fn empty_cache() -> Result<(), String> {
        // SAFETY: `err` points to `err_len` writable bytes for the call; the shim never unwinds.
        call(|err, err_len| unsafe { vg_cuda_empty_cache(err, err_len) })
    }

    pub(super) fn set_memory_fraction(fraction: f64, device: i32) -> Result<(), String> {
        // SAFETY: `err` points to `err_len` writable bytes for the call; the shim never unwinds.
        call(|err, err_len| unsafe { vg_cuda_set_memory_fraction(fraction, device, err, err_len) })
    }

    pub(super) fn use_pool_stream(device: i32) -> Result<(), String> {
        // SAFETY: `err` points to `err_len` writable bytes for the call; the shim never unwinds.
        call(|err, err_len| unsafe { vg_cuda_use_pool_stream(device, err, err_len) })
    }

    pub(super) fn sync_current_stream(device: i32) -> Result<(), String> {
        // SAFETY: `err` points to `err_len` writable bytes for the call; the shim never unwinds.
        call(|err, err_len| unsafe { vg_cuda_sync_current_stream(device, err, err_len) })
    }

    pub(super) fn inference_mode_enter() -> Option<*mut std::ffi::c_void> {
        // SAFETY: takes nothing; returns a guard owned by the caller, or null. Never unwinds.
        let guard = unsafe { vg_inference_mode_enter() };
        (!guard.is_null()).then_some(guard)
    }

    pub(super) fn inference_mode_exit(guard: *mut std::ffi::c_void) {
        // SAFETY: `guard` came from `inference_mode_enter` on this thread (`InferenceMode` is
        // neither Send nor Sync) and is ended once, by its Drop.
        unsafe { vg_inference_mode_exit(guard) }
    }
}

#[cfg(not(vramgate_cuda_shim))]
mod imp {
    use super::AllocatorStats;

    pub(super) const NOT_BUILT: &str =
        "ai-worker was built without the CUDA allocator shim (no CUDA headers at build time)";

    pub(super) fn stats(_device: i32) -> Result<AllocatorStats, String> {
        Err(NOT_BUILT.into())
    }

    pub(super) fn reset_peak(_device: i32) -> Result<(), String> {
        Err(NOT_BUILT.into())
    }

    pub(super) fn empty_cache() -> Result<(), String> {
        Err(NOT_BUILT.into())
    }

    pub(super) fn set_memory_fraction(_fraction: f64, _device: i32) -> Result<(), String> {
        Err(NOT_BUILT.into())
    }

    pub(super) fn use_pool_stream(_device: i32) -> Result<(), String> {
        Err(NOT_BUILT.into())
    }

    pub(super) fn sync_current_stream(_device: i32) -> Result<(), String> {
        Err(NOT_BUILT.into())
    }

    pub(super) fn inference_mode_enter() -> Option<*mut std::ffi::c_void> {
        None
    }

    pub(super) fn inference_mode_exit(_guard: *mut std::ffi::c_void) {}
}

#[cfg(test)]
mod tests {
    use super::*;

    // Safe without a GPU on either build: libtorch checks that the allocator has the device
    // (it has none before CUDA is initialised) and then the fraction, before touching CUDA.
    #[test]
    fn an_invalid_fraction_is_an_error() {
        let result = set_memory_fraction(2.0, 0);
        assert!(result.is_err(), "{result:?}");
        if let Err(message) = result {
            assert!(!message.is_empty());
        }
    }

    // The shim rejects a negative index itself, before reaching libtorch.
    #[test]
    fn a_negative_device_is_an_error() {
        let result = stats(-1);
        assert!(result.is_err(), "{result:?}");
        if BUILT {
            if let Err(message) = result {
                assert!(message.contains("out of range"), "{message}");
            }
        }
    }

    #[cfg(not(vramgate_cuda_shim))]
    #[test]
    fn without_the_shim_every_call_says_why() {
        const { assert!(!BUILT) };
        fn not_built<T>() -> Result<T, String> {
            Err(imp::NOT_BUILT.to_owned())
        }
        assert_eq!(stats(0), not_built());
        assert_eq!(reset_peak(0), not_built());
        assert_eq!(empty_cache(), not_built());
        assert_eq!(set_memory_fraction(0.5, 0), not_built());
        assert_eq!(use_pool_stream(0), not_built());
        assert!(InferenceMode::enter().is_none());
    }

    // Inference mode is thread-local autograd state: on while the guard lives, off after, and
    // a tensor made under it is an inference tensor (libtorch's own marker).
    #[cfg(vramgate_cuda_shim)]
    #[test]
    fn inference_mode_holds_while_its_guard_lives() {
        let plain = tch::Tensor::from_slice(&[1.0f32, 2.0]);
        assert!(!plain.is_inference());
        {
            let _guard = InferenceMode::enter().expect("the shim makes a guard");
            let made = tch::Tensor::from_slice(&[1.0f32, 2.0]) * 2.0;
            assert!(made.is_inference());
        }
        let after = tch::Tensor::from_slice(&[1.0f32]) * 2.0;
        assert!(!after.is_inference());
    }
}
