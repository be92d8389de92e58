// The tensor-core W8A16 configurations timed on this GPU (jaxllm.tuning picks one per matmul shape and row bucket
// when a model loads; the choice reaches the matmul as its `mma` attribute).
//
// t[i] = microseconds a call of w8a16_mma.cuh's kCandidates[i] on x [M, K] bf16 and the C stacked weight copies
// w [C, N, K] int8, scale [C, N, K / 64] f32; +inf for the configurations of another row bucket than M's. The
// calls rotate over the copies (jaxllm.tuning makes them span more than the L2, so each call reads device memory,
// as a step does); a call's time is (a CUDA graph of 2n calls - one of n) / n, the median of 5 replays, so launch
// gaps and the graph's own cost cancel (bench/graph_timer.cuh's method); +inf too for a configuration this GPU
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
#include "w8a16_mma.cuh"

namespace jaxllm {
namespace {

namespace mma = w8a16::mma;

struct Graph {   // a captured graph and its executable, freed on scope exit
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  ~Graph() {
    if (exec) cudaGraphExecDestroy(exec);
    if (graph) cudaGraphDestroy(graph);
  }
};
struct Events {
  cudaEvent_t a = nullptr, b = nullptr;
  ~Events() {
    if (a) cudaEventDestroy(a);
    if (b) cudaEventDestroy(b);
  }
};

// Median microseconds of 5 replays of a graph of `calls` launches of candidate `c`, call i on copy i % copies.
cudaError_t GraphUs(cudaStream_t st, const mma::Candidate& c, int calls, int copies, const __nv_bfloat16* x,
                    const int8_t* w, const float* scale, __nv_bfloat16* y, int m, int n, int k, float* us) {
  Graph g;
  if (cudaError_t e = cudaStreamBeginCapture(st, cudaStreamCaptureModeThreadLocal); e != cudaSuccess) return e;
  cudaError_t launched = cudaSuccess;
  for (int i = 0; i < calls && launched == cudaSuccess; ++i) {
    const size_t j = size_t(i % copies);
    launched = c.launch(st, x, w + j * size_t(n) * k, scale + j * size_t(n) * (k / mma::kChunk), y, m, n, k);
  }
  const cudaError_t ended = cudaStreamEndCapture(st, &g.graph);
  if (launched != cudaSuccess) return launched;
  if (ended != cudaSuccess) return ended;
  if (cudaError_t e = cudaGraphInstantiate(&g.exec, g.graph, 0); e != cudaSuccess) return e;
  Events ev;
  if (cudaError_t e = cudaEventCreate(&ev.a); e != cudaSuccess) return e;
  if (cudaError_t e = cudaEventCreate(&ev.b); e != cudaSuccess) return e;
  if (cudaError_t e = cudaGraphLaunch(g.exec, st); e != cudaSuccess) return e;   // warm-up
  std::vector<float> times;
  for (int r = 0; r < 5; ++r) {
    if (cudaError_t e = cudaEventRecord(ev.a, st); e != cudaSuccess) return e;
    if (cudaError_t e = cudaGraphLaunch(g.exec, st); e != cudaSuccess) return e;
    if (cudaError_t e = cudaEventRecord(ev.b, st); e != cudaSuccess) return e;
    if (cudaError_t e = cudaEventSynchronize(ev.b); e != cudaSuccess) return e;
    float ms = 0.f;
    if (cudaError_t e = cudaEventElapsedTime(&ms, ev.a, ev.b); e != cudaSuccess) return e;
    times.push_back(ms * 1e3f);
  }
  std::sort(times.begin(), times.end());
  *us = times[times.size() / 2];
  return cudaSuccess;
}

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
  Events ready;
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
    float once = 0.f, twice = 0.f;
    e = GraphUs(own, c, calls, int(copies), xp, wp, sp, yp, int(m), int(n), int(k), &once);
    if (e == cudaSuccess) e = GraphUs(own, c, 2 * calls, int(copies), xp, wp, sp, yp, int(m), int(n), int(k), &twice);
    if (e == cudaSuccess && twice > once) times[i] = (twice - once) / float(calls);   // else noise: left +inf
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
