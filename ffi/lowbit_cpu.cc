// CPU handler of the GGUF file's own 4- and 5-bit weights (jaxllm_lowbit; jaxllm.quant.LowBit):
//   y[m, n] = sum_g scale[n, g] * sum_j x[m, 32g + j] q[n, 32g + j] + min[n, g] * sum_j x[m, 32g + j]
// q: 4 bits a value, two a byte, a group's 16 bytes as the file keeps them (byte j: value j in the low
// nibble, value j + 16 in the high one); high (5-bit weights only): a uint32 a group, bit j the fifth bit of
// value j; scale and min: f16 a group of 32. Q4_0 and Q5_0 are scale d, min -8d / -16d; Q4_1 and Q5_1 are
// their own d and m. A stack of Q4_0 or of Q5_0 blocks only stores no min ([L, N, 0]): it is -8 or -16
// times the scale. Half the bytes of W8A16 or less: what bounds the 2-core CPU's decode.
//
// One row of x (decode, AVX-512 VNNI): each 32-wide group of x as int16, q = round(x / s) with
// s = max |x| / 32767 (2^-15 of the group's largest value: finer than bf16's 2^-8 relative rounding for
// every value within 128x of that largest one), and the group's f32 sum for the min term. Two groups a
// step: their 32 bytes widened to int16 once, the low nibbles (values 0..15 of both groups) and the high
// ones (values 16..31) meet x arranged the same way in vpdpwssd, so the 16 int32 lanes hold both groups'
// exact integer inner products (8 lanes each), converted and scaled by one FMA. One row of x with AVX2 and
// no VNNI (most x86 CPUs without AVX-512): the same int16 x and the same exact sums, at half the width: a
// group's 16 bytes widened to int16 once, its values 0..15 and 16..31 against x's in two vpmaddwd (pairs
// summed in int32), added, converted and scaled by one FMA. Several rows of x, or neither: each weight row is
// dequantized to f32 once and reused for every row of x (tiles of rows of x and of weights with AVX-512 or
// AVX2).
#if defined(__AVX512BW__) && defined(__AVX512VNNI__) && defined(__AVX512F__) && defined(__AVX512VL__)
#define JAXLLM_LOWBIT_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define JAXLLM_LOWBIT_AVX2 1
#endif
#if defined(__AVX512F__) || defined(JAXLLM_LOWBIT_AVX2)
#include <immintrin.h>
#endif
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "common.h"
#include "cpu_util.h"

namespace jaxllm {
namespace {

constexpr int64_t kLowGroup = 32;   // values a scale and min (jaxllm.quant.LOWBIT_GROUP)

inline float HalfToF32(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {   // subnormal: normalize
    int e = -1;
    uint32_t m = man;
    do { ++e; m <<= 1; } while (!(m & 0x400));
    bits = sign | uint32_t(112 - e) << 23 | ((m & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

struct LowBitShape {
  int64_t m, n, k, groups, layer;
  bool high;
  float implicit_min;   // min = implicit_min * scale where no min is stored (-8 or -16), else 0
};

ffi::Error CheckLowBit(const ffi::AnyBuffer& x, const ffi::AnyBuffer& q, const ffi::AnyBuffer& high,
                       const ffi::AnyBuffer& scale, const ffi::AnyBuffer& minv, const ffi::AnyBuffer& y,
                       int64_t layer, LowBitShape* out) {
  const std::string name = "jaxllm_lowbit: ";
  auto xd = x.dimensions(), qd = q.dimensions(), hd = high.dimensions(), sd = scale.dimensions(),
       md = minv.dimensions(), yd = y.dimensions();
  if ((x.element_type() != ffi::F32 && x.element_type() != ffi::BF16) || y.element_type() != x.element_type())
    return ffi::Error::InvalidArgument(name + "x must be f32 or bf16 and y of x's dtype");
  if (q.element_type() != ffi::U8 || high.element_type() != ffi::U32 || scale.element_type() != ffi::F16 ||
      minv.element_type() != ffi::F16)
    return ffi::Error::InvalidArgument(name + "q must be uint8, high uint32, scale and min float16");
  if (xd.size() != 2 || qd.size() != 3 || hd.size() != 3 || sd.size() != 3 || md.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument(name + "expected x [M, K], q [L, N, K/2], high [L, N, K/32 or 0], scale "
                                       "[L, N, K/32], min [L, N, K/32 or 0], y [M, N]; got x " + DimsString(xd) + ", q " +
                                       DimsString(qd) + ", high " + DimsString(hd) + ", scale " + DimsString(sd) +
                                       ", y " + DimsString(yd));
  LowBitShape s{xd[0], qd[1], xd[1], xd[1] / kLowGroup, layer, hd[2] != 0, md[2] == 0 ? (hd[2] ? -16.f : -8.f) : 0.f};
  const bool same = sd[0] == qd[0] && md[0] == qd[0] && hd[0] == qd[0] && sd[1] == s.n && md[1] == s.n &&
                    hd[1] == s.n && sd[2] == s.groups && (md[2] == 0 || md[2] == s.groups) &&
                    (hd[2] == 0 || hd[2] == s.groups);
  if (s.k < kLowGroup || s.k % kLowGroup || qd[2] * 2 != s.k || !same || yd[0] != s.m || yd[1] != s.n)
    return ffi::Error::InvalidArgument(name + "inconsistent shapes (K a multiple of 32) x " + DimsString(xd) +
                                       ", q " + DimsString(qd) + ", high " + DimsString(hd) + ", scale " +
                                       DimsString(sd) + ", min " + DimsString(md) + ", y " + DimsString(yd));
  if (layer < 0 || layer >= qd[0])
    return ffi::Error::InvalidArgument(name + "layer " + std::to_string(layer) + " out of range [0, " +
                                       std::to_string(qd[0]) + ")");
  *out = s;
  return ffi::Error::Success();
}

// One weight row [K] as f32 (scale * q + min; minv null: min = implicit_min * scale).
void DequantRow(const uint8_t* q, const uint32_t* high, const uint16_t* scale, const uint16_t* minv,
                float implicit_min, int64_t groups, float* out) {
  for (int64_t g = 0; g < groups; ++g) {
    const float d = HalfToF32(scale[g]), m = minv ? HalfToF32(minv[g]) : d * implicit_min;
    const uint32_t h = high ? high[g] : 0;
    const uint8_t* b = q + g * 16;
    float* o = out + g * kLowGroup;
    for (int j = 0; j < 16; ++j) {
      o[j] = d * float((b[j] & 15) | ((h >> j) & 1) << 4) + m;
      o[j + 16] = d * float((b[j] >> 4) | ((h >> (j + 16)) & 1) << 4) + m;
    }
  }
}

#if defined(__AVX512F__) || defined(JAXLLM_LOWBIT_AVX2)
#define JAXLLM_LOWBIT_TILES 1
// The f32 vector the tiles use: 16 lanes with AVX-512, else AVX2's 8.
struct F32Vec {
#if defined(__AVX512F__)
  using V = __m512;
  static constexpr int kLanes = 16;
  static V Zero() { return _mm512_setzero_ps(); }
  static V Load(const float* p) { return _mm512_loadu_ps(p); }
  static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static float Sum(V v) { return _mm512_reduce_add_ps(v); }
#else
  using V = __m256;
  static constexpr int kLanes = 8;
  static V Zero() { return _mm256_setzero_ps(); }
  static V Load(const float* p) { return _mm256_loadu_ps(p); }
  static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static float Sum(V v) { return HSum(v); }
#endif
};
constexpr int kWTile = 4;   // weight rows dequantized together (the micro-kernel's columns)
// Rows of x a micro-kernel call takes: MR x kWTile accumulators, kWTile weight and one x register must fit
// the 32 (AVX-512) or 16 (AVX2) vector registers.
constexpr int kXTile = F32Vec::kLanes == 16 ? 4 : 2;
constexpr int kLanes = F32Vec::kLanes;   // K a multiple of this

// out[i][j] = x[i] . w[j] for MR rows of x (stride k) and kWTile dequantized weight rows (stride k), K a
// multiple of kLanes: MR x kWTile accumulators, each step kWTile + MR loads for MR x kWTile FMAs (the pairwise
// loop's two loads an FMA left it bound by loads and by x's trips through L2).
template <int MR>
void TileDot(const float* __restrict x, const float* __restrict w, int64_t k, float (*out)[kWTile]) {
  using V = F32Vec::V;
  V acc[MR][kWTile];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kWTile; ++j) acc[i][j] = F32Vec::Zero();
  for (int64_t e = 0; e < k; e += kLanes) {
    V wv[kWTile];
    for (int j = 0; j < kWTile; ++j) wv[j] = F32Vec::Load(w + j * k + e);
    for (int i = 0; i < MR; ++i) {
      const V xv = F32Vec::Load(x + i * k + e);
      for (int j = 0; j < kWTile; ++j) acc[i][j] = F32Vec::Fma(xv, wv[j], acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < kWTile; ++j) out[i][j] = F32Vec::Sum(acc[i][j]);
}
#endif

// The path of several rows of x (or no VNNI or AVX2): y [M, N] = x [M, K] . w^T, each weight row n dequantized
// once by dequant(n, w [K] f32) and dotted with every row of x (with AVX-512 or AVX2: kWTile rows at a time,
// against tiles of kXTile rows of x).
template <typename Dequant>
void DotDequantizedRows(ffi::ThreadPool& pool, const float* xf, int64_t m, int64_t n, int64_t k, void* out,
                        ffi::DataType t, Dequant dequant) {
#ifdef JAXLLM_LOWBIT_TILES
  if (k % kLanes == 0) {
    ForRowChunks(pool, n, [&](int64_t n0, int64_t n1) {
      std::vector<float> w(static_cast<size_t>(kWTile * k));
      float tile[kXTile][kWTile];
      for (int64_t r0 = n0; r0 < n1; r0 += kWTile) {
        const int rt = int(std::min<int64_t>(kWTile, n1 - r0));
        for (int j = 0; j < rt; ++j) dequant(r0 + j, w.data() + j * k);
        // (a partial tile's missing rows keep what the last full one left: computed, never stored)
        for (int64_t m0 = 0; m0 < m; m0 += kXTile) {
          const int mt = int(std::min<int64_t>(kXTile, m - m0));
          const float* xt = xf + m0 * k;
          switch (mt) {
            case 1: TileDot<1>(xt, w.data(), k, tile); break;
            case 2: TileDot<2>(xt, w.data(), k, tile); break;
            case 3: TileDot<std::min(3, kXTile)>(xt, w.data(), k, tile); break;
            default: TileDot<kXTile>(xt, w.data(), k, tile); break;
          }
          for (int i = 0; i < mt; ++i)
            for (int j = 0; j < rt; ++j) StoreF32(out, t, (m0 + i) * n + r0 + j, tile[i][j]);
        }
      }
    });
    return;
  }
#endif
  ForRowChunks(pool, n, [&](int64_t n0, int64_t n1) {
    std::vector<float> w(static_cast<size_t>(k));
    for (int64_t r = n0; r < n1; ++r) {
      dequant(r, w.data());
      const float* wp = w.data();
      for (int64_t row = 0; row < m; ++row) {
        const float* xr = xf + row * k;
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t i = 0; i < k; ++i) dot += xr[i] * wp[i];
        StoreF32(out, t, row * n + r, dot);
      }
    }
  });
}

#if defined(JAXLLM_LOWBIT_VNNI) || defined(JAXLLM_LOWBIT_AVX2)
// Weight rows the one-row paths ask the caches for ahead of the row they compute (8; lab switch
// JAXLLM_LOWBIT_PREFETCH, 0: none): with the hardware's prefetch alone, qwen2.5-0.5b's gate/up read 13 GB/s
// of the VM's 41 (8 ahead: 30; docs/kernels.md).
inline int64_t PrefetchRows() {
  static const int64_t rows = [] {
    const char* e = LabEnv("JAXLLM_LOWBIT_PREFETCH");
    return e ? std::atoll(e) : int64_t(8);
  }();
  return rows;
}

inline void Prefetch(const void* base, int64_t bytes) {
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(static_cast<const char*>(base) + off, _MM_HINT_T0);
}

// One row of x as int16 in its own order, q = round(x / s) with s [K / 32] = max |x| / 32767 of each 32, and
// sum [K / 32] each 32's f32 sum (for the min terms).
struct NaturalX {
  std::vector<int16_t> q;
  std::vector<float> s, sum;
};

NaturalX SplitNatural(const float* x, int64_t k) {
  NaturalX nx{std::vector<int16_t>(size_t(k)), std::vector<float>(size_t(k / kLowGroup)),
              std::vector<float>(size_t(k / kLowGroup))};
  for (int64_t g = 0; g < k / kLowGroup; ++g) {
    const float* v = x + g * kLowGroup;
    float mx = 0.f, sum = 0.f;
    for (int j = 0; j < kLowGroup; ++j) {
      mx = std::max(mx, std::fabs(v[j]));
      sum += v[j];
    }
    const float inv = mx > 0.f ? 32767.f / mx : 0.f;
    nx.s[size_t(g)] = mx / 32767.f;
    nx.sum[size_t(g)] = sum;
    for (int j = 0; j < kLowGroup; ++j) nx.q[size_t(g * kLowGroup + j)] = int16_t(std::nearbyint(v[j] * inv));
  }
  return nx;
}

#endif

#ifdef JAXLLM_LOWBIT_VNNI
// One row of x for the VNNI path: per pair of groups p (2p, 2p + 1), lo [32] int16 = values 0..15 of group 2p
// then of 2p + 1, hi [32] = their values 16..31; s [G] the int16 scales, sum [G] the groups' f32 sums.
struct LowX {
  std::vector<int16_t> q;   // [G / 2][2][32]
  std::vector<float> s, sum;
};

LowX SplitLow(const float* x, int64_t groups) {
  const NaturalX nx = SplitNatural(x, groups * kLowGroup);   // the same int16 values, scales and sums
  LowX lx{std::vector<int16_t>(size_t(groups) * kLowGroup), nx.s, nx.sum};
  for (int64_t g = 0; g < groups; ++g) {
    const int16_t* v = &nx.q[size_t(g) * kLowGroup];
    int16_t* pair = &lx.q[size_t(g / 2) * 64];
    const int half = int(g & 1) * 16;
    std::copy(v, v + 16, pair + half);
    std::copy(v + 16, v + 32, pair + 32 + half);
  }
  return lx;
}

// The 32-bit masks of the fifth bits of groups g and g + 1 (h = their two words, g's low) in the split
// order: lanes 0..15 values 0..15 of g then of g + 1 (lo), lanes 16..31 their values 16..31 (hi).
inline void FifthBitMasks(const uint32_t* high, __mmask32* lo, __mmask32* hi) {
  uint64_t h;
  std::memcpy(&h, high, 8);
#ifdef __BMI2__
  *lo = __mmask32(_pext_u64(h, 0x0000ffff0000ffffull));
  *hi = __mmask32(_pext_u64(h, 0xffff0000ffff0000ull));
#else
  *lo = __mmask32((h & 0xffff) | ((h >> 16) & 0xffff0000u));
  *hi = __mmask32(((h >> 16) & 0xffff) | ((h >> 32) & 0xffff0000u));
#endif
}

// R consecutive weight rows against the split x (groups even; minv null: min = implicit_min * scale): the
// rows share each load of x and their accumulators run side by side. Row r's arrays start r rows on; ds
// [R * groups] scratch; out[r] its result.
template <int R>
void RowsDotLow(const LowX& x, const uint8_t* __restrict q, const uint32_t* __restrict high,
                const uint16_t* __restrict scale, const uint16_t* __restrict minv, float implicit_min,
                int64_t groups, float* ds, float* out, const uint8_t* q_ahead) {
  // The groups' combined scales (weight scale x x scale) and the min terms, 16 groups at a time.
  __m512 acc[R];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g += 16) {
    const __mmask16 live = groups - g >= 16 ? __mmask16(0xffff) : __mmask16((1u << (groups - g)) - 1);
    const __m512 xs = _mm512_maskz_loadu_ps(live, &x.s[size_t(g)]), xsum = _mm512_maskz_loadu_ps(live, &x.sum[size_t(g)]);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      const __m512 sc = _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, scale + r * groups + g));
      const __m512 mn = minv ? _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(live, minv + r * groups + g))
                             : _mm512_mul_ps(sc, _mm512_set1_ps(implicit_min));
      _mm512_mask_storeu_ps(ds + r * groups + g, live, _mm512_mul_ps(sc, xs));
      acc[r] = _mm512_fmadd_ps(mn, xsum, acc[r]);   // the min terms (lanes past the groups are zero)
    }
  }
  const __m512i nibble = _mm512_set1_epi16(15), sixteen = _mm512_set1_epi16(16);
  const __m512i halves = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (int64_t g = 0; g < groups; g += 2) {
    if (q_ahead && (g & 3) == 0) {   // the same line of the rows ahead, spread over the pass
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(q_ahead + (r * groups + g) * 16), _MM_HINT_T0);
    }
    const __m512i* xv = reinterpret_cast<const __m512i*>(&x.q[size_t(g / 2) * 64]);
    const __m512i x0 = _mm512_loadu_si512(xv), x1 = _mm512_loadu_si512(xv + 1);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      // Bytes of groups g and g + 1 as int16: lanes 0..15 group g's, 16..31 group g + 1's.
      const __m512i b = _mm512_cvtepu8_epi16(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + (r * groups + g) * 16)));
      __m512i lo = _mm512_and_si512(b, nibble), hi = _mm512_srli_epi16(b, 4);
      if (high) {
        __mmask32 mlo, mhi;
        FifthBitMasks(high + r * groups + g, &mlo, &mhi);
        lo = _mm512_mask_add_epi16(lo, mlo, lo, sixteen);
        hi = _mm512_mask_add_epi16(hi, mhi, hi, sixteen);
      }
      __m512i d = _mm512_dpwssd_epi32(_mm512_setzero_si512(), lo, x0);
      d = _mm512_dpwssd_epi32(d, hi, x1);
      // Lanes 0..7 hold group g's products, 8..15 group g + 1's.
      double pair;
      std::memcpy(&pair, ds + r * groups + g, 8);
      const __m512 s = _mm512_permutexvar_ps(halves, _mm512_castpd_ps(_mm512_set1_pd(pair)));
      acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), s, acc[r]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) out[r] = _mm512_reduce_add_ps(acc[r]);
}
#endif

#ifdef JAXLLM_LOWBIT_AVX2
// Lanes j of 16 int16: 16 where bit j of h (16 bits) is set, else 0 (a group's fifth bits, half of them).
inline __m256i FifthBits(uint32_t h) {
  const __m256i bit = _mm256_setr_epi16(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384,
                                        int16_t(-32768));
  const __m256i set = _mm256_cmpeq_epi16(_mm256_and_si256(_mm256_set1_epi16(int16_t(h)), bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi16(16));
}

// RowsDotLow of the VNNI path with AVX2: R consecutive weight rows against x in its own order (as there: ds [R * groups]
// scratch, out[r] row r's result). A group's int32 lanes each sum 4 products of at most 31 x 32767: exact in f32.
template <int R, bool kFifth>
void RowsDotLowAvx2(const NaturalX& x, const uint8_t* __restrict q, const uint32_t* __restrict high,
                    const uint16_t* __restrict scale, const uint16_t* __restrict minv, float implicit_min,
                    int64_t groups, float* ds, float* out, const uint8_t* q_ahead) {
  __m256 acc[R];
  float tail[R];
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps(), tail[r] = 0.f;
  // The groups' combined scales (weight scale x x scale) and the min terms, 8 groups at a time.
  int64_t g = 0;
  for (; g + 8 <= groups; g += 8) {
    const __m256 xs = _mm256_loadu_ps(&x.s[size_t(g)]), xsum = _mm256_loadu_ps(&x.sum[size_t(g)]);
    for (int r = 0; r < R; ++r) {
      const __m256 sc = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scale + r * groups + g)));
      const __m256 mn = minv ? _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(minv + r * groups + g)))
                             : _mm256_mul_ps(sc, _mm256_set1_ps(implicit_min));
      _mm256_storeu_ps(ds + r * groups + g, _mm256_mul_ps(sc, xs));
      acc[r] = _mm256_fmadd_ps(mn, xsum, acc[r]);
    }
  }
  for (; g < groups; ++g)
    for (int r = 0; r < R; ++r) {
      const float sc = HalfToF32(scale[r * groups + g]);
      ds[r * groups + g] = sc * x.s[size_t(g)];
      tail[r] += (minv ? HalfToF32(minv[r * groups + g]) : sc * implicit_min) * x.sum[size_t(g)];
    }
  const __m256i nibble = _mm256_set1_epi16(15);
  for (g = 0; g < groups; ++g) {
    if (q_ahead && (g & 3) == 0) {   // the same line of the rows ahead, spread over the pass
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(q_ahead + (r * groups + g) * 16), _MM_HINT_T0);
    }
    const __m256i* xv = reinterpret_cast<const __m256i*>(&x.q[size_t(g) * kLowGroup]);
    const __m256i x0 = _mm256_loadu_si256(xv), x1 = _mm256_loadu_si256(xv + 1);   // values 0..15, 16..31
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      // Byte j as int16 in lane j: its low nibble is value j, its high one value j + 16.
      const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + (r * groups + g) * 16)));
      __m256i lo = _mm256_and_si256(b, nibble), hi = _mm256_srli_epi16(b, 4);
      if (kFifth) {
        const uint32_t h = high[r * groups + g];
        lo = _mm256_add_epi16(lo, FifthBits(h & 0xffff));
        hi = _mm256_add_epi16(hi, FifthBits(h >> 16));
      }
      const __m256i d = _mm256_add_epi32(_mm256_madd_epi16(lo, x0), _mm256_madd_epi16(hi, x1));
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_broadcast_ss(ds + r * groups + g), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = HSum(acc[r]) + tail[r];
}

template <int R>
void RowsDotLow(const NaturalX& x, const uint8_t* __restrict q, const uint32_t* __restrict high,
                const uint16_t* __restrict scale, const uint16_t* __restrict minv, float implicit_min,
                int64_t groups, float* ds, float* out, const uint8_t* q_ahead) {
  (high ? RowsDotLowAvx2<R, true> : RowsDotLowAvx2<R, false>)(x, q, high, scale, minv, implicit_min, groups, ds, out,
                                                              q_ahead);
}
#endif

ffi::Error LowBitCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer q, ffi::AnyBuffer high,
                     ffi::AnyBuffer scale, ffi::AnyBuffer minv, ffi::Result<ffi::AnyBuffer> y, int64_t layer) {
  LowBitShape s;
  if (auto err = CheckLowBit(x, q, high, scale, minv, *y, layer, &s); err.failure()) return err;
  const ffi::DataType t = x.element_type();
  std::vector<float> xf(size_t(s.m * s.k));
  for (int64_t m = 0; m < s.m; ++m) LoadF32(x.untyped_data(), t, m * s.k, s.k, &xf[size_t(m * s.k)]);
  const int64_t g = s.groups;
  const uint8_t* ql = static_cast<const uint8_t*>(q.untyped_data()) + layer * s.n * (s.k / 2);
  const uint32_t* hl = s.high ? static_cast<const uint32_t*>(high.untyped_data()) + layer * s.n * g : nullptr;
  const uint16_t* sl = static_cast<const uint16_t*>(scale.untyped_data()) + layer * s.n * g;
  const uint16_t* ml =
      s.implicit_min != 0.f ? nullptr : static_cast<const uint16_t*>(minv.untyped_data()) + layer * s.n * g;
  void* out = y->untyped_data();
#if defined(JAXLLM_LOWBIT_VNNI)
  if (s.m == 1 && g % 2 == 0 && AllFinite(xf.data(), s.k)) {
    const LowX lx = SplitLow(xf.data(), g);
#elif defined(JAXLLM_LOWBIT_AVX2)
  if (s.m == 1 && AllFinite(xf.data(), s.k)) {
    const NaturalX lx = SplitNatural(xf.data(), s.k);
#endif
#if defined(JAXLLM_LOWBIT_VNNI) || defined(JAXLLM_LOWBIT_AVX2)
    ForRowChunks(pool, s.n, [&](int64_t n0, int64_t n1) {
      constexpr int R = 4;   // rows a pass
      std::vector<float> ds(static_cast<size_t>(R * g));
      float y[R];
      int64_t n = n0;
      const int64_t ahead = PrefetchRows();
      for (; n + R <= n1; n += R) {
        const bool pf = ahead > 0 && n + ahead + R <= s.n;   // the rows `ahead` on: the hardware's prefetch lags
        if (pf) {
          Prefetch(sl + (n + ahead) * g, R * g * 2);
          if (hl) Prefetch(hl + (n + ahead) * g, R * g * 4);
          if (ml) Prefetch(ml + (n + ahead) * g, R * g * 2);
        }
        RowsDotLow<R>(lx, ql + n * (s.k / 2), hl ? hl + n * g : nullptr, sl + n * g, ml ? ml + n * g : nullptr,
                      s.implicit_min, g, ds.data(), y, pf ? ql + (n + ahead) * (s.k / 2) : nullptr);
        for (int r = 0; r < R; ++r) StoreF32(out, t, n + r, y[r]);
      }
      for (; n < n1; ++n) {
        RowsDotLow<1>(lx, ql + n * (s.k / 2), hl ? hl + n * g : nullptr, sl + n * g, ml ? ml + n * g : nullptr,
                      s.implicit_min, g, ds.data(), y, nullptr);
        StoreF32(out, t, n, y[0]);
      }
    });
    return ffi::Error::Success();
  }
#endif
  DotDequantizedRows(pool, xf.data(), s.m, s.n, s.k, out, t, [&](int64_t n, float* w) {
    DequantRow(ql + n * (s.k / 2), hl ? hl + n * g : nullptr, sl + n * g, ml ? ml + n * g : nullptr, s.implicit_min, g, w);
  });
  return ffi::Error::Success();
}

// Test variant: y aliases a poisoned input buffer, so unwritten elements show.
ffi::Error LowBitCpuInto(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer q, ffi::AnyBuffer high,
                         ffi::AnyBuffer scale, ffi::AnyBuffer minv, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> y,
                         int64_t layer) {
  return LowBitCpu(pool, x, q, high, scale, minv, y, layer);
}

// ---- Q6_K (jaxllm_q6k; jaxllm.quant.Q6K) -------------------------------------------------------------
// The file's Q6_K super-blocks of 256 values, w = d * sc[i / 16] * (q - 32) with q 6 bits: ql [N, K / 2] the
// low 4 bits, qh [N, K / 4] the high 2, sc [N, K / 16] int8, d [N, K / 256] f16, in ggml's order: in each
// half of 128 values, byte l < 32 of ql holds value l (low nibble) and l + 64 (high); byte l + 32 values
// l + 32 and l + 96; qh byte l their high bits at 0, 2, 4 and 6 (values l, l + 32, l + 64, l + 96).
constexpr int64_t kSuper = 256;

ffi::Error CheckQ6K(const ffi::AnyBuffer& x, const ffi::AnyBuffer& ql, const ffi::AnyBuffer& qh,
                    const ffi::AnyBuffer& sc, const ffi::AnyBuffer& d, const ffi::AnyBuffer& y, int64_t layer,
                    int64_t* m, int64_t* n, int64_t* k) {
  const std::string name = "jaxllm_q6k: ";
  auto xd = x.dimensions(), ld = ql.dimensions(), hd = qh.dimensions(), sd = sc.dimensions(), dd = d.dimensions(),
       yd = y.dimensions();
  if ((x.element_type() != ffi::F32 && x.element_type() != ffi::BF16) || y.element_type() != x.element_type())
    return ffi::Error::InvalidArgument(name + "x must be f32 or bf16 and y of x's dtype");
  if (ql.element_type() != ffi::U8 || qh.element_type() != ffi::U8 || sc.element_type() != ffi::S8 ||
      d.element_type() != ffi::F16)
    return ffi::Error::InvalidArgument(name + "ql and qh must be uint8, sc int8, d float16");
  if (xd.size() != 2 || ld.size() != 3 || hd.size() != 3 || sd.size() != 3 || dd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument(name + "expected x [M, K], ql [L, N, K/2], qh [L, N, K/4], sc [L, N, K/16], "
                                       "d [L, N, K/256], y [M, N]; got x " + DimsString(xd) + ", ql " +
                                       DimsString(ld) + ", y " + DimsString(yd));
  *m = xd[0], *k = xd[1], *n = ld[1];
  const bool same = hd[0] == ld[0] && sd[0] == ld[0] && dd[0] == ld[0] && hd[1] == *n && sd[1] == *n && dd[1] == *n &&
                    ld[2] * 2 == *k && hd[2] * 4 == *k && sd[2] * 16 == *k && dd[2] * kSuper == *k;
  if (*k < kSuper || *k % kSuper || !same || yd[0] != *m || yd[1] != *n)
    return ffi::Error::InvalidArgument(name + "inconsistent shapes (K a multiple of 256) x " + DimsString(xd) +
                                       ", ql " + DimsString(ld) + ", qh " + DimsString(hd) + ", sc " + DimsString(sd) +
                                       ", d " + DimsString(dd) + ", y " + DimsString(yd));
  if (layer < 0 || layer >= ld[0])
    return ffi::Error::InvalidArgument(name + "layer " + std::to_string(layer) + " out of range [0, " +
                                       std::to_string(ld[0]) + ")");
  return ffi::Error::Success();
}

// One Q6_K weight row [K] as f32.
void DequantRowQ6K(const uint8_t* ql, const uint8_t* qh, const int8_t* sc, const uint16_t* d, int64_t supers,
                   float* out) {
  for (int64_t s = 0; s < supers; ++s) {
    const float dd = HalfToF32(d[s]);
    for (int h = 0; h < 2; ++h) {
      const uint8_t* lo = ql + s * 128 + h * 64;
      const uint8_t* hi = qh + s * 64 + h * 32;
      const int8_t* scale = sc + s * 16 + h * 8;
      float* o = out + s * kSuper + h * 128;
      for (int l = 0; l < 32; ++l) {
        const int q[4] = {(lo[l] & 15) | (hi[l] & 3) << 4, (lo[l + 32] & 15) | ((hi[l] >> 2) & 3) << 4,
                          (lo[l] >> 4) | ((hi[l] >> 4) & 3) << 4, (lo[l + 32] >> 4) | ((hi[l] >> 6) & 3) << 4};
        for (int i = 0; i < 4; ++i) o[l + 32 * i] = dd * float(scale[(l + 32 * i) / 16]) * float(q[i] - 32);
      }
    }
  }
}

#ifdef JAXLLM_LOWBIT_VNNI
// One Q6_K row against x: per 32 values, q - 32 as int16 against x's int16 in vpdpwssd (lanes 0..7 the first
// 16 values, one scale; 8..15 the next 16), scaled by d * sc * s with one FMA.
float RowDotQ6K(const NaturalX& x, const uint8_t* __restrict ql, const uint8_t* __restrict qh,
                const int8_t* __restrict sc, const uint16_t* __restrict d, int64_t supers,
                const uint8_t* ql_ahead, const uint8_t* qh_ahead) {
  const __m512i mask = _mm512_set1_epi16(0x30), nibble = _mm512_set1_epi16(15), off = _mm512_set1_epi16(32);
  // pick[i]: lanes 0..7 take scale 2i, lanes 8..15 scale 2i + 1 (of a super-block's 16).
  __m512i pick[8];
  for (int i = 0; i < 8; ++i)
    pick[i] = _mm512_set_epi32(2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1, 2 * i + 1,
                               2 * i, 2 * i, 2 * i, 2 * i, 2 * i, 2 * i, 2 * i, 2 * i);
  const __m512i pair = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);   // scale j: x's 32 j / 2
  __m512 acc = _mm512_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    if (ql_ahead) {   // the same super-block of the row ahead, spread over the row
      _mm_prefetch(reinterpret_cast<const char*>(ql_ahead + s * 128), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(ql_ahead + s * 128 + 64), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(qh_ahead + s * 64), _MM_HINT_T0);
    }
    const __m512 xs = _mm512_permutexvar_ps(pair, _mm512_castps256_ps512(_mm256_loadu_ps(&x.s[size_t(s * 8)])));
    const __m512 scf = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + s * 16))));
    const __m512 ds = _mm512_mul_ps(_mm512_mul_ps(scf, xs), _mm512_set1_ps(HalfToF32(d[s])));
    for (int h = 0; h < 2; ++h) {
      const uint8_t* lo = ql + s * 128 + h * 64;
      const __m512i a = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo)));
      const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(lo + 32)));
      const __m512i hb = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh + s * 64 + h * 32)));
      // Values 0..31, 32..63, 64..95, 96..127 of the half, each minus 32.
      const __m512i v[4] = {
          _mm512_sub_epi16(_mm512_or_si512(_mm512_and_si512(a, nibble), _mm512_and_si512(_mm512_slli_epi16(hb, 4), mask)), off),
          _mm512_sub_epi16(_mm512_or_si512(_mm512_and_si512(b, nibble), _mm512_and_si512(_mm512_slli_epi16(hb, 2), mask)), off),
          _mm512_sub_epi16(_mm512_or_si512(_mm512_srli_epi16(a, 4), _mm512_and_si512(hb, mask)), off),
          _mm512_sub_epi16(_mm512_or_si512(_mm512_srli_epi16(b, 4), _mm512_and_si512(_mm512_srli_epi16(hb, 2), mask)), off)};
      const int16_t* xq = &x.q[size_t(s * kSuper + h * 128)];
      for (int i = 0; i < 4; ++i) {
        const __m512i dot = _mm512_dpwssd_epi32(_mm512_setzero_si512(), v[i], _mm512_loadu_si512(xq + 32 * i));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_permutexvar_ps(pick[h * 4 + i], ds), acc);
      }
    }
  }
  return _mm512_reduce_add_ps(acc);
}
#endif

#ifdef JAXLLM_LOWBIT_AVX2
// RowDotQ6K with AVX2: per 16 values (one scale), q - 32 as int16 against x's int16 in vpmaddwd (8 int32 lanes,
// 2 products each: exact), scaled by d * sc * s with one FMA.
float RowDotQ6K(const NaturalX& x, const uint8_t* __restrict ql, const uint8_t* __restrict qh,
                const int8_t* __restrict sc, const uint16_t* __restrict d, int64_t supers,
                const uint8_t* ql_ahead, const uint8_t* qh_ahead) {
  const __m256i mask = _mm256_set1_epi16(0x30), nibble = _mm256_set1_epi16(15), off = _mm256_set1_epi16(32);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t s = 0; s < supers; ++s) {
    if (ql_ahead) {   // the same super-block of the row ahead, spread over the row
      _mm_prefetch(reinterpret_cast<const char*>(ql_ahead + s * 128), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(ql_ahead + s * 128 + 64), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(qh_ahead + s * 64), _MM_HINT_T0);
    }
    // ds[j]: the scale of values 16j..16j+15 of the super-block (d * sc[j] * x's scale of their 32).
    const float dd = HalfToF32(d[s]);
    float ds[16];
    for (int j = 0; j < 16; ++j) ds[j] = dd * float(sc[s * 16 + j]) * x.s[size_t(s * 8 + j / 2)];
    for (int h = 0; h < 2; ++h)
      for (int l0 = 0; l0 < 32; l0 += 16) {   // bytes l0..l0+15 of each 32 of the half's ql and qh
        const uint8_t* lo = ql + s * 128 + h * 64 + l0;
        const __m256i a = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo)));
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo + 32)));
        const __m256i hb = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qh + s * 64 + h * 32 + l0)));
        // Values l0.., 32 + l0.., 64 + l0.., 96 + l0.. of the half (16 each), each minus 32.
        const __m256i v[4] = {
            _mm256_sub_epi16(_mm256_or_si256(_mm256_and_si256(a, nibble), _mm256_and_si256(_mm256_slli_epi16(hb, 4), mask)), off),
            _mm256_sub_epi16(_mm256_or_si256(_mm256_and_si256(b, nibble), _mm256_and_si256(_mm256_slli_epi16(hb, 2), mask)), off),
            _mm256_sub_epi16(_mm256_or_si256(_mm256_srli_epi16(a, 4), _mm256_and_si256(hb, mask)), off),
            _mm256_sub_epi16(_mm256_or_si256(_mm256_srli_epi16(b, 4), _mm256_and_si256(_mm256_srli_epi16(hb, 2), mask)), off)};
        const int16_t* xq = &x.q[size_t(s * kSuper + h * 128 + l0)];
        for (int i = 0; i < 4; ++i) {
          const __m256i dot = _mm256_madd_epi16(v[i], _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + 32 * i)));
          acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_set1_ps(ds[h * 8 + 2 * i + l0 / 16]), acc);
        }
      }
  }
  return HSum(acc);
}
#endif

ffi::Error Q6KCpu(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer ql, ffi::AnyBuffer qh, ffi::AnyBuffer sc,
                  ffi::AnyBuffer d, ffi::Result<ffi::AnyBuffer> y, int64_t layer) {
  int64_t m, n, k;
  if (auto err = CheckQ6K(x, ql, qh, sc, d, *y, layer, &m, &n, &k); err.failure()) return err;
  const ffi::DataType t = x.element_type();
  std::vector<float> xf(size_t(m * k));
  for (int64_t r = 0; r < m; ++r) LoadF32(x.untyped_data(), t, r * k, k, &xf[size_t(r * k)]);
  const int64_t supers = k / kSuper;
  const uint8_t* lq = static_cast<const uint8_t*>(ql.untyped_data()) + layer * n * (k / 2);
  const uint8_t* hq = static_cast<const uint8_t*>(qh.untyped_data()) + layer * n * (k / 4);
  const int8_t* sl = static_cast<const int8_t*>(sc.untyped_data()) + layer * n * (k / 16);
  const uint16_t* dl = static_cast<const uint16_t*>(d.untyped_data()) + layer * n * supers;
  void* out = y->untyped_data();
#if defined(JAXLLM_LOWBIT_VNNI) || defined(JAXLLM_LOWBIT_AVX2)
  if (m == 1 && AllFinite(xf.data(), k)) {
    const NaturalX nx = SplitNatural(xf.data(), k);
    const int64_t ahead = PrefetchRows();
    ForRowChunks(pool, n, [&](int64_t n0, int64_t n1) {
      for (int64_t r = n0; r < n1; ++r) {
        const bool pf = ahead > 0 && r + ahead < n;
        if (pf) Prefetch(sl + (r + ahead) * (k / 16), k / 16);
        StoreF32(out, t, r, RowDotQ6K(nx, lq + r * (k / 2), hq + r * (k / 4), sl + r * (k / 16), dl + r * supers, supers,
                                      pf ? lq + (r + ahead) * (k / 2) : nullptr, pf ? hq + (r + ahead) * (k / 4) : nullptr));
      }
    });
    return ffi::Error::Success();
  }
#endif
  DotDequantizedRows(pool, xf.data(), m, n, k, out, t, [&](int64_t r, float* w) {
    DequantRowQ6K(lq + r * (k / 2), hq + r * (k / 4), sl + r * (k / 16), dl + r * supers, supers, w);
  });
  return ffi::Error::Success();
}

ffi::Error Q6KCpuInto(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer ql, ffi::AnyBuffer qh, ffi::AnyBuffer sc,
                      ffi::AnyBuffer d, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> y, int64_t layer) {
  return Q6KCpu(pool, x, ql, qh, sc, d, y, layer);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(Q6KMatmulCpu, Q6KCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()    // x [M, K] f32 / bf16
                                  .Arg<ffi::AnyBuffer>()    // ql [L, N, K / 2] uint8
                                  .Arg<ffi::AnyBuffer>()    // qh [L, N, K / 4] uint8
                                  .Arg<ffi::AnyBuffer>()    // sc [L, N, K / 16] int8
                                  .Arg<ffi::AnyBuffer>()    // d [L, N, K / 256] f16
                                  .Ret<ffi::AnyBuffer>()    // y [M, N], x's dtype
                                  .Attr<int64_t>("layer"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(Q6KMatmulCpuInto, Q6KCpuInto,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()    // the poisoned y, aliased to the result
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("layer"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(LowBitMatmulCpu, LowBitCpu,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()    // x [M, K] f32 / bf16
                                  .Arg<ffi::AnyBuffer>()    // q [L, N, K / 2] uint8
                                  .Arg<ffi::AnyBuffer>()    // high [L, N, K / 32] uint32 ([L, N, 0]: 4-bit)
                                  .Arg<ffi::AnyBuffer>()    // scale [L, N, K / 32] f16
                                  .Arg<ffi::AnyBuffer>()    // min [L, N, K / 32] f16 ([L, N, 0]: -8 / -16 scale)
                                  .Ret<ffi::AnyBuffer>()    // y [M, N], x's dtype
                                  .Attr<int64_t>("layer"));
XLA_FFI_DEFINE_HANDLER_SYMBOL(LowBitMatmulCpuInto, LowBitCpuInto,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()    // the poisoned y, aliased to the result
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("layer"));

}  // namespace jaxllm
