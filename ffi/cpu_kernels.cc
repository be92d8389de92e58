// CPU handlers: W8A16 matmul and decode attention, run on XLA's intra-op thread pool.
//
// W8A16: y[m, n] = sum_g scale[n, g] * sum_{k in group g} x[m, k] * w[n, k]. Each 64-wide group of a
// weight row is widened to f32 once and reused for every row of x, so small M (decode, batched decode)
// costs one pass over the int8 weights.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "common.h"

namespace jaxllm {
namespace {

inline float Bf16ToF32(uint16_t b) {
  uint32_t u = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline uint16_t F32ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (std::isnan(f)) return 0x7FC0;
  u += 0x7FFF + ((u >> 16) & 1);  // round to nearest even
  return uint16_t(u >> 16);
}

// Loads n values of x (f32 or bf16) as f32 into dst.
inline void LoadF32(const void* src, ffi::DataType t, int64_t offset, int64_t n, float* dst) {
  if (t == ffi::F32) {
    std::memcpy(dst, static_cast<const float*>(src) + offset, n * sizeof(float));
  } else {
    const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
    for (int64_t i = 0; i < n; ++i) dst[i] = Bf16ToF32(s[i]);
  }
}

inline void StoreF32(void* dst, ffi::DataType t, int64_t offset, float v) {
  if (t == ffi::F32) static_cast<float*>(dst)[offset] = v;
  else static_cast<uint16_t*>(dst)[offset] = F32ToBf16(v);
}

// Runs fn(chunk) for chunk in [0, n) on the calling thread and the pool; returns when all are done.
// Workers claim chunks from a shared counter, so a task the pool starts late finds nothing left to do.
template <typename Fn>
void ParallelFor(ffi::ThreadPool& pool, int64_t n, Fn fn) {
  struct State {
    std::atomic<int64_t> next{0}, done{0};
    std::mutex mu;
    std::condition_variable cv;
  };
  auto st = std::make_shared<State>();
  auto work = [st, n, fn]() {
    for (int64_t i; (i = st->next.fetch_add(1)) < n;) {
      fn(i);
      if (st->done.fetch_add(1) + 1 == n) {
        std::lock_guard<std::mutex> lock(st->mu);
        st->cv.notify_all();
      }
    }
  };
  int64_t helpers = std::min<int64_t>(pool.num_threads(), n - 1);
  for (int64_t t = 0; t < helpers; ++t) pool.Schedule([work] { work(); });
  work();
  std::unique_lock<std::mutex> lock(st->mu);
  st->cv.wait(lock, [&] { return st->done.load() == n; });
}

constexpr int64_t kRowsPerChunk = 64;
constexpr int64_t kGroup = 64;   // jaxllm.quant.GROUP: the layout every jaxllm weight has

// Decode (M = 1) with 64-wide groups: one pass over the row, int8 widened inside the multiply-add, the
// group's scale folded into the weight, 64 independent accumulator lanes reduced once per row.
float RowDot64(const float* __restrict x, const int8_t* __restrict row, const float* __restrict scales,
               int64_t groups) {
  alignas(64) float acc[kGroup] = {};
  for (int64_t g = 0; g < groups; ++g) {
    const float sc = scales[g];
    const int8_t* wg = row + g * kGroup;
    const float* xg = x + g * kGroup;
#pragma omp simd aligned(acc : 64)
    for (int64_t j = 0; j < kGroup; ++j) acc[j] += xg[j] * (sc * float(wg[j]));
  }
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < kGroup; ++j) sum += acc[j];
  return sum;
}

// Small batches (M > 1) with 64-wide groups: each group of the row is widened and scaled once, then
// multiply-added into MT rows' accumulators (MT <= 4: 16 vector registers); rows of x beyond MT run in
// further tiles over the same weight row, which is then in L1.
template <int MT>
void RowsDot64(const float* __restrict x, int64_t k, const int8_t* __restrict row, const float* __restrict scales,
               int64_t groups, float* out) {
  alignas(64) float acc[MT][kGroup] = {};
  alignas(64) float wsc[kGroup];
  for (int64_t g = 0; g < groups; ++g) {
    const float sc = scales[g];
    const int8_t* wg = row + g * kGroup;
#pragma omp simd aligned(wsc : 64)
    for (int64_t j = 0; j < kGroup; ++j) wsc[j] = sc * float(wg[j]);
    for (int m = 0; m < MT; ++m) {
      const float* xg = x + m * k + g * kGroup;
#pragma omp simd aligned(wsc : 64)
      for (int64_t j = 0; j < kGroup; ++j) acc[m][j] += xg[j] * wsc[j];
    }
  }
  for (int m = 0; m < MT; ++m) {
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < kGroup; ++j) sum += acc[m][j];
    out[m] = sum;
  }
}

void RowsDot64Any(const float* x, int64_t mt, int64_t k, const int8_t* row, const float* scales, int64_t groups,
                  float* out) {
  switch (mt) {
    case 1: out[0] = RowDot64(x, row, scales, groups); return;
    case 2: RowsDot64<2>(x, k, row, scales, groups, out); return;
    case 3: RowsDot64<3>(x, k, row, scales, groups, out); return;
    default: RowsDot64<4>(x, k, row, scales, groups, out); return;
  }
}

ffi::Error W8A16Cpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                    ffi::Result<ffi::AnyBuffer> y, int64_t layer) {
  MatmulShape s;
  if (auto err = CheckMatmul(x, w, scale, *y, layer, &s); err.failure()) return err;
  const ffi::DataType t = x.element_type();
  std::vector<float> xf(s.m * s.k);
  for (int64_t m = 0; m < s.m; ++m) LoadF32(x.untyped_data(), t, m * s.k, s.k, &xf[m * s.k]);
  const int8_t* wl = static_cast<const int8_t*>(w.untyped_data()) + layer * s.n * s.k;
  const float* sl = static_cast<const float*>(scale.untyped_data()) + layer * s.n * s.groups;
  void* out = y->untyped_data();
  const int64_t chunks = (s.n + kRowsPerChunk - 1) / kRowsPerChunk;
  if (s.group == kGroup) {
    ParallelFor(pool, chunks, [&, wl, sl, out](int64_t c) {
      float tile[4];
      for (int64_t n = c * kRowsPerChunk; n < std::min(s.n, (c + 1) * kRowsPerChunk); ++n)
        for (int64_t m0 = 0; m0 < s.m; m0 += 4) {
          const int64_t mt = std::min<int64_t>(4, s.m - m0);
          RowsDot64Any(&xf[m0 * s.k], mt, s.k, wl + n * s.k, sl + n * s.groups, s.groups, tile);
          for (int64_t i = 0; i < mt; ++i) StoreF32(out, t, (m0 + i) * s.n + n, tile[i]);
        }
    });
    return ffi::Error::Success();
  }
  // Other group sizes: each group of a row is widened to f32 once and reused for every row of x.
  ParallelFor(pool, chunks, [&, wl, sl, out](int64_t c) {
    std::vector<float> wf(s.group), acc(s.m);
    for (int64_t n = c * kRowsPerChunk; n < std::min(s.n, (c + 1) * kRowsPerChunk); ++n) {
      std::fill(acc.begin(), acc.end(), 0.f);
      const int8_t* row = wl + n * s.k;
      for (int64_t g = 0; g < s.groups; ++g) {
        const int8_t* wg = row + g * s.group;
        float* wfp = wf.data();
#pragma omp simd
        for (int64_t j = 0; j < s.group; ++j) wfp[j] = float(wg[j]);
        const float sc = sl[n * s.groups + g];
        for (int64_t m = 0; m < s.m; ++m) {
          const float* xg = &xf[m * s.k + g * s.group];
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t j = 0; j < s.group; ++j) dot += xg[j] * wfp[j];
          acc[m] += dot * sc;
        }
      }
      for (int64_t m = 0; m < s.m; ++m) StoreF32(out, t, m * s.n + n, acc[m]);
    }
  });
  return ffi::Error::Success();
}

ffi::Error DecodeAttentionCpu(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                              ffi::AnyBuffer lengths, ffi::Result<ffi::AnyBuffer> out,
                              ffi::Result<ffi::AnyBuffer> /*workspace: used by the CUDA handler only*/,
                              int64_t layer) {
  AttentionShape s;
  if (auto err = CheckAttention(q, k, v, lengths, *out, layer, &s); err.failure()) return err;
  const ffi::DataType t = q.element_type(), tkv = k.element_type();   // f32 q may meet a bf16 cache
  // Visible lengths are clipped to [1, S], the contract of every path (jaxllm/kernels/attention.py).
  const int32_t* len_in = static_cast<const int32_t*>(lengths.untyped_data());
  std::vector<int32_t> len(s.b);
  for (int64_t b = 0; b < s.b; ++b) len[b] = int32_t(std::clamp<int64_t>(len_in[b], 1, s.s));
  const int64_t rep = s.h / s.g;
  const float softmax_scale = 1.f / std::sqrt(float(s.d));
  // One task per (b, kv head): it reads that head's keys/values once for all `rep` query heads.
  ParallelFor(pool, s.b * s.g, [&, t, tkv, rep, softmax_scale](int64_t bg) {
    const int64_t b = bg / s.g, g = bg % s.g;
    const int64_t base = (((layer * s.b + b) * s.g + g) * s.s) * s.d;   // cache[layer, b, g, 0, 0]
    std::vector<float> qf(rep * s.d), acc(rep * s.d, 0.f), kf(s.d), vf(s.d), mx(rep, -INFINITY), den(rep, 0.f);
    for (int64_t r = 0; r < rep; ++r) LoadF32(q.untyped_data(), t, (b * s.h + g * rep + r) * s.d, s.d, &qf[r * s.d]);
    for (int64_t pos = 0; pos < len[b]; ++pos) {
      LoadF32(k.untyped_data(), tkv, base + pos * s.d, s.d, kf.data());
      LoadF32(v.untyped_data(), tkv, base + pos * s.d, s.d, vf.data());
      for (int64_t r = 0; r < rep; ++r) {
        const float* qr = &qf[r * s.d];
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < s.d; ++d) dot += qr[d] * kf[d];
        const float score = dot * softmax_scale;
        const float m_new = std::max(mx[r], score);
        const float correction = std::exp(mx[r] - m_new), p = std::exp(score - m_new);
        mx[r] = m_new;
        den[r] = den[r] * correction + p;
        float* ar = &acc[r * s.d];
#pragma omp simd
        for (int64_t d = 0; d < s.d; ++d) ar[d] = ar[d] * correction + p * vf[d];
      }
    }
    for (int64_t r = 0; r < rep; ++r)
      for (int64_t d = 0; d < s.d; ++d)
        StoreF32(out->untyped_data(), t, (b * s.h + g * rep + r) * s.d + d, acc[r * s.d + d] / den[r]);
  });
  return ffi::Error::Success();
}

// Test variants: the output aliases a poisoned input buffer, so tests can see unwritten elements.
ffi::Error W8A16CpuInto(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                        ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> y, int64_t layer) {
  return W8A16Cpu(pool, x, w, scale, y, layer);
}
ffi::Error DecodeAttentionCpuInto(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                  ffi::AnyBuffer lengths, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> out,
                                  ffi::Result<ffi::AnyBuffer> ws, int64_t layer) {
  return DecodeAttentionCpu(pool, q, k, v, lengths, out, ws, layer);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(W8A16MatmulCpu, W8A16Cpu, FinishW8A16(BindW8A16<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionCpuHandler, DecodeAttentionCpu, FinishAttention(BindAttention<ffi::ThreadPool>()));
// Test variants: one more argument, the poisoned output buffer aliased to the result.
XLA_FFI_DEFINE_HANDLER_SYMBOL(W8A16MatmulCpuInto, W8A16CpuInto,
                              FinishW8A16(BindW8A16<ffi::ThreadPool>().Arg<ffi::AnyBuffer>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionCpuIntoHandler, DecodeAttentionCpuInto,
                              FinishAttention(BindAttention<ffi::ThreadPool>().Arg<ffi::AnyBuffer>()));

}  // namespace jaxllm
