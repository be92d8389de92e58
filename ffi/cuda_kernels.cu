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

namespace jaxllm {
namespace {

template <typename T> __device__ __forceinline__ float ToF32(T v);
template <> __device__ __forceinline__ float ToF32<float>(float v) { return v; }
template <> __device__ __forceinline__ float ToF32<__nv_bfloat16>(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T FromF32(float v);
template <> __device__ __forceinline__ float FromF32<float>(float v) { return v; }
template <> __device__ __forceinline__ __nv_bfloat16 FromF32<__nv_bfloat16>(float v) { return __float2bfloat16(v); }

// Loads 16 consecutive activations x[0..15] as f32 (16-byte loads: 2 for bf16, 4 for f32).
__device__ __forceinline__ void Load16(const __nv_bfloat16* x, float* out) {
  uint4 a = __ldg(reinterpret_cast<const uint4*>(x)), b = __ldg(reinterpret_cast<const uint4*>(x) + 1);
  const __nv_bfloat162* pa = reinterpret_cast<const __nv_bfloat162*>(&a);
  const __nv_bfloat162* pb = reinterpret_cast<const __nv_bfloat162*>(&b);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 fa = __bfloat1622float2(pa[i]), fb = __bfloat1622float2(pb[i]);
    out[2 * i] = fa.x; out[2 * i + 1] = fa.y; out[8 + 2 * i] = fb.x; out[8 + 2 * i + 1] = fb.y;
  }
}
__device__ __forceinline__ void Load16(const float* x, float* out) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float4 f = __ldg(reinterpret_cast<const float4*>(x) + i);
    out[4 * i] = f.x; out[4 * i + 1] = f.y; out[4 * i + 2] = f.z; out[4 * i + 3] = f.w;
  }
}

// dot(x[0..15], w[0..15]) with w packed as 16 int8 in a uint4.
__device__ __forceinline__ float Dot16(const float* x, uint4 w) {
  const int8_t* q = reinterpret_cast<const int8_t*>(&w);
  float s = 0.f;
#pragma unroll
  for (int i = 0; i < 16; ++i) s = fmaf(x[i], float(q[i]), s);
  return s;
}

constexpr int kWarps = 4;     // warps per block
constexpr int kUnroll = 4;    // 16-byte weight loads in flight per lane and row

// One warp computes ROWS outputs for MT rows of x. Lanes stride over K in 16-byte chunks, kUnroll chunks
// per round with every load issued before any math; the warp then reduces its lanes' partial sums.
template <typename T, int MT, int ROWS>
__global__ void __launch_bounds__(kWarps * 32) W8A16Kernel(const T* __restrict__ x, const int8_t* __restrict__ w,
                                                           const float* __restrict__ scale, T* __restrict__ y,
                                                           int m_total, int n_total, int k_total, int groups,
                                                           int group) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int n0 = (blockIdx.x * kWarps + warp) * ROWS;
  const int m0 = blockIdx.y * MT;
  if (n0 >= n_total) return;
  const int chunks = k_total >> 4;
  float acc[MT][ROWS];
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) acc[m][r] = 0.f;

  for (int c0 = lane; c0 < chunks; c0 += 32 * kUnroll) {
    uint4 wv[kUnroll][ROWS];
    float sc[kUnroll][ROWS];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + u * 32;
#pragma unroll
      for (int r = 0; r < ROWS; ++r) {
        const int n = min(n0 + r, n_total - 1);
        if (c < chunks) {
          wv[u][r] = __ldg(reinterpret_cast<const uint4*>(w + size_t(n) * k_total) + c);
          sc[u][r] = __ldg(scale + size_t(n) * groups + (c * 16) / group);
        } else {
          wv[u][r] = make_uint4(0, 0, 0, 0);
          sc[u][r] = 0.f;
        }
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int c = c0 + u * 32;
      if (c >= chunks) break;
#pragma unroll
      for (int m = 0; m < MT; ++m) {
        if (m0 + m >= m_total) break;
        float xv[16];
        Load16(x + size_t(m0 + m) * k_total + c * 16, xv);
#pragma unroll
        for (int r = 0; r < ROWS; ++r) acc[m][r] = fmaf(Dot16(xv, wv[u][r]), sc[u][r], acc[m][r]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < MT; ++m)
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
      float v = acc[m][r];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
      if (lane == 0 && m0 + m < m_total && n0 + r < n_total)
        y[size_t(m0 + m) * n_total + n0 + r] = FromF32<T>(v);
    }
}

template <typename T, int MT, int ROWS>
cudaError_t LaunchW8A16(cudaStream_t stream, const MatmulShape& s, const void* x, const int8_t* w,
                        const float* scale, void* y) {
  dim3 grid((s.n + kWarps * ROWS - 1) / (kWarps * ROWS), (s.m + MT - 1) / MT);
  W8A16Kernel<T, MT, ROWS><<<grid, kWarps * 32, 0, stream>>>(
      static_cast<const T*>(x), w, scale, static_cast<T*>(y), int(s.m), int(s.n), int(s.k), int(s.groups),
      int(s.group));
  return cudaGetLastError();
}

// Few rows per warp when N is small (more warps in flight), more when N is large (more loads per warp).
template <typename T, int MT>
cudaError_t DispatchRows(cudaStream_t stream, const MatmulShape& s, const void* x, const int8_t* w,
                         const float* scale, void* y) {
  if (s.n >= 65536) return LaunchW8A16<T, MT, 4>(stream, s, x, w, scale, y);
  if (s.n >= 4096) return LaunchW8A16<T, MT, 2>(stream, s, x, w, scale, y);
  return LaunchW8A16<T, MT, 1>(stream, s, x, w, scale, y);
}

template <typename T>
cudaError_t DispatchM(cudaStream_t stream, const MatmulShape& s, const void* x, const int8_t* w,
                      const float* scale, void* y) {
  if (s.m <= 1) return DispatchRows<T, 1>(stream, s, x, w, scale, y);
  if (s.m <= 2) return DispatchRows<T, 2>(stream, s, x, w, scale, y);
  if (s.m <= 4) return DispatchRows<T, 4>(stream, s, x, w, scale, y);
  return DispatchRows<T, 8>(stream, s, x, w, scale, y);   // M > 8 runs in tiles of 8 (grid.y)
}

ffi::Error W8A16Cuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                     ffi::Result<ffi::AnyBuffer> y, int64_t layer) {
  MatmulShape s;
  if (auto err = CheckMatmul(x, w, scale, *y, layer, &s); err.failure()) return err;
  if (s.m == 0 || s.n == 0) return ffi::Error::Success();
  const int8_t* wl = static_cast<const int8_t*>(w.untyped_data()) + layer * s.n * s.k;
  const float* sl = static_cast<const float*>(scale.untyped_data()) + layer * s.n * s.groups;
  cudaError_t e = x.element_type() == ffi::BF16
                      ? DispatchM<__nv_bfloat16>(stream, s, x.untyped_data(), wl, sl, y->untyped_data())
                      : DispatchM<float>(stream, s, x.untyped_data(), wl, sl, y->untyped_data());
  if (e != cudaSuccess) return ffi::Error::Internal(std::string("jaxllm_w8a16 launch: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

// ---- decode attention ------------------------------------------------------------------------------

constexpr int kChunk = 64;        // cache positions per split block
constexpr int kAttnThreads = 128; // 4 warps

// Split pass: block (p, h, b) attends query head h over positions [p * kChunk, min((p + 1) * kChunk,
// len[b])) of its kv head h / (H / G), and writes unnormalized partials to the workspace:
// ws[b, h, p, 0:D] = sum_j exp(s_j - m) v_j, ws[.., D] = m, ws[.., D + 1] = sum_j exp(s_j - m).
// Blocks past the visible length return at once: cost follows the visible length, not S. One block per
// query head (not per kv head) keeps the grid wide at short lengths; the repeated K/V reads of a GQA
// group hit L2.
template <typename T, int D>
__global__ void __launch_bounds__(kAttnThreads) AttnSplitKernel(const T* __restrict__ q, const T* __restrict__ k,
                                                                const T* __restrict__ v,
                                                                const int32_t* __restrict__ lengths,
                                                                float* __restrict__ ws, int layer, int B, int H,
                                                                int G, int S, int P) {
  constexpr int kPerLane = D / 32;
  const int p = blockIdx.x, h = blockIdx.y, b = blockIdx.z;
  const int len = min(max(lengths[b], 1), S);
  const int s0 = p * kChunk;
  if (s0 >= len) return;
  const int n = min(kChunk, len - s0);
  const int g = h / (H / G);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __shared__ float p_s[kChunk];
  __shared__ float acc_s[kAttnThreads / 32][D];
  const float scale = rsqrtf(float(D));
  float qv[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) qv[i] = ToF32(q[(size_t(b) * H + h) * D + lane * kPerLane + i]) * scale;
  const size_t base = ((size_t(layer) * B + b) * G + g) * size_t(S) * D + size_t(s0) * D;

  // Scores: a warp per position, lanes across the head dim (coalesced row reads), shuffle-reduced.
  for (int j = warp; j < n; j += kAttnThreads / 32) {
    const T* kp = k + base + size_t(j) * D + lane * kPerLane;
    float dot = 0.f;
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) dot = fmaf(qv[i], ToF32(kp[i]), dot);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, off);
    if (lane == 0) p_s[j] = dot;
  }
  __syncthreads();
  // Max and exp-sum over the chunk (n <= 64): warp 0.
  __shared__ float m_s, l_s;
  if (warp == 0) {
    float m = -INFINITY;
    for (int j = lane; j < n; j += 32) m = fmaxf(m, p_s[j]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
    float l = 0.f;
    for (int j = lane; j < n; j += 32) {
      const float e = __expf(p_s[j] - m);
      p_s[j] = e;
      l += e;
    }
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) l += __shfl_xor_sync(0xffffffffu, l, off);
    if (lane == 0) { m_s = m; l_s = l; }
  }
  __syncthreads();
  // Weighted values: warp w takes positions w, w + 4, ...; lanes across the head dim; warps summed.
  float acc[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) acc[i] = 0.f;
  for (int j = warp; j < n; j += kAttnThreads / 32) {
    const T* vp = v + base + size_t(j) * D + lane * kPerLane;
    const float pj = p_s[j];
#pragma unroll
    for (int i = 0; i < kPerLane; ++i) acc[i] = fmaf(pj, ToF32(vp[i]), acc[i]);
  }
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) acc_s[warp][lane * kPerLane + i] = acc[i];
  __syncthreads();
  float* w = ws + ((size_t(b) * H + h) * P + p) * (D + 2);
  for (int d = threadIdx.x; d < D; d += kAttnThreads) {
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < kAttnThreads / 32; ++i) sum += acc_s[i][d];
    w[d] = sum;
  }
  if (threadIdx.x == 0) {
    w[D] = m_s;
    w[D + 1] = l_s;
  }
}

// Combine pass: block (b, h) merges the partials of the splits that the visible length reached.
template <typename T, int D>
__global__ void AttnCombineKernel(const float* __restrict__ ws, const int32_t* __restrict__ lengths,
                                  T* __restrict__ out, int H, int S, int P) {
  const int b = blockIdx.x / H, h = blockIdx.x % H;
  const int len = min(max(lengths[b], 1), S);
  const int used = (len + kChunk - 1) / kChunk;
  const float* w = ws + (size_t(b) * H + h) * P * (D + 2);
  float m = -INFINITY;
  for (int p = 0; p < used; ++p) m = fmaxf(m, w[p * (D + 2) + D]);
  float l = 0.f;
  for (int p = 0; p < used; ++p) l += w[p * (D + 2) + D + 1] * __expf(w[p * (D + 2) + D] - m);
  for (int d = threadIdx.x; d < D; d += blockDim.x) {
    float acc = 0.f;
    for (int p = 0; p < used; ++p) acc += w[p * (D + 2) + d] * __expf(w[p * (D + 2) + D] - m);
    out[(size_t(b) * H + h) * D + d] = FromF32<T>(acc / l);
  }
}

template <typename T, int D>
cudaError_t LaunchAttention(cudaStream_t stream, const AttentionShape& s, const ffi::AnyBuffer& q,
                            const ffi::AnyBuffer& k, const ffi::AnyBuffer& v, const int32_t* lengths, float* ws,
                            void* out, int P) {
  AttnSplitKernel<T, D><<<dim3(P, s.h, s.b), kAttnThreads, 0, stream>>>(
      static_cast<const T*>(q.untyped_data()), static_cast<const T*>(k.untyped_data()),
      static_cast<const T*>(v.untyped_data()), lengths, ws, int(s.layer), int(s.b), int(s.h), int(s.g), int(s.s), P);
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  AttnCombineKernel<T, D><<<s.b * s.h, D, 0, stream>>>(ws, lengths, static_cast<T*>(out), int(s.h), int(s.s), P);
  return cudaGetLastError();
}

ffi::Error DecodeAttentionCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                               ffi::AnyBuffer lengths, ffi::Result<ffi::AnyBuffer> out,
                               ffi::Result<ffi::AnyBuffer> workspace, int64_t layer) {
  AttentionShape s;
  if (auto err = CheckAttention(q, k, v, lengths, *out, layer, &s); err.failure()) return err;
  const int P = int((s.s + kChunk - 1) / kChunk);
  auto wd = workspace->dimensions();
  if (workspace->element_type() != ffi::F32 || wd.size() != 4 || wd[0] != s.b || wd[1] != s.h || wd[2] != P ||
      wd[3] != s.d + 2)
    return ffi::Error::InvalidArgument("jaxllm_decode_attention: workspace must be f32 [B, H, ceil(S / " +
                                       std::to_string(kChunk) + "), Dh + 2], got " + DimsString(wd));
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
