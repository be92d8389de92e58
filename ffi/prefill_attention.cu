// CUDA prefill attention: flash attention (FlashAttention-2's loop) on bf16 tensor cores, causal with a
// query offset, reading the stacked KV cache in place.
//
// out[b, t, h] = softmax_s(q[b, t, h] . k[layer, b, g, s] / sqrt(D)) . v[layer, b, g, s] over the keys
// s <= min(start[b] + t, S - 1), g = h / (H / G): the contract of jaxllm/kernels/attention.py. Nothing the
// size of T x S is ever written: a block of 4 warps takes 64 queries of one head (16 rows a warp), holds
// their q in registers as mma fragments, and walks the key tiles (BK keys) up to its last visible key,
// with the next tile's keys and values copied into shared memory (cp.async) while the current one is
// used. Per tile: scores S = q k^T by mma.m16n8k16 (f32 accumulators), the causal mask on the tiles that
// cross the diagonal, an online softmax in base 2 per row (each row's 4 lanes reduce by shuffles), then
// P (rounded to bf16, in registers: the accumulator layout of S is the A-operand layout of the next mma)
// times v into f32 accumulators. Work follows the visible keys; blocks with the most keys start first.
// Command-buffer compatible: the start positions are read on the device, nothing is allocated.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common.h"

namespace jaxllm {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = 32 * kWarps;
constexpr int kBQ = 16 * kWarps;   // queries per block

template <int D>
struct FlashGeometry {
  static constexpr int kChunks = D / 8;            // 16-byte chunks per row (8 bf16)
  static constexpr int kBK = 4096 / D;             // keys per tile: 64 for D 64, 32 for D 128 (32 KB of K/V
                                                   // for two stages, plus q's 8 or 16 KB: <= 48 KB static)
  static constexpr int kKSteps = D / 16;           // k-steps of 16 along D (scores)
  static constexpr int kNTiles = kBK / 8;          // n-tiles of 8 keys (scores)
  static constexpr int kDTiles = D / 8;            // n-tiles of 8 dims (output)
};

// Swizzled index of chunk c of row r in a [rows][kChunks] tile of 16-byte chunks: the 8 rows an ldmatrix
// reads at one chunk land on 8 different bank groups.
template <int C>
__device__ __forceinline__ int Swz(int r, int c) {
  return r * C + (c ^ (r & 7));
}

__device__ __forceinline__ uint32_t SmemAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void CpAsync16(void* dst, const void* src, bool ok) {
  // ok = false zero-fills the 16 bytes (src-size 0).
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(SmemAddr(dst)), "l"(src), "r"(ok ? 16 : 0));
}
__device__ __forceinline__ void CpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void CpAsyncWait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void LdMatrixX4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(SmemAddr(p)));
}
__device__ __forceinline__ void LdMatrixX4T(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(SmemAddr(p)));
}

// d += a (16x16, row) . b (16x8, col), bf16 inputs, f32 accumulators.
__device__ __forceinline__ void Mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t PackBf16(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}

// Grid: (query blocks, H, B). q [B, T, H, D], k/v [L, B, G, S, D], start [B], out [B, T, H, D].
template <int D>
__global__ void __launch_bounds__(kThreads, 2)
    FlashPrefillKernel(const __nv_bfloat16* __restrict__ q, const __nv_bfloat16* __restrict__ k,
                       const __nv_bfloat16* __restrict__ v, const int32_t* __restrict__ start,
                       __nv_bfloat16* __restrict__ out, int layer, int B, int T, int H, int G, int S) {
  using Geo = FlashGeometry<D>;
  constexpr int C = Geo::kChunks, BK = Geo::kBK, KS = Geo::kKSteps, NT = Geo::kNTiles, DT = Geo::kDTiles;
  __shared__ __align__(128) uint4 q_s[kBQ * C];
  __shared__ __align__(128) uint4 k_s[2][BK * C];
  __shared__ __align__(128) uint4 v_s[2][BK * C];

  const int qb = gridDim.x - 1 - blockIdx.x;   // the blocks with the most keys first
  const int h = blockIdx.y, b = blockIdx.z;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = h / (H / G);
  const int s0 = max(start[b], 0);
  const int t0 = qb * kBQ;
  // The block's last visible key: that of its last query (clipped to the cache).
  const int t_last = min(t0 + kBQ, T) - 1;
  const int key_end = min(s0 + t_last, S - 1) + 1;   // keys [0, key_end)
  const int n_tiles = (key_end + BK - 1) / BK;

  const size_t head = ((size_t(layer) * B + b) * G + g) * size_t(S) * D;
  const __nv_bfloat16* kh = k + head;
  const __nv_bfloat16* vh = v + head;

  // q tile -> shared memory (rows past T zero).
  for (int i = tid; i < kBQ * C; i += kThreads) {
    const int r = i / C, c = i % C, t = t0 + r;
    const __nv_bfloat16* src = q + ((size_t(b) * T + min(t, T - 1)) * H + h) * D + c * 8;
    CpAsync16(&q_s[Swz<C>(r, c)], src, t < T);
  }
  auto load_tile = [&](int tile, int stage) {
    const int kbase = tile * BK;
    for (int i = tid; i < BK * C; i += kThreads) {
      const int r = i / C, c = i % C, s = kbase + r;
      const bool ok = s < key_end;
      const size_t off = size_t(ok ? s : 0) * D + c * 8;
      CpAsync16(&k_s[stage][Swz<C>(r, c)], kh + off, ok);
      CpAsync16(&v_s[stage][Swz<C>(r, c)], vh + off, ok);
    }
  };
  load_tile(0, 0);
  CpAsyncCommit();   // group 0: q and the first tile

  // This thread's rows in the warp's 16: r0 = lane / 4 and r0 + 8; its columns in an n-tile: 2 (lane % 4) + {0, 1}.
  const int r0 = lane >> 2, cq = (lane & 3) * 2;
  const int row_a = warp * 16 + r0, row_b = row_a + 8;
  const int pos_a = s0 + t0 + row_a, pos_b = s0 + t0 + row_b;   // the queries' cache positions
  const float scale = rsqrtf(float(D)) * 1.4426950408889634f;   // 1 / sqrt(D) and log2 e (base 2)

  uint32_t qf[KS][4];
  float o[DT][4];
#pragma unroll
  for (int j = 0; j < DT; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m_a = -INFINITY, m_b = -INFINITY, l_a = 0.f, l_b = 0.f;

  for (int tile = 0; tile < n_tiles; ++tile) {
    const int stage = tile & 1;
    if (tile + 1 < n_tiles) load_tile(tile + 1, stage ^ 1);
    CpAsyncCommit();
    CpAsyncWait<1>();   // everything but the tile just issued has landed
    __syncthreads();
    if (tile == 0) {
#pragma unroll
      for (int ks = 0; ks < KS; ++ks) {   // A fragments of q: matrices (rows 0-7 | 8-15) x (k 0-7 | 8-15)
        const int m = lane >> 3, r = warp * 16 + (m & 1) * 8 + (lane & 7), c = ks * 2 + (m >> 1);
        LdMatrixX4(qf[ks], &q_s[Swz<C>(r, c)]);
      }
    }
    // Scores for this warp's 16 queries x BK keys.
    float sc[NT][4];
#pragma unroll
    for (int n = 0; n < NT; ++n) sc[n][0] = sc[n][1] = sc[n][2] = sc[n][3] = 0.f;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int ks = 0; ks < KS; ks += 2) {   // one x4 load: b0, b1 of k-steps ks and ks + 1
        uint32_t kf[4];
        const int r = n * 8 + (lane & 7), c = ks * 2 + (lane >> 3);
        LdMatrixX4(kf, &k_s[stage][Swz<C>(r, c)]);
        Mma(sc[n], qf[ks], kf[0], kf[1]);
        Mma(sc[n], qf[ks + 1], kf[2], kf[3]);
      }
    }
    // Mask (keys past a row's position, or past the visible end) and the online softmax.
    const int kbase = tile * BK;
    const bool edge = kbase + BK - 1 > s0 + t0 + warp * 16 || kbase + BK > key_end;
    float mx_a = m_a, mx_b = m_b;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int s = kbase + n * 8 + cq + e;
        float xa = sc[n][e] * scale, xb = sc[n][2 + e] * scale;
        if (edge) {
          if (s > pos_a || s >= key_end) xa = -INFINITY;
          if (s > pos_b || s >= key_end) xb = -INFINITY;
        }
        sc[n][e] = xa;
        sc[n][2 + e] = xb;
        mx_a = fmaxf(mx_a, xa);
        mx_b = fmaxf(mx_b, xb);
      }
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {
      mx_a = fmaxf(mx_a, __shfl_xor_sync(0xffffffffu, mx_a, off));
      mx_b = fmaxf(mx_b, __shfl_xor_sync(0xffffffffu, mx_b, off));
    }
    // A row with no visible key yet keeps m = -inf; use 0 as its base so exp2 gives 0, not NaN.
    const float base_a = mx_a == -INFINITY ? 0.f : mx_a, base_b = mx_b == -INFINITY ? 0.f : mx_b;
    const float alpha_a = exp2f(m_a - base_a), alpha_b = exp2f(m_b - base_b);
    m_a = mx_a;
    m_b = mx_b;
    float sum_a = 0.f, sum_b = 0.f;
    uint32_t pf[NT / 2][4];   // P as A fragments: k-step j covers n-tiles 2j and 2j + 1
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      const float p0 = exp2f(sc[n][0] - base_a), p1 = exp2f(sc[n][1] - base_a);
      const float p2 = exp2f(sc[n][2] - base_b), p3 = exp2f(sc[n][3] - base_b);
      sum_a += p0 + p1;
      sum_b += p2 + p3;
      pf[n / 2][(n & 1) * 2] = PackBf16(p0, p1);       // rows r0: a0 (n even) or a2 (n odd)
      pf[n / 2][(n & 1) * 2 + 1] = PackBf16(p2, p3);   // rows r0 + 8: a1 or a3
    }
    l_a = l_a * alpha_a + sum_a;   // partial over this lane's columns; the row's lanes sum at the end
    l_b = l_b * alpha_b + sum_b;
#pragma unroll
    for (int j = 0; j < DT; ++j) {
      o[j][0] *= alpha_a;
      o[j][1] *= alpha_a;
      o[j][2] *= alpha_b;
      o[j][3] *= alpha_b;
    }
    // O += P V: per k-step of 16 keys and pair of dim tiles, one transposed x4 load gives both b operands.
#pragma unroll
    for (int kk = 0; kk < NT / 2; ++kk) {
#pragma unroll
      for (int j = 0; j < DT; j += 2) {
        uint32_t vf[4];
        const int r = kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8, c = j + (lane >> 4);
        LdMatrixX4T(vf, &v_s[stage][Swz<C>(r, c)]);
        Mma(o[j], pf[kk], vf[0], vf[1]);
        Mma(o[j + 1], pf[kk], vf[2], vf[3]);
      }
    }
    __syncthreads();   // this stage is refilled two tiles on
  }

#pragma unroll
  for (int off = 1; off < 4; off <<= 1) {
    l_a += __shfl_xor_sync(0xffffffffu, l_a, off);
    l_b += __shfl_xor_sync(0xffffffffu, l_b, off);
  }
  const float inv_a = l_a > 0.f ? 1.f / l_a : 0.f, inv_b = l_b > 0.f ? 1.f / l_b : 0.f;
  const int ta = t0 + row_a, tb = t0 + row_b;
#pragma unroll
  for (int j = 0; j < DT; ++j) {
    const int d = j * 8 + cq;
    if (ta < T)
      *reinterpret_cast<__nv_bfloat162*>(out + ((size_t(b) * T + ta) * H + h) * D + d) =
          __floats2bfloat162_rn(o[j][0] * inv_a, o[j][1] * inv_a);
    if (tb < T)
      *reinterpret_cast<__nv_bfloat162*>(out + ((size_t(b) * T + tb) * H + h) * D + d) =
          __floats2bfloat162_rn(o[j][2] * inv_b, o[j][3] * inv_b);
  }
}

ffi::Error PrefillAttentionCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                ffi::AnyBuffer start, ffi::Result<ffi::AnyBuffer> out, int64_t layer) {
  auto qd = q.dimensions(), kd = k.dimensions(), sd = start.dimensions(), od = out->dimensions();
  if (q.element_type() != ffi::BF16 || k.element_type() != ffi::BF16 || v.element_type() != ffi::BF16 ||
      out->element_type() != ffi::BF16)
    return ffi::Error::InvalidArgument("jaxllm_prefill_attention: q, caches and output must be bf16");
  if (start.element_type() != ffi::S32)
    return ffi::Error::InvalidArgument("jaxllm_prefill_attention: start must be int32");
  if (qd.size() != 4 || kd.size() != 5 || sd.size() != 1 || od.size() != 4)
    return ffi::Error::InvalidArgument("jaxllm_prefill_attention: expected q [B, T, H, D], caches [L, B, G, S, D], "
                                       "start [B]; got q " + DimsString(qd) + ", k " + DimsString(kd));
  const int64_t B = qd[0], T = qd[1], H = qd[2], D = qd[3], L = kd[0], G = kd[2], S = kd[3];
  auto vd = v.dimensions();
  for (int i = 0; i < 5; ++i)
    if (kd[i] != vd[i]) return ffi::Error::InvalidArgument("jaxllm_prefill_attention: k and v caches differ in shape");
  for (int i = 0; i < 4; ++i)
    if (od[i] != qd[i]) return ffi::Error::InvalidArgument("jaxllm_prefill_attention: out must have q's shape");
  if (kd[1] != B || kd[4] != D || sd[0] != B || G < 1 || H % G || S < 1 || T < 1)
    return ffi::Error::InvalidArgument("jaxllm_prefill_attention: inconsistent shapes q " + DimsString(qd) + ", k " +
                                       DimsString(kd) + ", start " + DimsString(sd));
  if (layer < 0 || layer >= L)
    return ffi::Error::InvalidArgument("jaxllm_prefill_attention: layer " + std::to_string(layer) + " out of range");
  const dim3 grid(unsigned((T + kBQ - 1) / kBQ), unsigned(H), unsigned(B));
  const auto* qp = static_cast<const __nv_bfloat16*>(q.untyped_data());
  const auto* kp = static_cast<const __nv_bfloat16*>(k.untyped_data());
  const auto* vp = static_cast<const __nv_bfloat16*>(v.untyped_data());
  const auto* st = static_cast<const int32_t*>(start.untyped_data());
  auto* op = static_cast<__nv_bfloat16*>(out->untyped_data());
  if (D == 64) {
    FlashPrefillKernel<64><<<grid, kThreads, 0, stream>>>(qp, kp, vp, st, op, int(layer), int(B), int(T), int(H),
                                                         int(G), int(S));
  } else if (D == 128) {
    FlashPrefillKernel<128><<<grid, kThreads, 0, stream>>>(qp, kp, vp, st, op, int(layer), int(B), int(T), int(H),
                                                          int(G), int(S));
  } else {
    return ffi::Error::InvalidArgument("jaxllm_prefill_attention: head dim must be 64 or 128, got " +
                                       std::to_string(D));
  }
  if (cudaError_t e = cudaGetLastError(); e != cudaSuccess)
    return ffi::Error::Internal(std::string("jaxllm_prefill_attention launch: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

// Test variant: the output aliases a poisoned input buffer, so tests can see unwritten elements.
ffi::Error PrefillAttentionCudaInto(cudaStream_t stream, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                    ffi::AnyBuffer start, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> out,
                                    int64_t layer) {
  return PrefillAttentionCuda(stream, q, k, v, start, out, layer);
}

auto BindPrefill() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()   // XLA's stream
      .Arg<ffi::AnyBuffer>()                      // q [B, T, H, D] bf16
      .Arg<ffi::AnyBuffer>()                      // k cache [L, B, G, S, D] bf16
      .Arg<ffi::AnyBuffer>()                      // v cache [L, B, G, S, D] bf16
      .Arg<ffi::AnyBuffer>();                     // start [B] int32: cache position of query 0
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(PrefillAttentionCudaHandler, PrefillAttentionCuda,
                              BindPrefill().Ret<ffi::AnyBuffer>()   // out [B, T, H, D] bf16
                                  .Attr<int64_t>("layer"),          // which layer of the cache
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(PrefillAttentionCudaIntoHandler, PrefillAttentionCudaInto,
                              BindPrefill().Arg<ffi::AnyBuffer>()   // poisoned out, aliased to the result
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("layer"),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxllm
