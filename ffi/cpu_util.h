// Helpers the CPU handlers share: bf16 conversions, loading and storing activations as f32, the finiteness
// check of the integer paths, and running work on jaxllm's own threads (Workers) or XLA's intra-op pool.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>

#ifdef __AVX__
#include <immintrin.h>
#endif
#ifdef __linux__
#include <sched.h>
#endif

#include "xla/ffi/api/ffi.h"

namespace jaxllm {
namespace ffi = xla::ffi;

inline float Bf16ToF32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t F32ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7FC0;
  u += 0x7FFF + ((u >> 16) & 1);  // round to nearest even
  return uint16_t(u >> 16);
}

// Loads n values of x (f32 or bf16) as f32 into dst.
inline void LoadF32(const void* src, ffi::DataType t, int64_t offset, int64_t n, float* dst) {
  if (t == ffi::F32) {
    std::memcpy(dst, static_cast<const float*>(src) + offset, n * sizeof(float));
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToF32(s[i]);
  }
}

inline void StoreF32(void* dst, ffi::DataType t, int64_t offset, float v) {
  if (t == ffi::F32) static_cast<float*>(dst)[offset] = v;
  else static_cast<uint16_t*>(dst)[offset] = F32ToBf16(v);
}

// Whether every one of x[0, n) is finite (the integer paths need it; NaN and inf take the f32 paths).
#ifdef __AVX__
inline float HSum(__m256 v) {   // the sum of the 8 lanes
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
#endif

inline bool AllFinite(const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    if (!std::isfinite(x[i])) return false;
  return true;
}

// Threads of jaxllm's own that spin between calls: the handlers of one decode step come every 10-100 us, and
// XLA's intra-op pool wakes its sleeping workers through the kernel, which on the 2-core VM took longer
// than a layer's matmul (a second thread added nothing below ~1M weights; docs/results/2026-12-02-cpu-lowbit.md).
// A worker spins (pause) for kSpinUs after the last job, then sleeps on a condition variable.
//   JAXLLM_CPU_THREADS=T   threads a job runs on, the caller included (default: the CPUs this process may
//                          use); 1 runs everything on the caller.
//   JAXLLM_CPU_WORKERS=0   XLA's intra-op pool instead (no threads of jaxllm's own, none spinning; the same
//                          results). Both are user-facing (docs/usage.md), read in every build.
//
// One job at a time: its state is (generation << 32 | next chunk) in one atomic, so a worker that wakes late
// claims a chunk only of the job it read (its compare-and-swap fails once a newer job is published, and a job
// is complete, and its caller gone, only once every chunk it claimed is done). A caller that finds another
// job running (XLA running two handlers at once) does its own on its own thread.
class Workers {
 public:
  static constexpr int64_t kSpinUs = 200;

  // The process's workers (made on first use), or nullptr where jobs run without them.
  static Workers* Get() {
    static Workers* w = Make();
    return w;
  }

  // fn(i) for i in [0, n) on the caller and the workers; returns when all are done.
  template <typename Fn>
  void Run(int64_t n, Fn& fn) {
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (!busy.owns_lock() || n >= (int64_t(1) << 32)) {
      for (int64_t i = 0; i < n; ++i) fn(i);
      return;
    }
    fn_.store(&Trampoline<Fn>, std::memory_order_relaxed);
    ctx_.store(&fn, std::memory_order_relaxed);
    n_.store(n, std::memory_order_relaxed);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (state_.load(std::memory_order_relaxed) >> 32) + 1;
    state_.store(gen << 32, std::memory_order_seq_cst);   // published: fn_, ctx_, n_ and done_ before it
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> lock(sleep_mu_);
      sleep_cv_.notify_all();
    }
    Work(gen);
    while (done_.load(std::memory_order_acquire) < n) Pause();
  }

 private:
  using Call = void (*)(void*, int64_t);
  template <typename Fn>
  static void Trampoline(void* ctx, int64_t i) { (*static_cast<Fn*>(ctx))(i); }

  static void Pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
  }

  static int64_t EnvInt(const char* name, int64_t fallback) {
    const char* v = std::getenv(name);
    return v && *v ? std::strtoll(v, nullptr, 10) : fallback;
  }

  static Workers* Make() {
    if (EnvInt("JAXLLM_CPU_WORKERS", 1) == 0) return nullptr;
    int64_t threads = EnvInt("JAXLLM_CPU_THREADS", 0);
    if (threads <= 0) {
#ifdef __linux__
      cpu_set_t set;
      threads = sched_getaffinity(0, sizeof(set), &set) == 0 ? CPU_COUNT(&set) : 1;
#else
      threads = std::max<int64_t>(1, std::thread::hardware_concurrency());
#endif
    }
    auto* w = new Workers();   // never deleted: its threads live as long as the process
    for (int64_t t = 1; t < threads; ++t) std::thread([w] { w->Loop(); }).detach();
    return w;
  }

  // Claims and runs chunks of job `gen` until none is left (or a newer job replaced it).
  void Work(uint64_t gen) {
    uint64_t s = state_.load(std::memory_order_acquire);
    const Call fn = fn_.load(std::memory_order_relaxed);
    void* ctx = ctx_.load(std::memory_order_relaxed);
    const int64_t n = n_.load(std::memory_order_relaxed);
    while ((s >> 32) == gen && int64_t(s & 0xffffffffu) < n) {
      if (!state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel)) continue;
      fn(ctx, int64_t(s & 0xffffffffu));
      done_.fetch_add(1, std::memory_order_release);
      s = state_.load(std::memory_order_acquire);
    }
  }

  void Loop() {
    uint64_t seen = state_.load(std::memory_order_acquire) >> 32;
    for (;;) {
      auto t0 = std::chrono::steady_clock::now();
      uint64_t gen;
      for (int spins = 0; (gen = state_.load(std::memory_order_acquire) >> 32) == seen; ++spins) {
        Pause();
        if ((spins & 255) == 255 &&
            std::chrono::steady_clock::now() - t0 > std::chrono::microseconds(kSpinUs)) {
          std::unique_lock<std::mutex> lock(sleep_mu_);
          sleepers_.fetch_add(1, std::memory_order_seq_cst);
          sleep_cv_.wait(lock, [&] { return (state_.load(std::memory_order_seq_cst) >> 32) != seen; });
          sleepers_.fetch_sub(1, std::memory_order_relaxed);
          t0 = std::chrono::steady_clock::now();
        }
      }
      seen = gen;
      Work(gen);
    }
  }

  std::atomic<uint64_t> state_{0};
  std::atomic<Call> fn_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<int64_t> n_{0}, done_{0};
  std::atomic<int> sleepers_{0};
  std::mutex run_mu_, sleep_mu_;
  std::condition_variable sleep_cv_;
};

// Runs fn(chunk) for chunk in [0, n) on the calling thread and jaxllm's workers (or XLA's pool, see
// Workers); returns when all are done.
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, Fn fn) {
  if (n <= 1) {
    if (n == 1) fn(0);
    return;
  }
  if (Workers* w = Workers::Get()) {
    w->Run(n, fn);
    return;
  }
  // XLA's pool: workers claim chunks from a shared counter, so a task the pool starts late finds nothing
  // left to do.
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto st = std::make_shared<State>();
  auto work = [st, n, fn]() {
    for (int64_t i; (i = st->next.fetch_add(1)) < n;) {
      fn(i);
      if (st->done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(st->mu);
        st->cv.notify_all();
      }
    }
  };
  int64_t helpers = std::min<int64_t>(pool.num_threads(), n - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work(); });
  work();
  std::unique_lock<std::mutex> lock(st->mu);
  st->cv.wait(lock, [&] { return st->done.load() == n; });
}

constexpr int64_t kRowsPerChunk = 64;   // weight rows a pool task takes

// Runs fn(n0, n1) on the calling thread and the pool for the weight rows [n0, n1) of each chunk.
template <typename Fn>
void ForRowChunks(ffi::ThreadPool& pool, int64_t rows, Fn fn) {
  ParallelFor(pool, (rows + kRowsPerChunk - 1) / kRowsPerChunk,
              [&](int64_t c) { fn(c * kRowsPerChunk, std::min(rows, (c + 1) * kRowsPerChunk)); });
}

}  // namespace jaxllm
