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
#include "w8a16_cuda.cuh"

namespace jaxllm {
namespace {

// W8A16 configuration by shape (kernel templates in w8a16_cuda.cuh), chosen from bench/gemv_sweep.cu on
// the H200 (docs/kernels.md): TPR threads per row split K, ROWS rows per team, U loads in flight per row,
// MT rows of x per block (larger M runs in tiles of MT); weight loads skip L1 and prefetch 256 B into L2.
template <typename T>
cudaError_t DispatchW8A16(cudaStream_t st, const MatmulShape& s, const void* xp, const int8_t* w, const float* sc,
                          void* yp) {
  using namespace w8a16;
  const T* x = static_cast<const T*>(xp);
  T* y = static_cast<T*>(yp);
  const int m = int(s.m), n = int(s.n), k = int(s.k), g = int(s.groups);
  const bool long_k = k / 16 > 128, many_rows = n >= 4096, huge_n = n >= 32768;
  if (m == 1) {
    if (long_k) return Launch<T, 1, 256, 1, 2, true, true>(st, x, w, sc, y, m, n, k, g);     // K over the block
    if (huge_n && StreamFits<2>(k)) return LaunchStream<T, 2, 2, true>(st, x, w, sc, y, n, k, g);  // LM head
    if (many_rows) return Launch<T, 1, 32, 4, 2, true, true>(st, x, w, sc, y, m, n, k, g);   // warp per 4 rows
    return Launch<T, 1, 64, 1, 1, true, true>(st, x, w, sc, y, m, n, k, g);                  // 2 warps per row
  }
  if (m == 2) {
    if (many_rows) return Launch<T, 2, 32, 2, 2, true, true>(st, x, w, sc, y, m, n, k, g);
    if (long_k) return Launch<T, 2, 128, 1, 2, true, true>(st, x, w, sc, y, m, n, k, g);
    return Launch<T, 2, 64, 1, 2, true, true>(st, x, w, sc, y, m, n, k, g);
  }
  // M >= 3: tiles of 4 rows of x.
  if (huge_n) return Launch<T, 4, 32, 4, 2, true, true>(st, x, w, sc, y, m, n, k, g);
  if (many_rows) return Launch<T, 4, 32, 2, 2, true, true>(st, x, w, sc, y, m, n, k, g);
  if (long_k) return Launch<T, 4, 128, 1, 2, true, true>(st, x, w, sc, y, m, n, k, g);
  return Launch<T, 4, 64, 1, 2, true, true>(st, x, w, sc, y, m, n, k, g);
}

ffi::Error W8A16Cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                     ffi::Result<ffi::AnyBuffer> y, int64_t layer) {
  MatmulShape s;
  if (auto err = CheckMatmul(x, w, scale, *y, layer, &s); err.failure()) return err;
  if (s.m == 0 || s.n == 0) return ffi::Error::Success();
  const int8_t* wl = static_cast<const int8_t*>(w.untyped_data()) + layer * s.n * s.k;
  const float* sl = static_cast<const float*>(scale.untyped_data()) + layer * s.n * s.groups;
  cudaError_t e = x.element_type() == ffi::BF16
                      ? DispatchW8A16<__nv_bfloat16>(stream, s, x.untyped_data(), wl, sl, y->untyped_data())
                      : DispatchW8A16<float>(stream, s, x.untyped_data(), wl, sl, y->untyped_data());
  if (e != cudaSuccess) return ffi::Error::Internal(std::string("jaxllm_w8a16 launch: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

// ---- decode attention ------------------------------------------------------------------------------
//
// Flash-decoding in two kernels. The split kernel gives each block one (sequence b, kv head g, split p):
// all R = H / G query heads of the group at once, so each key/value row is read from memory once. The
// block walks the cache chunks c = p, p + P, p + 2P, ... below the visible length (read on the device),
// staging each chunk's keys and values in shared memory, with an online softmax per query head; it writes
// unnormalized partials ws[b, h, p] = (sum_j exp(s_j - m) v_j [Dh], m, sum_j exp(s_j - m)). The combine
// kernel merges the splits that the visible length reached. Cost follows the visible length, not S. The
// number of splits P is the workspace's dim 2, chosen by the Python wrapper to fill the GPU.

constexpr int kAttnThreads = 128;   // split kernel: 4 warps
constexpr int kCombineThreads = 256;
constexpr int kMaxSplits = 64;
constexpr int kMaxGroup = 16;       // query heads per kv head

template <typename T> __host__ __device__ constexpr int ChunkOf() { return sizeof(T) == 2 ? 64 : 32; }   // positions per chunk

// Shared memory of the split kernel, in 4-byte words: q [R][D] f32, scores/probabilities [R][C] f32,
// keys and values [C][row] with row = D * sizeof(T) / 4 + 1 words (the odd stride keeps column reads by
// consecutive rows conflict-free), then m, l, alpha [R].
template <typename T, int D>
__host__ __device__ constexpr int RowWords() { return D * int(sizeof(T)) / 4 + 1; }
template <typename T, int D>
size_t SplitSmemBytes(int r) {
  return 4 * (size_t(r) * D + size_t(r) * ChunkOf<T>() + 2 * size_t(ChunkOf<T>()) * RowWords<T, D>() + 3 * r);
}

__device__ __forceinline__ float WordElem(const uint32_t* row, int d, float) { return __uint_as_float(row[d]); }
__device__ __forceinline__ float WordElem(const uint32_t* row, int d, __nv_bfloat16) {
  const uint32_t w = row[d >> 1];
  return __uint_as_float((d & 1) ? (w & 0xffff0000u) : (w << 16));
}

template <typename T, int D>
__global__ void __launch_bounds__(kAttnThreads) AttnSplitKernel(const T* __restrict__ q, const T* __restrict__ k,
                                                                const T* __restrict__ v,
                                                                const int32_t* __restrict__ lengths,
                                                                float* __restrict__ ws, int layer, int B, int H,
                                                                int G, int S, int P) {
  constexpr int C = ChunkOf<T>(), W = RowWords<T, D>(), kVec = 16 / int(sizeof(T));   // elements per 16 B
  constexpr int kPairs = kMaxGroup * D / kAttnThreads;                                  // (head, d) per thread
  const int p = blockIdx.x, g = blockIdx.y, b = blockIdx.z, t = threadIdx.x;
  const int R = H / G;
  const int len = min(max(lengths[b], 1), S);
  if (p * C >= len) return;
  extern __shared__ float smem[];
  float* q_s = smem;                                                     // [R][D]
  float* p_s = q_s + R * D;                                              // [R][C]
  uint32_t* k_s = reinterpret_cast<uint32_t*>(p_s + R * C);              // [C][W]
  uint32_t* v_s = k_s + C * W;                                           // [C][W]
  float* m_s = reinterpret_cast<float*>(v_s + C * W);                    // [R]
  float* l_s = m_s + R;
  float* a_s = l_s + R;
  const float scale = rsqrtf(float(D));
  for (int i = t; i < R * D; i += kAttnThreads)
    q_s[i] = ToF32(q[(size_t(b) * H + g * R) * D + i]) * scale;
  for (int r = t; r < R; r += kAttnThreads) { m_s[r] = -INFINITY; l_s[r] = 0.f; }
  float acc[kPairs];
#pragma unroll
  for (int i = 0; i < kPairs; ++i) acc[i] = 0.f;
  const size_t head = ((size_t(layer) * B + b) * G + g) * size_t(S) * D;   // cache[layer, b, g, 0, 0]
  const int lane = t & 31, warp = t >> 5;

  for (int c0 = p * C; c0 < len; c0 += P * C) {
    const int n = min(C, len - c0);
    // Stage the chunk's keys and values: 16-byte global loads, 4-byte shared stores (padded rows).
    for (int i = t; i < n * (D / kVec); i += kAttnThreads) {
      const int j = i / (D / kVec), e = (i % (D / kVec)) * kVec;
      const uint4 kv = __ldg(reinterpret_cast<const uint4*>(k + head + size_t(c0 + j) * D + e));
      const uint4 vv = __ldg(reinterpret_cast<const uint4*>(v + head + size_t(c0 + j) * D + e));
      uint32_t* kd = k_s + j * W + e * int(sizeof(T)) / 4;
      uint32_t* vd = v_s + j * W + e * int(sizeof(T)) / 4;
      kd[0] = kv.x; kd[1] = kv.y; kd[2] = kv.z; kd[3] = kv.w;
      vd[0] = vv.x; vd[1] = vv.y; vd[2] = vv.z; vd[3] = vv.w;
    }
    __syncthreads();
    // Scores: one (head, position) per thread and round; a warp shares its head (q broadcast).
    for (int i = t; i < R * C; i += kAttnThreads) {
      const int r = i / C, j = i % C;
      float dot = -INFINITY;
      if (j < n) {
        const uint32_t* row = k_s + j * W;
        const float* qr = q_s + r * D;
        dot = 0.f;
#pragma unroll 16
        for (int d = 0; d < D; ++d) dot = fmaf(qr[d], WordElem(row, d, T()), dot);
      }
      p_s[i] = dot;
    }
    __syncthreads();
    // Online softmax: a warp per head.
    for (int r = warp; r < R; r += kAttnThreads / 32) {
      float mx = -INFINITY;
      for (int j = lane; j < n; j += 32) mx = fmaxf(mx, p_s[r * C + j]);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_old = m_s[r], m_new = fmaxf(m_old, mx);
      float sum = 0.f;
      for (int j = lane; j < C; j += 32) {
        const float e = j < n ? __expf(p_s[r * C + j] - m_new) : 0.f;
        p_s[r * C + j] = e;
        sum += e;
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      if (lane == 0) {
        const float alpha = __expf(m_old - m_new);   // 0 on the first chunk (m_old = -inf)
        a_s[r] = alpha;
        m_s[r] = m_new;
        l_s[r] = l_s[r] * alpha + sum;
      }
    }
    __syncthreads();
    // Values: thread owns (head, d) pairs t, t + 128, ...; consecutive threads take consecutive d.
#pragma unroll
    for (int i = 0; i < kPairs; ++i) {
      const int idx = t + i * kAttnThreads;
      if (idx < R * D) {
        const int r = idx / D, d = idx % D;
        const float* pr = p_s + r * C;
        float a = acc[i] * a_s[r];
        for (int j = 0; j < n; ++j) a = fmaf(pr[j], WordElem(v_s + j * W, d, T()), a);
        acc[i] = a;
      }
    }
    __syncthreads();   // the next chunk overwrites k_s, v_s, p_s
  }
#pragma unroll
  for (int i = 0; i < kPairs; ++i) {
    const int idx = t + i * kAttnThreads;
    if (idx < R * D) {
      const int r = idx / D, d = idx % D;
      float* w = ws + ((size_t(b) * H + g * R + r) * P + p) * (D + 2);
      w[d] = acc[i];
      if (d == 0) { w[D] = m_s[r]; w[D + 1] = l_s[r]; }
    }
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

// Combine: block (b, h) merges the partials of the splits that the visible length reached.
template <typename T, int D>
__global__ void __launch_bounds__(kCombineThreads) AttnCombineKernel(const float* __restrict__ ws,
                                                                     const int32_t* __restrict__ lengths,
                                                                     T* __restrict__ out, int H, int S, int P) {
  constexpr int C = ChunkOf<T>(), kParts = kCombineThreads / D;
  __shared__ float f_s[kMaxSplits];
  __shared__ float red[kCombineThreads / 32];
  __shared__ float part_s[kParts][D];
  const int b = blockIdx.x / H, t = threadIdx.x;
  const int len = min(max(lengths[b], 1), S);
  const int used = min(P, (len + C - 1) / C);
  const float* w = ws + size_t(blockIdx.x) * P * (D + 2);
  float m = -INFINITY;
  for (int p = t; p < used; p += kCombineThreads) m = fmaxf(m, w[p * (D + 2) + D]);
  m = BlockReduce(m, true, red);
  float l = 0.f;
  for (int p = t; p < used; p += kCombineThreads) {
    const float f = __expf(w[p * (D + 2) + D] - m);
    f_s[p] = f;
    l += w[p * (D + 2) + D + 1] * f;
  }
  l = BlockReduce(l, false, red);   // its barriers also publish f_s
  const int d = t % D, part = t / D;
  float acc = 0.f;
#pragma unroll 4
  for (int p = part; p < used; p += kParts) acc = fmaf(f_s[p], w[p * (D + 2) + d], acc);
  part_s[part][d] = acc;
  __syncthreads();
  if (t < D) {
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kParts; ++i) sum += part_s[i][t];
    out[size_t(blockIdx.x) * D + t] = FromF32<T>(sum / l);
  }
}

template <typename T, int D>
cudaError_t LaunchAttention(cudaStream_t stream, const AttentionShape& s, const ffi::AnyBuffer& q,
                            const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, const int32_t* lengths, float* ws,
                            void* out, int P) {
  const size_t smem = SplitSmemBytes<T, D>(int(s.h / s.g));   // at most 46 KB (kMaxGroup, D 128): no opt-in needed
  AttnSplitKernel<T, D><<<dim3(P, s.g, s.b), kAttnThreads, smem, stream>>>(
      static_cast<const T*>(q.untyped_data()), static_cast<const T*>(k.untyped_data()),
      static_cast<const T*>(v.untyped_data()), lengths, ws, int(s.layer), int(s.b), int(s.h), int(s.g), int(s.s), P);
  cudaError_t e = cudaGetLastError();
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

// Test variants: the output aliases a poisoned input buffer, so tests can see unwritten elements.
ffi::Error W8A16CudaInto(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                         ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> y, int64_t layer) {
  return W8A16Cuda(stream, x, w, scale, y, layer);
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
// Test variants: one more argument, the poisoned output buffer aliased to the result.
XLA_FFI_DEFINE_HANDLER_SYMBOL(W8A16MatmulCudaInto, W8A16CudaInto,
                              FinishW8A16(BindW8A16<ffi::PlatformStream<cudaStream_t>>().Arg<ffi::AnyBuffer>()),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionCudaIntoHandler, DecodeAttentionCudaInto,
                              FinishAttention(BindAttention<ffi::PlatformStream<cudaStream_t>>().Arg<ffi::AnyBuffer>()),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxllm
