// The whole MLP of a decode layer in one kernel (batch 1, bf16, W8A16): RMSNorm, gate/up, SwiGLU, down and
// the residual add, split over F instead of run as two GEMVs with a grid-wide boundary between them:
//   y = x + T(down . T(silu(T(gate . n)) * T(up . n))),  n = T(x * rsqrt(mean(x^2) + eps) * norm_w)
// as the per-op path's norm_linear(swiglu) and linear_residual compute it, with two differences in the
// sums: the activations meet the weights as int16 chunks (w8a16's kInt16: 2^-15 of each 16 values' largest),
// and down's sum over F is exact in fixed point (below) before its one rounding to T.
//
// Block b takes F rows [64 b, 64 b + 64): its 64 gate and 64 up rows of [2F, D] and the matching 64 columns
// of down [D, F] (one scale group of 64 per down row). It copies all of them into shared memory
// (cp.async) before it waits for the previous kernel (programmatic dependent launch), so the layer's
// weights stream in while the attention and the O projection still run; after the wait it normalizes x,
// computes its 64 activations and their partial down products for all D outputs, and adds those into
// int64 accumulators in fixed point (2^-32; exact, so the order the blocks arrive in does not change a bit).
// The block that takes the last ticket adds the sums to the residual, rounded to T once, and leaves the
// accumulators and the ticket zero for the next layer (the caller zeroes them once per call).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>

#include "w8a16_cuda.cuh"

namespace jaxllm {
namespace mlp {

// FC: F rows a block (16, 32 or 64: within one scale group of down's rows); FC * 8 threads, a warp per 4 of
// its outputs. JAXLLM_MLP_FC picks it (default 64).
constexpr float kFixed = 4294967296.f;    // 2^32: the accumulators' unit is 2^-32
constexpr int kMaxD = 1024;                // the shared memory of one block (SmemBytes) stays under 227 KB

struct Args {
  float* x;                     // [D] f32 residual: read by every block, then updated by the last one
  const float* norm_w;          // [D]
  const int8_t* wgu;            // [2F, D] this layer's gate rows then up rows
  const float* sgu;             // [2F, D / gs] their scales
  const int8_t* wd;             // [D, F]
  const float* sd;              // [D, F / 64]
  unsigned long long* acc;      // [D] fixed-point sums: zero on entry, left zero
  unsigned int* ticket;         // zero on entry, left zero
  float eps;
  int d, f, ggu;                // ggu: gate/up scale groups a row (D / gs)
  bool early;                   // let the next kernel launch once the copies are issued
};

// Layout of the dynamic shared memory (16-byte aligned pieces).
struct Smem {
  size_t wgu, wd, sgu, sd, xq, xs, total;
};
__host__ __device__ inline Smem Layout(int d, int ggu, int kFC) {
  Smem s;
  size_t at = 0;
  auto take = [&](size_t n) { const size_t here = at; at += (n + 15) / 16 * 16; return here; };
  s.wgu = take(size_t(2 * kFC) * d);
  s.wd = take(size_t(d) * kFC);
  s.sgu = take(size_t(2 * kFC) * ggu * 4);
  s.sd = take(size_t(d) * 4);
  s.xq = take(size_t(d / 16) * 32);
  s.xs = take(size_t(d / 16) * 4);
  s.total = at;
  return s;
}

__device__ __forceinline__ void CopyAsync16(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(gmem) : "memory");
}
__device__ __forceinline__ void CopyAsync4(void* smem, const void* gmem) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(s), "l"(gmem) : "memory");
}

template <typename T, int kFC>
__global__ void __launch_bounds__(kFC * 8) Kernel(Args a) {
  using namespace w8a16;
  constexpr int kThreads = kFC * 8, kLanesPerRow = kFC / 16;   // down: lanes a row, a chunk each
  extern __shared__ __align__(16) uint8_t smem[];
  const Smem L = Layout(a.d, a.ggu, kFC);
  int8_t* wgu_s = reinterpret_cast<int8_t*>(smem + L.wgu);   // [128][D]: gate rows, then up rows
  int8_t* wd_s = reinterpret_cast<int8_t*>(smem + L.wd);     // [D][64]
  float* sgu_s = reinterpret_cast<float*>(smem + L.sgu);     // [128][ggu]
  float* sd_s = reinterpret_cast<float*>(smem + L.sd);       // [D]
  uint4* xq = reinterpret_cast<uint4*>(smem + L.xq);         // [D / 16][2] int16 chunks of n
  float* xs = reinterpret_cast<float*>(smem + L.xs);         // [D / 16] their scales
  __shared__ uint4 hq[kFC / 16][2];                          // the FC activations as int16 chunks
  __shared__ float hs[kFC / 16], hv[kFC], red[kThreads / 32];
  __shared__ float inv_rms;
  __shared__ bool last;
  const int d = a.d, f0 = blockIdx.x * kFC, tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int chunks = d / 16;

  // 1. Every weight byte of the block on its way into shared memory; nothing read yet that a kernel before
  //    this one writes.
  {
    const int row_chunks = kFC * chunks;   // 16-byte pieces of FC contiguous rows
    const int8_t* gate = a.wgu + size_t(f0) * d;
    const int8_t* up = a.wgu + size_t(a.f + f0) * d;
    for (int i = tid; i < row_chunks; i += kThreads) {
      CopyAsync16(wgu_s + size_t(i) * 16, gate + size_t(i) * 16);
      CopyAsync16(wgu_s + size_t(row_chunks + i) * 16, up + size_t(i) * 16);
    }
    for (int i = tid; i < d * (kFC / 16); i += kThreads) {   // row n's FC bytes at column f0
      const int n = i / (kFC / 16), c = i % (kFC / 16);
      CopyAsync16(wd_s + size_t(n) * kFC + c * 16, a.wd + size_t(n) * a.f + f0 + c * 16);
    }
    const int srow = kFC * a.ggu / 4;   // 16-byte pieces of the scales of FC rows
    for (int i = tid; i < srow; i += kThreads) {
      CopyAsync16(sgu_s + 4 * i, a.sgu + size_t(f0) * a.ggu + 4 * i);
      CopyAsync16(sgu_s + 4 * (srow + i), a.sgu + size_t(a.f + f0) * a.ggu + 4 * i);
    }
    const int dg = a.f / 64;
    for (int n = tid; n < d; n += kThreads) CopyAsync4(sd_s + n, a.sd + size_t(n) * dg + f0 / 64);
    asm volatile("cp.async.commit_group;" ::: "memory");
  }
  if (a.early) GridDepLaunch();
  GridDepWait();

  // 2. RMSNorm of the residual row, as int16 chunks (w8a16's norm16 rounding: T(x * inv * w)).
  {
    float ss = 0.f;
    for (int i = tid; i < d; i += kThreads) ss = fmaf(a.x[i], a.x[i], ss);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, off);
    if (lane == 0) red[warp] = ss;
    __syncthreads();
    if (tid == 0) {
      float v = 0.f;
#pragma unroll
      for (int i = 0; i < kThreads / 32; ++i) v += red[i];
      inv_rms = rsqrtf(v / float(d) + a.eps);
    }
    __syncthreads();
    for (int c = tid; c < chunks; c += kThreads) {
      float v[16];
#pragma unroll
      for (int i = 0; i < 16; i += 4) {
        const float4 xv = *reinterpret_cast<const float4*>(a.x + c * 16 + i);
        const float4 g = __ldg(reinterpret_cast<const float4*>(a.norm_w + c * 16 + i));
        v[i] = ToF32(FromF32<T>(xv.x * inv_rms * g.x));
        v[i + 1] = ToF32(FromF32<T>(xv.y * inv_rms * g.y));
        v[i + 2] = ToF32(FromF32<T>(xv.z * inv_rms * g.z));
        v[i + 3] = ToF32(FromF32<T>(xv.w * inv_rms * g.w));
      }
      XChunk<Conv::kInt16> q;
      QuantizeInt16(v, q);
      xq[2 * c] = make_uint4(q.q[0], q.q[1], q.q[2], q.q[3]);
      xq[2 * c + 1] = make_uint4(q.q[4], q.q[5], q.q[6], q.q[7]);
      xs[c] = q.s;
    }
  }
  asm volatile("cp.async.wait_all;" ::: "memory");
  __syncthreads();

  // 3. Gate and up: warp w takes outputs 4w .. 4w + 3, i.e. gate rows 4w + j and up rows 64 + 4w + j; lanes
  //    split each row's chunks.
  {
    const int gs_chunks = chunks / a.ggu;   // 16-byte chunks a scale group
    float acc[8];
#pragma unroll
    for (int r = 0; r < 8; ++r) acc[r] = 0.f;
    for (int c = lane; c < chunks; c += 32) {
      XChunk<Conv::kInt16> xc;
      const uint4 p = xq[2 * c], q = xq[2 * c + 1];
      xc.q[0] = p.x; xc.q[1] = p.y; xc.q[2] = p.z; xc.q[3] = p.w;
      xc.q[4] = q.x; xc.q[5] = q.y; xc.q[6] = q.z; xc.q[7] = q.w;
      xc.s = xs[c];
      const int g = c / gs_chunks;
#pragma unroll
      for (int r = 0; r < 8; ++r) {
        const int row = (r < 4 ? 0 : kFC) + 4 * warp + (r & 3);
        const uint4 w = *reinterpret_cast<const uint4*>(wgu_s + size_t(row) * d + c * 16);
        acc[r] = Accumulate<Conv::kInt16>(acc[r], xc, w, sgu_s[row * a.ggu + g]);
      }
    }
    const int j = GroupSumEach<8, 32>(acc, lane);   // lane l: the total of row value l / 4
    const float up = __shfl_down_sync(0xffffffffu, acc[0], 16);
    if (lane % 4 == 0 && j < 4) {
      const float gv = ToF32(FromF32<T>(acc[0]));
      hv[4 * warp + j] = ToF32(FromF32<T>(gv / (1.f + __expf(-gv)) * ToF32(FromF32<T>(up))));
    }
  }
  __syncthreads();
  if (tid < kFC / 16) {
    XChunk<Conv::kInt16> q;
    QuantizeInt16(hv + 16 * tid, q);
    hq[tid][0] = make_uint4(q.q[0], q.q[1], q.q[2], q.q[3]);
    hq[tid][1] = make_uint4(q.q[4], q.q[5], q.q[6], q.q[7]);
    hs[tid] = q.s;
  }
  __syncthreads();

  // 4. Down's partial products over this block's FC columns: FC / 16 lanes a row (a chunk each).
  {
    const int c = lane % kLanesPerRow;
    XChunk<Conv::kInt16> hc;
    hc.q[0] = hq[c][0].x; hc.q[1] = hq[c][0].y; hc.q[2] = hq[c][0].z; hc.q[3] = hq[c][0].w;
    hc.q[4] = hq[c][1].x; hc.q[5] = hq[c][1].y; hc.q[6] = hq[c][1].z; hc.q[7] = hq[c][1].w;
    hc.s = hs[c];
    constexpr int kRowsPerWarp = 32 / kLanesPerRow;
    for (int n0 = warp * kRowsPerWarp; n0 < d; n0 += kThreads / 32 * kRowsPerWarp) {
      const int n = n0 + lane / kLanesPerRow;
      float p = 0.f;
      if (n < d) p = Accumulate<Conv::kInt16>(0.f, hc, *reinterpret_cast<const uint4*>(wd_s + size_t(n) * kFC + c * 16),
                                              sd_s[n]);
#pragma unroll
      for (int off = 1; off < kLanesPerRow; off *= 2) p += __shfl_xor_sync(0xffffffffu, p, off);
      if (c == 0 && n < d) atomicAdd(a.acc + n, static_cast<unsigned long long>(__float2ll_rn(p * kFixed)));
    }
  }

  // 5. The last block adds the sums to the residual.
  __syncthreads();
  if (tid == 0) {
    __threadfence();
    last = atomicAdd(a.ticket, 1u) == gridDim.x - 1;
  }
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int n = tid; n < d; n += kThreads) {
    const long long v = static_cast<long long>(atomicExch(a.acc + n, 0ull));
    a.x[n] = a.x[n] + ToF32(FromF32<T>(float(double(v) * (1.0 / 4294967296.0))));
  }
  if (tid == 0) atomicExch(a.ticket, 0u);
}

// Whether the fused MLP takes this geometry (else the caller runs gate/up and down as two kernels).
inline bool Fits(int64_t b, int64_t d, int64_t f, int64_t gu_group, int64_t down_group) {
  return b == 1 && d % 16 == 0 && d <= kMaxD && f % 64 == 0 && down_group == 64 && gu_group % 16 == 0 &&
         d % gu_group == 0 && (16 * (d / gu_group)) % 4 == 0;
}

template <typename T, int kFC>
cudaError_t LaunchFC(cudaStream_t stream, bool pdl, const Args& a) {
  auto kernel = Kernel<T, kFC>;
  const size_t smem = Layout(a.d, a.ggu, kFC).total;
  // The opt-in to more than 48 KB of dynamic shared memory, once per device and size.
  constexpr int kDevices = 64;
  static size_t opted[kDevices] = {};
  int dev = 0;
  if (cudaError_t e = cudaGetDevice(&dev); e != cudaSuccess) return e;
  if (dev >= kDevices || smem > opted[dev]) {
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
        e != cudaSuccess)
      return e;
    if (dev < kDevices) opted[dev] = smem;
  }
  return w8a16::LaunchEx(stream, pdl, dim3(a.f / kFC), dim3(kFC * 8), smem, kernel, a);
}

template <typename T>
cudaError_t Launch(cudaStream_t stream, bool pdl, const Args& a) {
  static const int fc = [] {
    const char* v = std::getenv("JAXLLM_MLP_FC");
    return v && *v ? std::atoi(v) : 64;
  }();
  if (fc == 16) return LaunchFC<T, 16>(stream, pdl, a);
  if (fc == 32) return LaunchFC<T, 32>(stream, pdl, a);
  return LaunchFC<T, 64>(stream, pdl, a);
}

}  // namespace mlp
}  // namespace jaxllm
