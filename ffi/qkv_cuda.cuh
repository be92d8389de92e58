// The QKV epilogue on the GPU (jaxllm_qkv_epilogue, and the prologue of the fused step's attention): bias
// (qwen2), the per-head q/k RMSNorm (qwen3), RoPE at the device position (both styles) and the K/V append
// at the device write position.
//
// The arithmetic is written once, per RoPE pair, with every rounding spelled out (__f*_rn: no contraction
// left to the compiler), so that the block-per-head kernel below and the warp-per-head prologue of
// attn1::Kernel give the same bits. Roundings follow the unfused path (model.layer): the bias added in f32
// and rounded to T, the head norm in f32 rounded to T, RoPE in f32 rounded to T.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "w8a16_cuda.cuh"   // ToF32, FromF32; GridDepWait, GridDepLaunch (launch.cuh, through it)

namespace jaxllm {
namespace qkv {

// The epilogue's operands (per-layer rows already selected).
struct Args {
  const void* qkv = nullptr;        // [B, (H + 2G) D] T: the QKV projection (queries, keys, values)
  const float* bias = nullptr;      // [(H + 2G) D] or null
  const float* qn = nullptr;        // [D] or null: the query heads' norm
  const float* kn = nullptr;        // [D] or null: the key heads' norm
  const float* inv_freq = nullptr;  // [D / 2]
  const int32_t* pos = nullptr;     // [B] RoPE positions
  const int32_t* writes = nullptr;  // [B] cache positions (outside [0, S): nothing written)
  void* kc = nullptr;               // caches [L, N, G, S, D] T (N >= B rows), row b written at writes[b]
  void* vc = nullptr;
  int layer = 0;
  bool neox = false;
  float pos_scale = 1.f, eps = 0.f;
  // The layers call's launch option for the attention kernel it prefixes: let the next kernel launch before
  // waiting on the previous one (programmatic dependent launch).
  bool early = false;
  // Its options for comparison and timing: the call's inputs and constants loaded after the wait instead of
  // before it (JAXLLM_PREFETCH=0), and stop (JAXLLM_ATTN_STOP: 1 after the wait, 2 after the
  // prologue, 3 after the tiles, without the merge; wrong results, for timing only).
  bool late_inputs = false;
  int stop = 0;
};

// The elements of RoPE pair i of a head of D: neox pairs i and i + D / 2, the normal style 2i and 2i + 1.
__device__ __forceinline__ void PairOf(int i, int d, bool neox, int* e0, int* e1) {
  *e0 = neox ? i : 2 * i;
  *e1 = neox ? i + d / 2 : 2 * i + 1;
}

// v + bias in f32, rounded to T (the unfused path's bias add).
template <typename T>
__device__ __forceinline__ float AddBias(float v, float bias) { return ToF32(FromF32<T>(__fadd_rn(v, bias))); }

template <typename T>
__device__ __forceinline__ float Biased(const T* row, const float* bias, int col) {
  const float v = ToF32(row[col]);
  return bias ? AddBias<T>(v, bias[col]) : v;
}

__device__ __forceinline__ float PairSq(float a, float c) { return __fmaf_rn(a, a, __fmul_rn(c, c)); }

__device__ __forceinline__ float WarpSum(float v) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v = __fadd_rn(v, __shfl_xor_sync(0xffffffffu, v, off));
  return v;
}

__device__ __forceinline__ float NormInv(float sum_sq, int d, float eps) {
  return rsqrtf(__fadd_rn(__fdiv_rn(sum_sq, float(d)), eps));
}

template <typename T>
__device__ __forceinline__ float Normed(float v, float inv, float w) {
  return ToF32(FromF32<T>(__fmul_rn(__fmul_rn(v, inv), w)));
}

// RoPE of pair (a, c) with frequency f at position pos (already divided by the linear scale).
template <typename T>
__device__ __forceinline__ void Rotate(float a, float c, float pos, float f, T* r0, T* r1) {
  float sn, cs;
  sincosf(__fmul_rn(pos, f), &sn, &cs);
  *r0 = FromF32<T>(__fmaf_rn(a, cs, -__fmul_rn(c, sn)));
  *r1 = FromF32<T>(__fmaf_rn(c, cs, __fmul_rn(a, sn)));
}

__device__ __forceinline__ float ScaledPos(const Args& a, int b) { return __fdiv_rn(float(a.pos[b]), a.pos_scale); }

// Offset of position `at` of kv head g, sequence b, in the caches [L, N, G, S, D] (N rows, N >= B).
__device__ __forceinline__ size_t CacheAt(const Args& a, int N, int G, int S, int D, int b, int g, int at) {
  return ((size_t(a.layer) * N + b) * G + g) * size_t(S) * D + size_t(at) * D;
}

// What one warp's head reads besides the QKV row: the bias of its pairs' elements, their norm weights and
// RoPE frequencies, and the position. All of it is written before the layers call starts (constants, and the
// call's inputs), so attn1::Kernel loads it before its grid dependency wait, off the path after it.
template <int D>
struct HeadConsts {
  static constexpr int kPairs = D / 64;   // RoPE pairs per lane
  float b0[kPairs], b1[kPairs], n0[kPairs], n1[kPairs], f[kPairs];
  float pos;
  bool has_bias, has_norm;
};

template <int D>
__device__ __forceinline__ HeadConsts<D> LoadHeadConsts(const Args& a, int b, int hd, int H, int lane) {
  HeadConsts<D> c;
  const float* nw = hd < H ? a.qn : a.kn;
  c.has_bias = a.bias != nullptr;
  c.has_norm = nw != nullptr;
#pragma unroll
  for (int j = 0; j < HeadConsts<D>::kPairs; ++j) {
    int e0, e1;
    PairOf(lane + 32 * j, D, a.neox, &e0, &e1);
    c.b0[j] = a.bias ? a.bias[hd * D + e0] : 0.f;
    c.b1[j] = a.bias ? a.bias[hd * D + e1] : 0.f;
    c.n0[j] = nw ? nw[e0] : 0.f;
    c.n1[j] = nw ? nw[e1] : 0.f;
    c.f[j] = a.inv_freq[lane + 32 * j];
  }
  c.pos = ScaledPos(a, b);
  return c;
}

// One head by one warp (attn1::Kernel's prologue), in two steps so that a warp can have several heads' loads in
// flight before it computes any: Load reads head hd of sequence b's row (hd < H: a query head, normed by qn;
// H <= hd < H + G: a key head, normed by kn), and Apply adds its bias, normalizes and rotates it, calling
// put(e, value) for each of its D elements. c: the head's constants (LoadHeadConsts). The arithmetic of Biased,
// Normed and Rotate, as EpilogueKernel does it.
template <int D>
struct HeadRow {
  static constexpr int kPairs = D / 64;
  static_assert(D % 64 == 0, "a warp takes D / 2 pairs in whole rounds");
  float x0[kPairs], x1[kPairs];
  int e0[kPairs], e1[kPairs];

  template <typename T>
  __device__ __forceinline__ void Load(const Args& a, int b, int hd, int H, int G, int lane) {
    const T* row = static_cast<const T*>(a.qkv) + size_t(b) * (H + 2 * G) * D;
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      PairOf(lane + 32 * j, D, a.neox, &e0[j], &e1[j]);
      x0[j] = ToF32(row[hd * D + e0[j]]);
      x1[j] = ToF32(row[hd * D + e1[j]]);
    }
  }

  template <typename T, typename Put>
  __device__ __forceinline__ void Apply(const Args& a, const HeadConsts<D>& c, Put put) {
    if (c.has_bias) {
#pragma unroll
      for (int j = 0; j < kPairs; ++j) {
        x0[j] = AddBias<T>(x0[j], c.b0[j]);
        x1[j] = AddBias<T>(x1[j], c.b1[j]);
      }
    }
    if (c.has_norm) {   // the sum over the head in the block kernel's order: per 32 pairs, then across them
      float tot = 0.f;
#pragma unroll
      for (int j = 0; j < kPairs; ++j) tot = __fadd_rn(tot, WarpSum(PairSq(x0[j], x1[j])));
      const float inv = NormInv(tot, D, a.eps);
#pragma unroll
      for (int j = 0; j < kPairs; ++j) {
        x0[j] = Normed<T>(x0[j], inv, c.n0[j]);
        x1[j] = Normed<T>(x1[j], inv, c.n1[j]);
      }
    }
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      T r0, r1;
      Rotate<T>(x0[j], x1[j], c.pos, c.f[j], &r0, &r1);
      put(e0[j], r0);
      put(e1[j], r1);
    }
  }
};

// Block (head, b) of D / 2 threads, heads 0..H-1 the queries (into q_out [B, H, D]) and H..H+G-1 the keys
// (whose block also appends the values); thread i owns RoPE pair i. It also zeroes the attention counters
// [B, G] (jaxllm_decode_attention_merged's, which then reset themselves). N: the caches' rows (>= B, the grid's y).
template <typename T>
__global__ void EpilogueKernel(Args a, T* __restrict__ q_out, int32_t* __restrict__ counters, int N, int H, int G,
                               int S, int D) {
  w8a16::GridDepWait();
  w8a16::GridDepLaunch();
  const int head = blockIdx.x, b = blockIdx.y, i = threadIdx.x, half = D / 2;
  if (head == 0)
    for (int j = i; j < G; j += half) counters[b * G + j] = 0;
  const T* row = static_cast<const T*>(a.qkv) + size_t(b) * (H + 2 * G) * D;
  int e0, e1;
  PairOf(i, D, a.neox, &e0, &e1);
  const int col = head * D;
  float x0 = Biased(row, a.bias, col + e0), x1 = Biased(row, a.bias, col + e1);
  const float* nw = head < H ? a.qn : a.kn;
  if (nw) {
    __shared__ float red[32];
    const float ss = WarpSum(PairSq(x0, x1));
    if ((i & 31) == 0) red[i >> 5] = ss;
    __syncthreads();
    float tot = 0.f;
    for (int j = 0; j < (half + 31) / 32; ++j) tot = __fadd_rn(tot, red[j]);
    const float inv = NormInv(tot, D, a.eps);
    x0 = Normed<T>(x0, inv, nw[e0]);
    x1 = Normed<T>(x1, inv, nw[e1]);
  }
  T r0, r1;
  Rotate<T>(x0, x1, ScaledPos(a, b), a.inv_freq[i], &r0, &r1);
  if (head < H) {
    T* o = q_out + (size_t(b) * H + head) * D;
    o[e0] = r0;
    o[e1] = r1;
    return;
  }
  const int g = head - H, at = a.writes[b];
  if (at < 0 || at >= S) return;
  const size_t off = CacheAt(a, N, G, S, D, b, g, at);
  T* kc = static_cast<T*>(a.kc);
  T* vc = static_cast<T*>(a.vc);
  kc[off + e0] = r0;
  kc[off + e1] = r1;
  const int vcol = (H + G + g) * D;
  vc[off + e0] = FromF32<T>(Biased(row, a.bias, vcol + e0));
  vc[off + e1] = FromF32<T>(Biased(row, a.bias, vcol + e1));
}

template <typename T>
cudaError_t LaunchEpilogue(cudaStream_t stream, bool pdl, const Args& a, T* q_out, int32_t* counters, int B, int N,
                           int H, int G, int S, int D) {
  return w8a16::LaunchEx(stream, pdl, dim3(unsigned(H + G), unsigned(B)), dim3(unsigned(D / 2)), 0,
                         EpilogueKernel<T>, a, q_out, counters, N, H, G, S, D);
}

}  // namespace qkv
}  // namespace jaxllm
