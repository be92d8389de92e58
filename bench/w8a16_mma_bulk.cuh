// A candidate for ffi/w8a16_mma.cuh at 8-64 rows of x, timed beside it by bench/gemv_sweep.cu (sm_90a only; not
// in the extension): each warp streams its weights into shared memory with Hopper's bulk copies (cp.async.bulk,
// the TMA engine's 1-D form), one copy a weight row a stage, S stages of U chunks ahead, each stage counted on
// its own mbarrier. No thread issues a load a 16-byte piece (the per-thread cp.async rings, bench/w8a16_mma_ring.cuh
// and bench/w8a16_wgmma.cuh, were slower than loading into registers), and the bytes in flight cost no registers.
// The warps of a block never wait on each other until the end. x is read through L1 as in ffi/w8a16_mma.cuh, or
// (XB) bulk-copied into the stage too, each row padded by 16 bytes (conflict-free reads).
//
// The arithmetic is ffi/w8a16_mma.cuh's, fragment for fragment: the same K permutation (thread c of a quad reads
// inputs 16c..16c+15 of a row's chunk, here from shared memory), the same exact int8 conversion, each 64-input
// scale group summed apart and scaled per row, the KS warps' partial tiles summed in shared memory at the end.
#pragma once

#include "w8a16_mma.cuh"

namespace jaxllm {
namespace w8a16 {
namespace mma_bulk {

using mma::Int8x4ToBf16;
using mma::kChunk;
using mma::Mma;

__device__ __forceinline__ uint32_t SharedAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void BarInit(uint64_t* bar) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(SharedAddr(bar)) : "memory");
}
__device__ __forceinline__ void BarExpect(uint64_t* bar, uint32_t bytes) {   // the phase's one arrival
  asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }" ::"r"(SharedAddr(bar)),
               "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void BarWait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done)
                 : "r"(SharedAddr(bar)), "r"(parity)
                 : "memory");
}
// `bytes` (a multiple of 16, both addresses 16-byte aligned) global -> shared, counted on `bar`.
__device__ __forceinline__ void BulkCopy(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   SharedAddr(dst)),
               "l"(src), "r"(bytes), "r"(SharedAddr(bar))
               : "memory");
}

// A stage, per warp: weights [16 RT rows][U chunks of 64 bytes], then with XB x [8 MT rows][U x 128 + 16 bytes].
__host__ __device__ constexpr int XPitch(int u) { return u * kChunk * 2 + 16; }
__host__ __device__ constexpr int StageBytes(int mt, int rt, int u, bool xb) {
  return 16 * rt * u * kChunk + (xb ? 8 * mt * XPitch(u) : 0);
}
__host__ __device__ constexpr size_t BarBytes(int ks, int s) { return (size_t(ks) * s * 8 + 15) / 16 * 16; }
constexpr size_t PartialBytes(int mt, int rt, int ks) { return size_t(ks) * 16 * rt * 8 * mt * sizeof(float); }
constexpr size_t SmemBytes(int mt, int rt, int ks, int s, int u, bool xb) {   // the partial tiles reuse the stages
  return BarBytes(ks, s) + (size_t(ks) * s * StageBytes(mt, rt, u, xb) > PartialBytes(mt, rt, ks)
                                ? size_t(ks) * s * StageBytes(mt, rt, u, xb)
                                : PartialBytes(mt, rt, ks));
}

// One block: rows [16 RT blockIdx.x, +16 RT) of w, rows [8 MT blockIdx.y, +8 MT) of x; warp i takes the i-th of
// KS contiguous ranges of the chunks. x [M, K] bf16, w [N, K] int8, scale [N, K / 64] f32, y [M, N] bf16.
// K % 64 == 0; x, w 16-byte aligned.
template <int MT, int RT, int KS, int S, int U, bool XB>
__global__ void __launch_bounds__(KS * 32) Kernel(const __nv_bfloat16* __restrict__ x, const int8_t* __restrict__ w,
                                                  const float* __restrict__ scale, __nv_bfloat16* __restrict__ y,
                                                  int m, int n, int k) {
  static_assert(S >= 2 && U >= 1 && 16 * RT <= 32 && 8 * MT <= 64, "one bulk copy a lane for the weights' rows");
  // (x's rows, with XB: one or two a lane)
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) unsigned char smem[];
  constexpr int kStage = StageBytes(MT, RT, U, XB);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int chunks = k / kChunk, row0 = blockIdx.x * 16 * RT, xrow0 = blockIdx.y * 8 * MT;
  const int begin = warp * chunks / KS, count = (warp + 1) * chunks / KS - begin;
  const int steps = (count + U - 1) / U;
  uint64_t* bars = reinterpret_cast<uint64_t*>(smem) + warp * S;
  unsigned char* stages = smem + BarBytes(KS, S) + size_t(warp) * S * kStage;
  const int live_x = min(8 * MT, m - xrow0);             // x rows of this block's tile that exist

  if (lane < S) BarInit(bars + lane);
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  __syncwarp();

  // Step i (chunks begin + U i ..) into stage i % S: lane 0 arms the barrier with the bytes, then lane l copies
  // weight row l (rows past N: row N - 1, never written) and, with XB, x rows l and l + 32 (live rows only).
  auto issue = [&](int i) {
    if (i >= steps) return;
    const int c0 = begin + U * i, nv = min(U, count - U * i);
    unsigned char* st = stages + (i % S) * kStage;
    if (lane == 0) BarExpect(bars + i % S, uint32_t(nv * kChunk) * (16 * RT + (XB ? 2 * live_x : 0)));
    __syncwarp();
    if (lane < 16 * RT) {
      const int row = min(row0 + lane, n - 1);
      BulkCopy(st + lane * U * kChunk, w + size_t(row) * k + size_t(c0) * kChunk, nv * kChunk, bars + i % S);
    }
    if constexpr (XB) {   // up to 64 rows: two a lane (call 2 ran with one, rows 0-31: its 50- and 64-row XB hung)
      for (int r = lane; r < live_x; r += 32)
        BulkCopy(st + 16 * RT * U * kChunk + r * XPitch(U), x + size_t(xrow0 + r) * k + size_t(c0) * kChunk,
                 nv * kChunk * 2, bars + i % S);
    }
  };

  // This thread's rows of x (g of each 8-row tile; a row past M contributes zeros), for the reads through L1.
  const __nv_bfloat16* xrow[MT];
  bool xlive[MT];
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    const int row = xrow0 + 8 * t + g;
    xlive[t] = row < m;
    xrow[t] = x + size_t(xlive[t] ? row : 0) * k + 16 * c;
  }
  const float* srow[RT][2];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) srow[r][h] = scale + size_t(min(row0 + 16 * r + 8 * h + g, n - 1)) * chunks;

  float acc[RT][MT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][t][i] = 0.f;

#pragma unroll 1
  for (int i = 0; i < S - 1; ++i) issue(i);
#pragma unroll 1
  for (int i = 0; i < steps; ++i) {
    issue(i + S - 1);                                      // into the stage read in step i - 1 (synced below)
    const int c0 = begin + U * i, nv = min(U, count - U * i);
    float sc[U][RT][2];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) sc[u][r][h] = u < nv ? __ldg(srow[r][h] + c0 + u) : 0.f;
    BarWait(bars + i % S, (i / S) & 1);
    const unsigned char* st = stages + (i % S) * kStage;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (u >= nv) break;
      uint32_t a[RT][4][4];                                // [tile][step j] the A fragment
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        const uint4 q0 = *reinterpret_cast<const uint4*>(st + (16 * r + g) * U * kChunk + u * kChunk + 16 * c);
        const uint4 q1 = *reinterpret_cast<const uint4*>(st + (16 * r + 8 + g) * U * kChunk + u * kChunk + 16 * c);
        const uint32_t w0[4] = {q0.x, q0.y, q0.z, q0.w}, w1[4] = {q1.x, q1.y, q1.z, q1.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          Int8x4ToBf16(w0[j], a[r][j][0], a[r][j][2]);     // row g: inputs 4j, 4j+1 | 4j+2, 4j+3
          Int8x4ToBf16(w1[j], a[r][j][1], a[r][j][3]);     // row g + 8
        }
      }
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        uint4 xv[2];                                       // 16 bf16 of x: words 2j, 2j+1 are step j's
        if constexpr (XB) {
          const unsigned char* p = st + 16 * RT * U * kChunk + (8 * t + g) * XPitch(U) + u * kChunk * 2 + 32 * c;
          xv[0] = xlive[t] ? *reinterpret_cast<const uint4*>(p) : make_uint4(0, 0, 0, 0);
          xv[1] = xlive[t] ? *reinterpret_cast<const uint4*>(p + 16) : make_uint4(0, 0, 0, 0);
        } else {
          const uint4* p = reinterpret_cast<const uint4*>(xrow[t] + size_t(c0 + u) * kChunk);
          xv[0] = xlive[t] ? __ldg(p) : make_uint4(0, 0, 0, 0);
          xv[1] = xlive[t] ? __ldg(p + 1) : make_uint4(0, 0, 0, 0);
        }
        const uint32_t xw[8] = {xv[0].x, xv[0].y, xv[0].z, xv[0].w, xv[1].x, xv[1].y, xv[1].z, xv[1].w};
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
    // Every lane's reads of this stage are done before step i + 1 refills it (S >= 2: the refill of step i + 1
    // targets stage (i + S) % S = i % S); the async proxy's writes are ordered after them.
    __syncwarp();
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();                                         // every warp is done with its stages (all copies landed)

  // The fragment: d0, d1 at (row g, x rows 2c, 2c + 1), d2, d3 at (row g + 8, the same x rows).
  float* partial = reinterpret_cast<float*>(smem + BarBytes(KS, S));   // [KS][8 MT][16 RT]
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
#endif
}

template <int MT, int RT, int KS, int S, int U, bool XB>
cudaError_t Launch(cudaStream_t stream, const __nv_bfloat16* x, const int8_t* w, const float* scale,
                   __nv_bfloat16* y, int m, int n, int k) {
  auto kernel = Kernel<MT, RT, KS, S, U, XB>;
  constexpr size_t smem = SmemBytes(MT, RT, KS, S, U, XB);
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

}  // namespace mma_bulk
}  // namespace w8a16
}  // namespace jaxllm
