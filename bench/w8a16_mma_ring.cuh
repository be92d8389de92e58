// A candidate for ffi/w8a16_mma.cuh at 8-64 rows of x, timed beside it by bench/gemv_sweep.cu (not in the
// extension until the sweep shows it faster): each warp streams its weights through a ring of S slots in shared
// memory with cp.async, S - 1 chunks ahead, and never waits on another warp until the end.
//
// Why: Nsight Compute on ffi/w8a16_mma.cuh's 7B rules (docs/results/2026-12-06-h100-mma-profile.md) found its
// warps waiting on global loads (long scoreboard 6.4-7.1 cycles an issued instruction, issue slots 29-39% busy,
// DRAM 52-59%) and, at 64 rows, 252 registers a thread (12% of warps active). That kernel holds its U chunks in
// flight in registers and only between its compute rounds. Here the bytes in flight live in shared memory, so
// they cost no registers and stay in flight while the warp computes: a warp's weights (RT 16-row tiles), their
// scales and, with XR, its rows of x for a chunk fill one slot. Each thread copies exactly the bytes it will read
// back (its own 16 bytes of a weight row, its own two scales a tile, its own 32 bytes of an x row), so
// cp.async.wait_group alone makes a slot readable: no barrier, no warp sync. Without XR, x is read through L1
// as in ffi/w8a16_mma.cuh.
//
// The arithmetic is ffi/w8a16_mma.cuh's, fragment for fragment (the same K permutation, the same exact int8
// conversion, each 64-input scale group summed apart and scaled per row, the KS warps' partial tiles summed in
// shared memory at the end); the loop order differs: all RT tiles' A fragments are converted first, then x is
// taken a tile of 8 rows at a time (fewer live registers at 64 rows).
#pragma once

#include "w8a16_mma.cuh"

namespace jaxllm {
namespace w8a16 {
namespace mma_ring {

using mma::Int8x4ToBf16;
using mma::kChunk;
using mma::Mma;

__device__ __forceinline__ uint32_t SharedAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// 16 bytes global -> shared, L1 bypassed, L2 asked for the 256 bytes around; zeros (nothing read) when !ok.
__device__ __forceinline__ void Copy16(void* dst, const void* src, bool ok = true) {
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(SharedAddr(dst)), "l"(src),
               "r"(ok ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void Copy4(void* dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(SharedAddr(dst)), "l"(src) : "memory");
}
__device__ __forceinline__ void Commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void WaitGroup() {
  asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// One slot, per warp: weights [RT][2 halves][32 lanes] x 16 bytes, scales [RT][2][32] f32, then with XR
// x [MT][2 pieces][32 lanes] x 16 bytes.
__host__ __device__ constexpr int WeightBytes(int rt) { return rt * 2 * 32 * 16; }
__host__ __device__ constexpr int SlotBytes(int mt, int rt, bool xr) { return WeightBytes(rt) + rt * 2 * 32 * 4 + (xr ? mt * 2 * 32 * 16 : 0); }
constexpr size_t RingBytes(int mt, int rt, int ks, int s, bool xr) { return size_t(ks) * s * SlotBytes(mt, rt, xr); }
constexpr size_t PartialBytes(int mt, int rt, int ks) { return size_t(ks) * 16 * rt * 8 * mt * sizeof(float); }
constexpr size_t SmemBytes(int mt, int rt, int ks, int s, bool xr) {   // the partial tiles reuse the rings
  return RingBytes(mt, rt, ks, s, xr) > PartialBytes(mt, rt, ks) ? RingBytes(mt, rt, ks, s, xr)
                                                                 : PartialBytes(mt, rt, ks);
}

// One block: rows [16 RT blockIdx.x, +16 RT) of w, rows [8 MT blockIdx.y, +8 MT) of x; warp i takes the i-th of
// KS contiguous ranges of the chunks. x [M, K] bf16, w [N, K] int8, scale [N, K / 64] f32, y [M, N] bf16.
// K % 64 == 0.
template <int MT, int RT, int KS, int S, bool XR>
__global__ void __launch_bounds__(KS * 32) Kernel(const __nv_bfloat16* __restrict__ x, const int8_t* __restrict__ w,
                                                  const float* __restrict__ scale, __nv_bfloat16* __restrict__ y,
                                                  int m, int n, int k) {
  static_assert(S >= 2 && MT >= 1 && RT >= 1 && KS >= 1 && KS <= 32, "a ring of at least two slots");
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kSlot = SlotBytes(MT, RT, XR);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int chunks = k / kChunk, row0 = blockIdx.x * 16 * RT, xrow0 = blockIdx.y * 8 * MT;
  const int begin = warp * chunks / KS, count = (warp + 1) * chunks / KS - begin;
  unsigned char* ring = smem + size_t(warp) * S * kSlot;

  // This thread's rows of w (g and g + 8 of each 16-row tile; a row past N reads row N - 1, never written)
  // and of x (g of each 8-row tile; a row past M contributes zeros), at the warp's first chunk.
  const int8_t* wrow[RT][2];
  const float* srow[RT][2];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = min(row0 + 16 * r + 8 * h + g, n - 1);
      wrow[r][h] = w + size_t(row) * k + size_t(begin) * kChunk + 16 * c;
      srow[r][h] = scale + size_t(row) * chunks + begin;
    }
  const __nv_bfloat16* xrow[MT];
  bool xlive[MT];
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    const int row = xrow0 + 8 * t + g;
    xlive[t] = row < m;
    xrow[t] = x + size_t(xlive[t] ? row : 0) * k + size_t(begin) * kChunk + 16 * c;
  }

  // Chunk i of the warp's range into slot `slot`; a group is committed even when there is no chunk i, so the
  // count of groups after chunk i's is always S - 2 when it is waited for.
  auto issue = [&](int i, int slot) {
    if (i < count) {
      unsigned char* p = ring + slot * kSlot;
      uint4* ws = reinterpret_cast<uint4*>(p);
      float* ss = reinterpret_cast<float*>(p + WeightBytes(RT));
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          Copy16(ws + (2 * r + h) * 32 + lane, wrow[r][h] + size_t(i) * kChunk);
          Copy4(ss + (2 * r + h) * 32 + lane, srow[r][h] + i);
        }
      if constexpr (XR) {
        uint4* xs = reinterpret_cast<uint4*>(p + WeightBytes(RT) + RT * 2 * 32 * 4);
#pragma unroll
        for (int t = 0; t < MT; ++t)
#pragma unroll
          for (int j = 0; j < 2; ++j) Copy16(xs + (2 * t + j) * 32 + lane, xrow[t] + size_t(i) * kChunk + 8 * j, xlive[t]);
      }
    }
    Commit();
  };

  float acc[RT][MT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][t][i] = 0.f;

#pragma unroll
  for (int i = 0; i < S - 1; ++i) issue(i, i);
  int slot = 0;
#pragma unroll 1
  for (int i = 0; i < count; ++i) {
    WaitGroup<S - 2>();                                    // chunk i's copies (this thread's own) have landed
    const unsigned char* p = ring + slot * kSlot;
    const uint4* ws = reinterpret_cast<const uint4*>(p);
    const float* ss = reinterpret_cast<const float*>(p + WeightBytes(RT));
    uint32_t a[RT][4][4];                                  // [tile][step j] the A fragment
    float sc[RT][2];
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      const uint4 q0 = ws[(2 * r) * 32 + lane], q1 = ws[(2 * r + 1) * 32 + lane];
      sc[r][0] = ss[(2 * r) * 32 + lane];
      sc[r][1] = ss[(2 * r + 1) * 32 + lane];
      const uint32_t w0[4] = {q0.x, q0.y, q0.z, q0.w}, w1[4] = {q1.x, q1.y, q1.z, q1.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        Int8x4ToBf16(w0[j], a[r][j][0], a[r][j][2]);       // row g: inputs 4j, 4j+1 | 4j+2, 4j+3
        Int8x4ToBf16(w1[j], a[r][j][1], a[r][j][3]);       // row g + 8
      }
    }
    const uint4* xs = reinterpret_cast<const uint4*>(p + WeightBytes(RT) + RT * 2 * 32 * 4);
    // Refill the slot read in the previous step (its reads were used by that step's MMAs, so they are done).
    issue(i + S - 1, slot == 0 ? S - 1 : slot - 1);
    slot = slot + 1 == S ? 0 : slot + 1;
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      uint4 xv[2];                                         // 16 bf16 of x: words 2j, 2j+1 are step j's
      if constexpr (XR) {
        xv[0] = xs[(2 * t) * 32 + lane];
        xv[1] = xs[(2 * t + 1) * 32 + lane];
      } else {
        const uint4* q = reinterpret_cast<const uint4*>(xrow[t] + size_t(i) * kChunk);
        xv[0] = xlive[t] ? __ldg(q) : make_uint4(0, 0, 0, 0);
        xv[1] = xlive[t] ? __ldg(q + 1) : make_uint4(0, 0, 0, 0);
      }
      const uint32_t xw[8] = {xv[0].x, xv[0].y, xv[0].z, xv[0].w, xv[1].x, xv[1].y, xv[1].z, xv[1].w};
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < 4; ++j) Mma(part, a[r][j], xw[2 * j], xw[2 * j + 1], part);
        acc[r][t][0] += part[0] * sc[r][0];               // rows g (d0, d1) and g + 8 (d2, d3)
        acc[r][t][1] += part[1] * sc[r][0];
        acc[r][t][2] += part[2] * sc[r][1];
        acc[r][t][3] += part[3] * sc[r][1];
      }
    }
  }
  WaitGroup<0>();                                          // the trailing (empty) groups
  __syncthreads();                                         // every warp is done with its ring

  // The fragment: d0, d1 at (row g, x rows 2c, 2c + 1), d2, d3 at (row g + 8, the same x rows).
  float* partial = reinterpret_cast<float*>(smem);         // [KS][8 MT][16 RT]
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

template <int MT, int RT, int KS, int S, bool XR>
cudaError_t Launch(cudaStream_t stream, const __nv_bfloat16* x, const int8_t* w, const float* scale,
                   __nv_bfloat16* y, int m, int n, int k) {
  auto kernel = Kernel<MT, RT, KS, S, XR>;
  constexpr size_t smem = SmemBytes(MT, RT, KS, S, XR);
  static_assert(smem <= (227 << 10), "more shared memory than a Hopper block may have");
  if constexpr (smem > (48 << 10)) {   // the opt-in to more dynamic shared memory, once
    static const cudaError_t opted =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (opted != cudaSuccess) return opted;
  }
  const dim3 grid((n + 16 * RT - 1) / (16 * RT), (m + 8 * MT - 1) / (8 * MT));
  kernel<<<grid, KS * 32, smem, stream>>>(x, w, scale, y, m, n, k);
  return cudaGetLastError();
}

}  // namespace mma_ring
}  // namespace w8a16
}  // namespace jaxllm
