// The CUDA W8A16 matmul kernel, y[M, N] = x[M, K] . dequant(w[N, K], scale[N, G])^T, as one template
// that cuda_kernels.cu dispatches by shape and bench/gemv_sweep.cu times over its parameters.
//
// Weights stay in the row-major [N, K] int8 layout the rest of the engine uses (the XLA path and the CPU
// handlers read the same buffers): a row's K bytes are contiguous, so 16-byte loads by consecutive threads
// are coalesced and every weight byte is read once per call.
//
// Work split: a block of kThreads threads holds kThreads / TPR teams; a team of TPR threads computes ROWS
// output rows for MT rows of x, splitting K between its threads in 16-byte chunks (thread t takes chunks
// t, t + TPR, ...) with U chunks per row loaded before any is used. Large TPR suits long K and few rows
// (more loads in flight per row); TPR <= 32 suits short K and many rows (no cross-warp reduction), down to
// part of a warp (gate/up at K 896: 16 lanes of 4 chunks for 2 rows, half the threads of a warp per row).
//
// The inner product, one of three ways (Conv):
// - kI2F: int8 -> f32 by the conversion instruction (a quarter of the FMA rate), f32 FMAs.
// - kMagic: int8 -> f32 without it: byte b ^ 0x80 = b + 128 is placed under the exponent of 2^23 with one
//   byte permute, giving the float 2^23 + 128 + b exactly, and one subtraction of 2^23 + 128 leaves b
//   exactly; f32 FMAs. About 3 instructions per weight, most of them on the integer pipe (half the FMA rate).
// - kInt16: the 16 activations of a chunk become 16-bit integers with one f32 scale (x ~ s * q, q in
//   [-32767, 32767], s = max |x| / 32767: at least bf16's precision for every element within 2^7 of the
//   chunk's largest), and the weights meet them in integer dot products (dp2a: two int16 x int8 products
//   and an add, exact in int32), one conversion and FMA per 16 weights: about half an instruction per
//   weight. The chunk is quantized once per load of x (per warp in the streaming variant).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

#include "common.h"
#include "w8a16_mma.cuh"

namespace jaxllm {

template <typename T> __device__ __forceinline__ float ToF32(T v);
template <> __device__ __forceinline__ float ToF32<float>(float v) { return v; }
template <> __device__ __forceinline__ float ToF32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T FromF32(float v);
template <> __device__ __forceinline__ float FromF32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 FromF32<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

namespace w8a16 {

constexpr int kThreads = 256;

// Loads 16 consecutive activations x[0..15] as f32 (16-byte loads: 2 for bf16, 4 for f32).
__device__ __forceinline__ void Load16(const __nv_bfloat16* x, float* out) {
  const uint4 a = __ldg(reinterpret_cast<const uint4*>(x)), b = __ldg(reinterpret_cast<const uint4*>(x) + 1);
  const uint32_t words[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {   // bf16 -> f32 is a 16-bit shift
    out[2 * i] = __uint_as_float(words[i] << 16);
    out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void Load16(const float* x, float* out) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float4 f = __ldg(reinterpret_cast<const float4*>(x) + i);
    out[4 * i] = f.x; out[4 * i + 1] = f.y; out[4 * i + 2] = f.z; out[4 * i + 3] = f.w;
  }
}

// The same from shared memory (normalized x staged by the block, kNorm): plain loads, not the read-only path.
__device__ __forceinline__ void Load16Shared(const __nv_bfloat16* x, float* out) {
  const uint4 a = reinterpret_cast<const uint4*>(x)[0], b = reinterpret_cast<const uint4*>(x)[1];
  const uint32_t words[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    out[2 * i] = __uint_as_float(words[i] << 16);
    out[2 * i + 1] = __uint_as_float(words[i] & 0xffff0000u);
  }
}
__device__ __forceinline__ void Load16Shared(const float* x, float* out) {
#pragma unroll
  for (int i = 0; i < 16; ++i) out[i] = x[i];
}

enum class Conv { kI2F, kMagic, kInt16 };

// dot(x[0..15], w[0..15]) with w packed as 16 int8 in a uint4, in f32 (kI2F or kMagic).
template <Conv C>
__device__ __forceinline__ float Dot16(const float* x, uint4 w) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
  float s = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const uint32_t biased = words[j] ^ 0x80808080u;   // b + 128 per byte
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      float q;
      if constexpr (C == Conv::kMagic) {
        q = __uint_as_float(__byte_perm(biased, 0x4b000000u, 0x7650u | i)) - 8388736.f;   // 2^23 + 128
      } else {
        q = float(int8_t(words[j] >> (8 * i)));
      }
      s = fmaf(x[4 * j + i], q, s);
    }
  }
  return s;
}

// A 16-activation chunk of x as the inner product takes it: f32 values, or int16 pairs and a scale.
template <Conv C>
struct XChunk {
  float v[16];
};
template <>
struct XChunk<Conv::kInt16> {
  uint32_t q[8];   // (x[2i], x[2i + 1]) as int16, low half first
  float s;         // x ~ s * q
};

// x ~ s * q with q int16 (see kInt16 above).
__device__ __forceinline__ void QuantizeInt16(const float* v, XChunk<Conv::kInt16>& out) {
  float amax = 0.f, probe = 0.f;   // probe: +0, or NaN where a value is not finite (fmaxf would drop a NaN)
#pragma unroll
  for (int i = 0; i < 16; ++i) {
    amax = fmaxf(amax, fabsf(v[i]));
    probe = fmaf(v[i], 0.f, probe);
  }
  const float inv = amax > 0.f ? 32767.f / amax : 0.f;
  out.s = amax * (1.f / 32767.f) + probe;   // a chunk with a NaN or an infinity makes its products NaN
#pragma unroll
  for (int i = 0; i < 8; ++i) {   // 1.5 * 2^23 + v: the low mantissa bits hold round(v) in two's complement
    const uint32_t lo = __float_as_uint(fmaf(v[2 * i], inv, 12582912.f));
    const uint32_t hi = __float_as_uint(fmaf(v[2 * i + 1], inv, 12582912.f));
    out.q[i] = __byte_perm(lo, hi, 0x5410);
  }
}

template <Conv C, typename T, bool SHARED = false>
__device__ __forceinline__ void LoadX(const T* x, XChunk<C>& out) {
  if constexpr (C == Conv::kInt16) {
    float v[16];
    if constexpr (SHARED) Load16Shared(x, v); else Load16(x, v);
    QuantizeInt16(v, out);
  } else {
    if constexpr (SHARED) Load16Shared(x, out.v); else Load16(x, out.v);
  }
}

template <Conv C>
__device__ __forceinline__ void ZeroX(XChunk<C>& out) {
  if constexpr (C == Conv::kInt16) {
#pragma unroll
    for (int i = 0; i < 8; ++i) out.q[i] = 0u;
    out.s = 0.f;
  } else {
#pragma unroll
    for (int i = 0; i < 16; ++i) out.v[i] = 0.f;
  }
}

// acc + scale * dot(x chunk, w chunk).
template <Conv C>
__device__ __forceinline__ float Accumulate(float acc, const XChunk<C>& x, uint4 w, float scale) {
  if constexpr (C == Conv::kInt16) {
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
    int d = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {   // bytes 4j, 4j + 1 with q[2j]; bytes 4j + 2, 4j + 3 with q[2j + 1]
      d = __dp2a_lo(int(x.q[2 * j]), int(words[j]), d);
      d = __dp2a_hi(int(x.q[2 * j + 1]), int(words[j]), d);
    }
    return fmaf(float(d), x.s * scale, acc);
  } else {
    return fmaf(Dot16<C>(x.v, w), scale, acc);
  }
}

// A 16-byte weight load. HINT: read-only path without L1 allocation and a 256-byte L2 prefetch (weights are
// read once per call; x and the scales keep L1); otherwise the plain read-only load.
template <bool HINT>
__device__ __forceinline__ uint4 LoadW(const uint4* p) {
  if constexpr (HINT) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
  } else {
    return __ldg(p);
  }
}

// floor(c / d) for c * d < 2^32 as one multiply-high by magic = ceil(2^32 / d) (d = 1: magic 0).
__device__ __forceinline__ int DivSmall(int c, uint32_t magic) { return magic ? int(__umulhi(uint32_t(c), magic)) : c; }
inline uint32_t DivMagic(uint32_t d) { return d == 1 ? 0u : uint32_t(((uint64_t(1) << 32) + d - 1) / d); }

// Sums each of V values over groups of W lanes (W a power of two <= 32, lane = the index within the group)
// in V - 1 + log2(W / V) shuffles instead of V log2(W): each of the first log2(V) steps halves the values a
// lane holds, keeping one half and trading the other with its partner. Afterwards a[0] holds the group's
// total of value lane / (W / V), which the function returns.
template <int V, int W>
__device__ __forceinline__ int GroupSumEach(float (&a)[V], int lane) {
  static_assert(W <= 32 && (W & (W - 1)) == 0 && (V & (V - 1)) == 0 && V <= W, "powers of two, V <= W <= 32");
  int off = W / 2;
#pragma unroll
  for (int h = V / 2; h >= 1; h /= 2, off /= 2) {
    const bool upper = lane & off;
#pragma unroll
    for (int i = 0; i < h; ++i) {
      const float keep = upper ? a[i + h] : a[i], send = upper ? a[i] : a[i + h];
      a[i] = keep + __shfl_xor_sync(0xffffffffu, send, off);
    }
  }
#pragma unroll
  for (; off > 0; off /= 2) a[0] += __shfl_xor_sync(0xffffffffu, a[0], off);
  return lane / (W / V);
}

// Shared memory of a kInt16 block that stages x (kStageX): MT rows of K / 16 chunks, 16 int16 and a scale each.
constexpr size_t XStageBytes(int mt, int k) { return size_t(mt) * (k / 16) * (2 * sizeof(uint4) + sizeof(float)); }
constexpr size_t kMaxXStageBytes = 48 << 10;   // without the opt-in to more dynamic shared memory
// Chunk i of staged x: its 16 int16 as two uint4 at x_stage[2 i], its scale at xs_stage[i].
__device__ __forceinline__ void StoreStaged(uint4* x_stage, float* xs_stage, int i, const XChunk<Conv::kInt16>& xc) {
  x_stage[2 * i] = make_uint4(xc.q[0], xc.q[1], xc.q[2], xc.q[3]);
  x_stage[2 * i + 1] = make_uint4(xc.q[4], xc.q[5], xc.q[6], xc.q[7]);
  xs_stage[i] = xc.s;
}
__device__ __forceinline__ void LoadStaged(const uint4* x_stage, const float* xs_stage, int i, XChunk<Conv::kInt16>& xc) {
  const uint4 a = x_stage[2 * i], b = x_stage[2 * i + 1];
  xc.q[0] = a.x; xc.q[1] = a.y; xc.q[2] = a.z; xc.q[3] = a.w;
  xc.q[4] = b.x; xc.q[5] = b.y; xc.q[6] = b.z; xc.q[7] = b.w;
  xc.s = xs_stage[i];
}
// Shared memory of a kNorm block without kStageX: MT normalized rows of x in T.
template <typename T>
constexpr size_t NormStageBytes(int mt, int k) { return size_t(mt) * k * sizeof(T); }

// Options of a configuration (F: a bitwise or of these).
enum : unsigned {
  kHint = 1u,      // weight loads without L1 allocation and with a 256-byte L2 prefetch (LoadW)
  kStageX = 2u,    // kInt16 only: the block quantizes its MT rows of x into shared memory once (dynamic shared
                   // memory of XStageBytes(MT, K)) instead of every thread quantizing each chunk it uses
  kXFirst = 4u,    // with kStageX: stage x before issuing the weight loads, not after them (the staging threads
                   // then wait on x alone; faster on the H200 for gate/up at M = 1 with kBalance in the sweep, and
                   // at M > 1). Ignored with kNorm, whose first weight loads always go out before the wait. In the
                   // fused step O and down (kResidual) were faster without it (h100-x-first), which a sweep of
                   // one kernel alone cannot show: its loads then overlap the previous kernel's tail.
  kBalance = 8u,   // block b takes its even share [b N / grid, (b + 1) N / grid) of the rows, its teams taking
                   // them round robin (team t: rows lo + t, lo + t + kTeams, ..., at most ROWS), so that a grid
                   // of a whole number of blocks per SM shares the rows evenly between the SMs (see Launch).
  // Fusions (the decode step's prologue and epilogues; docs/kernels.md):
  kNorm = 16u,     // x is the f32 residual stream: each block computes its rows' RMS and stages
                   // T(x * rsqrt(mean(x^2) + eps) * norm_w) in shared memory (int16 chunks with kStageX)
  kResidual = 32u, // y (f32) = res + T(x . w): the residual add of the O and down projections
  kSwiGLU = 64u,   // w holds [gate; up] (2F rows); y [M, F] = T(silu(T(gate)) * T(up)); ROWS even: a team's
                   // rows are gate and up of the same outputs
  kArgmax = 128u,  // no y: the greedy token. y is uint32 [M, 4], zeroed by the caller: words 0-1 the
                   // largest (orderable T(x . w) << 32 | ~row) by a 64-bit atomic max (ties: the lowest row,
                   // as argmax), word 2 set where a value is not finite
};

// The fused operands: the norm weight [K] and eps (kNorm), the residual [M, N] (kResidual, may be y itself:
// each element is read and then written by one thread); pdl: launch as a programmatic dependent of the
// previous kernel on the stream (the kernel issues its first weight loads, then waits for that kernel);
// early: with pdl, let the next kernel launch just before this one waits (after issuing its first weight
// loads, except where kXFirst stages x first), not once its weights are read, so that the next kernel's loads
// overlap this one's whole run.
struct Fuse {
  const float* norm_w = nullptr;
  float eps = 0.f;
  const float* res = nullptr;
  bool pdl = false;
  bool early = false;
  // Loads moved off the path after the wait: the norm weight's lines asked into L1 before it (kNorm), the
  // residual element loaded right after it (kResidual). JAXLLM_PREFETCH=0 turns both off, for comparison.
  bool prefetch = true;
  // Ints the kernel's first block zeroes, or null: the layers call's first kernel zeroes the attention
  // counters and the greedy head's output (no memset nodes).
  int32_t* zero = nullptr;
  int zero_n = 0;
  int32_t* zero2 = nullptr;
  int zero2_n = 0;
};

// f32 -> uint32 with the same order (negative values flipped), for the packed argmax.
__device__ __forceinline__ uint32_t OrderedBits(float v) {
  const uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}

// kNorm's prologue, shared by the kernels that normalize x: inv_rms[m] = rsqrt(mean(x[m]^2) + eps) for the
// first m_here of MT rows of the f32 x (row stride k, a multiple of 16; 16-byte aligned), summed by every thread
// of the block (kThreads) in a fixed order; ends with a barrier. It runs right after the wait on the kernel that
// wrote x, so its loads are on the kernel's path: each thread issues all of its loads (16-byte pieces, up to
// kNormBatch of them) before it uses any. (A loop of one scalar load a trip made the threads with 3 of K = 896's
// elements wait on 3 round trips to L2, one after another.)
constexpr int kNormBatch = 4;
template <int MT>
__device__ __forceinline__ void NormRows(const float* xf, int m_here, int k, float eps, float* inv_rms) {
  __shared__ float red[kThreads / 32][MT];
  float ss[MT];
#pragma unroll
  for (int m = 0; m < MT; ++m) ss[m] = 0.f;
  // Piece p (16 bytes) of the m_here contiguous rows belongs to row p / (k / 4); thread t takes t, t + kThreads, ...
  const float4* x4 = reinterpret_cast<const float4*>(xf);
  const int per_row = k >> 2, total = m_here * per_row;
#pragma unroll 1
  for (int p0 = threadIdx.x; p0 < total; p0 += kThreads * kNormBatch) {
    float4 v[kNormBatch];
#pragma unroll
    for (int j = 0; j < kNormBatch; ++j) {
      const int p = p0 + j * kThreads;
      v[j] = p < total ? x4[p] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int j = 0; j < kNormBatch; ++j) {
      const int row = MT == 1 ? 0 : (p0 + j * kThreads) / per_row;
      const float sq = fmaf(v[j].w, v[j].w, fmaf(v[j].z, v[j].z, fmaf(v[j].y, v[j].y, v[j].x * v[j].x)));
#pragma unroll
      for (int m = 0; m < MT; ++m)
        if (row == m) ss[m] += sq;   // (pieces past the end are zeros, whichever row they name)
    }
  }
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss[m] += __shfl_xor_sync(0xffffffffu, ss[m], off);
  }
  if ((threadIdx.x & 31) == 0)
#pragma unroll
    for (int m = 0; m < MT; ++m) red[threadIdx.x >> 5][m] = ss[m];
  __syncthreads();
  if (threadIdx.x < MT) {
    float v = 0.f;
#pragma unroll
    for (int i = 0; i < kThreads / 32; ++i) v += red[i][threadIdx.x];
    inv_rms[threadIdx.x] = rsqrtf(v / float(k) + eps);
  }
  __syncthreads();
}

// 16 normalized activations T(x[i] * inv * norm_w[i]) as f32, from 16 f32 of x and of the norm weight.
template <typename T>
__device__ __forceinline__ void Norm16(const float* xf, const float* norm_w, float inv, float* v) {
#pragma unroll
  for (int i = 0; i < 16; i += 4) {
    const float4 a = *reinterpret_cast<const float4*>(xf + i);
    const float4 g = __ldg(reinterpret_cast<const float4*>(norm_w + i));
    v[i] = ToF32(FromF32<T>(a.x * inv * g.x));
    v[i + 1] = ToF32(FromF32<T>(a.y * inv * g.y));
    v[i + 2] = ToF32(FromF32<T>(a.z * inv * g.z));
    v[i + 3] = ToF32(FromF32<T>(a.w * inv * g.w));
  }
}

// Rows without kBalance: team i of the grid takes rows i * ROWS ... i * ROWS + ROWS - 1 (with kSwiGLU: outputs
// i * ROWS / 2 ..., each from its gate row and its up row F further).
template <typename T, int MT, int TPR, int ROWS, int U, Conv C, unsigned F = 0>
__global__ void __launch_bounds__(kThreads) Kernel(const void* __restrict__ x_in, const int8_t* __restrict__ w,
                                                   const float* __restrict__ scale, void* __restrict__ y_out,
                                                   int m_total, int n_total, int k_total, int groups,
                                                   uint32_t chunk_div, Fuse fu) {
  constexpr bool HINT = F & kHint, XS = F & kStageX, XA = F & kXFirst, BAL = F & kBalance;
  constexpr bool NORM = F & kNorm, RES = F & kResidual, SW = F & kSwiGLU, ARG = F & kArgmax;
  static_assert((TPR % 32 == 0 || 32 % TPR == 0) && kThreads % TPR == 0, "a team is whole warps or part of one");
  static_assert(!XS || C == Conv::kInt16, "x is staged as int16 chunks");
  static_assert(XS || !XA, "kXFirst orders the staging of x");
  static_assert(!SW || ROWS % 2 == 0, "kSwiGLU pairs a team's rows");
  static_assert(int(RES) + int(SW) + int(ARG) <= 1, "one epilogue");
  constexpr int kTeams = kThreads / TPR, kWarpsPerTeam = (TPR + 31) / 32, kLanes = TPR < 32 ? TPR : 32;
  constexpr int RO = SW ? ROWS / 2 : ROWS;   // outputs per team
  const T* x = static_cast<const T*>(x_in);
  const int t = threadIdx.x % TPR, team = threadIdx.x / TPR;
  const int n_out = SW ? n_total / 2 : n_total;
  // This team's outputs: row_base + r * row_step for r < RO, those below row_end; output o reads weight row
  // o (and o + n_out, its up row, with kSwiGLU).
  int row_base, row_end;
  constexpr int row_step = BAL ? kTeams : 1;
  if constexpr (BAL) {
    row_base = int(int64_t(blockIdx.x) * n_out / gridDim.x) + team;
    row_end = int(int64_t(blockIdx.x + 1) * n_out / gridDim.x);
  } else {
    row_base = (blockIdx.x * kTeams + team) * RO;
    row_end = n_out;
  }
  const int m0 = blockIdx.y * MT;
  const int chunks = k_total >> 4;
  const uint4* wrow[ROWS];
  const float* srow[ROWS];
  bool row_ok[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    // Rows past the end are never written; with kBalance they are not loaded (zeros), without it (only
    // in the last block) they load the last row again, which keeps the predicate (and a register) out.
    const int o = row_base + (r % RO) * row_step;
    row_ok[r] = !BAL || o < row_end;
    const int n_load = (BAL ? o : min(o, n_out - 1)) + (r / RO) * n_out;
    wrow[r] = reinterpret_cast<const uint4*>(w + size_t(n_load) * k_total);
    srow[r] = scale + size_t(n_load) * groups;
  }
  float acc[MT][ROWS];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[m][r] = 0.f;

  uint4 wv[U][ROWS];
  float sc[U][ROWS];
  auto load_round = [&](int c0) {   // U chunks of each row (zeros past K)
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * TPR;
      const int g = DivSmall(c, chunk_div);
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        wv[u][r] = c < chunks && row_ok[r] ? LoadW<HINT>(wrow[r] + c) : make_uint4(0, 0, 0, 0);
        sc[u][r] = c < chunks && row_ok[r] ? __ldg(srow[r] + g) : 0.f;
      }
    }
  };
  extern __shared__ uint4 x_stage[];   // kStageX: [MT][chunks][2] int16 chunks, then [MT][chunks] f32 scales
  float* xs_stage = reinterpret_cast<float*>(x_stage + 2 * MT * chunks);
  T* xn_stage = reinterpret_cast<T*>(x_stage);   // kNorm without kStageX: [MT][K] normalized x
  const int m_here = min(MT, m_total - m0);
  __shared__ float inv_rms[MT];
  auto norm_rows = [&] {   // inv_rms[m] = rsqrt(mean(x[m0 + m]^2) + eps)
    if constexpr (NORM) NormRows<MT>(static_cast<const float*>(x_in) + size_t(m0) * k_total, m_here, k_total, fu.eps, inv_rms);
  };
  // 16 normalized activations of row m from element e, rounded to T as the unfused path rounds them.
  auto norm16 = [&](int m, int e, float* v) {
    Norm16<T>(static_cast<const float*>(x_in) + size_t(m0 + m) * k_total + e, fu.norm_w + e, inv_rms[m], v);
  };
  auto stage_x = [&] {   // this thread's chunks of the MT rows of x below M
    if constexpr (XS) {
      for (int i = threadIdx.x; i < m_here * chunks; i += kThreads) {
        XChunk<C> xc;
        if constexpr (NORM) {
          float v[16];
          norm16(i / chunks, (i % chunks) * 16, v);
          QuantizeInt16(v, xc);
        } else {
          LoadX<C>(x + size_t(m0) * k_total + i * 16, xc);
        }
        StoreStaged(x_stage, xs_stage, i, xc);
      }
    } else if constexpr (NORM) {
      for (int i = threadIdx.x; i < m_here * chunks; i += kThreads) {
        float v[16];
        norm16(i / chunks, (i % chunks) * 16, v);
#pragma unroll
        for (int j = 0; j < 16; ++j) xn_stage[size_t(i) * 16 + j] = FromF32<T>(v[j]);
      }
    }
  };
  // The output this thread writes after the reduction, if any (as the epilogue below picks it).
  constexpr int V = MT * ROWS;
  auto my_output = [&](int* m, int* o) {
    const int lane = t % kLanes;
    const int j = kWarpsPerTeam == 1 ? lane / (kLanes / V) : t;
    const bool writer = kWarpsPerTeam == 1 ? lane % (kLanes / V) == 0 : t < V;
    const int r = j % ROWS;
    *m = j / ROWS;
    *o = row_base + r % RO * row_step;
    return writer && r < RO && m0 + *m < m_total && *o < row_end;
  };
  if (blockIdx.x == 0 && blockIdx.y == 0) {
    if (fu.zero != nullptr)
      for (int i = threadIdx.x; i < fu.zero_n; i += kThreads) fu.zero[i] = 0;
    if (fu.zero2 != nullptr)
      for (int i = threadIdx.x; i < fu.zero2_n; i += kThreads) fu.zero2[i] = 0;
  }
  int c0 = t;
  // Nothing before GridDepWait reads what an earlier kernel writes: the weights' first loads go out first.
  if constexpr (NORM) {   // the weights' first loads are in flight while the block normalizes x
    load_round(c0);
    if (fu.early) GridDepLaunch();
    // The norm weight is a constant: its lines are asked into L1 now, so that staging x after the block's
    // RMS meets them there instead of waiting on a second trip to memory.
    if (fu.prefetch)
      for (int i = threadIdx.x * 32; i < k_total; i += kThreads * 32)
        asm volatile("prefetch.global.L1 [%0];" ::"l"(fu.norm_w + i));
    GridDepWait();
    norm_rows();
    stage_x();
    __syncthreads();
  } else {
    if constexpr (XS && XA) {
      if (fu.early) GridDepLaunch();
      GridDepWait();
      stage_x();
    }
    load_round(c0);
    if constexpr (!(XS && XA)) {
      if (fu.early) GridDepLaunch();
      GridDepWait();
    }
    if constexpr (XS && !XA) stage_x();
    if constexpr (XS) __syncthreads();
  }
  // kResidual: this thread's residual element is loaded now, its latency under the dot products, not after.
  float res_in = 0.f;
  if constexpr (RES) {
    int m, o;
    if (fu.prefetch && my_output(&m, &o)) res_in = fu.res[size_t(m0 + m) * n_out + o];
  }
  while (true) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = c0 + u * TPR;
      if (c >= chunks) break;
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m0 + m >= m_total) break;
        XChunk<C> xc;
        if constexpr (XS) {
          LoadStaged(x_stage, xs_stage, m * chunks + c, xc);
        } else if constexpr (NORM) {
          LoadX<C, T, true>(xn_stage + size_t(m) * k_total + c * 16, xc);
        } else {
          LoadX<C>(x + size_t(m0 + m) * k_total + c * 16, xc);
        }
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[m][r] = Accumulate<C>(acc[m][r], xc, wv[u][r], sc[u][r]);
      }
    }
    c0 += TPR * U;
    if (c0 >= chunks) break;
    load_round(c0);
  }
  if (!fu.early) GridDepLaunch();   // the weights are read: the next kernel may start issuing its own
  // Reduce over the team: its lanes in each warp by shuffles (a[0] ends up with the total of value j on
  // the lanes j * kLanes / V ...), then (TPR > 32) the team's warps through shared memory.
  float a[V];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) a[m * ROWS + r] = acc[m][r];
  const int lane = t % kLanes;
  const int j = GroupSumEach<V, kLanes>(a, lane);
  const bool holder = lane % (kLanes / V) == 0;
  __shared__ unsigned long long best[ARG ? MT : 1];   // kArgmax: the block's packed maximum per row of x
  if constexpr (ARG) {
    if (threadIdx.x < MT) best[threadIdx.x] = 0ull;
    __syncthreads();
  }
  uint32_t nonfinite = 0;   // kArgmax: bit m set where row m0 + m met a value that is not finite
  // Output (m, o) of value v (and, with kSwiGLU, its up value u).
  auto emit = [&](int m, int o, float v, float u) {
    const size_t at = size_t(m0 + m) * n_out + o;
    if constexpr (RES) {
      static_cast<float*>(y_out)[at] = (fu.prefetch ? res_in : fu.res[at]) + ToF32(FromF32<T>(v));
    } else if constexpr (SW) {
      const float g = ToF32(FromF32<T>(v));
      static_cast<T*>(y_out)[at] = FromF32<T>(g / (1.f + __expf(-g)) * ToF32(FromF32<T>(u)));
    } else if constexpr (ARG) {
      const float r = ToF32(FromF32<T>(v));
      if (!isfinite(r)) nonfinite |= 1u << m;
      atomicMax(&best[m], (static_cast<unsigned long long>(OrderedBits(r)) << 32) | (0xffffffffu - uint32_t(o)));
    } else {
      static_cast<T*>(y_out)[at] = FromF32<T>(v);
    }
  };
  if constexpr (kWarpsPerTeam == 1) {
    // kSwiGLU: the up value of output j sits RO values further, on the lane RO * kLanes / V further.
    const float up = SW ? __shfl_down_sync(0xffffffffu, a[0], RO * (kLanes / V)) : 0.f;
    const int m = j / ROWS, r = j % ROWS, o = row_base + r % RO * row_step;
    if (holder && r < RO && m0 + m < m_total && o < row_end) emit(m, o, a[0], up);
  } else {
    __shared__ float part[kThreads / 32][V];
    const int warp = threadIdx.x >> 5;
    if (holder) part[warp][j] = a[0];
    __syncthreads();
    if (t < V) {
      const int m = t / ROWS, r = t % ROWS, o = row_base + r % RO * row_step;
      float v = 0.f, u = 0.f;
#pragma unroll
      for (int i = 0; i < kWarpsPerTeam; ++i) v += part[team * kWarpsPerTeam + i][t];
      if constexpr (SW) {
#pragma unroll
        for (int i = 0; i < kWarpsPerTeam; ++i) u += part[team * kWarpsPerTeam + i][min(t + RO, V - 1)];
      }
      if (r < RO && m0 + m < m_total && o < row_end) emit(m, o, v, u);
    }
  }
  if constexpr (ARG) {
    __syncthreads();
    uint32_t* out = static_cast<uint32_t*>(y_out);
    if (threadIdx.x < m_here)
      atomicMax(reinterpret_cast<unsigned long long*>(out + size_t(m0 + threadIdx.x) * 4), best[threadIdx.x]);
    for (int m = 0; m < m_here; ++m)
      if (nonfinite >> m & 1u) atomicOr(out + size_t(m0 + m) * 4 + 2, 1u);
  }
}

// Streaming variant for short K (K / 16 <= 32 * U chunks: one round per row) and many rows: a grid of
// at most the resident blocks, each warp walking row groups n0, n0 + stride, ... with the next group's
// weights loaded before the current group is computed (two register buffers), and x's chunks loaded once.
// Whether K fits the streaming variant with U chunks per lane (one round of 32 * U chunks per row).
template <int U>
constexpr bool StreamFits(int k) { return k / 16 <= 32 * U; }

template <int U, int ROWS, bool HINT>
__device__ __forceinline__ void LoadRows(const int8_t* __restrict__ w, const float* __restrict__ scale, int n0,
                                         int n_total, int k_total, int groups, int lane, int chunks,
                                         uint32_t chunk_div, uint4 (&wv)[U][ROWS], float (&sc)[U][ROWS]) {
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int n = min(n0 + r, n_total - 1);
    const uint4* wrow = reinterpret_cast<const uint4*>(w + size_t(n) * k_total);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int c = lane + 32 * u;
      wv[u][r] = c < chunks ? LoadW<HINT>(wrow + c) : make_uint4(0, 0, 0, 0);
      sc[u][r] = c < chunks ? __ldg(scale + size_t(n) * groups + DivSmall(c, chunk_div)) : 0.f;
    }
  }
}

template <typename T, int U, int ROWS, Conv C>
__device__ __forceinline__ void DotRows(const XChunk<C> (&xv)[U], const uint4 (&wv)[U][ROWS],
                                        const float (&sc)[U][ROWS], T* __restrict__ y, int n0, int n_total,
                                        int lane) {
  float acc[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    acc[r] = 0.f;
#pragma unroll
    for (int u = 0; u < U; ++u) acc[r] = Accumulate<C>(acc[r], xv[u], wv[u][r], sc[u][r]);
  }
  const int r = GroupSumEach<ROWS, 32>(acc, lane);
  if (lane % (32 / ROWS) == 0 && n0 + r < n_total) y[n0 + r] = FromF32<T>(acc[0]);
}

// A warp's row groups n0, n0 + stride, ... below n_total (n0 < n_total; wa and sa hold n0's weights and scales),
// two per trip, one per register buffer: the next group's loads go out before body(weights, scales, n) runs on
// the current one.
template <int U, int ROWS, bool HINT, typename Body>
__device__ __forceinline__ void WalkRowGroups(const int8_t* __restrict__ w, const float* __restrict__ scale, int n0,
                                              int stride, int n_total, int k_total, int groups, int lane, int chunks,
                                              uint32_t chunk_div, uint4 (&wa)[U][ROWS], float (&sa)[U][ROWS],
                                              uint4 (&wb)[U][ROWS], float (&sb)[U][ROWS], Body&& body) {
  while (true) {
    const int n1 = n0 + stride;
    if (n1 < n_total) LoadRows<U, ROWS, HINT>(w, scale, n1, n_total, k_total, groups, lane, chunks, chunk_div, wb, sb);
    body(wa, sa, n0);
    if (n1 >= n_total) break;
    const int n2 = n1 + stride;
    if (n2 < n_total) LoadRows<U, ROWS, HINT>(w, scale, n2, n_total, k_total, groups, lane, chunks, chunk_div, wa, sa);
    body(wb, sb, n1);
    if (n2 >= n_total) break;
    n0 = n2;
  }
}

// MINB: blocks per SM the registers must allow (1: the compiler's choice).
template <typename T, int ROWS, int U, bool HINT, int MINB = 1, Conv C = Conv::kMagic>
__global__ void __launch_bounds__(kThreads, MINB) StreamKernel(const T* __restrict__ x, const int8_t* __restrict__ w,
                                                         const float* __restrict__ scale, T* __restrict__ y,
                                                         int n_total, int k_total, int groups, uint32_t chunk_div) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int chunks = k_total >> 4;
  const int stride = gridDim.x * (kThreads / 32) * ROWS;
  int n0 = (blockIdx.x * (kThreads / 32) + warp) * ROWS;
  if (n0 >= n_total) return;
  uint4 wa[U][ROWS], wb[U][ROWS];
  float sa[U][ROWS], sb[U][ROWS];
  LoadRows<U, ROWS, HINT>(w, scale, n0, n_total, k_total, groups, lane, chunks, chunk_div, wa, sa);
  XChunk<C> xv[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = lane + 32 * u;
    if (c < chunks) {
      LoadX<C>(x + c * 16, xv[u]);
    } else {
      ZeroX<C>(xv[u]);
    }
  }
  WalkRowGroups<U, ROWS, HINT>(w, scale, n0, stride, n_total, k_total, groups, lane, chunks, chunk_div, wa, sa, wb, sb,
                               [&](const uint4 (&wv)[U][ROWS], const float (&sv)[U][ROWS], int n) {
                                 DotRows<T, U, ROWS, C>(xv, wv, sv, y, n, n_total, lane);
                               });
}

// SMs of the current device and blocks of `kernel` (kThreads threads, `smem` bytes of dynamic shared
// memory) resident on each at once, queried once per device, kernel and shared-memory size.
struct Residency {
  int sms = 1, per_sm = 1;
};
inline cudaError_t ResidencyOf(const void* kernel, size_t smem, Residency* out) {
  static std::mutex mu;
  static std::map<std::tuple<int, const void*, size_t>, Residency> cache;
  int dev = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  const std::lock_guard<std::mutex> lock(mu);
  if (auto it = cache.find({dev, kernel, smem}); it != cache.end()) {
    *out = it->second;
    return cudaSuccess;
  }
  int sms = 0, per_sm = 0;
  if (cudaError_t e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev); e != cudaSuccess) return e;
  if (cudaError_t e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem);
      e != cudaSuccess)
    return e;   // nothing cached: the next call asks again
  *out = cache[{dev, kernel, smem}] = {std::max(1, sms), std::max(1, per_sm)};
  return cudaSuccess;
}

template <typename T, int ROWS, int U, bool HINT, int MINB = 1, Conv C = Conv::kMagic>
cudaError_t LaunchStream(cudaStream_t stream, const T* x, const int8_t* w, const float* scale, T* y, int n, int k,
                         int groups) {
  auto kernel = StreamKernel<T, ROWS, U, HINT, MINB, C>;
  constexpr int kRowsPerBlock = kThreads / 32 * ROWS;
  Residency res;
  if (cudaError_t e = ResidencyOf(reinterpret_cast<const void*>(kernel), 0, &res); e != cudaSuccess) return e;
  const int blocks = std::min((n + kRowsPerBlock - 1) / kRowsPerBlock, res.sms * res.per_sm);
  kernel<<<blocks, kThreads, 0, stream>>>(x, w, scale, y, n, k, groups, DivMagic(uint32_t(k / groups / 16)));
  return cudaGetLastError();
}

// The LM head at M = 1 (kNorm, many rows, K / 16 <= 32 U) on the blocks the GPU holds at once: ARG, the greedy
// head (kNorm | kArgmax), else the logits. The same logits, bit for bit, as Kernel<T, 1, 32, 4, 2, kInt16, kHint |
// kStageX | kNorm [| kArgmax]>: x's RMS summed in the same order, the same int16 chunks, lane l taking chunks l,
// l + 32, ..., the same shuffle tree. But each block normalizes and stages x once, not once per 32 rows, then its
// warps walk row groups n0, n0 + stride, ... with the next group's weights loaded while the current one is
// computed (WalkRowGroups, as StreamKernel). ARG: each lane keeps its best packed value in a register, one 64-bit
// atomic a block into y (uint32 [1, 4], zeroed by the caller); otherwise y is T [1, N].
template <typename T, int ROWS, int U, bool ARG>
__global__ void __launch_bounds__(kThreads, 2) HeadKernel(const float* __restrict__ x, const int8_t* __restrict__ w,
                                                       const float* __restrict__ scale, void* __restrict__ y_out,
                                                       int n_total, int k_total, int groups, uint32_t chunk_div,
                                                       Fuse fu) {
  constexpr Conv C = Conv::kInt16;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, chunks = k_total >> 4;
  const int stride = gridDim.x * (kThreads / 32) * ROWS;
  int n0 = (blockIdx.x * (kThreads / 32) + warp) * ROWS;   // (past the end in the last block's spare warps)
  uint4 wa[U][ROWS], wb[U][ROWS];
  float sa[U][ROWS], sb[U][ROWS];
  LoadRows<U, ROWS, true>(w, scale, n0, n_total, k_total, groups, lane, chunks, chunk_div, wa, sa);
  if (fu.prefetch)
    for (int i = threadIdx.x * 32; i < k_total; i += kThreads * 32) asm volatile("prefetch.global.L1 [%0];" ::"l"(fu.norm_w + i));
  GridDepWait();
  __shared__ float inv_rms[1];
  NormRows<1>(x, 1, k_total, fu.eps, inv_rms);
  extern __shared__ uint4 x_stage[];   // [chunks][2] int16 chunks, then [chunks] f32 scales
  float* xs_stage = reinterpret_cast<float*>(x_stage + 2 * chunks);
  for (int i = threadIdx.x; i < chunks; i += kThreads) {
    float v[16];
    Norm16<T>(x + i * 16, fu.norm_w + i * 16, inv_rms[0], v);
    XChunk<C> xc;
    QuantizeInt16(v, xc);
    StoreStaged(x_stage, xs_stage, i, xc);
  }
  __syncthreads();
  XChunk<C> xv[U];
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int c = lane + 32 * u;
    if (c < chunks) {
      LoadStaged(x_stage, xs_stage, c, xv[u]);
    } else {
      ZeroX<C>(xv[u]);
    }
  }
  unsigned long long best = 0ull;   // (orderable value << 32 | ~row), as Kernel's kArgmax packs it
  bool nonfinite = false;
  auto group = [&](const uint4 (&wv)[U][ROWS], const float (&sv)[U][ROWS], int n) {
    float acc[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      acc[r] = 0.f;
#pragma unroll
      for (int u = 0; u < U; ++u)   // (Kernel stops at the last chunk: the same additions)
        if (lane + 32 * u < chunks) acc[r] = Accumulate<C>(acc[r], xv[u], wv[u][r], sv[u][r]);
    }
    const int j = GroupSumEach<ROWS, 32>(acc, lane);
    if (lane % (32 / ROWS) == 0 && n + j < n_total) {
      if constexpr (ARG) {
        const float v = ToF32(FromF32<T>(acc[0]));
        nonfinite |= !isfinite(v);
        best = max(best, (static_cast<unsigned long long>(OrderedBits(v)) << 32) | (0xffffffffu - uint32_t(n + j)));
      } else {
        static_cast<T*>(y_out)[n + j] = FromF32<T>(acc[0]);
      }
    }
  };
  if (n0 < n_total)
    WalkRowGroups<U, ROWS, true>(w, scale, n0, stride, n_total, k_total, groups, lane, chunks, chunk_div, wa, sa, wb, sb,
                                 group);
  if constexpr (!ARG) return;
  uint32_t* y = static_cast<uint32_t*>(y_out);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) best = max(best, __shfl_xor_sync(0xffffffffu, best, off));
  nonfinite = __any_sync(0xffffffffu, nonfinite);
  __shared__ unsigned long long warp_best[kThreads / 32];
  __shared__ bool warp_nonfinite[kThreads / 32];
  if (lane == 0) {
    warp_best[warp] = best;
    warp_nonfinite[warp] = nonfinite;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    bool nf = false;
#pragma unroll
    for (int i = 0; i < kThreads / 32; ++i) {
      best = max(best, warp_best[i]);
      nf |= warp_nonfinite[i];
    }
    atomicMax(reinterpret_cast<unsigned long long*>(y), best);
    if (nf) atomicOr(y + 2, 1u);
  }
}

template <typename T, int ROWS, int U, bool ARG>
cudaError_t LaunchHead(cudaStream_t stream, const float* x, const int8_t* w, const float* scale, void* y, int n, int k,
                       int groups, const Fuse& fu) {
  auto kernel = HeadKernel<T, ROWS, U, ARG>;
  const size_t smem = XStageBytes(1, k);
  Residency res;
  if (cudaError_t e = ResidencyOf(reinterpret_cast<const void*>(kernel), smem, &res); e != cudaSuccess) return e;
  constexpr int kRowsPerBlock = kThreads / 32 * ROWS;
  const int blocks = std::min((n + kRowsPerBlock - 1) / kRowsPerBlock, res.sms * res.per_sm);
  return LaunchEx(stream, fu.pdl, dim3(blocks), dim3(kThreads), smem, kernel, x, w, scale, y, n, k, groups,
                  DivMagic(uint32_t(k / groups / 16)), fu);
}

// Launches one configuration; w and scale point at the layer's [N, K] and [N, G] slices. kStageX needs
// XStageBytes(MT, K) <= kMaxXStageBytes (the caller checks). With kBalance, a grid that fits on the GPU at
// once is rounded up to a whole number of blocks per SM (each block then takes fewer rows): otherwise the
// SMs that hold one block more than the others read that much more and finish last.
template <typename T, int MT, int TPR, int ROWS, int U, Conv C, unsigned F = 0>
cudaError_t Launch(cudaStream_t stream, const void* x, const int8_t* w, const float* scale, void* y, int m, int n,
                   int k, int groups, Fuse fu = {}) {
  auto kernel = Kernel<T, MT, TPR, ROWS, U, C, F>;
  constexpr int kRowsPerBlock = kThreads / TPR * ROWS;
  const size_t smem = (F & kStageX) ? XStageBytes(MT, k) : (F & kNorm) ? NormStageBytes<T>(MT, k) : 0;
  const int n_out = (F & kSwiGLU) ? n / 2 : n;
  int blocks = (n + kRowsPerBlock - 1) / kRowsPerBlock;
  if constexpr ((F & kBalance) != 0) {
    Residency res;
    if (cudaError_t e = ResidencyOf(reinterpret_cast<const void*>(kernel), smem, &res); e != cudaSuccess) return e;
    const int per_sm = (blocks + res.sms - 1) / res.sms;
    if (per_sm <= res.per_sm) blocks = std::min(per_sm * res.sms, n_out);
  }
  return LaunchEx(stream, fu.pdl, dim3(blocks, (m + MT - 1) / MT), dim3(kThreads), smem, kernel, x, w, scale, y, m, n,
                  k, groups, DivMagic(uint32_t(k / groups / 16)), fu);
}

// W8A16 configuration by shape (kernel templates in w8a16_cuda.cuh), chosen from bench/gemv_sweep.cu on
// the H200 (docs/kernels.md): TPR threads per row split K, ROWS rows per team, U loads in flight per row,
// MT rows of x per block (larger M runs in tiles of MT); weight loads skip L1 and prefetch 256 B into L2.
// Many rows with bf16 activations (gate/up, the LM head) take the int16 inner product with x staged in
// shared memory (compute-bound otherwise); few rows and long K are latency-bound and keep the f32 one.
// f32 activations always keep the f32 inner product (exact to f32 rounding).
// EX: the fusion flags (kNorm, kResidual, kSwiGLU, kArgmax) added to every configuration; with kSwiGLU the
// configurations of one row per team take two. x and y are what the flags say (see Kernel). mma_choice: the
// tensor-core configuration for 5-64 rows of bf16 x (mma::Dispatch's choice; -1 its rule).
template <unsigned EX>
constexpr int Rows(int rows) { return (EX & kSwiGLU) && rows < 2 ? 2 : rows; }

template <typename T, unsigned EX = 0>
cudaError_t Dispatch(cudaStream_t st, const MatmulShape& s, const void* xp, const int8_t* w, const float* sc,
                     void* yp, Fuse fu = {}, int mma_choice = -1) {
  constexpr Conv kMagic = Conv::kMagic, kInt16 = Conv::kInt16;
  constexpr unsigned kStaged = kHint | kStageX | EX, kStagedFirst = kHint | kStageX | kXFirst | EX, kH = kHint | EX;
  const void* x = xp;
  void* y = yp;
  const int m = int(s.m), n = int(s.n), k = int(s.k), g = int(s.groups);
  const bool long_k = k / 16 > 128, many_rows = n >= 4096, huge_n = n >= 32768, big = n >= 1536 && k >= 2048;
  const int mt = m == 1 ? 1 : m == 2 ? 2 : 4;
  const bool stage_fits = sizeof(T) == 2 && XStageBytes(mt, k) <= kMaxXStageBytes;   // x as staged int16 chunks
  const bool int16 = many_rows && stage_fits;
  if (m == 1) {
    // The LM head, greedy or logits, on resident blocks (lab switch JAXLLM_HEAD_GRID=1: a block per 32 rows, for
    // comparison).
    if constexpr (EX == (kNorm | kArgmax) || EX == kNorm) {
      static const bool grid = LabFlag("JAXLLM_HEAD_GRID", false);
      if (int16 && huge_n && !grid && StreamFits<4>(k)) {
        constexpr bool kArg = EX & kArgmax;
        const float* xf = static_cast<const float*>(x);
        return StreamFits<2>(k) ? LaunchHead<T, 4, 2, kArg>(st, xf, w, sc, y, n, k, g, fu)
                                : LaunchHead<T, 1, 4, kArg>(st, xf, w, sc, y, n, k, g, fu);
      }
    }
    // The 1B-14B shapes (N >= 1536, K >= 2048; bench/gemv_sweep.cu's *_1b ... *_14b shapes on the H200,
    // docs/results/2026-12-04-h200-scaling.md): a warp per 2 or 4 rows with x staged as int16 chunks once a block,
    // 1.0-2.0x faster there than the short-K and long-K rules below, which were chosen on Qwen2.5-0.5B's shapes.
    if (big && stage_fits) {
      if (huge_n) return Launch<T, 1, 32, 4, 2, kInt16, kStaged>(st, x, w, sc, y, m, n, k, g, fu);   // gate/up 7B, heads
      // q/k/v and gate/up (kNorm in the fused step: kXFirst ignored), and the 8B-14B O (kResidual: x still staged
      // first; weights first, as the rule below, not measured there)
      if (many_rows && k < 8192)
        return Launch<T, 1, 32, 2, 2, kInt16, kStagedFirst>(st, x, w, sc, y, m, n, k, g, fu);
      // The 1B-3B down projections (N <= 2048, K >= 8192): 4 warps a row over K, f32 (the sweep's best there, 6.65
      // against 7.70 us at 1B and 6.03 against 7.75 at 1.5B, plain matmul; 3B's 2048 x 11008 and the fused residual
      // variant were not in that sweep; the 7B-14B ones, N >= 3584, keep the rule below).
      if (n <= 2048 && k >= 8192) return Launch<T, 1, 128, Rows<EX>(1), 1, kMagic, kH>(st, x, w, sc, y, m, n, k, g, fu);
      // O of the 1B, 3B and 7B shapes (N < 4096), the 7B-14B down, and the 1B and 3B q/k/v: rows shared evenly
      // between the SMs; the first weight loads issued before the wait on the previous kernel, x staged after it
      // (the fused step 1.1-1.5% faster at 7B, O and down, and 1.4-1.6% at 1B, O alone, than x staged first; two
      // interleaved pairs each on the H100: docs/results/2026-12-06-h100-x-first.md).
      return Launch<T, 1, 32, 2, 4, kInt16, kStaged | kBalance>(st, x, w, sc, y, m, n, k, g, fu);
    }
    // The down projection (a residual epilogue at long K): 4 rows a block, rows shared evenly between the SMs (two
    // blocks an SM), each thread's chunks of x turned into int16 once for its 4 rows: a quarter of the blocks, each
    // reading x once for 4 rows, and half an instruction a weight (docs/results/2026-12-03-h200-swizzle.md).
    if constexpr (EX == kResidual && sizeof(T) == 2) {
      if (long_k) return Launch<T, 1, 256, 4, 2, kInt16, kH | kBalance>(st, x, w, sc, y, m, n, k, g, fu);
    }
    if (long_k) return Launch<T, 1, 256, Rows<EX>(1), 2, kMagic, kH>(st, x, w, sc, y, m, n, k, g, fu);     // K over the block
    if (int16 && huge_n) return Launch<T, 1, 32, Rows<EX>(4), 2, kInt16, kStaged>(st, x, w, sc, y, m, n, k, g, fu);  // LM head
    if (int16)   // half a warp per 2 rows, rows shared evenly between the SMs
      return Launch<T, 1, 16, Rows<EX>(2), 4, kInt16, kStagedFirst | kBalance>(st, x, w, sc, y, m, n, k, g, fu);
    if (EX == 0 && huge_n && StreamFits<2>(k))   // f32 LM head
      return LaunchStream<T, 2, 2, true>(st, static_cast<const T*>(x), w, sc, static_cast<T*>(y), n, k, g);
    if (many_rows) return Launch<T, 1, 32, Rows<EX>(4), 2, kMagic, kH>(st, x, w, sc, y, m, n, k, g, fu);   // warp per 4 rows
    // Norm + QKV (few rows, short K): x normalized and staged as int16 once a block, a warp per 2 rows, rows shared
    // evenly (a block an SM on the H200), so that its blocks fit beside the down projection's and issue their
    // weight loads while it runs.
    if constexpr (EX == kNorm && sizeof(T) == 2) {
      if (stage_fits) return Launch<T, 1, 32, 2, 2, kInt16, kStaged | kBalance>(st, x, w, sc, y, m, n, k, g, fu);
    }
    return Launch<T, 1, 64, Rows<EX>(1), 1, kMagic, kH>(st, x, w, sc, y, m, n, k, g, fu);                  // 2 warps per row
  }
  if (m == 2) {
    if (int16 && huge_n) return Launch<T, 2, 32, Rows<EX>(4), 2, kInt16, kStaged>(st, x, w, sc, y, m, n, k, g, fu);
    if (int16) return Launch<T, 2, 32, Rows<EX>(2), 2, kInt16, kStagedFirst>(st, x, w, sc, y, m, n, k, g, fu);
    if (many_rows) return Launch<T, 2, 32, Rows<EX>(2), 2, kMagic, kH>(st, x, w, sc, y, m, n, k, g, fu);
    if (long_k) return Launch<T, 2, 128, Rows<EX>(1), 2, kMagic, kH>(st, x, w, sc, y, m, n, k, g, fu);
    return Launch<T, 2, 64, Rows<EX>(1), 2, kMagic, kH>(st, x, w, sc, y, m, n, k, g, fu);
  }
  // 5 or more rows of bf16 x, plain matmul: tensor cores (w8a16_mma.cuh), the weights read once for up to 64 rows.
  if constexpr (EX == 0 && std::is_same_v<T, __nv_bfloat16>) {
    if (mma::Takes(m, s.group, k))
      return mma::Dispatch(st, static_cast<const __nv_bfloat16*>(x), w, sc, static_cast<__nv_bfloat16*>(y), m, n, k,
                           mma_choice);
  }
  // M >= 3: tiles of 4 rows of x.
  if (int16 && huge_n) return Launch<T, 4, 32, Rows<EX>(4), 2, kInt16, kStagedFirst>(st, x, w, sc, y, m, n, k, g, fu);
  if (int16) return Launch<T, 4, 32, Rows<EX>(2), 2, kInt16, kStagedFirst>(st, x, w, sc, y, m, n, k, g, fu);
  if (huge_n) return Launch<T, 4, 32, Rows<EX>(4), 2, kMagic, kH>(st, x, w, sc, y, m, n, k, g, fu);
  if (many_rows) return Launch<T, 4, 32, Rows<EX>(2), 2, kMagic, kH>(st, x, w, sc, y, m, n, k, g, fu);
  if (long_k) return Launch<T, 4, 128, Rows<EX>(1), 2, kMagic, kH>(st, x, w, sc, y, m, n, k, g, fu);
  return Launch<T, 4, 64, Rows<EX>(1), 2, kMagic, kH>(st, x, w, sc, y, m, n, k, g, fu);
}


}  // namespace w8a16
}  // namespace jaxllm
