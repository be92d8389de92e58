// CPU handlers: W8A16 matmul and decode attention, run on XLA's intra-op thread pool.
//
// W8A16: y[m, n] = sum_g scale[n, g] * sum_{k in group g} x[m, k] * w[n, k]. Each 64-wide group of a
// weight row is read once and reused for every row of x, so small M (decode, batched decode) costs one
// pass over the int8 weights. With AVX-512 VNNI (the build machine's, -march=native) the inner products
// are integer: each 64-wide group of x is split into two int16 parts, x ~ s1 q1 + s2 q2 (q1 = round(x / s1),
// s1 = max |x| / 32767, then the remainder the same way), which leaves about 2^-30 of the group's largest
// |x| unrepresented, far below f32's rounding of the products; the weights meet both in vpdpwssd (int16 x
// int16 pairs summed exactly in int32), two conversions and FMAs per 64 weights. With AVX2 and no VNNI the
// same split x meets the weights in vpmaddwd at half the width (each int32 lane kept to 4 products, exact in
// f32 as above). Elsewhere the group is widened to f32.
#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512F__)
#define JAXLLM_CPU_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__)
#define JAXLLM_CPU_AVX2 1
#endif
#if defined(JAXLLM_CPU_VNNI) || defined(JAXLLM_CPU_AVX2)
#include <immintrin.h>
#endif
#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "common.h"
#include "cpu_util.h"

namespace jaxllm {
namespace {

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

#if defined(JAXLLM_CPU_VNNI) || defined(JAXLLM_CPU_AVX2)
// One row of x, its 64-wide groups as two int16 parts (see the top of the file): q [G][2][64], s [G][2].
struct SplitX {
  std::vector<int16_t> q;
  std::vector<float> s;
};

// The int16 part of each of 64 finite values v and its scale: q = round(v / s), s = max |v| / 32767 (0 when
// all are zero).
inline float QuantizeInt16(const float* v, int16_t* q) {
  float mx = 0.f;
  for (int j = 0; j < kGroup; ++j) mx = std::max(mx, std::fabs(v[j]));
  if (mx == 0.f) {
    std::fill(q, q + kGroup, int16_t(0));
    return 0.f;
  }
  const float sc = mx / 32767.f, inv = 32767.f / mx;
  for (int j = 0; j < kGroup; ++j)
    q[j] = int16_t(std::max(-32767.f, std::min(32767.f, std::nearbyint(v[j] * inv))));
  return sc;
}

// x [K], every value finite (the caller checks: the f32 path propagates NaN and inf).
SplitX Split(const float* x, int64_t k) {
  const int64_t groups = k / kGroup;
  SplitX sx{std::vector<int16_t>(size_t(groups * 2 * kGroup)), std::vector<float>(size_t(groups * 2))};
  float rest[kGroup];
  for (int64_t g = 0; g < groups; ++g) {
    const float* v = x + g * kGroup;
    int16_t* q = &sx.q[size_t(g) * 2 * kGroup];
    const float s1 = QuantizeInt16(v, q);
    for (int j = 0; j < kGroup; ++j) rest[j] = std::fma(-float(q[j]), s1, v[j]);
    sx.s[2 * g] = s1;
    sx.s[2 * g + 1] = QuantizeInt16(rest, q + kGroup);
  }
  return sx;
}

#endif

#ifdef JAXLLM_CPU_VNNI
// One weight row against the split x: sum_g scale[g] (s1 D1 + s2 D2), D the groups' exact integer inner
// products (each int32 lane sums 4 products of at most 32767 x 128: exact in f32).
float RowDotInt16(const SplitX& x, int64_t groups, const int8_t* __restrict row, const float* __restrict scales) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m512i w0 = _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * kGroup)));
    const __m512i w1 =
        _mm512_cvtepi8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + g * kGroup + 32)));
    const __m512i* qv = reinterpret_cast<const __m512i*>(&x.q[size_t(g) * 2 * kGroup]);
    __m512i d1 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w0, _mm512_loadu_si512(qv));
    d1 = _mm512_dpwssd_epi32(d1, w1, _mm512_loadu_si512(qv + 1));
    __m512i d2 = _mm512_dpwssd_epi32(_mm512_setzero_si512(), w0, _mm512_loadu_si512(qv + 2));
    d2 = _mm512_dpwssd_epi32(d2, w1, _mm512_loadu_si512(qv + 3));
    const float sw = scales[g];
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d1), _mm512_set1_ps(sw * x.s[2 * g]), acc);
    acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d2), _mm512_set1_ps(sw * x.s[2 * g + 1]), acc);
  }
  return _mm512_reduce_add_ps(acc);
}
#endif

#ifdef JAXLLM_CPU_AVX2
// RowDotInt16 with AVX2: per group, its 64 weights as four int16 vectors against the parts' four each;
// vpmaddwd's pairs added two at a time, so an int32 lane holds 4 products (exact in f32), two of them a part.
float RowDotInt16(const SplitX& x, int64_t groups, const int8_t* __restrict row, const float* __restrict scales) {
  __m256 acc = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256i w[4];
    for (int i = 0; i < 4; ++i)
      w[i] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + g * kGroup + 16 * i)));
    const __m256i* qv = reinterpret_cast<const __m256i*>(&x.q[size_t(g) * 2 * kGroup]);
    __m256 part[2];
    for (int p = 0; p < 2; ++p) {
      const __m256i a = _mm256_add_epi32(_mm256_madd_epi16(w[0], _mm256_loadu_si256(qv + 4 * p)),
                                         _mm256_madd_epi16(w[1], _mm256_loadu_si256(qv + 4 * p + 1)));
      const __m256i b = _mm256_add_epi32(_mm256_madd_epi16(w[2], _mm256_loadu_si256(qv + 4 * p + 2)),
                                         _mm256_madd_epi16(w[3], _mm256_loadu_si256(qv + 4 * p + 3)));
      part[p] = _mm256_add_ps(_mm256_cvtepi32_ps(a), _mm256_cvtepi32_ps(b));
    }
    const float sw = scales[g];
    acc = _mm256_fmadd_ps(part[0], _mm256_set1_ps(sw * x.s[2 * g]), acc);
    acc = _mm256_fmadd_ps(part[1], _mm256_set1_ps(sw * x.s[2 * g + 1]), acc);
  }
  return HSum(acc);
}
#endif

// y[m, n] = x[m] . dequant(w[n]) for f32 rows xf [M, K]; emit(m, n, value) stores each (from pool threads,
// each (m, n) once).
template <typename Emit>
void MatmulF32(ffi::ThreadPool& pool, const MatmulShape& s, const float* xf, const int8_t* wl, const float* sl,
               Emit emit) {
#if defined(JAXLLM_CPU_VNNI) || defined(JAXLLM_CPU_AVX2)
  // One row of x (decode at batch 1): with VNNI measured 1.1-1.3x the f32 path's rate on the 2-core AMD EPYC
  // (up to ~20 G weights/s, near what its memory delivers); four rows ran no faster, so M > 1 keeps the f32 path.
  if (s.group == kGroup && s.m == 1 && AllFinite(xf, s.k)) {
    const SplitX x = Split(xf, s.k);
    ForRowChunks(pool, s.n, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) emit(0, n, RowDotInt16(x, s.groups, wl + n * s.k, sl + n * s.groups));
    });
    return;
  }
#endif
  if (s.group == kGroup) {
    ForRowChunks(pool, s.n, [&](int64_t n0, int64_t n1) {
      float tile[4];
      for (int64_t n = n0; n < n1; ++n)
        for (int64_t m0 = 0; m0 < s.m; m0 += 4) {
          const int64_t mt = std::min<int64_t>(4, s.m - m0);
          RowsDot64Any(&xf[m0 * s.k], mt, s.k, wl + n * s.k, sl + n * s.groups, s.groups, tile);
          for (int64_t i = 0; i < mt; ++i) emit(m0 + i, n, tile[i]);
        }
    });
    return;
  }
  // Other group sizes: each group of a row is widened to f32 once and reused for every row of x.
  ForRowChunks(pool, s.n, [&](int64_t n0, int64_t n1) {
    std::vector<float> wf(s.group), acc(s.m);
    for (int64_t n = n0; n < n1; ++n) {
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
      for (int64_t m = 0; m < s.m; ++m) emit(m, n, acc[m]);
    }
  });
}

ffi::Error W8A16Cpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                    ffi::Result<ffi::AnyBuffer> y, int64_t layer, int64_t /*mma: the GPU's*/) {
  MatmulShape s;
  if (auto err = CheckMatmul(x, w, scale, *y, layer, &s); err.failure()) return err;
  const ffi::DataType t = x.element_type();
  std::vector<float> xf(s.m * s.k);
  for (int64_t m = 0; m < s.m; ++m) LoadF32(x.untyped_data(), t, m * s.k, s.k, &xf[m * s.k]);
  const int8_t* wl = static_cast<const int8_t*>(w.untyped_data()) + layer * s.n * s.k;
  const float* sl = static_cast<const float*>(scale.untyped_data()) + layer * s.n * s.groups;
  void* out = y->untyped_data();
  MatmulF32(pool, s, xf.data(), wl, sl, [&, out, t](int64_t m, int64_t n, float v) { StoreF32(out, t, m * s.n + n, v); });
  return ffi::Error::Success();
}

// f32 rounded to the activation dtype (bf16: round to nearest even) and back.
inline float RoundTo(bool bf16, float v) { return bf16 ? Bf16ToF32(F32ToBf16(v)) : v; }

// out[i] = x[i] * rsqrt(mean(x^2) + eps) * w[i], rounded to the activation dtype (out may be x).
void NormRound(const float* x, const float* w, int64_t n, float eps, bool bf16, float* out) {
  double ss = 0.0;
  for (int64_t i = 0; i < n; ++i) ss += double(x[i]) * x[i];
  const float inv = 1.f / std::sqrt(float(ss / double(n)) + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = RoundTo(bf16, x[i] * inv * w[i]);
}

// The fused matmul (see FusedMode in common.h), as the unfused path computes it.
ffi::Error FusedCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale, ffi::AnyBuffer aux,
                    ffi::Result<ffi::AnyBuffer> y, int64_t layer, int64_t norm_layer, int64_t mode, int64_t bf16_attr,
                    float eps) {
  MatmulShape s;
  const bool bf16 = bf16_attr != 0;
  if (auto err = CheckFused(x, w, scale, aux, *y, layer, norm_layer, mode, bf16, &s); err.failure()) return err;
  const ffi::DataType t = bf16 ? ffi::BF16 : ffi::F32;
  std::vector<float> xf(s.m * s.k);
  if (mode == kModeResidual) {
    for (int64_t m = 0; m < s.m; ++m) LoadF32(x.untyped_data(), t, m * s.k, s.k, &xf[m * s.k]);
  } else {   // x * rsqrt(mean(x^2) + eps) * norm_w, rounded to the activation dtype
    const float* xr = static_cast<const float*>(x.untyped_data());
    const float* nw = static_cast<const float*>(aux.untyped_data()) + norm_layer * s.k;
    for (int64_t m = 0; m < s.m; ++m) NormRound(xr + m * s.k, nw, s.k, eps, bf16, &xf[m * s.k]);
  }
  const int8_t* wl = static_cast<const int8_t*>(w.untyped_data()) + layer * s.n * s.k;
  const float* sl = static_cast<const float*>(scale.untyped_data()) + layer * s.n * s.groups;
  void* out = y->untyped_data();
  if (mode == kModeNorm) {
    MatmulF32(pool, s, xf.data(), wl, sl, [&, out, t](int64_t m, int64_t n, float v) { StoreF32(out, t, m * s.n + n, v); });
    return ffi::Error::Success();
  }
  if (mode == kModeResidual) {
    const float* res = static_cast<const float*>(aux.untyped_data());
    float* yo = static_cast<float*>(out);
    MatmulF32(pool, s, xf.data(), wl, sl,
              [&, res, yo, bf16](int64_t m, int64_t n, float v) { yo[m * s.n + n] = res[m * s.n + n] + RoundTo(bf16, v); });
    return ffi::Error::Success();
  }
  std::vector<float> full(s.m * s.n);   // the rows' values, rounded to the activation dtype
  float* fp = full.data();
  MatmulF32(pool, s, xf.data(), wl, sl, [&, fp, bf16](int64_t m, int64_t n, float v) { fp[m * s.n + n] = RoundTo(bf16, v); });
  if (mode == kModeNormSwiGLU) {
    const int64_t f = s.n / 2;
    for (int64_t m = 0; m < s.m; ++m)
      for (int64_t j = 0; j < f; ++j) {
        const float g = fp[m * s.n + j], u = fp[m * s.n + f + j];
        StoreF32(out, t, m * f + j, g / (1.f + std::exp(-g)) * u);
      }
    return ffi::Error::Success();
  }
  uint32_t* packed = static_cast<uint32_t*>(out);   // argmax: the first largest, words (row, 0, nonfinite, 0)
  for (int64_t m = 0; m < s.m; ++m) {
    int64_t best = 0;
    bool nonfinite = false;
    for (int64_t n = 0; n < s.n; ++n) {
      const float v = fp[m * s.n + n];
      nonfinite |= !std::isfinite(v);
      if (v > fp[m * s.n + best]) best = n;
    }
    packed[m * 4] = 0xffffffffu - uint32_t(best);
    packed[m * 4 + 1] = 0;
    packed[m * 4 + 2] = nonfinite;
    packed[m * 4 + 3] = 0;
  }
  return ffi::Error::Success();
}

ffi::Error FusedCpuInto(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                        ffi::AnyBuffer aux, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> y, int64_t layer,
                        int64_t norm_layer, int64_t mode, int64_t bf16, float eps) {
  return FusedCpu(pool, x, w, scale, aux, y, layer, norm_layer, mode, bf16, eps);
}

// The QKV epilogue (see BindQkv in common.h), as the unfused path computes it; the caches may hold more rows than
// qkv (N >= B: rows [0, B) written).
ffi::Error QkvCpu(ffi::ThreadPool, ffi::AnyBuffer qkv, ffi::AnyBuffer bias, ffi::AnyBuffer qn, ffi::AnyBuffer kn,
                  ffi::AnyBuffer inv_freq, ffi::AnyBuffer pos, ffi::AnyBuffer writes, ffi::AnyBuffer k_in,
                  ffi::AnyBuffer v_in, ffi::Result<ffi::AnyBuffer> q_out, ffi::Result<ffi::AnyBuffer> kc,
                  ffi::Result<ffi::AnyBuffer> vc, ffi::Result<ffi::AnyBuffer> counters, int64_t layer, int64_t neox,
                  float pos_scale, float eps) {
  QkvShape s;
  if (auto err = CheckQkv(qkv, bias, qn, kn, inv_freq, pos, writes, *kc, *vc, *q_out, *counters, layer, &s);
      err.failure())
    return err;
  HoldAliasHost(k_in, *kc);   // the caches, aliased
  HoldAliasHost(v_in, *vc);
  const ffi::DataType t = qkv.element_type();
  const bool bf16 = t == ffi::BF16;
  const float *bp = LayerRow(bias, layer, s.nqkv), *qp = LayerRow(qn, layer, s.d), *kp = LayerRow(kn, layer, s.d);
  const float* freq = static_cast<const float*>(inv_freq.untyped_data());
  const int32_t *pp = static_cast<const int32_t*>(pos.untyped_data()), *wp = static_cast<const int32_t*>(writes.untyped_data());
  std::memset(counters->untyped_data(), 0, size_t(s.b * s.g) * sizeof(int32_t));
  const int64_t half = s.d / 2;
  std::vector<float> row(s.nqkv), head(s.d);
  for (int64_t b = 0; b < s.b; ++b) {
    LoadF32(qkv.untyped_data(), t, b * s.nqkv, s.nqkv, row.data());
    if (bp)
      for (int64_t i = 0; i < s.nqkv; ++i) row[i] = RoundTo(bf16, row[i] + bp[i]);
    const float p = float(pp[b]) / pos_scale;
    const int64_t at = wp[b];
    for (int64_t h = 0; h < s.h + s.g; ++h) {
      std::copy(&row[h * s.d], &row[(h + 1) * s.d], head.begin());
      const float* nw = h < s.h ? qp : kp;
      if (nw) NormRound(head.data(), nw, s.d, eps, bf16, head.data());
      const bool is_q = h < s.h;
      if (!is_q && (at < 0 || at >= s.s)) continue;
      const int64_t g = h - s.h;
      const int64_t base = is_q ? (b * s.h + h) * s.d : (((layer * s.n + b) * s.g + g) * s.s + at) * s.d;
      void* dst = is_q ? q_out->untyped_data() : kc->untyped_data();
      for (int64_t i = 0; i < half; ++i) {
        const int64_t e0 = neox ? i : 2 * i, e1 = neox ? i + half : 2 * i + 1;
        const float angle = p * freq[i], cs = std::cos(angle), sn = std::sin(angle);
        const float a = head[e0], c = head[e1];
        StoreF32(dst, t, base + e0, a * cs - c * sn);
        StoreF32(dst, t, base + e1, c * cs + a * sn);
      }
      if (!is_q)
        for (int64_t i = 0; i < s.d; ++i) StoreF32(vc->untyped_data(), t, base + i, row[(s.h + s.g + g) * s.d + i]);
    }
  }
  return ffi::Error::Success();
}

// exp(x) for x <= 0 (-inf included: about 1e-38, not 0) without a library call, so that a loop of it
// vectorizes: x = n ln 2 + r with n = round(x / ln 2), |r| <= ln 2 / 2, exp(r) by Cephes' degree-6
// polynomial (relative error about 2e-7), 2^n through the exponent bits.
inline float ExpNonPositive(float x) {
  x = std::max(x, -87.f);
  const float t = std::fma(x, 1.44269504f, 12582912.f);   // 1.5 * 2^23 + x / ln 2: n in the low bits
  const float n = t - 12582912.f;
  float r = std::fma(n, -0.693359375f, x);
  r = std::fma(n, 2.12194440e-4f, r);
  float p = 1.9875691500e-4f;
  p = std::fma(p, r, 1.3981999507e-3f);
  p = std::fma(p, r, 8.3334519073e-3f);
  p = std::fma(p, r, 4.1665795894e-2f);
  p = std::fma(p, r, 1.6666665459e-1f);
  p = std::fma(p, r, 5.0000001201e-1f);
  p = std::fma(p, r * r, r) + 1.f;
  uint32_t tb, pb;
  std::memcpy(&tb, &t, 4);
  std::memcpy(&pb, &p, 4);
  pb += (tb - 0x4B400000u) << 23;   // n (two's complement, |n| <= 126) added to the exponent
  float out;
  std::memcpy(&out, &pb, 4);
  return out;
}

constexpr int64_t kAttnChunk = 256;   // positions a task of the CPU decode attention takes

// Decode attention: a task per (sequence, kv head, chunk of kAttnChunk visible positions). It reads each key
// once for the group's query heads (scores), takes exp(score - the chunk's maximum) in one vectorized pass,
// then reads each value once for the weighted sums; the chunks of a (sequence, kv head) then merge by their
// maxima (one chunk: nothing to merge). Scores and sums in f32. The caches may hold more rows than q (N >= B:
// rows [0, B) read).
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
  std::vector<int64_t> first(s.b + 1, 0);   // first task of sequence b's kv heads: chunks per head
  for (int64_t b = 0; b < s.b; ++b) {
    len[b] = int32_t(std::clamp<int64_t>(len_in[b], 1, s.s));
    first[b + 1] = first[b] + (len[b] + kAttnChunk - 1) / kAttnChunk;
  }
  const int64_t rep = s.h / s.g, d = s.d;
  const float softmax_scale = 1.f / std::sqrt(float(d));
  // Partials per (sequence, kv head, chunk): acc [rep][d], then max [rep] and denominator [rep].
  const int64_t part = rep * (d + 2);
  std::vector<float> parts(size_t(first[s.b] * s.g * part));
  ParallelFor(pool, first[s.b] * s.g, [&](int64_t task) {
    const int64_t g = task % s.g, chunk_task = task / s.g;
    const int64_t b = std::upper_bound(first.begin(), first.end(), chunk_task) - first.begin() - 1;
    const int64_t p0 = (chunk_task - first[b]) * kAttnChunk, n = std::min<int64_t>(kAttnChunk, len[b] - p0);
    const int64_t base = (((layer * s.n + b) * s.g + g) * s.s + p0) * d;   // cache[layer, b, g, p0, 0] (N rows)
    std::vector<float> qf(rep * d), row(d), sc(rep * n);
    for (int64_t r = 0; r < rep; ++r) LoadF32(q.untyped_data(), t, (b * s.h + g * rep + r) * d, d, &qf[r * d]);
    // A cache row as f32: in place for an f32 cache, else widened into `row`.
    auto row_of = [&](const ffi::AnyBuffer& c, int64_t pos) -> const float* {
      if (tkv == ffi::F32) return static_cast<const float*>(c.untyped_data()) + base + pos * d;
      LoadF32(c.untyped_data(), tkv, base + pos * d, d, row.data());
      return row.data();
    };
    for (int64_t pos = 0; pos < n; ++pos) {
      const float* kr = row_of(k, pos);
      for (int64_t r = 0; r < rep; ++r) {
        const float* qr = &qf[r * d];
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t e = 0; e < d; ++e) dot += qr[e] * kr[e];
        sc[r * n + pos] = dot * softmax_scale;
      }
    }
    float* pt = &parts[size_t(task) * part];   // acc [rep][d], max [rep], den [rep]
    float* mx = pt + rep * d;
    float* den = mx + rep;
    for (int64_t r = 0; r < rep; ++r) {
      float* sr = &sc[r * n];
      float m = -INFINITY;
      for (int64_t pos = 0; pos < n; ++pos) m = std::max(m, sr[pos]);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t pos = 0; pos < n; ++pos) {
        sr[pos] = ExpNonPositive(sr[pos] - m);
        sum += sr[pos];
      }
      mx[r] = m;
      den[r] = sum;
    }
    std::fill(pt, pt + rep * d, 0.f);
    for (int64_t pos = 0; pos < n; ++pos) {
      const float* vr = row_of(v, pos);
      for (int64_t r = 0; r < rep; ++r) {
        const float w = sc[r * n + pos];
        float* ar = pt + r * d;
#pragma omp simd
        for (int64_t e = 0; e < d; ++e) ar[e] = std::fma(w, vr[e], ar[e]);
      }
    }
  });
  // Merge each (sequence, query head)'s chunks: weights exp(max_c - max over chunks) (1 for a single chunk).
  std::vector<float> acc(d);
  for (int64_t b = 0; b < s.b; ++b) {
    for (int64_t g = 0; g < s.g; ++g) {
      for (int64_t r = 0; r < rep; ++r) {
        float m = -INFINITY;
        for (int64_t c = first[b]; c < first[b + 1]; ++c) m = std::max(m, parts[size_t(c * s.g + g) * part + rep * d + r]);
        std::fill(acc.begin(), acc.end(), 0.f);
        float den = 0.f;
        for (int64_t c = first[b]; c < first[b + 1]; ++c) {
          const float* pt = &parts[size_t(c * s.g + g) * part];
          const float f = std::exp(pt[rep * d + r] - m);
          den = std::fma(f, pt[rep * d + rep + r], den);
          for (int64_t e = 0; e < d; ++e) acc[e] = std::fma(f, pt[r * d + e], acc[e]);
        }
        for (int64_t e = 0; e < d; ++e) StoreF32(out->untyped_data(), t, (b * s.h + g * rep + r) * d + e, acc[e] / den);
      }
    }
  }
  return ffi::Error::Success();
}

// The one-kernel attention's signature on the CPU: the same computation (counters untouched: the input's, zero).
ffi::Error DecodeAttentionMergedCpu(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                    ffi::AnyBuffer lengths, ffi::AnyBuffer counters_in, ffi::Result<ffi::AnyBuffer> out,
                                    ffi::Result<ffi::AnyBuffer> ws, ffi::Result<ffi::AnyBuffer> counters,
                                    int64_t layer) {
  HoldAliasHost(counters_in, *counters);   // aliased
  return DecodeAttentionCpu(pool, q, k, v, lengths, out, ws, layer);
}

// Test variants: the output aliases a poisoned input buffer, so tests can see unwritten elements.
ffi::Error W8A16CpuInto(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                        ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> y, int64_t layer, int64_t mma) {
  return W8A16Cpu(pool, x, w, scale, y, layer, mma);
}
ffi::Error DecodeAttentionCpuInto(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer k, ffi::AnyBuffer v,
                                  ffi::AnyBuffer lengths, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> out,
                                  ffi::Result<ffi::AnyBuffer> ws, int64_t layer) {
  return DecodeAttentionCpu(pool, q, k, v, lengths, out, ws, layer);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(W8A16MatmulCpu, W8A16Cpu, FinishW8A16(BindW8A16<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionCpuHandler, DecodeAttentionCpu, FinishAttention(BindAttention<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionMergedCpuHandler, DecodeAttentionMergedCpu,
                              BindMergedAttention(BindAttention<ffi::ThreadPool>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(W8A16FusedCpu, FusedCpu, BindFused<ffi::ThreadPool>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(W8A16FusedCpuInto, FusedCpuInto, BindFusedInto<ffi::ThreadPool>());
XLA_FFI_DEFINE_HANDLER_SYMBOL(QkvEpilogueCpu, QkvCpu, BindQkv<ffi::ThreadPool>());
// Test variants: one more argument, the poisoned output buffer aliased to the result.
XLA_FFI_DEFINE_HANDLER_SYMBOL(W8A16MatmulCpuInto, W8A16CpuInto,
                              FinishW8A16(BindW8A16<ffi::ThreadPool>().Arg<ffi::AnyBuffer>()));
XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeAttentionCpuIntoHandler, DecodeAttentionCpuInto,
                              FinishAttention(BindAttention<ffi::ThreadPool>().Arg<ffi::AnyBuffer>()));

}  // namespace jaxllm
