// Candidate (bench only): ffi/w8a16_mma.cuh's tensor-core kernel with its weight loads software-pipelined. The
// kernel in use issues U chunks' loads, then converts and multiplies them, so a warp has no loads in flight while
// it computes, and waits a whole memory latency each group. Here the next group's loads are issued before the
// current group is computed (two register buffers, used in turn with static indices), so loads stay in flight.
// The fragments, K permutation, scaling and reduction are the kernel's own (its helpers are used); only the loop
// differs. bench/gemv_sweep.cu times it as mmapipe_*.
#pragma once

#include "w8a16_mma.cuh"

namespace jaxllm {
namespace w8a16 {
namespace mma_pipe {

using mma::kChunk;

template <int RT, int U>
struct Group {
  uint4 wq[U][RT][2];
  float sc[U][RT][2];
};

// Issues the loads of chunks [base, base + U) (those below end) into g.
template <int RT, int U>
__device__ __forceinline__ void Load(Group<RT, U>& g, const int8_t* const (&wrow)[RT][2],
                                     const float* const (&srow)[RT][2], int base, int end) {
#pragma unroll
  for (int u = 0; u < U; ++u)
#pragma unroll
    for (int r = 0; r < RT; ++r)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const bool live = base + u < end;
        g.wq[u][r][h] = live ? mma::LoadWeights(wrow[r][h] + size_t(base + u) * kChunk) : make_uint4(0, 0, 0, 0);
        g.sc[u][r][h] = live ? __ldg(srow[r][h] + base + u) : 0.f;
      }
}

// Multiplies the group's chunks with x into acc, as mma::Kernel's inner loop.
template <int MT, int RT, int U>
__device__ __forceinline__ void Compute(const Group<RT, U>& g, float (&acc)[RT][MT][4],
                                        const __nv_bfloat16* const (&xrow)[MT], const bool (&xlive)[MT], int base,
                                        int end) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
    if (base + u >= end) break;
    uint4 xv[MT][2];
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      const uint4* p = reinterpret_cast<const uint4*>(xrow[t] + size_t(base + u) * kChunk);
      xv[t][0] = xlive[t] ? __ldg(p) : make_uint4(0, 0, 0, 0);
      xv[t][1] = xlive[t] ? __ldg(p + 1) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      uint32_t a[4][4];
      const uint32_t q0[4] = {g.wq[u][r][0].x, g.wq[u][r][0].y, g.wq[u][r][0].z, g.wq[u][r][0].w};
      const uint32_t q1[4] = {g.wq[u][r][1].x, g.wq[u][r][1].y, g.wq[u][r][1].z, g.wq[u][r][1].w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        mma::Int8x4ToBf16(q0[j], a[j][0], a[j][2]);
        mma::Int8x4ToBf16(q1[j], a[j][1], a[j][3]);
      }
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        const uint32_t xw[8] = {xv[t][0].x, xv[t][0].y, xv[t][0].z, xv[t][0].w,
                                xv[t][1].x, xv[t][1].y, xv[t][1].z, xv[t][1].w};
        float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < 4; ++j) mma::Mma(part, a[j], xw[2 * j], xw[2 * j + 1], part);
        acc[r][t][0] += part[0] * g.sc[u][r][0];
        acc[r][t][1] += part[1] * g.sc[u][r][0];
        acc[r][t][2] += part[2] * g.sc[u][r][1];
        acc[r][t][3] += part[3] * g.sc[u][r][1];
      }
    }
  }
}

template <int MT, int RT, int KS, int U>
__global__ void __launch_bounds__(KS * 32) Kernel(const __nv_bfloat16* __restrict__ x, const int8_t* __restrict__ w,
                                                  const float* __restrict__ scale, __nv_bfloat16* __restrict__ y,
                                                  int m, int n, int k) {
  extern __shared__ float partial[];                     // [KS][8 MT][16 RT]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int chunks = k / kChunk, row0 = blockIdx.x * 16 * RT, xrow0 = blockIdx.y * 8 * MT;
  const int begin = warp * chunks / KS, end = (warp + 1) * chunks / KS;
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

  Group<RT, U> ga, gb;
  Load(ga, wrow, srow, begin, end);
  for (int base = begin; base < end; base += 2 * U) {
    if (base + U < end) Load(gb, wrow, srow, base + U, end);
    Compute(ga, acc, xrow, xlive, base, end);
    if (base + U >= end) break;
    if (base + 2 * U < end) Load(ga, wrow, srow, base + 2 * U, end);
    Compute(gb, acc, xrow, xlive, base + U, end);
  }

  float* mine = partial + size_t(warp) * 8 * MT * 16 * RT;
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int wr = 16 * r + g + 8 * (i / 2), xr = 8 * t + 2 * c + i % 2;
        mine[xr * 16 * RT + wr] = acc[r][t][i];
      }
  __syncthreads();
  for (int o = threadIdx.x; o < 8 * MT * 16 * RT; o += KS * 32) {
    const int xr = o / (16 * RT), wr = o % (16 * RT), row = row0 + wr, xm = xrow0 + xr;
    if (row >= n || xm >= m) continue;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < KS; ++i) sum += partial[size_t(i) * 8 * MT * 16 * RT + o];
    y[size_t(xm) * n + row] = __float2bfloat16(sum);
  }
}

template <int MT, int RT, int KS, int U>
cudaError_t Launch(cudaStream_t stream, const __nv_bfloat16* x, const int8_t* w, const float* scale,
                   __nv_bfloat16* y, int m, int n, int k) {
  auto kernel = Kernel<MT, RT, KS, U>;
  constexpr size_t smem = mma::SmemBytes(MT, RT, KS);
  if constexpr (smem > (48 << 10)) {
    static const cudaError_t opted =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (opted != cudaSuccess) return opted;
  }
  const dim3 grid((n + 16 * RT - 1) / (16 * RT), (m + 8 * MT - 1) / (8 * MT));
  kernel<<<grid, KS * 32, smem, stream>>>(x, w, scale, y, m, n, k);
  return cudaGetLastError();
}

}  // namespace mma_pipe
}  // namespace w8a16
}  // namespace jaxllm
