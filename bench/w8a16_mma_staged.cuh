// A candidate for ffi/w8a16_mma.cuh at 16-64 rows of x, timed beside it by bench/gemv_sweep.cu (not in the
// extension until the sweep shows it faster on the H200): x staged once per block in shared memory and shared
// by several warps that own different rows of w.
//
// Why: ffi/w8a16_mma.cuh's warps split K, so no two warps of a block read the same x; at 64 rows each warp reads
// 4-8 bytes of x (through L1, mostly from L2) per weight byte, and the 7B matmuls ran at 1.0-1.35 TB/s
// (docs/results/2026-12-04-h200-scaling.md). Here a block is KS groups of NW warps: the groups split K as
// before, and the NW warps of a group own different rows (RT 16-row tiles each) of the same K range, so the
// group copies each slab of x (U chunks of 64 inputs, all 8 MT rows) from global memory once (cp.async, into
// one of two buffers while the other is read) and its warps read it from shared memory: x's global traffic
// per weight byte falls by NW (against ffi/w8a16_mma.cuh at the same RT). Each warp loads the next slab's
// weights before it computes the current one (two register buffers). The arithmetic is ffi/w8a16_mma.cuh's, fragment for fragment: the same K
// permutation (a thread's x operands are two 16-byte words of a row, read here from shared memory with rows
// padded by 16 bytes: conflict-free), the same exact int8 conversion, each 64-input scale group summed apart
// and scaled per row, then the groups' partial tiles summed in shared memory.
//
// Measured (H100 80GB, 2026-12-05, docs/results/2026-12-05-h100-tensor-cores.md): right on every shape; at the
// 7B matmuls slower than ffi/w8a16_mma.cuh except the LM head (151936 x 3584), where it is faster at 16, 32 and
// 64 rows (228.0, 288.2, 410.9 us against 268.1, 341.6, 429.8 in one call). Not dispatched yet.
#pragma once

#include "w8a16_mma.cuh"

namespace jaxllm {
namespace w8a16 {
namespace mma_staged {

using mma::Int8x4ToBf16;
using mma::kChunk;
using mma::LoadWeights;
using mma::Mma;

__device__ __forceinline__ void CopyAsync16(void* dst, const void* src, bool ok) {   // zeros when !ok
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void CopyAsyncCommit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
__device__ __forceinline__ void CopyAsyncWaitAll() { asm volatile("cp.async.wait_all;" ::: "memory"); }
// Barrier of one group's warps (ids 1..KS; 0 is __syncthreads').
__device__ __forceinline__ void GroupSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Row pitch of a staged slab, in bf16: U chunks and 16 bytes of padding (consecutive rows 16 bytes apart in
// the banks, so a quarter warp's eight 16-byte reads of two rows hit all 32 banks once).
__host__ __device__ constexpr int Pitch(int u) { return u * kChunk + 8; }
constexpr size_t StageBytes(int mt, int ks, int u) { return size_t(ks) * 2 * 8 * mt * Pitch(u) * 2; }
constexpr size_t PartialBytes(int mt, int rt, int nw, int ks) { return size_t(ks) * 8 * mt * 16 * rt * nw * 4; }
constexpr size_t SmemBytes(int mt, int rt, int nw, int ks, int u) {
  return StageBytes(mt, ks, u) > PartialBytes(mt, rt, nw, ks) ? StageBytes(mt, ks, u) : PartialBytes(mt, rt, nw, ks);
}

// One block: rows [16 RT NW blockIdx.x, +16 RT NW) of w, rows [8 MT blockIdx.y, +8 MT) of x.
// x [M, K] bf16, w [N, K] int8, scale [N, K / 64] f32, y [M, N] bf16. K % 64 == 0.
template <int MT, int RT, int NW, int KS, int U>
__global__ void __launch_bounds__(NW * KS * 32) Kernel(const __nv_bfloat16* __restrict__ x,
                                                       const int8_t* __restrict__ w, const float* __restrict__ scale,
                                                       __nv_bfloat16* __restrict__ y, int m, int n, int k) {
  static_assert(KS >= 1 && KS <= 15, "one named barrier a group: ids 1..15 (0 is __syncthreads')");
  static_assert(NW * KS * 32 <= 1024 && MT >= 1 && RT >= 1 && U >= 1, "a block of at most 1024 threads");
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kRowsX = 8 * MT, kPitch = Pitch(U), kGroupThreads = NW * 32, kRowsW = 16 * RT * NW;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int group = warp / NW, wig = warp % NW, gtid = threadIdx.x % kGroupThreads;
  const int chunks = k / kChunk, row0 = blockIdx.x * kRowsW + 16 * RT * wig, xrow0 = blockIdx.y * kRowsX;
  const int begin = group * chunks / KS, end = (group + 1) * chunks / KS;
  // [2][8 MT][kPitch] bf16: this group's two slab buffers.
  __nv_bfloat16* stage = reinterpret_cast<__nv_bfloat16*>(smem) + size_t(group) * 2 * kRowsX * kPitch;

  const int8_t* wrow[RT][2];
  const float* srow[RT][2];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = min(row0 + 16 * r + 8 * h + g, n - 1);   // a row past N reads row N - 1, never written
      wrow[r][h] = w + size_t(row) * k + 16 * c;
      srow[r][h] = scale + size_t(row) * chunks;
    }

  // The group's copy of slab [base, base + U) of x into buffer b: 8 MT rows x U chunks, 16 bytes a copy;
  // rows past M and chunks past the range are zeros.
  auto stage_slab = [&](int base, int b) {
    __nv_bfloat16* dst = stage + size_t(b) * kRowsX * kPitch;
    for (int i = gtid; i < kRowsX * U * 8; i += kGroupThreads) {
      const int row = i / (U * 8), piece = i % (U * 8), u = piece / 8, xm = xrow0 + row;
      const bool ok = xm < m && base + u < end;
      CopyAsync16(dst + row * kPitch + piece * 8, x + size_t(ok ? xm : 0) * k + size_t(ok ? base + u : 0) * kChunk +
                  (piece % 8) * 8, ok);
    }
    CopyAsyncCommit();
  };
  auto load_weights = [&](int base, uint4 (&wq)[U][RT][2], float (&sc)[U][RT][2]) {
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
  };

  float acc[RT][MT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][t][i] = 0.f;

  // Two register buffers of weights, used in turn (named apart, so that no register array is indexed at run
  // time): slab i computes from one while slab i + 1's loads land in the other.
  uint4 wqa[U][RT][2], wqb[U][RT][2];
  float sca[U][RT][2], scb[U][RT][2];
  if (begin < end) {
    stage_slab(begin, 0);
    load_weights(begin, wqa, sca);
  }
  CopyAsyncWaitAll();
  GroupSync(group + 1, kGroupThreads);
  // One slab: the next one's x and weights put in flight, this one's computed from buffer b and (wq, sc).
  auto step = [&](int base, int b, const uint4 (&wq)[U][RT][2], const float (&sc)[U][RT][2],
                  uint4 (&wq_next)[U][RT][2], float (&sc_next)[U][RT][2]) {
    if (base + U < end) {
      stage_slab(base + U, b ^ 1);
      load_weights(base + U, wq_next, sc_next);
    }
    const __nv_bfloat16* xs = stage + size_t(b) * kRowsX * kPitch + 16 * c;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + u >= end) break;
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        uint32_t a[4][4];                            // [step j] the A fragment
        const uint32_t q0[4] = {wq[u][r][0].x, wq[u][r][0].y, wq[u][r][0].z, wq[u][r][0].w};
        const uint32_t q1[4] = {wq[u][r][1].x, wq[u][r][1].y, wq[u][r][1].z, wq[u][r][1].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          Int8x4ToBf16(q0[j], a[j][0], a[j][2]);     // row g: inputs 4j, 4j+1 | 4j+2, 4j+3
          Int8x4ToBf16(q1[j], a[j][1], a[j][3]);     // row g + 8
        }
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          const uint4* p = reinterpret_cast<const uint4*>(xs + (8 * t + g) * kPitch + u * kChunk);
          const uint4 x0 = p[0], x1 = p[1];
          const uint32_t xw[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
          float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int j = 0; j < 4; ++j) Mma(part, a[j], xw[2 * j], xw[2 * j + 1], part);
          acc[r][t][0] += part[0] * sc[u][r][0];     // rows g (d0, d1) and g + 8 (d2, d3)
          acc[r][t][1] += part[1] * sc[u][r][0];
          acc[r][t][2] += part[2] * sc[u][r][1];
          acc[r][t][3] += part[3] * sc[u][r][1];
        }
      }
    }
    CopyAsyncWaitAll();                              // the next slab is in; every warp is done with this one
    GroupSync(group + 1, kGroupThreads);
  };
  for (int base = begin; base < end; base += 2 * U) {
    step(base, 0, wqa, sca, wqb, scb);
    if (base + U >= end) break;
    step(base + U, 1, wqb, scb, wqa, sca);
  }

  // The groups' partial tiles: [KS][8 MT][16 RT NW] f32 over the (now unused) stage.
  __syncthreads();
  float* partial = reinterpret_cast<float*>(smem);
  float* mine = partial + size_t(group) * kRowsX * kRowsW;
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int wr = 16 * RT * wig + 16 * r + g + 8 * (i / 2), xr = 8 * t + 2 * c + i % 2;
        mine[xr * kRowsW + wr] = acc[r][t][i];
      }
  __syncthreads();
  for (int o = threadIdx.x; o < kRowsX * kRowsW; o += NW * KS * 32) {
    const int xr = o / kRowsW, wr = o % kRowsW, row = blockIdx.x * kRowsW + wr, xm = xrow0 + xr;
    if (row >= n || xm >= m) continue;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < KS; ++i) sum += partial[size_t(i) * kRowsX * kRowsW + o];
    y[size_t(xm) * n + row] = __float2bfloat16(sum);
  }
}

template <int MT, int RT, int NW, int KS, int U>
cudaError_t Launch(cudaStream_t stream, const __nv_bfloat16* x, const int8_t* w, const float* scale,
                   __nv_bfloat16* y, int m, int n, int k) {
  auto kernel = Kernel<MT, RT, NW, KS, U>;
  constexpr size_t smem = SmemBytes(MT, RT, NW, KS, U);
  static_assert(smem <= (227 << 10), "more shared memory than an SM has");
  if constexpr (smem > (48 << 10)) {
    static const cudaError_t opted =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (opted != cudaSuccess) return opted;
  }
  const dim3 grid((n + 16 * RT * NW - 1) / (16 * RT * NW), (m + 8 * MT - 1) / (8 * MT));
  kernel<<<grid, NW * KS * 32, smem, stream>>>(x, w, scale, y, m, n, k);
  return cudaGetLastError();
}

}  // namespace mma_staged
}  // namespace w8a16
}  // namespace jaxllm
