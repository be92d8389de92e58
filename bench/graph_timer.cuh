// Timing helpers of the raw-CUDA benches (gemv_sweep.cu, candidates_sweep.cu): calls captured into one
// CUDA graph, replayed, timed by events; per call = the difference between 2n and n calls over n, so launch
// gaps and the graph's own overhead cancel.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

#define CHECK(call)                                                                                  \
  do {                                                                                               \
    cudaError_t e_ = (call);                                                                         \
    if (e_ != cudaSuccess) {                                                                         \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));    \
      std::exit(1);                                                                                  \
    }                                                                                                \
  } while (0)

// Median over `reps` replays of a graph of `calls` launches of fn(i) (i = call index).
inline float GraphMedianUs(cudaStream_t st, int calls, const std::function<void(int)>& fn, int reps = 15) {
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CHECK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
  for (int i = 0; i < calls; ++i) fn(i);
  CHECK(cudaStreamEndCapture(st, &graph));
  CHECK(cudaGraphInstantiate(&exec, graph, 0));
  cudaEvent_t a, b;
  CHECK(cudaEventCreate(&a));
  CHECK(cudaEventCreate(&b));
  for (int i = 0; i < 3; ++i) CHECK(cudaGraphLaunch(exec, st));
  std::vector<float> ts;
  for (int r = 0; r < reps; ++r) {
    CHECK(cudaEventRecord(a, st));
    CHECK(cudaGraphLaunch(exec, st));
    CHECK(cudaEventRecord(b, st));
    CHECK(cudaEventSynchronize(b));
    float ms;
    CHECK(cudaEventElapsedTime(&ms, a, b));
    ts.push_back(ms * 1e3f);
  }
  CHECK(cudaEventDestroy(a));
  CHECK(cudaEventDestroy(b));
  CHECK(cudaGraphExecDestroy(exec));
  CHECK(cudaGraphDestroy(graph));
  std::sort(ts.begin(), ts.end());
  return ts[ts.size() / 2];
}

// Per-call microseconds: (graph of 2n calls - graph of n calls) / n.
inline float PerCallUs(cudaStream_t st, int n, const std::function<void(int)>& fn) {
  const float t1 = GraphMedianUs(st, n, fn), t2 = GraphMedianUs(st, 2 * n, fn);
  return (t2 - t1) / n;
}

