// TouchPages: one 4-byte load per 64 KB of a weight slice and of its scales, so that their pages' address
// translations are warm for a later kernel while next to none of their bytes come into L2 (one 32-byte sector in
// 2048). The lab switch JAXLLM_MMA_TOUCH (cuda_kernels.cu) and bench/matmul_chain.cu use it to ask whether the
// batched step's matmuls lose time to address translation (docs/results/2026-12-06-h100-matmul-study.md).
// Include it from one file of a binary (a plain kernel, defined here).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace jaxllm {

// w [w_bytes] and s [s_bytes] (each a multiple of 4 bytes): loads at every 64 KB offset below each size.
__global__ void TouchPagesKernel(const int8_t* __restrict__ w, size_t w_bytes, const int8_t* __restrict__ s,
                                 size_t s_bytes, uint32_t* __restrict__ sink) {
  const size_t i = (blockIdx.x * size_t(blockDim.x) + threadIdx.x) << 16;
  uint32_t v = 0;
  if (i < w_bytes) v ^= __ldcg(reinterpret_cast<const uint32_t*>(w + i));
  if (i < s_bytes) v ^= __ldcg(reinterpret_cast<const uint32_t*>(s + i));
  if (v == 0x9e3779b9u && sink != nullptr) *sink = v;   // never in practice: keeps the loads
}

inline cudaError_t TouchPages(cudaStream_t stream, const int8_t* w, size_t w_bytes, const float* s, size_t s_bytes,
                              uint32_t* sink = nullptr) {
  const size_t threads = (std::max(w_bytes, s_bytes) >> 16) + 1;
  TouchPagesKernel<<<unsigned((threads + 127) / 128), 128, 0, stream>>>(
      w, w_bytes, reinterpret_cast<const int8_t*>(s), s_bytes, sink);
  return cudaGetLastError();
}

}  // namespace jaxllm
