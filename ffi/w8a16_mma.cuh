// The W8A16 matmul on tensor cores for 5-64 rows of x (batched decode): y[M, N] = x[M, K] . dequant(w, scale)^T
// with bf16 activations, int8 weights in the engine's row-major [N, K] layout and one f32 scale per 64 inputs
// of a row (jaxllm.quant.GROUP). cuda_kernels.cu reaches it through w8a16::Dispatch; bench/gemv_sweep.cu
// times its configurations.
//
// Weights are the A operand of mma.sync.m16n8k16 (16 rows of w, "swap AB": the output tile is y^T), x the B
// operand (8 rows of x a tile), so a batch of 8-64 wastes no weight bytes. The int8 weights are converted in
// registers (exactly: each byte under the exponent of 2^23 and one subtraction, then the upper half of the
// f32, which holds the integer exactly, as bf16), never written back. Each K chunk of 64 is one scale group:
// its four k16 steps accumulate into a fresh f32 fragment that is scaled per row and added, so the result
// is exact up to f32 accumulation, like the GEMV kernels (and unlike a bf16 dequantized weight).
//
// The K permutation: a 64-wide chunk is loaded as one 16-byte piece per thread and row (thread c of a
// quad takes inputs 16c..16c+15), and in k16 step j the mma's logical inputs {2c, 2c+1, 2c+8, 2c+9} are taken
// to be the physical inputs 16c + 4j + {0, 1, 2, 3}. The same map holds for the A fragment (rows of w) and
// the B fragment (columns of x^T): a dot product does not care about the order of its terms, and x's four
// bf16 of a step are then two consecutive 32-bit words of the thread's 32-byte load of x.
//
// Work split: a block of KS warps owns 16 * RT rows of w; warp i takes the i-th of KS contiguous ranges of
// the chunks (split K), keeping U chunks' weight loads in flight (L1 bypassed, 256-byte L2 prefetch); the
// warps' partial tiles meet in shared memory and the block writes y. x (reused by every block) is read
// through L1.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common.h"
#include "launch.cuh"

namespace jaxllm {
namespace w8a16 {
namespace mma {

constexpr int kChunk = 64;    // inputs per chunk: one scale group
constexpr int kMinM = 5;      // rows of x from which Dispatch takes this kernel (M <= 4: the GEMV kernels)
constexpr int kMaxM = 64;     // rows of x per block column (more: further block columns, each reading w again)

// Whether w8a16::Dispatch hands a bf16 matmul of m rows, scale group `group` and K = k to this kernel.
inline bool Takes(int64_t m, int64_t group, int64_t k) { return m >= kMinM && group == kChunk && k % kChunk == 0; }

// Four int8 weights (one 32-bit word, lowest byte first) as two bf16x2: lo = (b0, b1), hi = (b2, b3).
__device__ __forceinline__ void Int8x4ToBf16(uint32_t q, uint32_t& lo, uint32_t& hi) {
  const uint32_t u = q ^ 0x80808080u;                     // b + 128 in each byte
  constexpr float kBias = 8388736.f;                      // 2^23 + 128
  const float f0 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7650)) - kBias;
  const float f1 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7651)) - kBias;
  const float f2 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7652)) - kBias;
  const float f3 = __uint_as_float(__byte_perm(u, 0x4B000000u, 0x7653)) - kBias;
  lo = __byte_perm(__float_as_uint(f0), __float_as_uint(f1), 0x7632);
  hi = __byte_perm(__float_as_uint(f2), __float_as_uint(f3), 0x7632);
}

// d = a . b + c for one 16x8x16 tile (bf16 inputs, f32 accumulators).
__device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                                    const float (&c)[4]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%10, %11, %12, %13};"
      : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

__device__ __forceinline__ uint4 LoadWeights(const int8_t* p) {
  uint4 v;
  asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p));
  return v;
}

// Shared memory of a block: the KS warps' partial [16 RT, 8 MT] tiles in f32.
constexpr size_t SmemBytes(int mt, int rt, int ks) { return size_t(ks) * 16 * rt * 8 * mt * sizeof(float); }

// One block: rows [16 RT blockIdx.x, +16 RT) of w, rows [8 MT blockIdx.y, +8 MT) of x.
// x [M, K] bf16, w [N, K] int8, scale [N, K / 64] f32, y [M, N] bf16. K % 64 == 0.
template <int MT, int RT, int KS, int U, bool PDL = false>
__global__ void __launch_bounds__(KS * 32) Kernel(const __nv_bfloat16* __restrict__ x, const int8_t* __restrict__ w,
                                                  const float* __restrict__ scale, __nv_bfloat16* __restrict__ y,
                                                  int m, int n, int k) {
  extern __shared__ float partial[];                     // [KS][8 MT][16 RT]
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int chunks = k / kChunk, row0 = blockIdx.x * 16 * RT, xrow0 = blockIdx.y * 8 * MT;
  const int begin = warp * chunks / KS, end = (warp + 1) * chunks / KS;

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

  // x's 16 bf16 of chunk q per tile: words 2j, 2j + 1 are step j's.
  auto load_x = [&](int q, uint4 (&dst)[MT][2]) {
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      const uint4* p = reinterpret_cast<const uint4*>(xrow[t] + size_t(q) * kChunk);
      dst[t][0] = xlive[t] ? __ldg(p) : make_uint4(0, 0, 0, 0);
      dst[t][1] = xlive[t] ? __ldg(p + 1) : make_uint4(0, 0, 0, 0);
    }
  };
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
    if constexpr (PDL) {   // launched as a programmatic dependent: wait once the first weights are asked for
      if (base == begin) {
        GridDepLaunch();
        GridDepWait();
      }
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
      if (base + u >= end) break;
      uint4 xv[MT][2];
      load_x(base + u, xv);
#pragma unroll
      for (int r = 0; r < RT; ++r) {
        uint32_t a[4][4];                                  // [step j] the A fragment
        const uint32_t q0[4] = {wq[u][r][0].x, wq[u][r][0].y, wq[u][r][0].z, wq[u][r][0].w};
        const uint32_t q1[4] = {wq[u][r][1].x, wq[u][r][1].y, wq[u][r][1].z, wq[u][r][1].w};
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          Int8x4ToBf16(q0[j], a[j][0], a[j][2]);           // row g: inputs 4j, 4j+1 | 4j+2, 4j+3
          Int8x4ToBf16(q1[j], a[j][1], a[j][3]);           // row g + 8
        }
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          const uint32_t xw[8] = {xv[t][0].x, xv[t][0].y, xv[t][0].z, xv[t][0].w,
                                  xv[t][1].x, xv[t][1].y, xv[t][1].z, xv[t][1].w};
          float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
          for (int j = 0; j < 4; ++j) Mma(part, a[j], xw[2 * j], xw[2 * j + 1], part);
          acc[r][t][0] += part[0] * sc[u][r][0];           // rows g (d0, d1) and g + 8 (d2, d3)
          acc[r][t][1] += part[1] * sc[u][r][0];
          acc[r][t][2] += part[2] * sc[u][r][1];
          acc[r][t][3] += part[3] * sc[u][r][1];
        }
      }
    }
  }

  // The fragment: d0, d1 at (row g, x rows 2c, 2c + 1), d2, d3 at (row g + 8, the same x rows).
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

template <int MT, int RT, int KS, int U, bool PDL = false>
cudaError_t Launch(cudaStream_t stream, const __nv_bfloat16* x, const int8_t* w, const float* scale,
                   __nv_bfloat16* y, int m, int n, int k) {
  auto kernel = Kernel<MT, RT, KS, U, PDL>;
  constexpr size_t smem = SmemBytes(MT, RT, KS);
  if constexpr (smem > (48 << 10)) {   // the opt-in to more dynamic shared memory, once
    static const cudaError_t opted =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (opted != cudaSuccess) return opted;
  }
  const dim3 grid((n + 16 * RT - 1) / (16 * RT), (m + 8 * MT - 1) / (8 * MT));
  if constexpr (PDL)   // a programmatic dependent of the stream's previous kernel
    return LaunchEx(stream, true, grid, dim3(KS * 32), smem, kernel, x, w, scale, y, m, n, k);
  kernel<<<grid, KS * 32, smem, stream>>>(x, w, scale, y, m, n, k);
  return cudaGetLastError();
}

// The configurations a measured choice may name (jaxllm.tuning times them on the model's shapes when the engine
// loads, bench/gemv_sweep.cu beside others): index -> launch. Every one is right for any M (its 8 MT rows of x
// a block row; they sum K in different orders); `rows` is the row bucket (8, 16, 32, 64: Bucket) it is timed at. A
// saved choice holds for the extension build that timed it (jaxllm.tuning keys its file on the build's hash).
using LaunchFn = cudaError_t (*)(cudaStream_t, const __nv_bfloat16*, const int8_t*, const float*, __nv_bfloat16*,
                                 int, int, int);
struct Candidate {
  int rows;
  LaunchFn launch;
};
inline constexpr Candidate kCandidates[] = {
    {8, Launch<1, 1, 4, 4>},   {8, Launch<1, 1, 16, 2>},  {8, Launch<1, 1, 8, 4>},   {8, Launch<1, 1, 2, 4>},
    {8, Launch<1, 1, 1, 4>},   {8, Launch<1, 2, 4, 2>},
    {16, Launch<2, 1, 4, 4>},  {16, Launch<2, 1, 8, 8>},  {16, Launch<2, 2, 2, 4>},  {16, Launch<2, 1, 1, 4>},
    {16, Launch<2, 1, 2, 4>},  {16, Launch<2, 2, 8, 2>},  {16, Launch<2, 1, 16, 4>}, {16, Launch<2, 2, 1, 4>},
    {32, Launch<4, 1, 4, 4>},  {32, Launch<4, 1, 8, 4>},  {32, Launch<4, 2, 8, 2>},  {32, Launch<4, 1, 2, 4>},
    {32, Launch<4, 1, 1, 4>},  {32, Launch<4, 2, 2, 2>},
    {64, Launch<8, 2, 4, 2>},  {64, Launch<8, 2, 8, 1>},  {64, Launch<8, 2, 2, 2>},  {64, Launch<8, 2, 1, 2>},
    {64, Launch<8, 1, 8, 2>},  {64, Launch<8, 2, 16, 1>},
};
inline constexpr int kCandidateCount = int(sizeof(kCandidates) / sizeof(kCandidates[0]));
inline int Bucket(int m) { return m <= 8 ? 8 : m <= 16 ? 16 : m <= 32 ? 32 : 64; }

// The configuration by shape: `choice` (an index into kCandidates, measured on this GPU by jaxllm.tuning) when
// one is given, else the rule, from bench/gemv_sweep.cu on the H200 at M = 8, 16, 32, 64 over the 0.5B and 7B
// matmuls (docs/results/2026-12-04-h200-scaling.md): x tiles to cover M (up to kMaxM a block column); many
// 16-row tiles (N >= 4608: 7B's q/k/v, gate/up, the LM heads) split K over 4 warps with 4 chunks in flight,
// few over 8 or 16; from 33 rows two 16-row tiles a warp (x's L1 reads per weight byte halved). The LM heads
// (N >= 65536) at 9-16 rows: two 16-row tiles a warp, K over 2 warps, 23% faster than the rule above on the H100
// (Qwen2.5-7B's head, bench/gemv_sweep.cu) and 7-28% on the H200 (the 0.5B, 7B and 8B heads, jaxllm.tuning's
// timings): docs/results/2026-12-06-h100-autotune.md (lab switch JAXLLM_MMA_HEAD=0: the rule before, for an A/B).
inline cudaError_t Dispatch(cudaStream_t stream, const __nv_bfloat16* x, const int8_t* w, const float* scale,
                            __nv_bfloat16* y, int m, int n, int k, int choice = -1) {
  if (choice >= 0 && choice < kCandidateCount) return kCandidates[choice].launch(stream, x, w, scale, y, m, n, k);
  const int tiles = (n + 15) / 16;
  static const bool head_rule = LabFlag("JAXLLM_MMA_HEAD", true);
  const bool many = tiles >= 288, head = tiles >= 4096 && head_rule;
  if (m <= 8)
    return many ? Launch<1, 1, 4, 4>(stream, x, w, scale, y, m, n, k) : Launch<1, 1, 16, 2>(stream, x, w, scale, y, m, n, k);
  if (m <= 16 && head) return Launch<2, 2, 2, 4>(stream, x, w, scale, y, m, n, k);
  if (m <= 16)
    return many ? Launch<2, 1, 4, 4>(stream, x, w, scale, y, m, n, k) : Launch<2, 1, 8, 8>(stream, x, w, scale, y, m, n, k);
  if (m <= 32)
    return many ? Launch<4, 1, 4, 4>(stream, x, w, scale, y, m, n, k) : Launch<4, 1, 8, 4>(stream, x, w, scale, y, m, n, k);
  return tiles >= 2000 ? Launch<8, 2, 4, 2>(stream, x, w, scale, y, m, n, k) : Launch<8, 2, 8, 1>(stream, x, w, scale, y, m, n, k);
}

}  // namespace mma
}  // namespace w8a16
}  // namespace jaxllm
