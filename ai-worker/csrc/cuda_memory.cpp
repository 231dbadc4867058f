// C ABI over libtorch's CUDA caching allocator (c10::cuda::CUDACachingAllocator).
//
// tch exposes no part of the caching allocator, yet the worker needs its numbers (bytes held by
// live tensors vs. bytes cudaMalloc'd and cached) and its knobs (per-process memory fraction,
// returning cached blocks to the driver). This file is compiled by ai-worker/build.rs only when
// the torch and CUDA headers and libc10_cuda.so are present; src/cuda_memory.rs is the Rust side.
//
// Every function returns 0 on success. On failure it returns non-zero and, when `err` is non-null
// and `err_len` > 0, writes a NUL-terminated (possibly truncated) message into `err`. No C++
// exception ever crosses the C boundary.

#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/InferenceMode.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/Exception.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>

namespace {

namespace alloc = c10::cuda::CUDACachingAllocator;

constexpr int kOk = 0;
constexpr int kFailed = 1;

// Copies "<op>: <message>" into `err`, truncated to fit and always NUL-terminated. Control
// characters are replaced: libtorch streams c10::DeviceIndex (an int8_t) into some messages as a
// raw char, so "device 0" can arrive as "device \0", which would otherwise cut the text short.
void write_error(char* err, size_t err_len, const char* op, const char* message, size_t message_len)
    noexcept {
  if (err == nullptr || err_len == 0) {
    return;
  }
  size_t n = 0;
  const auto put = [&](const char* text, size_t len) {
    for (size_t i = 0; i < len && n + 1 < err_len; ++i) {
      const unsigned char c = static_cast<unsigned char>(text[i]);
      err[n++] = (c < 0x20 && c != '\n' && c != '\t') || c == 0x7f ? '?' : static_cast<char>(c);
    }
  };
  if (op != nullptr) {
    put(op, std::strlen(op));
    put(": ", 2);
  }
  if (message != nullptr) {
    put(message, message_len);
  }
  err[n] = '\0';
}

// Runs `body`; any exception becomes kFailed plus "<op>: <message>" in `err`.
template <typename F>
int guarded(char* err, size_t err_len, const char* op, F&& body) noexcept {
  try {
    body();
    return kOk;
  } catch (const c10::Error& e) {
    // msg() is the message without the C++ backtrace that what() appends, and, unlike
    // what_without_backtrace(), keeps any embedded NUL (see write_error).
    write_error(err, err_len, op, e.msg().data(), e.msg().size());
  } catch (const std::exception& e) {
    const char* what = e.what();
    write_error(err, err_len, op, what, what == nullptr ? 0 : std::strlen(what));
  } catch (...) {
    static constexpr char kUnknown[] = "unknown C++ exception from the CUDA caching allocator";
    write_error(err, err_len, op, kUnknown, sizeof(kUnknown) - 1);
  }
  return kFailed;
}

c10::DeviceIndex to_device_index(int device) {
  TORCH_CHECK(
      device >= 0 && device <= std::numeric_limits<c10::DeviceIndex>::max(),
      "CUDA device index out of range [0, ",
      static_cast<int>(std::numeric_limits<c10::DeviceIndex>::max()),
      "]");
  return static_cast<c10::DeviceIndex>(device);
}

// The allocator pointer is set by a static initialiser in libc10_cuda.so, so it is non-null
// whenever that library is loaded; checked anyway rather than trusted.
alloc::CUDAAllocator* caching_allocator() {
  alloc::CUDAAllocator* a = alloc::get();
  TORCH_CHECK(a != nullptr, "the CUDA caching allocator is not set up (libc10_cuda not initialised)");
  return a;
}

uint64_t non_negative(int64_t v) {
  return v < 0 ? 0 : static_cast<uint64_t>(v);
}

} // namespace

extern "C" {

// Current and peak bytes of the AGGREGATE pool (small + large) on `device`:
// allocated = held by live tensors, reserved = obtained from cudaMalloc (allocated + cached).
// Before libtorch has initialised the allocator (no CUDA tensor created yet in this process)
// nothing can have been allocated through it, so all four are 0, as torch.cuda.memory_stats does.
int vg_cuda_memory_stats(
    int device,
    uint64_t* allocated,
    uint64_t* reserved,
    uint64_t* peak_allocated,
    uint64_t* peak_reserved,
    char* err,
    size_t err_len) {
  char op[64];
  std::snprintf(op, sizeof op, "memory stats of cuda:%d", device);
  return guarded(err, err_len, op, [&] {
    TORCH_CHECK(
        allocated != nullptr && reserved != nullptr && peak_allocated != nullptr &&
            peak_reserved != nullptr,
        "vg_cuda_memory_stats: null output pointer");
    const c10::DeviceIndex index = to_device_index(device);
    alloc::CUDAAllocator* a = caching_allocator();
    if (!a->initialized()) {
      *allocated = *reserved = *peak_allocated = *peak_reserved = 0;
      return;
    }
    const c10::CachingDeviceAllocator::DeviceStats stats = a->getDeviceStats(index);
    constexpr auto agg = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    *allocated = non_negative(stats.allocated_bytes[agg].current);
    *reserved = non_negative(stats.reserved_bytes[agg].current);
    *peak_allocated = non_negative(stats.allocated_bytes[agg].peak);
    *peak_reserved = non_negative(stats.reserved_bytes[agg].peak);
  });
}

// Resets the peaks of `device` to the current values. A no-op before the allocator is initialised.
int vg_cuda_reset_peak(int device, char* err, size_t err_len) {
  char op[64];
  std::snprintf(op, sizeof op, "reset peak stats of cuda:%d", device);
  return guarded(err, err_len, op, [&] {
    const c10::DeviceIndex index = to_device_index(device);
    alloc::CUDAAllocator* a = caching_allocator();
    if (!a->initialized()) {
      return;
    }
    a->resetPeakStats(index);
  });
}

// Returns every unused cached block (on all devices) to the driver.
int vg_cuda_empty_cache(char* err, size_t err_len) {
  return guarded(err, err_len, "empty CUDA cache", [&] { caching_allocator()->emptyCache(); });
}

// Caps what the allocator may reserve on `device` at `fraction` of its total memory; allocations
// beyond the cap fail with a CUDA OOM error. libtorch rejects fractions outside [0, 1] (and NaN),
// and fails when the allocator is not initialised yet ("did you call init?"), which happens on the
// first CUDA tensor, not before.
int vg_cuda_set_memory_fraction(double fraction, int device, char* err, size_t err_len) {
  char op[80];
  std::snprintf(op, sizeof op, "set memory fraction %g on cuda:%d", fraction, device);
  return guarded(err, err_len, op, [&] {
    const c10::DeviceIndex index = to_device_index(device);
    caching_allocator()->setMemoryFraction(fraction, index);
  });
}

// Makes the calling thread's current stream on `device` one of libtorch's pool streams, for the
// rest of the thread's life: every kernel and copy the thread queues afterwards goes there, so
// batch threads of several model instances overlap on the card instead of queueing on the
// default stream. The current stream is thread-local in libtorch.
int vg_cuda_use_pool_stream(int device, char* err, size_t err_len) {
  char op[64];
  std::snprintf(op, sizeof op, "a pool stream on cuda:%d", device);
  return guarded(err, err_len, op, [&] {
    const c10::DeviceIndex index = to_device_index(device);
    c10::cuda::setCurrentCUDAStream(c10::cuda::getStreamFromPool(/*isHighPriority=*/false, index));
  });
}

// Waits until everything the calling thread queued on its current stream of `device` is done.
int vg_cuda_sync_current_stream(int device, char* err, size_t err_len) {
  char op[64];
  std::snprintf(op, sizeof op, "synchronise the stream on cuda:%d", device);
  return guarded(err, err_len, op, [&] {
    const c10::DeviceIndex index = to_device_index(device);
    c10::cuda::getCurrentCUDAStream(index).synchronize();
  });
}

// Enters c10::InferenceMode on the calling thread (no autograd bookkeeping at all: no version
// counters, no views tracked), returning the guard to hand back to vg_inference_mode_exit on the
// same thread; null on failure. Guards nest; each must be ended in reverse order.
void* vg_inference_mode_enter() noexcept {
  try {
    return new c10::InferenceMode(true);
  } catch (...) {
    return nullptr;
  }
}

// Ends a guard from vg_inference_mode_enter (null: nothing to do), restoring the thread's state.
void vg_inference_mode_exit(void* guard) noexcept {
  delete static_cast<c10::InferenceMode*>(guard);
}

} // extern "C"
