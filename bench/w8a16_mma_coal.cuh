// A candidate for ffi/w8a16_mma.cuh at 9-64 rows of x, timed beside it by bench/mma_coal.cu: the same tensor-core
// arithmetic, fed from a block-wide ring of cp.async stages in shared memory whose global reads are whole row
// segments.
//
// Why: the earlier studies found the kernel in use neither bandwidth- nor issue-bound at 16 rows (DRAM 52-59% busy,
// issue 29-39%, docs/results/2026-12-06-h100-mma-profile.md): a warp has loads in flight only between its groups
// of chunks. Its loads alone reach the contiguous read only on a 1 KB-tiled weight layout
// (docs/results/2026-12-06-h100-matmul-study.md), because each load instruction touches 8 rows x 64 bytes. Two
// earlier rings through shared memory kept the kernel's per-lane load pattern (a lane copies what it reads back)
// and were no faster. Here the two are taken apart:
//   - the copies: every thread of the block copies 16-byte pieces so that consecutive lanes take consecutive
//     pieces of one row's KB x 64 bytes (a stage is BR rows of w x KB chunks, their scales, and the block's
//     8 MT rows of x over the same inputs), S stages in flight, one barrier a stage;
//   - the reads: each warp reads its fragments from the stage in shared memory, rows padded so that the
//     16-byte reads of a quarter warp hit distinct banks (w rows KB x 64 + 64 bytes apart, x rows KB x 128 + 16).
// The arithmetic is ffi/w8a16_mma.cuh's, fragment for fragment (the same K permutation and exact int8
// conversion, each 64-input scale group summed apart and scaled per row); warps split a stage's chunks (WK) and
// own different rows (WR groups of RT 16-row tiles), so the sums run in another order than the kernel's.
//
// Measured (H100 80GB, 2026-12-07, docs/results/2026-12-07-h100-ring.md; weights rotated over ~1 GB): right on
// every shape; faster than ffi/w8a16_mma.cuh's best only on the 7B gate/up at 13-16 rows (63.7-64.3 us against
// 66.6-66.8, two calls) and the 7B LM head at 64 rows (376 against 413), slower on the other 7B shapes and at 64
// rows. Not a tuning candidate: it takes K in whole stages only (kCandidates must take any K a multiple of 64).
// A persistent version (balanced tile ranges, the ring running on across a block's groups) was slower on every
// shape: git show 482ff81:bench/w8a16_mma_coal.cuh.
#pragma once

#include "w8a16_mma.cuh"

namespace jaxllm {
namespace w8a16 {
namespace mma_coal {

using mma::Int8x4ToBf16;
using mma::kChunk;
using mma::Mma;

__device__ __forceinline__ void Copy16(void* dst, const void* src, bool ok) {   // zeros when !ok
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(ok ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void Copy4(void* dst, const void* src) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d), "l"(src) : "memory");
}
__device__ __forceinline__ void Commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void WaitGroup() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

template <int MT, int RT, int WR, int WK, int KB, int S>
struct Geo {
  static_assert(KB % 2 == 0 && KB % WK == 0 && S >= 2, "KB even, a multiple of WK; two stages at least");
  static constexpr int kThreads = WR * WK * 32;
  static constexpr int kRowsW = 16 * RT * WR;       // rows of w a block
  static constexpr int kRowsX = 8 * MT;             // rows of x a block
  static constexpr int kPitchW = KB * kChunk + 64;  // bytes between w rows in a stage (= 64 mod 128)
  static constexpr int kPitchX = KB * 128 + 16;     // bytes between x rows (= 16 mod 128)
  static constexpr int kBytesW = kRowsW * kPitchW;
  static constexpr int kBytesS = kRowsW * KB * 4;
  static constexpr int kBytesX = kRowsX * kPitchX;
  static constexpr int kStage = kBytesW + kBytesS + kBytesX;
  static constexpr int kPartial = WK * kRowsX * kRowsW * 4;
  static constexpr int kSmem = S * kStage > kPartial ? S * kStage : kPartial;
};

// y [M, N] = x [M, K] . dequant(w [N, K], scale [N, K / 64])^T; K a multiple of 64 KB.
template <int MT, int RT, int WR, int WK, int KB, int S>
__global__ void __launch_bounds__(WR * WK * 32) Kernel(const __nv_bfloat16* __restrict__ x,
                                                       const int8_t* __restrict__ w, const float* __restrict__ scale,
                                                       __nv_bfloat16* __restrict__ y, int m, int n, int k) {
  using G = Geo<MT, RT, WR, WK, KB, S>;
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int wr = warp % WR, wk = warp / WR;
  const int chunks = k / kChunk, stages = chunks / KB;
  const int row0 = blockIdx.x * G::kRowsW, xrow0 = blockIdx.y * G::kRowsX;

  // Stage `st` into slot st % S (nothing past the last stage), then one commit group either way.
  auto issue = [&](int st) {
    if (st < stages) {
      unsigned char* base = smem + (st % S) * G::kStage;
      constexpr int kPiecesRow = KB * 4;                       // 16-byte pieces of a w row's stage
      for (int p = threadIdx.x; p < G::kRowsW * kPiecesRow; p += G::kThreads) {
        const int r = p / kPiecesRow, col = p % kPiecesRow, row = min(row0 + r, n - 1);
        Copy16(base + r * G::kPitchW + col * 16, w + size_t(row) * k + size_t(st) * KB * kChunk + col * 16, true);
      }
      float* sdst = reinterpret_cast<float*>(base + G::kBytesW);
      for (int p = threadIdx.x; p < G::kRowsW * KB; p += G::kThreads) {
        const int r = p / KB, q = p % KB, row = min(row0 + r, n - 1);
        Copy4(sdst + p, scale + size_t(row) * chunks + st * KB + q);
      }
      unsigned char* xdst = base + G::kBytesW + G::kBytesS;
      constexpr int kPiecesX = KB * 8;                          // 16-byte pieces of an x row's stage
      for (int p = threadIdx.x; p < G::kRowsX * kPiecesX; p += G::kThreads) {
        const int r = p / kPiecesX, col = p % kPiecesX, xr = xrow0 + r;
        const bool live = xr < m;
        Copy16(xdst + r * G::kPitchX + col * 16, x + size_t(live ? xr : 0) * k + size_t(st) * KB * kChunk + col * 8,
               live);
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
  for (int s = 0; s < S - 1; ++s) issue(s);
  for (int st = 0; st < stages; ++st) {
    WaitGroup<S - 2>();        // this thread's copies of stage st have landed
    __syncthreads();           // everyone's have, and nobody still reads the slot refilled next
    issue(st + S - 1);
    const unsigned char* ws = smem + (st % S) * G::kStage;
    const float* ss = reinterpret_cast<const float*>(ws + G::kBytesW);
    const unsigned char* xs = ws + G::kBytesW + G::kBytesS;
#pragma unroll
    for (int qq = 0; qq < KB / WK; ++qq) {
      const int q = wk * (KB / WK) + qq;
      uint32_t xw[MT][8];                                   // x row 8t + g, inputs 16c..16c+15 of chunk q
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        const uint4* p = reinterpret_cast<const uint4*>(xs + (8 * t + g) * G::kPitchX + q * 128 + 32 * c);
        const uint4 a = p[0], b = p[1];
        xw[t][0] = a.x, xw[t][1] = a.y, xw[t][2] = a.z, xw[t][3] = a.w;
        xw[t][4] = b.x, xw[t][5] = b.y, xw[t][6] = b.z, xw[t][7] = b.w;
      }
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        const int lr = (wr * RT + r) * 16 + g;              // rows lr and lr + 8 of the block
        const uint4 w0 = *reinterpret_cast<const uint4*>(ws + lr * G::kPitchW + q * kChunk + 16 * c);
        const uint4 w1 = *reinterpret_cast<const uint4*>(ws + (lr + 8) * G::kPitchW + q * kChunk + 16 * c);
        const float s0 = ss[lr * KB + q], s1 = ss[(lr + 8) * KB + q];
        uint32_t a[4][4];
        const uint32_t q0[4] = {w0.x, w0.y, w0.z, w0.w};
        const uint32_t q1[4] = {w1.x, w1.y, w1.z, w1.w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          Int8x4ToBf16(q0[j], a[j][0], a[j][2]);
          Int8x4ToBf16(q1[j], a[j][1], a[j][3]);
        }
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int j = 0; j < 4; ++j) Mma(part, a[j], xw[t][2 * j], xw[t][2 * j + 1], part);
          acc[r][t][0] += part[0] * s0;
          acc[r][t][1] += part[1] * s0;
          acc[r][t][2] += part[2] * s1;
          acc[r][t][3] += part[3] * s1;
        }
      }
    }
  }
  WaitGroup<0>();
  __syncthreads();

  // The WK warps of a row group meet in shared memory: partial [WK][rows of x][rows of w].
  float* partial = reinterpret_cast<float*>(smem);
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int lr = (wr * RT + r) * 16 + g + 8 * (i / 2), xr = 8 * t + 2 * c + i % 2;
        partial[(wk * G::kRowsX + xr) * G::kRowsW + lr] = acc[r][t][i];
      }
  __syncthreads();
  for (int o = threadIdx.x; o < G::kRowsX * G::kRowsW; o += G::kThreads) {
    const int xr = o / G::kRowsW, lr = o % G::kRowsW, row = row0 + lr, xm = xrow0 + xr;
    if (row >= n || xm >= m) continue;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < WK; ++i) sum += partial[i * G::kRowsX * G::kRowsW + o];
    y[size_t(xm) * n + row] = __float2bfloat16(sum);
  }
}

// Whether a configuration takes K (whole stages) and fits a block's shared memory on this GPU.
template <int MT, int RT, int WR, int WK, int KB, int S>
bool Fits(int k) {
  return k % (KB * kChunk) == 0 && Geo<MT, RT, WR, WK, KB, S>::kSmem <= 227 * 1024;
}

template <int MT, int RT, int WR, int WK, int KB, int S>
cudaError_t Launch(cudaStream_t stream, const __nv_bfloat16* x, const int8_t* w, const float* scale,
                   __nv_bfloat16* y, int m, int n, int k) {
  using G = Geo<MT, RT, WR, WK, KB, S>;
  auto kernel = Kernel<MT, RT, WR, WK, KB, S>;
  static const cudaError_t opted =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(G::kSmem));
  if (opted != cudaSuccess) return opted;
  const dim3 grid((n + G::kRowsW - 1) / G::kRowsW, (m + G::kRowsX - 1) / G::kRowsX);
  kernel<<<grid, G::kThreads, G::kSmem, stream>>>(x, w, scale, y, m, n, k);
  return cudaGetLastError();
}


}  // namespace mma_coal
}  // namespace w8a16
}  // namespace jaxllm
