// A candidate for ffi/w8a16_mma.cuh at 16-64 rows of x, timed beside it by bench/gemv_sweep.cu: the same
// kernel, fragment for fragment and in the same summation order, with two changes meant to keep more warps on
// an SM at 64 rows, where ffi/w8a16_mma.cuh takes 252 registers a thread and 12% of the SM's warps are active
// (docs/results/2026-12-06-h100-mma-profile.md):
//   - a chunk's A fragments are converted for all RT tiles first, then x is read one 8-row tile at a time
//     (8 registers, not 8 MT) and used against every tile;
//   - __launch_bounds__ asks for MINB blocks an SM, so the compiler caps the registers to fit them;
//   - SWAP orders the grid x-tile first: the blocks of one slab of w for the 8 MT-row tiles of x run side by
//     side, so with MT < 8 at 64 rows w is read from device memory about once and from L2 for the other tiles
//     (ffi/w8a16_mma.cuh's order runs every slab for x's first tile, then again for the next);
//   - NW warps of a block own different 16 RT-row slabs of w over the same K range (KS such groups split K),
//     so they read the same x, which L1 then serves once for all of them: x's traffic from L2 per weight byte
//     falls by NW (at 64 rows ffi/w8a16_mma.cuh's blocks read 8 / RT bytes of x per weight byte, from L2
//     where x outgrows L1: 2.4 MB for the 7B down projection).
#pragma once

#include "w8a16_mma.cuh"

namespace jaxllm {
namespace w8a16 {
namespace mma_occ {

using mma::Int8x4ToBf16;
using mma::kChunk;
using mma::LoadWeights;
using mma::Mma;

// One block: rows [16 RT NW tile, +16 RT NW) of w, rows [8 MT xtile, +8 MT) of x.
// x [M, K] bf16, w [N, K] int8, scale [N, K / 64] f32, y [M, N] bf16. K % 64 == 0.
template <int MT, int RT, int KS, int U, int MINB, bool SWAP, int NW>
__global__ void __launch_bounds__(KS * NW * 32, MINB) Kernel(const __nv_bfloat16* __restrict__ x, const int8_t* __restrict__ w,
                                                  const float* __restrict__ scale, __nv_bfloat16* __restrict__ y,
                                                  int m, int n, int k) {
  constexpr int BR = 16 * RT * NW;                       // rows of w a block
  extern __shared__ float partial[];                     // [KS][8 MT][BR]
  const int warp = threadIdx.x / 32, group = warp / NW, member = warp % NW, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int tile = SWAP ? blockIdx.y : blockIdx.x, xtile = SWAP ? blockIdx.x : blockIdx.y;
  const int chunks = k / kChunk, block0 = tile * BR, row0 = block0 + member * 16 * RT, xrow0 = xtile * 8 * MT;
  const int begin = group * chunks / KS, end = (group + 1) * chunks / KS;

  // This thread's rows of w (g and g + 8 of each 16-row tile; a row past N reads row N - 1, never written)
  // and of x (g of each 8-row tile; a row past M contributes zeros).
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
      uint32_t a[RT][4][4];                                // [tile r][step j] the A fragment
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        const uint32_t q0[4] = {wq[u][r][0].x, wq[u][r][0].y, wq[u][r][0].z, wq[u][r][0].w};
        const uint32_t q1[4] = {wq[u][r][1].x, wq[u][r][1].y, wq[u][r][1].z, wq[u][r][1].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          Int8x4ToBf16(q0[j], a[r][j][0], a[r][j][2]);     // row g: inputs 4j, 4j+1 | 4j+2, 4j+3
          Int8x4ToBf16(q1[j], a[r][j][1], a[r][j][3]);     // row g + 8
        }
      }
#pragma unroll
      for (int t = 0; t < MT; ++t) {                       // one tile of x at a time: 16 bf16, words 2j, 2j+1 step j's
        const uint4* p = reinterpret_cast<const uint4*>(xrow[t] + size_t(base + u) * kChunk);
        const uint4 x0 = xlive[t] ? __ldg(p) : make_uint4(0, 0, 0, 0);
        const uint4 x1 = xlive[t] ? __ldg(p + 1) : make_uint4(0, 0, 0, 0);
        const uint32_t xw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
        for (int r = 0; r < RT; ++r) {
          float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int j = 0; j < 4; ++j) Mma(part, a[r][j], xw[2 * j], xw[2 * j + 1], part);
          acc[r][t][0] += part[0] * sc[u][r][0];           // rows g (d0, d1) and g + 8 (d2, d3)
          acc[r][t][1] += part[1] * sc[u][r][0];
          acc[r][t][2] += part[2] * sc[u][r][1];
          acc[r][t][3] += part[3] * sc[u][r][1];
        }
      }
    }
  }

  // The fragment: d0, d1 at (row g, x rows 2c, 2c + 1), d2, d3 at (row g + 8, the same x rows).
  float* mine = partial + size_t(group) * 8 * MT * BR + member * 16 * RT;
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int wr = 16 * r + g + 8 * (i / 2), xr = 8 * t + 2 * c + i % 2;
        mine[xr * BR + wr] = acc[r][t][i];
      }
  __syncthreads();
  for (int o = threadIdx.x; o < 8 * MT * BR; o += KS * NW * 32) {
    const int xr = o / BR, wr = o % BR, row = block0 + wr, xm = xrow0 + xr;
    if (row >= n || xm >= m) continue;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < KS; ++i) sum += partial[size_t(i) * 8 * MT * BR + o];
    y[size_t(xm) * n + row] = __float2bfloat16(sum);
  }
}

template <int MT, int RT, int KS, int U, int MINB, bool SWAP, int NW = 1>
cudaError_t Launch(cudaStream_t stream, const __nv_bfloat16* x, const int8_t* w, const float* scale,
                   __nv_bfloat16* y, int m, int n, int k) {
  auto kernel = Kernel<MT, RT, KS, U, MINB, SWAP, NW>;
  constexpr size_t smem = mma::SmemBytes(MT, RT * NW, KS);
  if constexpr (smem > (48 << 10)) {   // the opt-in to more dynamic shared memory, once
    static const cudaError_t opted =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (opted != cudaSuccess) return opted;
  }
  const unsigned tiles = (n + 16 * RT * NW - 1) / (16 * RT * NW), xtiles = (m + 8 * MT - 1) / (8 * MT);
  const dim3 grid = SWAP ? dim3(xtiles, tiles) : dim3(tiles, xtiles);
  kernel<<<grid, KS * NW * 32, smem, stream>>>(x, w, scale, y, m, n, k);
  return cudaGetLastError();
}

}  // namespace mma_occ
}  // namespace w8a16
}  // namespace jaxllm
