// The tensor-core W8A16 configurations timed on this GPU (jaxllm.tuning picks one per matmul shape and row bucket
// when a model loads; the choice reaches the matmul as its `mma` attribute).
//
// t[i] = microseconds a call of w8a16_mma.cuh's kCandidates[i] on x [M, K] bf16 and the C stacked weight copies
// w [C, N, K] int8, scale [C, N, K / 64] f32; +inf for the configurations of another row bucket than M's. The
// calls rotate over the copies (jaxllm.tuning makes them span more than the L2, so each call reads device memory,
// as a step does); a call's time is (a CUDA graph of 2n calls - one of n) / n, the median of 5 replays, so launch
// gaps and the graph's own cost cancel (graph_timing.cuh); +inf too for a configuration this GPU
// cannot launch, or whose difference is not positive (noise). It runs on a stream of its own after XLA's and
// synchronizes: not for command buffers, run once when a model loads (in jaxllm.tuning's child process).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "common.h"
#include "graph_timing.cuh"
#include "w8a16_mma.cuh"

namespace jaxllm {
namespace {

namespace mma = w8a16::mma;

struct Event {   // freed on scope exit
  cudaEvent_t a = nullptr;
  ~Event() {
    if (a) cudaEventDestroy(a);
  }
};

ffi::Error W8A16Tune(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                     ffi::Result<ffi::AnyBuffer> y, ffi::Result<ffi::Buffer<ffi::F32>> t) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions(), yd = y->dimensions();
  if (x.element_type() != ffi::BF16 || w.element_type() != ffi::S8 || scale.element_type() != ffi::F32 ||
      y->element_type() != ffi::BF16 || xd.size() != 2 || wd.size() != 3 || sd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("jaxllm_w8a16_tune: expected x [M, K] bf16, w [C, N, K] int8, scale "
                                       "[C, N, K / 64] f32 and y [M, N] bf16");
  const int64_t m = xd[0], k = xd[1], copies = wd[0], n = wd[1];
  if (m < mma::kMinM || m > mma::kMaxM || k % mma::kChunk != 0 || k < mma::kChunk || wd[2] != k || n < 1 ||
      copies < 1 || sd[0] != copies || sd[1] != n || sd[2] != k / mma::kChunk || yd[0] != m || yd[1] != n)
    return ffi::Error::InvalidArgument(
        "jaxllm_w8a16_tune: expected " + std::to_string(mma::kMinM) + "-" + std::to_string(mma::kMaxM) +
        " rows of x, K a multiple of 64 and shapes that agree; got x [" + std::to_string(m) + ", " +
        std::to_string(k) + "], w [" + std::to_string(copies) + ", " + std::to_string(n) + ", " +
        std::to_string(wd[2]) + "], scale [" + std::to_string(sd[0]) + ", " + std::to_string(sd[1]) + ", " +
        std::to_string(sd[2]) + "]");
  if (t->element_count() != size_t(mma::kCandidateCount))
    return ffi::Error::InvalidArgument("jaxllm_w8a16_tune: t must hold " + std::to_string(mma::kCandidateCount) +
                                       " times, got " + std::to_string(t->element_count()));
  struct Stream {   // this call's own stream (on the current device), synchronized and freed on every return
    cudaStream_t s = nullptr;
    ~Stream() {
      if (s) {
        cudaStreamSynchronize(s);
        cudaStreamDestroy(s);
      }
    }
  } own_stream;
  if (cudaError_t e = cudaStreamCreateWithFlags(&own_stream.s, cudaStreamNonBlocking); e != cudaSuccess)
    return ffi::Error::Internal(std::string("jaxllm_w8a16_tune: no stream of its own: ") + cudaGetErrorString(e));
  cudaStream_t own = own_stream.s;
  // After XLA's stream: the inputs are written there.
  Event ready;
  cudaError_t e = cudaEventCreateWithFlags(&ready.a, cudaEventDisableTiming);
  if (e == cudaSuccess) e = cudaEventRecord(ready.a, stream);
  if (e == cudaSuccess) e = cudaStreamWaitEvent(own, ready.a, 0);
  const auto* xp = static_cast<const __nv_bfloat16*>(x.untyped_data());
  const auto* wp = static_cast<const int8_t*>(w.untyped_data());
  const auto* sp = static_cast<const float*>(scale.untyped_data());
  auto* yp = static_cast<__nv_bfloat16*>(y->untyped_data());
  const int calls = int(std::max<int64_t>(16, copies));
  std::vector<float> times(mma::kCandidateCount, INFINITY);
  for (int i = 0; i < mma::kCandidateCount && e == cudaSuccess; ++i) {
    const mma::Candidate& c = mma::kCandidates[i];
    if (c.rows != mma::Bucket(int(m))) continue;
    // One call outside the capture first: a configuration's one-time opt-in to more shared memory. One this GPU
    // cannot launch (more shared memory than it has: 128 KB blocks on a 99 KB sm_86/89) stays +inf, its error
    // cleared; any other error ends the timing.
    if (c.launch(own, xp, wp, sp, yp, int(m), int(n), int(k)) != cudaSuccess) {
      cudaGetLastError();
      e = cudaStreamSynchronize(own);
      continue;
    }
    // Call j on weight copy j % copies; 5 replays after 1.
    const auto launch = [&](int j) {
      const size_t copy = size_t(j % copies);
      return c.launch(own, xp, wp + copy * size_t(n) * k, sp + copy * size_t(n) * (k / mma::kChunk), yp, int(m),
                      int(n), int(k));
    };
    float us = 0.f;
    e = PerCallUs(own, calls, launch, 5, 1, cudaStreamCaptureModeThreadLocal, &us);
    if (e == cudaSuccess && us > 0.f) times[i] = us;   // else noise: left +inf
  }
  if (e == cudaSuccess) e = cudaStreamSynchronize(own);
  if (e == cudaSuccess) e = cudaMemcpyAsync(t->typed_data(), times.data(), times.size() * sizeof(float),
                                            cudaMemcpyHostToDevice, stream);
  if (e == cudaSuccess) e = cudaStreamSynchronize(stream);   // `times` is freed on return
  if (e != cudaSuccess) return ffi::Error::Internal(std::string("jaxllm_w8a16_tune: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace

int MmaCandidateCount() { return mma::kCandidateCount; }

XLA_FFI_DEFINE_HANDLER_SYMBOL(W8A16TuneCuda, W8A16Tune,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()                  // x [M, K] bf16
                                  .Arg<ffi::AnyBuffer>()                  // w [C, N, K] int8
                                  .Arg<ffi::AnyBuffer>()                  // scale [C, N, K / 64] f32
                                  .Ret<ffi::AnyBuffer>()                  // y [M, N] bf16 (scratch)
                                  .Ret<ffi::Buffer<ffi::F32>>());         // t [kCandidateCount] microseconds

}  // namespace jaxllm
