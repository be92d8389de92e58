// Timing launches with CUDA graphs (ffi/tune_cuda.cu's tuner; bench/graph_timer.cuh wraps it for the raw-CUDA
// benches): `calls` launches captured into one graph and replayed, timed by events; a call's time is the
// difference between a graph of 2n calls and one of n, over n, so launch gaps and the graph's own cost cancel.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <functional>
#include <vector>

namespace jaxllm {

// Median microseconds over `reps` replays (after `warmups`) of a graph of `calls` launches of launch(i)
// (i = call index), captured in `mode`. The first error (a launch's included) is returned; nothing is left behind.
inline cudaError_t GraphMedianUs(cudaStream_t st, int calls, const std::function<cudaError_t(int)>& launch,
                                 int reps, int warmups, cudaStreamCaptureMode mode, float* us) {
  struct Held {   // freed on every return
    cudaGraph_t graph = nullptr;
    cudaGraphExec_t exec = nullptr;
    cudaEvent_t a = nullptr, b = nullptr;
    ~Held() {
      if (a) cudaEventDestroy(a);
      if (b) cudaEventDestroy(b);
      if (exec) cudaGraphExecDestroy(exec);
      if (graph) cudaGraphDestroy(graph);
    }
  } h;
  if (cudaError_t e = cudaStreamBeginCapture(st, mode); e != cudaSuccess) return e;
  cudaError_t launched = cudaSuccess;
  for (int i = 0; i < calls && launched == cudaSuccess; ++i) launched = launch(i);
  const cudaError_t ended = cudaStreamEndCapture(st, &h.graph);
  if (launched != cudaSuccess) return launched;
  if (ended != cudaSuccess) return ended;
  if (cudaError_t e = cudaGraphInstantiate(&h.exec, h.graph, 0); e != cudaSuccess) return e;
  if (cudaError_t e = cudaEventCreate(&h.a); e != cudaSuccess) return e;
  if (cudaError_t e = cudaEventCreate(&h.b); e != cudaSuccess) return e;
  for (int i = 0; i < warmups; ++i)
    if (cudaError_t e = cudaGraphLaunch(h.exec, st); e != cudaSuccess) return e;
  std::vector<float> times;
  for (int r = 0; r < reps; ++r) {
    if (cudaError_t e = cudaEventRecord(h.a, st); e != cudaSuccess) return e;
    if (cudaError_t e = cudaGraphLaunch(h.exec, st); e != cudaSuccess) return e;
    if (cudaError_t e = cudaEventRecord(h.b, st); e != cudaSuccess) return e;
    if (cudaError_t e = cudaEventSynchronize(h.b); e != cudaSuccess) return e;
    float ms = 0.f;
    if (cudaError_t e = cudaEventElapsedTime(&ms, h.a, h.b); e != cudaSuccess) return e;
    times.push_back(ms * 1e3f);
  }
  std::sort(times.begin(), times.end());
  *us = times[times.size() / 2];
  return cudaSuccess;
}

// Per-call microseconds: (the median of a graph of 2n calls - that of n calls) / n; noise can make it <= 0.
inline cudaError_t PerCallUs(cudaStream_t st, int n, const std::function<cudaError_t(int)>& launch, int reps,
                             int warmups, cudaStreamCaptureMode mode, float* us) {
  float once = 0.f, twice = 0.f;
  if (cudaError_t e = GraphMedianUs(st, n, launch, reps, warmups, mode, &once); e != cudaSuccess) return e;
  if (cudaError_t e = GraphMedianUs(st, 2 * n, launch, reps, warmups, mode, &twice); e != cudaSuccess) return e;
  *us = (twice - once) / float(n);
  return cudaSuccess;
}

}  // namespace jaxllm
