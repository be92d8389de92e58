// Random fills of the raw-CUDA benches (gemv_sweep.cu, matmul_chain.cu, mma_layout.cu): a counter hash
// (splitmix64's finalizer) of each element's index and a seed, so every run draws the same values.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

__device__ inline uint32_t Hash(uint64_t i, uint32_t seed) {
  uint64_t z = i * 0x9e3779b97f4a7c15ull + seed;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return uint32_t(z ^ (z >> 31));
}
// int8 weights in [-127, 127]
__global__ void FillInt8(int8_t* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = int8_t(Hash(i, seed) % 255 - 127);
}
// f32 group scales in [0.001, 0.011)
__global__ void FillScale(float* p, size_t n, uint32_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = 1e-3f + 1e-2f * (Hash(i, seed) % 1000) / 1000.f;
}
// bf16 values in [lo, hi)
__global__ void FillBf16(__nv_bfloat16* p, size_t n, uint32_t seed, float lo = -1.f, float hi = 1.f) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
    p[i] = __float2bfloat16(lo + (hi - lo) * (Hash(i, seed) % 65536) / 65536.f);
}
