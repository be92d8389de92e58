// CUDA handlers: W8A16 matmul (small M) and split-sequence decode attention.
//
// Both are command-buffer compatible: they only launch kernels on XLA's stream, read every per-step
// value (visible lengths) on the device, and allocate nothing (the attention's partial results live in
// a workspace buffer that XLA allocates as a second output).
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common.h"
#include "attention_cuda.cuh"
#include "w8a16_cuda.cuh"

namespace jaxllm {
namespace {

ffi::Error W8A16Cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                     ffi::Result<ffi::AnyBuffer> y, int64_t layer, int64_t mma) {
  MatmulShape s;
  if (auto err = CheckMatmul(x, w, scale, *y, layer, &s); err.failure()) return err;
  if (mma < -1 || mma >= w8a16::mma::kCandidateCount)
    return ffi::Error::InvalidArgument("jaxllm_w8a16: mma must be -1 (the rule) or a configuration index below " +
                                       std::to_string(w8a16::mma::kCandidateCount) + ", got " + std::to_string(mma));
  if (s.m == 0 || s.n == 0) return ffi::Error::Success();
  const int8_t* wl = static_cast<const int8_t*>(w.untyped_data()) + layer * s.n * s.k;
  const float* sl = static_cast<const float*>(scale.untyped_data()) + layer * s.n * s.groups;
  cudaError_t e = x.element_type() == ffi::BF16
                      ? w8a16::Dispatch<__nv_bfloat16>(stream, s, x.untyped_data(), wl, sl, y->untyped_data(), {},
                                                       int(mma))
                      : w8a16::Dispatch<float>(stream, s, x.untyped_data(), wl, sl, y->untyped_data());
  if (e != cudaSuccess) return ffi::Error::Internal(std::string("jaxllm_w8a16 launch: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

// ---- decode attention ------------------------------------------------------------------------------
//
// Flash-decoding in two kernels. The split kernel's block (split p, kv head g, sequence b) has 4 warps and
// takes all R = H / G query heads of the group at once, so each key/value row is read from memory once.
// The cache is cut into chunks of 4 warp tiles; block p walks chunks p, p + P, ... below the visible
// length (read on the device), warp w taking tile w of each, with no block barrier inside the walk.
// In a tile, lanes split the keys (kLanesPerPos lanes per position, 128 bytes of its row each, held in
// registers) for the scores, and the head dims (D / 32 per lane, so each value row is one coalesced read)
// for the weighted sum; keys and values of the tile are loaded together before either is used. Softmax is
// online per head, in base 2 (q carries log2 e). The warps then merge in shared memory and write the
// block's unnormalized partials ws[b, h, p] = (sum_j 2^(s_j - m) v_j [D], m, sum_j 2^(s_j - m)); the
// combine kernel merges the splits that the visible length reached. Cost follows the visible length, not
// S. The number of splits P is the workspace's dim 2, chosen by the Python wrapper to fill the GPU. The caches
// may hold more rows than q (N >= B, a server's slots): block (p, g, b) reads row b, at the caches' own strides.

constexpr int kAttnWarps = 4;
constexpr int kAttnThreads = 32 * kAttnWarps;
constexpr int kCombineThreads = 256;
constexpr int kMaxSplits = 256;
constexpr int kMaxGroup = 16;       // query heads per kv head

template <typename T, int D>
struct AttnGeometry {
  static constexpr int kKeyElems = 128 / int(sizeof(T));   // elements of a key row one lane holds (128 bytes)
  static constexpr int kLanesPerPos = D / kKeyElems;        // 1, 2 or 4
  static constexpr int kTile = 32 / kLanesPerPos;           // positions per warp tile
  static constexpr int kChunk = kTile * kAttnWarps;         // positions per block chunk (ffi.attention_chunk)
  static constexpr int kValElems = D / 32;                  // head dims per lane in the weighted sum
  static constexpr int kValWords = kValElems * int(sizeof(T)) / 4;   // their 4-byte words: 1, 2 or 4
  static constexpr int kQStride = kKeyElems + 4;            // floats per (head, key part) row of q in shared
                                                            // memory: parts of one head land on distinct banks
};

__device__ __forceinline__ float WordElem(const uint32_t* row, int d, float) { return __uint_as_float(row[d]); }
__device__ __forceinline__ float WordElem(const uint32_t* row, int d, __nv_bfloat16) {
  const uint32_t w = row[d >> 1];
  return __uint_as_float((d & 1) ? (w & 0xffff0000u) : (w << 16));
}

// N 4-byte words from p (4 * N bytes, aligned), zeros when !ok.
template <int N>
__device__ __forceinline__ void LoadWords(const void* p, bool ok, uint32_t (&out)[N]) {
  if constexpr (N == 1) {
    out[0] = ok ? __ldg(static_cast<const uint32_t*>(p)) : 0u;
  } else if constexpr (N == 2) {
    const uint2 v = ok ? __ldg(static_cast<const uint2*>(p)) : make_uint2(0, 0);
    out[0] = v.x; out[1] = v.y;
  } else {
    static_assert(N == 4, "1, 2 or 4 words");
    const uint4 v = ok ? __ldg(static_cast<const uint4*>(p)) : make_uint4(0, 0, 0, 0);
    out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
  }
}

// RM: query heads per kv head the kernel is built for (R <= RM; rows past R are skipped).
template <typename T, int D, int RM>
__global__ void __launch_bounds__(kAttnThreads, RM <= 8 ? 4 : 2)
    AttnSplitKernel(const T* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                    const int32_t* __restrict__ lengths, float* __restrict__ ws, int layer, int N, int H, int G, int S,
                    int P) {
  using Geo = AttnGeometry<T, D>;
  constexpr int EK = Geo::kKeyElems, LPP = Geo::kLanesPerPos, TP = Geo::kTile, CH = Geo::kChunk;
  constexpr int DV = Geo::kValElems, VW = Geo::kValWords, QS = Geo::kQStride, EV = 16 / int(sizeof(T));
  // Shared memory: q [RM][LPP][QS] and probabilities [warp][RM][TP] during the walk, the warps' partial
  // sums [warp][RM][D] in their place for the merge; each warp's running max and sum [warp][RM] throughout
  // (few reads per tile, and registers are what bounds the blocks per SM).
  constexpr int kQ = RM * LPP * QS, kP = kAttnWarps * RM * TP, kAcc = kAttnWarps * RM * D;
  constexpr int kWalk = kQ + kP > kAcc ? kQ + kP : kAcc;
  __shared__ __align__(16) float smem[kWalk + 2 * kAttnWarps * RM];
  float* q_s = smem;
  float* p_s = smem + kQ;
  float* acc_s = smem;
  float* m_s = smem + kWalk;
  float* l_s = m_s + kAttnWarps * RM;

  const int p = blockIdx.x, g = blockIdx.y, b = blockIdx.z, t = threadIdx.x, lane = t & 31, warp = t >> 5;
  const int R = H / G;
  const int len = min(max(lengths[b], 1), S);
  if (p * CH >= len) return;
  const size_t head = ((size_t(layer) * N + b) * G + g) * size_t(S) * D;   // cache[layer, b, g, 0, 0] (N rows)
  const T* kh = k + head;
  const T* vh = v + head;
  const int kpos = lane / LPP, kpart = lane % LPP;
  // A tile's keys (this lane: position kpos, elements [kpart * EK, +EK)) and values (this lane's dims).
  uint4 kr[EK / EV];
  uint32_t vr[TP][VW];
  auto load_tile = [&](int base) {
    const int kp = base + kpos;
    const uint4* ksrc = reinterpret_cast<const uint4*>(kh + size_t(kp) * D + kpart * EK);
#pragma unroll
    for (int i = 0; i < EK / EV; ++i) kr[i] = kp < len ? __ldg(ksrc + i) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int j = 0; j < TP; ++j) LoadWords<VW>(vh + size_t(base + j) * D + lane * DV, base + j < len, vr[j]);
  };
  int c0 = p * CH, base = c0 + warp * TP;
  if (base < len) load_tile(base);   // the first tile's loads overlap staging q

  const float q_scale = rsqrtf(float(D)) * 1.4426950408889634f;   // 1 / sqrt(D), and log2 e for base 2
  for (int i = t; i < RM * D; i += kAttnThreads) {
    const int r = i / D, d = i % D;
    q_s[(r * LPP + d / EK) * QS + d % EK] = r < R ? ToF32(q[(size_t(b) * H + g * R + r) * D + d]) * q_scale : 0.f;
  }
  float acc[RM][DV];
#pragma unroll
  for (int r = 0; r < RM; ++r)
#pragma unroll
    for (int e = 0; e < DV; ++e) acc[r][e] = 0.f;
  float* p_w = p_s + warp * RM * TP;   // this warp's probabilities [RM][TP]
  float* m_w = m_s + warp * RM;        // and running max and sum [RM]
  float* l_w = l_s + warp * RM;
  if (lane < RM) { m_w[lane] = -INFINITY; l_w[lane] = 0.f; }
  __syncthreads();

  // This warp's tiles: `base` in chunks c0 = p, p + P, ... (later tiles lie further on).
  for (; base < len; c0 += P * CH, base = c0 + warp * TP) {
    if (c0 != p * CH) load_tile(base);
    const int kp = base + kpos;

    // Scores s[r] = q_r . k_kpos (partial over this lane's part, then summed over the position's lanes).
    float s[RM];
#pragma unroll
    for (int r = 0; r < RM; ++r) s[r] = 0.f;
#pragma unroll
    for (int i = 0; i < EK / EV; ++i) {
      const uint32_t words[4] = {kr[i].x, kr[i].y, kr[i].z, kr[i].w};
#pragma unroll
      for (int r = 0; r < RM; ++r) {
        if (r >= R) break;
        const float* qrow = q_s + (r * LPP + kpart) * QS + i * EV;
#pragma unroll
        for (int e = 0; e < EV; e += 4) {
          const float4 qv = *reinterpret_cast<const float4*>(qrow + e);
          s[r] = fmaf(qv.x, WordElem(words, e, T()), s[r]);
          s[r] = fmaf(qv.y, WordElem(words, e + 1, T()), s[r]);
          s[r] = fmaf(qv.z, WordElem(words, e + 2, T()), s[r]);
          s[r] = fmaf(qv.w, WordElem(words, e + 3, T()), s[r]);
        }
      }
    }
    // Online softmax per head over the tile; each lane keeps its position's probability.
#pragma unroll
    for (int r = 0; r < RM; ++r) {
      if (r >= R) break;
#pragma unroll
      for (int off = 1; off < LPP; off <<= 1) s[r] += __shfl_xor_sync(0xffffffffu, s[r], off);
      const float sc = kp < len ? s[r] : -INFINITY;
      float mx = sc;
#pragma unroll
      for (int off = 16; off >= LPP; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_old = m_w[r], m_new = fmaxf(m_old, mx);   // finite: the tile's first position is visible
      const float pr = exp2f(sc - m_new);
      float sum = pr;
#pragma unroll
      for (int off = 16; off >= LPP; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      const float alpha = exp2f(m_old - m_new);   // 0 on the first tile (m = -inf)
#pragma unroll
      for (int e = 0; e < DV; ++e) acc[r][e] *= alpha;
      if (kpart == 0) p_w[r * TP + kpos] = pr;
      const float l_new = l_w[r] * alpha + sum;
      __syncwarp();   // every lane has read m_w[r] and l_w[r]
      if (lane == 0) { m_w[r] = m_new; l_w[r] = l_new; }
    }
    __syncwarp();
    // Weighted sum of the values, four positions at a time.
#pragma unroll
    for (int j0 = 0; j0 < TP; j0 += 4) {
      float vv[4][DV];
#pragma unroll
      for (int jj = 0; jj < 4; ++jj)
#pragma unroll
        for (int e = 0; e < DV; ++e) vv[jj][e] = WordElem(vr[j0 + jj], e, T());
#pragma unroll
      for (int r = 0; r < RM; ++r) {
        if (r >= R) break;
        const float4 pv = *reinterpret_cast<const float4*>(p_w + r * TP + j0);
#pragma unroll
        for (int e = 0; e < DV; ++e) {
          float a = acc[r][e];
          a = fmaf(pv.x, vv[0][e], a);
          a = fmaf(pv.y, vv[1][e], a);
          a = fmaf(pv.z, vv[2][e], a);
          acc[r][e] = fmaf(pv.w, vv[3][e], a);
        }
      }
    }
    __syncwarp();   // the next tile overwrites p_w
  }

  // Merge the warps (a warp without tiles has m = -inf, l = 0, acc = 0) and write the block's partials.
  __syncthreads();   // q_s and p_s are done with: acc_s takes their place
#pragma unroll
  for (int r = 0; r < RM; ++r) {
    if (r >= R) break;
#pragma unroll
    for (int e = 0; e < DV; ++e) acc_s[(warp * RM + r) * D + lane * DV + e] = acc[r][e];
  }
  __syncthreads();
  for (int i = t; i < R * D; i += kAttnThreads) {
    const int r = i / D, d = i % D;
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) mm = fmaxf(mm, m_s[w * RM + r]);   // finite: warp 0 had a tile
    float a = 0.f, ll = 0.f;
#pragma unroll
    for (int w = 0; w < kAttnWarps; ++w) {
      const float f = exp2f(m_s[w * RM + r] - mm);
      a = fmaf(f, acc_s[(w * RM + r) * D + d], a);
      ll = fmaf(f, l_s[w * RM + r], ll);
    }
    float* o = ws + ((size_t(b) * H + g * R + r) * P + p) * (D + 2);
    o[d] = a;
    if (d == 0) { o[D] = mm; o[D + 1] = ll; }
  }
}

// Block-wide reduction over kCombineThreads threads (max when is_max, else sum).
__device__ __forceinline__ float BlockReduce(float x, bool is_max, float* red) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const float o = __shfl_xor_sync(0xffffffffu, x, off);
    x = is_max ? fmaxf(x, o) : x + o;
  }
  __syncthreads();   // red may still be read by an earlier call
  if (lane == 0) red[warp] = x;
  __syncthreads();
  float r = red[0];
  for (int i = 1; i < kCombineThreads / 32; ++i) r = is_max ? fmaxf(r, red[i]) : r + red[i];
  return r;
}

// Combine: block (b, h) merges the partials of the splits that the visible length reached. A thread per
// split (kMaxSplits <= kCombineThreads); split 0 is always reached (length >= 1), so each thread's values
// are loaded before the length arrives and masked after.
template <typename T, int D>
__global__ void __launch_bounds__(kCombineThreads) AttnCombineKernel(const float* __restrict__ ws,
                                                                     const int32_t* __restrict__ lengths,
                                                                     T* __restrict__ out, int H, int S, int P) {
  static_assert(kMaxSplits <= kCombineThreads, "one split per thread");
  constexpr int C = AttnGeometry<T, D>::kChunk, kParts = kCombineThreads / D;
  __shared__ float f_s[kMaxSplits];
  __shared__ float red[kCombineThreads / 32];
  __shared__ float part_s[kParts][D];
  const int b = blockIdx.x / H, t = threadIdx.x;
  const float* w = ws + size_t(blockIdx.x) * P * (D + 2);
  const int d = t % D, part = t / D;
  const float m_own = t < P ? w[t * (D + 2) + D] : -INFINITY;       // split t's max and sum
  const float l_own = t < P ? w[t * (D + 2) + D + 1] : 0.f;
  const float first = part < P ? w[part * (D + 2) + d] : 0.f;      // split `part`'s sum at dim d
  const int len = min(max(lengths[b], 1), S);
  const int used = min(P, (len + C - 1) / C);
  const float m = BlockReduce(t < used ? m_own : -INFINITY, true, red);   // base 2
  const float f = t < used ? exp2f(m_own - m) : 0.f;
  if (t < kMaxSplits) f_s[t] = f;
  // Splits past `used` hold stale words (possibly NaN): masked, never multiplied by 0.
  const float l = BlockReduce(t < used ? l_own * f : 0.f, false, red);   // its barriers also publish f_s
  float acc = part < used ? f_s[part] * first : 0.f;
#pragma unroll 4
  for (int p = part + kParts; p < used; p += kParts) acc = fmaf(f_s[p], w[p * (D + 2) + d], acc);
  part_s[part][d] = acc;
  __syncthreads();
  if (t < D) {
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kParts; ++i) sum += part_s[i][t];
    out[size_t(blockIdx.x) * D + t] = FromF32<T>(sum / l);
  }
}

template <typename T, int D, int RM>
cudaError_t LaunchSplit(cudaStream_t stream, const AttentionShape& s, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                        const ffi::AnyBuffer& v, const int32_t* lengths, float* ws, int P) {
  AttnSplitKernel<T, D, RM><<<dim3(P, s.g, s.b), kAttnThreads, 0, stream>>>(
      static_cast<const T*>(q.untyped_data()), static_cast<const T*>(k.untyped_data()),
      static_cast<const T*>(v.untyped_data()), lengths, ws, int(s.layer), int(s.n), int(s.h), int(s.g), int(s.s), P);
  return cudaGetLastError();
}

template <typename T, int D>
cudaError_t LaunchAttention(cudaStream_t stream, const AttentionShape& s, const ffi::AnyBuffer& q,
                            const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, const int32_t* lengths, float* ws,
                            void* out, int P) {
  const int r = int(s.h / s.g);   // query heads per kv head: the kernel built for the next size up
  cudaError_t e = r <= 4   ? LaunchSplit<T, D, 4>(stream, s, q, k, v, lengths, ws, P)
                  : r <= 8 ? LaunchSplit<T, D, 8>(stream, s, q, k, v, lengths, ws, P)
                           : LaunchSplit<T, D, kMaxGroup>(stream, s, q, k, v, lengths, ws, P);
  if (e != cudaSuccess) return e;
  AttnCombineKernel<T, D><<<s.b * s.h, kCombineThreads, 0, stream>>>(ws, lengths, static_cast<T*>(out), int(s.h),
                                                                     int(s.s), P);
  return cudaGetLastError();
}

ffi::Error DecodeAttentionCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                               ffi::AnyBuffer lengths, ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> workspace, int64_t layer) {
  AttentionShape s;
  if (auto err = CheckAttention(q, k, v, lengths, *out, layer, &s); err.failure()) return err;
  if (k.element_type() != q.element_type())
    return ffi::Error::InvalidArgument("jaxllm_decode_attention: the CUDA kernel takes q in the caches' dtype");
  auto wd = workspace->dimensions();
  const int P = wd.size() == 4 ? int(wd[2]) : 0;
  if (workspace->element_type() != ffi::F32 || wd.size() != 4 || wd[0] != s.b || wd[1] != s.h || P < 1 ||
      P > kMaxSplits || wd[3] != s.d + 2)
    return ffi::Error::InvalidArgument("jaxllm_decode_attention: workspace must be f32 [B, H, P, Dh + 2] with 1 <= P "
                                       "<= " + std::to_string(kMaxSplits) + ", got " + DimsString(wd));
  if (s.h / s.g > kMaxGroup)
    return ffi::Error::InvalidArgument("jaxllm_decode_attention: at most " + std::to_string(kMaxGroup) +
                                       " query heads per kv head, got " + std::to_string(s.h / s.g));
  const int32_t* len = static_cast<const int32_t*>(lengths.untyped_data());
  float* ws = static_cast<float*>(workspace->untyped_data());
  const bool bf16 = q.element_type() == ffi::BF16;
  cudaError_t e;
  if (s.d == 64) {
    e = bf16 ? LaunchAttention<__nv_bfloat16, 64>(stream, s, q, k, v, len, ws, out->untyped_data(), P)
             : LaunchAttention<float, 64>(stream, s, q, k, v, len, ws, out->untyped_data(), P);
  } else if (s.d == 128) {
    e = bf16 ? LaunchAttention<__nv_bfloat16, 128>(stream, s, q, k, v, len, ws, out->untyped_data(), P)
             : LaunchAttention<float, 128>(stream, s, q, k, v, len, ws, out->untyped_data(), P);
  } else {
    return ffi::Error::InvalidArgument("jaxllm_decode_attention: head dim must be 64 or 128, got " +
                                       std::to_string(s.d));
  }
  if (e != cudaSuccess)
    return ffi::Error::Internal(std::string("jaxllm_decode_attention launch: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

template <typename T, int D>
cudaError_t LaunchOne(cudaStream_t stream, const AttentionShape& s, const ffi::AnyBuffer& q, const ffi::AnyBuffer& k,
                      const ffi::AnyBuffer& v, const int32_t* lengths, float* ws, void* out, int P, int32_t* counters) {
  return attn1::Launch<T, D>(stream, static_cast<const T*>(q.untyped_data()), static_cast<const T*>(k.untyped_data()),
                             static_cast<const T*>(v.untyped_data()), lengths, ws, static_cast<T*>(out), counters,
                             int(s.layer), int(s.b), int(s.n), int(s.h), int(s.g), int(s.s), P);
}

// The one-kernel attention (attention_cuda.cuh): counters [B, G] int32, zero on entry and left zero, aliased
// to the third result.
ffi::Error DecodeAttentionMergedCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                     ffi::AnyBuffer lengths, ffi::AnyBuffer counters_in, ffi::Result<ffi::AnyBuffer> out,
                                     ffi::Result<ffi::AnyBuffer> workspace, ffi::Result<ffi::AnyBuffer> counters,
                                     int64_t layer) {
  AttentionShape s;
  if (auto err = CheckAttention(q, k, v, lengths, *out, layer, &s); err.failure()) return err;
  if (k.element_type() != q.element_type())
    return ffi::Error::InvalidArgument("jaxllm_decode_attention_merged: the CUDA kernel takes q in the caches' dtype");
  auto wd = workspace->dimensions(), cd = counters->dimensions();
  const int P = wd.size() == 4 ? int(wd[2]) : 0;
  if (workspace->element_type() != ffi::F32 || wd.size() != 4 || wd[0] != s.b || wd[1] != s.h || P < 1 ||
      P > attn1::kMaxSplits || wd[3] != s.d + 2)
    return ffi::Error::InvalidArgument("jaxllm_decode_attention_merged: workspace must be f32 [B, H, P, Dh + 2] with "
                                       "1 <= P <= " + std::to_string(attn1::kMaxSplits) + ", got " + DimsString(wd));
  if (counters->element_type() != ffi::S32 || cd.size() != 2 || cd[0] != s.b || cd[1] != s.g)
    return ffi::Error::InvalidArgument("jaxllm_decode_attention_merged: counters must be int32 [B, G], got " +
                                       DimsString(cd));
  if (s.h / s.g > attn1::kMaxGroup)
    return ffi::Error::InvalidArgument("jaxllm_decode_attention_merged: at most " + std::to_string(attn1::kMaxGroup) +
                                       " query heads per kv head, got " + std::to_string(s.h / s.g));
  const int32_t* len = static_cast<const int32_t*>(lengths.untyped_data());
  float* ws = static_cast<float*>(workspace->untyped_data());
  int32_t* cnt = static_cast<int32_t*>(counters->untyped_data());
  const bool bf16 = q.element_type() == ffi::BF16;
  cudaError_t e = HoldAlias(stream, counters_in, *counters);   // aliased
  if (e != cudaSuccess)
    return ffi::Error::Internal(std::string("jaxllm_decode_attention_merged counters copy: ") + cudaGetErrorString(e));
  if (s.d == 64) {
    e = bf16 ? LaunchOne<__nv_bfloat16, 64>(stream, s, q, k, v, len, ws, out->untyped_data(), P, cnt)
             : LaunchOne<float, 64>(stream, s, q, k, v, len, ws, out->untyped_data(), P, cnt);
  } else if (s.d == 128) {
    e = bf16 ? LaunchOne<__nv_bfloat16, 128>(stream, s, q, k, v, len, ws, out->untyped_data(), P, cnt)
             : LaunchOne<float, 128>(stream, s, q, k, v, len, ws, out->untyped_data(), P, cnt);
  } else {
    return ffi::Error::InvalidArgument("jaxllm_decode_attention_merged: head dim must be 64 or 128, got " +
                                       std::to_string(s.d));
  }
  if (e != cudaSuccess)
    return ffi::Error::Internal(std::string("jaxllm_decode_attention_merged launch: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

// Test variants: the output aliases a poisoned input buffer, so tests can see unwritten elements.
ffi::Error W8A16CudaInto(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                         ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> y, int64_t layer, int64_t mma) {
  return W8A16Cuda(stream, x, w, scale, y, layer, mma);
}
ffi::Error DecodeAttentionCudaInto(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                   ffi::AnyBuffer lengths, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> out,
                                   ffi::Result<ffi::AnyBuffer> ws, int64_t layer) {
  return DecodeAttentionCuda(stream, q, k, v, lengths, out, ws, layer);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(W8A16MatmulCuda, W8A16Cuda, FinishW8A16(BindW8A16<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionCudaHandler, DecodeAttentionCuda, FinishAttention(BindAttention<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionMergedCudaHandler, DecodeAttentionMergedCuda,
                              BindMergedAttention(BindAttention<ffi::PlatformStream<cudaStream_t>>()),
                              {ffi::Traits::kCmdBufferCompatible});
// Test variants: one more argument, the poisoned output buffer aliased to the result.
XLA_FFI_DEFINE_HANDLER_SYMBOL(W8A16MatmulCudaInto, W8A16CudaInto,
                              FinishW8A16(BindW8A16<ffi::PlatformStream<cudaStream_t>>().Arg<ffi::AnyBuffer>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionCudaIntoHandler, DecodeAttentionCudaInto,
                              FinishAttention(BindAttention<ffi::PlatformStream<cudaStream_t>>().Arg<ffi::AnyBuffer>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxllm
