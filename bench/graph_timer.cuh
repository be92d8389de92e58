// Timing helpers of the raw-CUDA benches (gemv_sweep.cu, candidates_sweep.cu, mma_coal.cu; built with -I ffi): calls
// captured into one CUDA graph, replayed, timed by events; per call = the difference between 2n and n calls over n,
// so launch gaps and the graph's own overhead cancel (ffi/graph_timing.cuh, which the tuner uses too). And the
// check of a matmul's bf16 output against its f32 reference.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#include "graph_timing.cuh"

#define CHECK(call)                                                                                  \
  do {                                                                                               \
    cudaError_t e_ = (call);                                                                         \
    if (e_ != cudaSuccess) {                                                                         \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));    \
      std::exit(1);                                                                                  \
    }                                                                                                \
  } while (0)

// Median over `reps` replays (after 3) of a graph of `calls` launches of fn(i) (i = call index; fn checks its own
// launches): ffi/graph_timing.cuh's, exiting on an error.
inline float GraphMedianUs(cudaStream_t st, int calls, const std::function<void(int)>& fn, int reps = 15) {
  float us = 0.f;
  CHECK(jaxllm::GraphMedianUs(st, calls, [&](int i) { fn(i); return cudaSuccess; }, reps, 3,
                              cudaStreamCaptureModeGlobal, &us));
  return us;
}

// Per-call microseconds: (graph of 2n calls - graph of n calls) / n.
inline float PerCallUs(cudaStream_t st, int n, const std::function<void(int)>& fn) {
  float us = 0.f;
  CHECK(jaxllm::PerCallUs(st, n, [&](int i) { fn(i); return cudaSuccess; }, 15, 3, cudaStreamCaptureModeGlobal, &us));
  return us;
}

// y (bf16, ref.size() outputs on the device) against ref (f32, host): the relative L2 error and the worst single
// output's error over the reference's RMS (a few wrong rows can hide in the L2 sum); NaN (unwritten, poisoned
// outputs) propagates to both.
inline void ErrorVsReference(cudaStream_t st, const __nv_bfloat16* y, const std::vector<float>& ref, double* err,
                             double* worst) {
  std::vector<__nv_bfloat16> got(ref.size());
  CHECK(cudaMemcpyAsync(got.data(), y, got.size() * 2, cudaMemcpyDeviceToHost, st));
  CHECK(cudaStreamSynchronize(st));
  double num = 0, den = 0, most = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double d = double(__bfloat162float(got[i])) - ref[i];
    num += d * d;
    den += double(ref[i]) * ref[i];
    most = std::isnan(d) || std::fabs(d) > most ? std::fabs(d) : most;
  }
  *err = std::sqrt(num / den);
  *worst = most / std::sqrt(den / got.size());
}
