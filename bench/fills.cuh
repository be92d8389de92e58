// Random fills of the raw-CUDA benches (gemv_sweep.cu, matmul_chain.cu): a counter hash
// (splitmix64's finalizer) of each element's index and a seed, so every run draws the same values; and
// ReadOnce, a contiguous read of weight bytes at the copy rate (matmul_chain.cu).
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

// Reads n16 16-byte pieces and ns f32 (scales; none when ns is 0) once, 4 pieces in flight a thread, with the
// W8A16 kernels' weight load (L1 bypassed, 256-byte L2 prefetch); writes nothing unless the bytes hash to a
// constant. Launched on the GPU's resident blocks.
__global__ void __launch_bounds__(256) ReadOnce(const uint4* __restrict__ p, size_t n16, const float* __restrict__ s,
                                                size_t ns, uint32_t* sink) {
  constexpr int U = 4;
  uint32_t acc = 0;
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n16; i += stride * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      v[u] = make_uint4(0, 0, 0, 0);
      if (i + u * stride < n16)
        asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                     : "=r"(v[u].x), "=r"(v[u].y), "=r"(v[u].z), "=r"(v[u].w)
                     : "l"(p + i + u * stride));
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < ns; i += stride) acc ^= __float_as_uint(__ldg(s + i));
  if (acc == 0x9e3779b9u) *sink = acc;
}
