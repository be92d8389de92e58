// A candidate for ffi/w8a16_mma.cuh at 16-64 rows of x on the shapes with few rows of w and a long K (the 7B down
// projection: N 3584, K 18944), timed beside it by bench/gemv_sweep.cu: K split over blocks, not only over the
// warps of a block, and NW warps a block sharing x.
//
// Why: at 64 rows ffi/w8a16_mma.cuh's best down configuration is 112 blocks of 8 warps (252 registers a thread:
// one block an SM), fewer blocks than the H100's 132 SMs, and each block reads all 2.4 MB of x for its 32 rows of
// w: 272 MB of x from L2 against 68 MB of weights, about 50 us at the ~5.4 TB/s the sweep's numbers imply for L2
// (one 16-row tile a warp instead of two doubles both x's bytes and the time: 113 against 52 us). Here S blocks
// split K for each 16 RT NW-row slab of w, so there are S times the blocks, and the NW warps of a block read the
// same x (L1 serves it once), so x's L2 traffic falls by NW.
//
// Each block writes its f32 partial [M, BR] tile to a workspace [S, M, N]; a second kernel sums the S partials in
// a fixed order and writes y in bf16 (deterministic; no atomics, no counters). The arithmetic within a block is
// ffi/w8a16_mma.cuh's with XT (x a tile at a time), fragment for fragment.
#pragma once

#include <algorithm>

#include "w8a16_mma.cuh"

namespace jaxllm {
namespace w8a16 {
namespace mma_splitk {

using mma::Int8x4ToBf16;
using mma::kChunk;
using mma::LoadWeights;
using mma::Mma;

// Block (blockIdx.x, blockIdx.y, blockIdx.z): rows [BR x, +BR) of w, K split y of S, rows [8 MT z, +8 MT) of x.
// ws [S, M, N] f32: this split's partial sums.
template <int MT, int RT, int NW, int S, int U>
__global__ void __launch_bounds__(NW * 32) Kernel(const __nv_bfloat16* __restrict__ x, const int8_t* __restrict__ w,
                                                  const float* __restrict__ scale, float* __restrict__ ws, int m,
                                                  int n, int k) {
  constexpr int BR = 16 * RT * NW;
  const int member = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int chunks = k / kChunk, row0 = blockIdx.x * BR + member * 16 * RT, xrow0 = blockIdx.z * 8 * MT;
  const int begin = blockIdx.y * chunks / S, end = (blockIdx.y + 1) * chunks / S;

  const int8_t* wrow[RT][2];
  const float* srow[RT][2];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = min(row0 + 16 * r + 8 * h + g, n - 1);
      wrow[r][h] = w + size_t(row) * k + 16 * c;
      srow[r][h] = scale + size_t(row) * chunks;
    }
  const __nv_bfloat16* xrow[MT];
  bool xlive[MT];
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    const int row = xrow0 + 8 * t + g;
    xlive[t] = row < m;
    xrow[t] = x + size_t(xlive[t] ? row : 0) * k + 16 * c;
  }

  float acc[RT][MT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][t][i] = 0.f;

  for (int base = begin; base < end; base += U) {
    uint4 wq[U][RT][2];
    float sc[U][RT][2];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const bool live = base + u < end;
          wq[u][r][h] = live ? LoadWeights(wrow[r][h] + size_t(base + u) * kChunk) : make_uint4(0, 0, 0, 0);
          sc[u][r][h] = live ? __ldg(srow[r][h] + base + u) : 0.f;
        }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + u >= end) break;
      uint32_t a[RT][4][4];
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        const uint32_t q0[4] = {wq[u][r][0].x, wq[u][r][0].y, wq[u][r][0].z, wq[u][r][0].w};
        const uint32_t q1[4] = {wq[u][r][1].x, wq[u][r][1].y, wq[u][r][1].z, wq[u][r][1].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          Int8x4ToBf16(q0[j], a[r][j][0], a[r][j][2]);
          Int8x4ToBf16(q1[j], a[r][j][1], a[r][j][3]);
        }
      }
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        const uint4* p = reinterpret_cast<const uint4*>(xrow[t] + size_t(base + u) * kChunk);
        const uint4 x0 = xlive[t] ? __ldg(p) : make_uint4(0, 0, 0, 0);
        const uint4 x1 = xlive[t] ? __ldg(p + 1) : make_uint4(0, 0, 0, 0);
        const uint32_t xw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int j = 0; j < 4; ++j) Mma(part, a[r][j], xw[2 * j], xw[2 * j + 1], part);
          acc[r][t][0] += part[0] * sc[u][r][0];
          acc[r][t][1] += part[1] * sc[u][r][0];
          acc[r][t][2] += part[2] * sc[u][r][1];
          acc[r][t][3] += part[3] * sc[u][r][1];
        }
      }
    }
  }

  // d0, d1 at (row g, x rows 2c, 2c + 1), d2, d3 at (row g + 8, the same x rows).
  float* out = ws + size_t(blockIdx.y) * m * n;
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int row = row0 + 16 * r + g + 8 * (i / 2), xm = xrow0 + 8 * t + 2 * c + i % 2;
        if (row < n && xm < m) out[size_t(xm) * n + row] = acc[r][t][i];
      }
}

// y [M, N] = the S partials of ws summed in order, in bf16.
template <int S>
__global__ void Reduce(const float* __restrict__ ws, __nv_bfloat16* __restrict__ y, int mn) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < mn; i += gridDim.x * blockDim.x) {
    float sum = 0.f;
#pragma unroll
    for (int s = 0; s < S; ++s) sum += ws[size_t(s) * mn + i];
    y[i] = __float2bfloat16(sum);
  }
}

// The workspace: grown on a call outside stream capture (the sweep checks every configuration once before it
// times it), never during one.
inline float* Workspace(size_t bytes, cudaError_t* err) {
  static float* ws = nullptr;
  static size_t cap = 0;
  *err = cudaSuccess;
  if (bytes <= cap) return ws;
  if (ws) cudaFree(ws);
  ws = nullptr;
  cap = 0;
  *err = cudaMalloc(&ws, bytes);
  if (*err == cudaSuccess) cap = bytes;
  return ws;
}

template <int MT, int RT, int NW, int S, int U>
cudaError_t Launch(cudaStream_t stream, const __nv_bfloat16* x, const int8_t* w, const float* scale,
                   __nv_bfloat16* y, int m, int n, int k) {
  cudaError_t e;
  float* ws = Workspace(size_t(S) * m * n * sizeof(float), &e);
  if (e != cudaSuccess) return e;
  const dim3 grid((n + 16 * RT * NW - 1) / (16 * RT * NW), S, (m + 8 * MT - 1) / (8 * MT));
  Kernel<MT, RT, NW, S, U><<<grid, NW * 32, 0, stream>>>(x, w, scale, ws, m, n, k);
  Reduce<S><<<std::min((m * n + 255) / 256, 1024), 256, 0, stream>>>(ws, y, m * n);
  return cudaGetLastError();
}

}  // namespace mma_splitk
}  // namespace w8a16
}  // namespace jaxllm
