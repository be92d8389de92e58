// CUDA handlers of the fused decode-step ops (jaxllm/kernels/fused.py): the W8A16 matmul with the RMSNorm
// prologue and the residual / SwiGLU / greedy-argmax epilogues (kernel templates in w8a16_cuda.cuh), and
// the QKV epilogue (bias, q/k RMSNorm, RoPE, the K/V append into the cache in place).
//
// Command-buffer compatible like the others: kernels (and, for the argmax, a memset of its output) on
// XLA's stream, every per-step value read on the device, nothing allocated.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>

#include "common.h"
#include "attention_cuda.cuh"
#include "qkv_cuda.cuh"
#include "w8a16_cuda.cuh"

namespace jaxllm {
namespace {

template <typename T>
cudaError_t DispatchFused(cudaStream_t st, int64_t mode, const MatmulShape& s, const void* x, const int8_t* w,
                          const float* sc, void* y, w8a16::Fuse fu) {
  using namespace w8a16;
  switch (mode) {
    case kModeNorm: return Dispatch<T, kNorm>(st, s, x, w, sc, y, fu);
    case kModeNormSwiGLU: return Dispatch<T, kNorm | kSwiGLU>(st, s, x, w, sc, y, fu);
    case kModeNormArgmax: {
      if (cudaError_t e = cudaMemsetAsync(y, 0, size_t(s.m) * 4 * sizeof(uint32_t), st); e != cudaSuccess) return e;
      return Dispatch<T, kNorm | kArgmax>(st, s, x, w, sc, y, fu);
    }
    default: return Dispatch<T, kResidual>(st, s, x, w, sc, y, fu);
  }
}

ffi::Error FusedCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale, ffi::AnyBuffer aux,
                     ffi::Result<ffi::AnyBuffer> y, int64_t layer, int64_t norm_layer, int64_t mode, int64_t bf16,
                     float eps) {
  MatmulShape s;
  if (auto err = CheckFused(x, w, scale, aux, *y, layer, norm_layer, mode, bf16 != 0, &s); err.failure()) return err;
  if (bf16 == 0)
    return ffi::Error::InvalidArgument("jaxllm_w8a16_fused: the CUDA kernels are built for bf16 activations");
  if (s.m > 4) return ffi::Error::InvalidArgument("jaxllm_w8a16_fused: at most 4 rows of x, got " + std::to_string(s.m));
  if (mode != kModeResidual && w8a16::NormStageBytes<__nv_bfloat16>(4, int(s.k)) > w8a16::kMaxXStageBytes)
    return ffi::Error::InvalidArgument("jaxllm_w8a16_fused: K = " + std::to_string(s.k) + " too long for the norm "
                                       "prologue's shared memory");
  if (s.m == 0 || s.n == 0) return ffi::Error::Success();
  const int8_t* wl = static_cast<const int8_t*>(w.untyped_data()) + layer * s.n * s.k;
  const float* sl = static_cast<const float*>(scale.untyped_data()) + layer * s.n * s.groups;
  w8a16::Fuse fu;
  if (mode == kModeResidual) {
    fu.res = static_cast<const float*>(aux.untyped_data());
  } else {
    fu.norm_w = static_cast<const float*>(aux.untyped_data()) + norm_layer * s.k;
    fu.eps = eps;
  }
  cudaError_t e = DispatchFused<__nv_bfloat16>(stream, mode, s, x.untyped_data(), wl, sl, y->untyped_data(), fu);
  if (e != cudaSuccess) return ffi::Error::Internal(std::string("jaxllm_w8a16_fused launch: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

// ---- QKV epilogue (kernel in qkv_cuda.cuh) -----------------------------------------------------------------

// The k and v caches, outputs aliased to their inputs (the QKV epilogue's and the layers call's): each input
// copied in where XLA gave its output a buffer of its own (HoldAlias, common.h).
cudaError_t HoldCaches(cudaStream_t stream, const ffi::AnyBuffer& k_in, ffi::AnyBuffer& kc,
                       const ffi::AnyBuffer& v_in, ffi::AnyBuffer& vc) {
  cudaError_t e = HoldAlias(stream, k_in, kc);
  return e == cudaSuccess ? HoldAlias(stream, v_in, vc) : e;
}

ffi::Error QkvCuda(cudaStream_t stream, ffi::AnyBuffer qkv, ffi::AnyBuffer bias, ffi::AnyBuffer qn, ffi::AnyBuffer kn,
                   ffi::AnyBuffer inv_freq, ffi::AnyBuffer pos, ffi::AnyBuffer writes, ffi::AnyBuffer k_in,
                   ffi::AnyBuffer v_in, ffi::Result<ffi::AnyBuffer> q_out, ffi::Result<ffi::AnyBuffer> kc,
                   ffi::Result<ffi::AnyBuffer> vc, ffi::Result<ffi::AnyBuffer> counters, int64_t layer, int64_t neox,
                   float pos_scale, float eps) {
  QkvShape s;
  if (auto err = CheckQkv(qkv, bias, qn, kn, inv_freq, pos, writes, *kc, *vc, *q_out, *counters, layer, &s);
      err.failure())
    return err;
  if (s.b == 0) return ffi::Error::Success();
  if (cudaError_t e = HoldCaches(stream, k_in, *kc, v_in, *vc); e != cudaSuccess)
    return ffi::Error::Internal(std::string("jaxllm_qkv_epilogue cache copy: ") + cudaGetErrorString(e));
  qkv::Args a;
  a.qkv = qkv.untyped_data();
  a.bias = LayerRow(bias, layer, s.nqkv);
  a.qn = LayerRow(qn, layer, s.d);
  a.kn = LayerRow(kn, layer, s.d);
  a.inv_freq = static_cast<const float*>(inv_freq.untyped_data());
  a.pos = static_cast<const int32_t*>(pos.untyped_data());
  a.writes = static_cast<const int32_t*>(writes.untyped_data());
  a.kc = kc->untyped_data();
  a.vc = vc->untyped_data();
  a.layer = int(layer);
  a.neox = neox != 0;
  a.pos_scale = pos_scale;
  a.eps = eps;
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    return qkv::LaunchEpilogue<T>(stream, false, a, static_cast<T*>(q_out->untyped_data()),
                                  static_cast<int32_t*>(counters->untyped_data()), int(s.b), int(s.n), int(s.h),
                                  int(s.g), int(s.s), int(s.d));
  };
  cudaError_t e = qkv.element_type() == ffi::BF16 ? launch(__nv_bfloat16()) : launch(float());
  if (e != cudaSuccess) return ffi::Error::Internal(std::string("jaxllm_qkv_epilogue launch: ") + cudaGetErrorString(e));
  return ffi::Error::Success();
}

// Test variant: the output aliases a poisoned input buffer (one more argument), so unwritten elements show.
ffi::Error FusedCudaInto(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer w, ffi::AnyBuffer scale,
                         ffi::AnyBuffer aux, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> y, int64_t layer,
                         int64_t norm_layer, int64_t mode, int64_t bf16, float eps) {
  return FusedCuda(stream, x, w, scale, aux, y, layer, norm_layer, mode, bf16, eps);
}

// ---- every decode layer in one call ----------------------------------------------------------------------
//
// Five kernels per layer, launched back to back on XLA's stream from one handler: norm + QKV; attention with
// the QKV epilogue as its prologue (attn1::Kernel<..., true>: the per-op path's epilogue kernel and attention
// kernel in one, the same bits); O + residual; norm + gate/up + SwiGLU; down + residual. One node of XLA's
// command buffer for all layers, and (pdl) each kernel a programmatic dependent of the one before, so that it
// is launched while that one finishes and issues its weight loads before waiting for it. The residual
// stream is updated in place in x_out (the first O projection reads x); intermediates live in the workspace
// (LayersWorkspace, the same sizes as fused.layers_workspace_bytes), whose attention counters are zeroed
// once per call (each merging block resets its own after that). With `head`, the final norm and the LM head
// (greedy argmax or logits) follow as the call's last kernel, a dependent of the last down projection.

// JAXLLM_LAYERS_SKIP (a lab switch, see LabEnv): a comma-separated list of the layer stages the layers call
// leaves out (qkv, attention, o, gate_up, down), to time the step without them
// (docs/results/2026-12-02-h200-breakdown.md). Timing only: the step's results are wrong. Unknown names are
// reported on stderr and ignored. A release build never reads it: 0.
enum : unsigned { kSkipQkv = 1u, kSkipAttention = 2u, kSkipO = 4u, kSkipGateUp = 8u, kSkipDown = 16u };
inline unsigned LayersSkip() {
  const char* v = LabEnv("JAXLLM_LAYERS_SKIP");
  if (v == nullptr) return 0;
  const std::pair<const char*, unsigned> names[] = {
      {"qkv", kSkipQkv}, {"attention", kSkipAttention}, {"o", kSkipO}, {"gate_up", kSkipGateUp}, {"down", kSkipDown}};
  unsigned mask = 0;
  std::string list(v);
  size_t at = 0;
  while (at <= list.size()) {
    const size_t end = std::min(list.find(',', at), list.size());
    const std::string item = list.substr(at, end - at);
    bool known = item.empty();
    for (const auto& [name, bit] : names)
      if (item == name) mask |= bit, known = true;
    if (!known)
      std::fprintf(stderr, "jaxllm: JAXLLM_LAYERS_SKIP: unknown stage '%s' ignored (expected qkv, attention, o, "
                   "gate_up or down)\n", item.c_str());
    at = end + 1;
  }
  if (mask != 0)
    std::fprintf(stderr, "jaxllm: JAXLLM_LAYERS_SKIP=%s leaves those stages out of every decode layer: the results "
                 "are wrong (for timing only)\n", v);
  return mask;
}

// JAXLLM_ATTN_STOP=wait|prologue|tiles (a lab switch, see LabEnv): every layer's attention returns right after
// its wait, after its prologue (the query heads and the cache append), or after its tiles without the merge.
// Timing only: the results are wrong; it says where the attention's time goes. A release build never reads it: 0.
inline int AttnStop() {
  const char* v = LabEnv("JAXLLM_ATTN_STOP");
  if (v == nullptr || !*v) return 0;
  const std::string s(v);
  const int stop = s == "wait" ? 1 : s == "prologue" ? 2 : s == "tiles" ? 3 : 0;
  if (stop == 0)
    std::fprintf(stderr, "jaxllm: JAXLLM_ATTN_STOP: unknown point '%s' ignored (expected wait, prologue or tiles)\n", v);
  else
    std::fprintf(stderr, "jaxllm: JAXLLM_ATTN_STOP=%s stops every decode layer's attention there: the results are "
                 "wrong (for timing only)\n", v);
  return stop;
}

struct LayersWorkspace {
  size_t qkv, attn, act, ws, counters, total;
};
inline size_t Align256(size_t n) { return (n + 255) / 256 * 256; }
inline LayersWorkspace LayersLayout(int64_t b, int64_t n, int64_t h, int64_t dh, int64_t f, int64_t p, int64_t g) {
  LayersWorkspace w;
  size_t at = 0;
  w.qkv = at; at += Align256(size_t(b * n) * 2);
  w.attn = at; at += Align256(size_t(b * h * dh) * 2);
  w.act = at; at += Align256(size_t(b * f) * 2);
  w.ws = at; at += Align256(size_t(b * h * p * (dh + 2)) * 4);
  w.counters = at; at += Align256(size_t(b * g) * 4);
  w.total = at;
  return w;
}

ffi::Error LayersCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer pos, ffi::AnyBuffer writes,
                      ffi::AnyBuffer lengths, ffi::AnyBuffer inv_freq, ffi::AnyBuffer attn_norm, ffi::AnyBuffer wqkv,
                      ffi::AnyBuffer sqkv, ffi::AnyBuffer bqkv, ffi::AnyBuffer qn, ffi::AnyBuffer kn, ffi::AnyBuffer wo,
                      ffi::AnyBuffer so, ffi::AnyBuffer ffn_norm, ffi::AnyBuffer wgu, ffi::AnyBuffer sgu,
                      ffi::AnyBuffer wd, ffi::AnyBuffer sd, ffi::AnyBuffer k_in, ffi::AnyBuffer v_in, ffi::AnyBuffer out_norm,
                      ffi::AnyBuffer wh, ffi::AnyBuffer sh, ffi::Result<ffi::AnyBuffer> x_out,
                      ffi::Result<ffi::AnyBuffer> kc, ffi::Result<ffi::AnyBuffer> vc,
                      ffi::Result<ffi::AnyBuffer> workspace, ffi::Result<ffi::AnyBuffer> head_out, int64_t heads,
                      int64_t kv_heads, int64_t neox, float pos_scale, float eps, int64_t splits, int64_t pdl,
                      int64_t head) {
  const std::string name = "jaxllm_decode_layers: ";
  auto xd = x.dimensions(), kd = kc->dimensions();
  if (x.element_type() != ffi::F32 || xd.size() != 2 || kd.size() != 5 || kc->element_type() != ffi::BF16 ||
      vc->element_type() != ffi::BF16)
    return ffi::Error::InvalidArgument(name + "expected x [B, D] f32 and bf16 caches [L, N, G, S, Dh]");
  // The caches may hold more rows than x (N >= B, a server's slots): the step reads and writes rows [0, B).
  const int64_t b = xd[0], d = xd[1], layers = kd[0], cache_rows = kd[1], g = kd[2], smax = kd[3], dh = kd[4];
  const int64_t h = heads;
  if (auto err = CheckCacheRows(name, "x", xd, kd); err.failure()) return err;
  if (g != kv_heads || h % g || h / g > attn1::kMaxGroup || (dh != 64 && dh != 128) || b > 4 ||
      splits < 1 || splits > attn1::kMaxSplits)
    return ffi::Error::InvalidArgument(name + "unsupported geometry: caches " + DimsString(kd) + ", heads " +
                                       std::to_string(h) + ", batch " + std::to_string(b));
  const int64_t n = (h + 2 * g) * dh;
  // Each matmul through the checks of the single-op call (x of the right width, stacked weights of L).
  MatmulShape mq, mo, mg, md;
  auto check = [&](const ffi::AnyBuffer& w, const ffi::AnyBuffer& sc, int64_t rows, int64_t k, MatmulShape* m) {
    auto wd2 = w.dimensions(), sd2 = sc.dimensions();
    if (w.element_type() != ffi::S8 || sc.element_type() != ffi::F32 || wd2.size() != 3 || sd2.size() != 3 ||
        wd2[0] != layers || wd2[1] != rows || wd2[2] != k || sd2[0] != layers || sd2[1] != rows || sd2[2] < 1 ||
        k % sd2[2] || (k / sd2[2]) % 16)
      return false;
    *m = MatmulShape{b, rows, k, sd2[2], k / sd2[2], 0};
    return true;
  };
  const int64_t f = wgu.dimensions().size() == 3 ? wgu.dimensions()[1] / 2 : 0;
  if (!check(wqkv, sqkv, n, d, &mq) || !check(wo, so, d, h * dh, &mo) || !check(wgu, sgu, 2 * f, d, &mg) ||
      !check(wd, sd, d, f, &md) || f < 1)
    return ffi::Error::InvalidArgument(name + "weights do not fit the model geometry");
  if (w8a16::NormStageBytes<__nv_bfloat16>(4, int(d)) > w8a16::kMaxXStageBytes)
    return ffi::Error::InvalidArgument(name + "model width too large for the norm prologue");
  auto rows_ok = [&](const ffi::AnyBuffer& a, int64_t cols, bool optional) {
    auto ad = a.dimensions();
    if (optional && ad.size() == 1 && ad[0] == 0) return a.element_type() == ffi::F32;
    return a.element_type() == ffi::F32 && ad.size() == 2 && ad[0] == layers && ad[1] == cols;
  };
  if (!rows_ok(attn_norm, d, false) || !rows_ok(ffn_norm, d, false) || !rows_ok(bqkv, n, true) ||
      !rows_ok(qn, dh, true) || !rows_ok(kn, dh, true))
    return ffi::Error::InvalidArgument(name + "norm weights must be f32 [L, D], bias [L, N] or [0], q/k norms [L, Dh] or [0]");
  for (const ffi::AnyBuffer* a : {&pos, &writes, &lengths})
    if (a->element_type() != ffi::S32 || a->dimensions().size() != 1 || a->dimensions()[0] != b)
      return ffi::Error::InvalidArgument(name + "pos, writes and lengths must be int32 [B]");
  if (inv_freq.element_type() != ffi::F32 || inv_freq.dimensions().size() != 1 || inv_freq.dimensions()[0] != dh / 2)
    return ffi::Error::InvalidArgument(name + "inv_freq must be f32 [Dh / 2]");
  const LayersWorkspace lw = LayersLayout(b, n, h, dh, f, splits, g);
  auto wsd = workspace->dimensions();
  if (workspace->element_type() != ffi::U8 || wsd.size() != 1 || size_t(wsd[0]) < lw.total ||
      x_out->element_type() != ffi::F32 || x_out->dimensions().size() != 2 || x_out->dimensions()[0] != b ||
      x_out->dimensions()[1] != d)
    return ffi::Error::InvalidArgument(name + "workspace must be uint8 [" + std::to_string(lw.total) +
                                       "] and x_out f32 [B, D]");
  // The LM head after the last layer (head 1: the greedy argmax, uint32 [B, 4]; 2: the logits, bf16 [B, V]; 0:
  // none, the head's operands and output empty): the final norm's weight [D], the head [V, D] and its scales.
  MatmulShape mh{};
  if (head != 0) {
    auto hwd = wh.dimensions(), hsd = sh.dimensions(), hod = head_out->dimensions();
    const bool ok = (head == 1 || head == 2) && out_norm.element_type() == ffi::F32 &&
                    out_norm.dimensions().size() == 1 && out_norm.dimensions()[0] == d &&
                    wh.element_type() == ffi::S8 && hwd.size() == 2 &&
                    hwd[1] == d && sh.element_type() == ffi::F32 && hsd.size() == 2 && hsd[0] == hwd[0] &&
                    hsd[1] >= 1 && d % hsd[1] == 0 && (d / hsd[1]) % 16 == 0 && hod.size() == 2 && hod[0] == b &&
                    (head == 1 ? head_out->element_type() == ffi::U32 && hod[1] == 4
                               : head_out->element_type() == ffi::BF16 && hod[1] == hwd[0]);
    if (!ok)
      return ffi::Error::InvalidArgument(name + "the head takes the final norm f32 [D], int8 [V, D] weights, f32 "
                                         "[V, G] scales and writes uint32 [B, 4] (argmax) or bf16 [B, V] (logits)");
    mh = MatmulShape{b, hwd[0], d, hsd[1], d / hsd[1], 0};
  }
  if (b == 0) return ffi::Error::Success();
  if (cudaError_t e = HoldCaches(stream, k_in, *kc, v_in, *vc); e != cudaSuccess)
    return ffi::Error::Internal(name + "cache copy: " + cudaGetErrorString(e));

  using bf16 = __nv_bfloat16;
  using namespace w8a16;
  uint8_t* base = static_cast<uint8_t*>(workspace->untyped_data());
  bf16* qkv = reinterpret_cast<bf16*>(base + lw.qkv);
  bf16* attn = reinterpret_cast<bf16*>(base + lw.attn);
  bf16* act = reinterpret_cast<bf16*>(base + lw.act);
  float* ws = reinterpret_cast<float*>(base + lw.ws);
  int32_t* cnt = reinterpret_cast<int32_t*>(base + lw.counters);
  const float* xin = static_cast<const float*>(x.untyped_data());
  float* xo = static_cast<float*>(x_out->untyped_data());
  bf16* kcp = static_cast<bf16*>(kc->untyped_data());
  bf16* vcp = static_cast<bf16*>(vc->untyped_data());
  auto f32 = [](const ffi::AnyBuffer& a) { return static_cast<const float*>(a.untyped_data()); };
  auto i8 = [](const ffi::AnyBuffer& a) { return static_cast<const int8_t*>(a.untyped_data()); };
  const bool use_pdl = pdl != 0;
  // Each kernel lets the next one launch as soon as it has issued its weight loads, before its own wait, so
  // that the next one's loads overlap its whole run (lab switch JAXLLM_PDL_EARLY=0: once its weights are read,
  // for comparison; docs/kernels.md).
  static const bool early_env = LabFlag("JAXLLM_PDL_EARLY", true);
  const bool early = use_pdl && early_env;
  const int32_t* len = static_cast<const int32_t*>(lengths.untyped_data());
  qkv::Args pa;
  pa.qkv = qkv;
  pa.inv_freq = f32(inv_freq);
  pa.pos = static_cast<const int32_t*>(pos.untyped_data());
  pa.writes = static_cast<const int32_t*>(writes.untyped_data());
  pa.kc = kcp;
  pa.vc = vcp;
  pa.neox = neox != 0;
  pa.pos_scale = pos_scale;
  pa.eps = eps;
  pa.early = early;
  // Loads off the path after each kernel's wait (the attention's inputs and constants before it, the norm
  // weight's lines into L1, the residual right after it); lab switch JAXLLM_PREFETCH=0 leaves them where they were.
  static const bool prefetch = LabFlag("JAXLLM_PREFETCH", true);
  pa.late_inputs = !prefetch;
  static const int attn_stop = AttnStop();
  pa.stop = attn_stop;
  // Layer i's slice of a stacked [L, rows, cols] weight (int8) or scale (f32).
  auto w8 = [&](const ffi::AnyBuffer& a, int64_t i, const MatmulShape& m) { return i8(a) + i * m.n * m.k; };
  auto s32 = [&](const ffi::AnyBuffer& a, int64_t i, const MatmulShape& m) { return f32(a) + i * m.n * m.groups; };
  // Stages left out of every layer (lab switch JAXLLM_LAYERS_SKIP; timing only: the results are wrong). The first
  // kernel launched is never a programmatic dependent: it waits for what XLA ran before the call.
  static const unsigned skip = LayersSkip();
  // The attention's counters start at zero (each attention leaves them so): the first QKV kernel zeroes them,
  // before any attention kernel passes its wait; a memset where that kernel is left out.
  cudaError_t e = cudaSuccess;
  int32_t* head_zero = head == 1 ? static_cast<int32_t*>(head_out->untyped_data()) : nullptr;   // argmax: zeroed
  if (skip & kSkipQkv) {
    e = cudaMemsetAsync(cnt, 0, size_t(b * g) * sizeof(int32_t), stream);
    if (e == cudaSuccess && head_zero != nullptr)
      e = cudaMemsetAsync(head_zero, 0, size_t(b) * 4 * sizeof(uint32_t), stream);
  }
  bool first = true;
  auto pdl_next = [&] {
    const bool p = use_pdl && !first;
    first = false;
    return p;
  };
  for (int64_t i = 0; i < layers && e == cudaSuccess; ++i) {
    const float* xcur = i == 0 ? xin : xo;
    if (!(skip & kSkipQkv)) {
      Fuse fq{f32(attn_norm) + i * d, eps, nullptr, pdl_next(), early, prefetch};
      if (i == 0) {
        fq.zero = cnt;
        fq.zero_n = int(b * g);
        fq.zero2 = head_zero;
        fq.zero2_n = int(b * 4);
      }
      e = Dispatch<bf16, kNorm>(stream, mq, xcur, w8(wqkv, i, mq), s32(sqkv, i, mq), qkv, fq);
      if (e != cudaSuccess) break;
    }
    if (!(skip & kSkipAttention)) {
      pa.bias = LayerRow(bqkv, i, n);
      pa.qn = LayerRow(qn, i, dh);
      pa.kn = LayerRow(kn, i, dh);
      pa.layer = int(i);
      const bool pdl_attn = pdl_next();
      e = dh == 64 ? attn1::Launch<bf16, 64>(stream, nullptr, kcp, vcp, len, ws, attn, cnt, int(i), int(b),
                                             int(cache_rows), int(h), int(g), int(smax), int(splits), pdl_attn, pa)
                   : attn1::Launch<bf16, 128>(stream, nullptr, kcp, vcp, len, ws, attn, cnt, int(i), int(b),
                                              int(cache_rows), int(h), int(g), int(smax), int(splits), pdl_attn, pa);
      if (e != cudaSuccess) break;
    }
    if (!(skip & kSkipO)) {
      Fuse fo{nullptr, 0.f, xcur, pdl_next(), early, prefetch};
      e = Dispatch<bf16, kResidual>(stream, mo, attn, w8(wo, i, mo), s32(so, i, mo), xo, fo);
      if (e != cudaSuccess) break;
    }
    if (!(skip & kSkipGateUp)) {
      Fuse fg{f32(ffn_norm) + i * d, eps, nullptr, pdl_next(), early, prefetch};
      e = Dispatch<bf16, kNorm | kSwiGLU>(stream, mg, xo, w8(wgu, i, mg), s32(sgu, i, mg), act, fg);
      if (e != cudaSuccess) break;
    }
    if (!(skip & kSkipDown)) {
      Fuse fd{nullptr, 0.f, xo, pdl_next(), early, prefetch};
      e = Dispatch<bf16, kResidual>(stream, md, act, w8(wd, i, md), s32(sd, i, md), xo, fd);
    }
  }
  if (head != 0 && e == cudaSuccess) {   // the final norm and the LM head, a dependent of the last down projection
    Fuse fh{f32(out_norm), eps, nullptr, pdl_next(), early, prefetch};
    e = head == 1 ? Dispatch<bf16, kNorm | kArgmax>(stream, mh, xo, i8(wh), f32(sh), head_out->untyped_data(), fh)
                  : Dispatch<bf16, kNorm>(stream, mh, xo, i8(wh), f32(sh), head_out->untyped_data(), fh);
  }
  if (e != cudaSuccess) return ffi::Error::Internal(name + "launch: " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(DecodeLayersCuda, LayersCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()    // x [B, D] f32
                                  .Arg<ffi::AnyBuffer>()    // pos [B] int32 (RoPE)
                                  .Arg<ffi::AnyBuffer>()    // writes [B] int32 (cache position, >= S: none)
                                  .Arg<ffi::AnyBuffer>()    // lengths [B] int32 (visible keys)
                                  .Arg<ffi::AnyBuffer>()    // inv_freq [Dh / 2] f32
                                  .Arg<ffi::AnyBuffer>()    // attn_norm [L, D]
                                  .Arg<ffi::AnyBuffer>()    // wqkv [L, N, D] int8
                                  .Arg<ffi::AnyBuffer>()    // its scales
                                  .Arg<ffi::AnyBuffer>()    // bqkv [L, N] or [0]
                                  .Arg<ffi::AnyBuffer>()    // q norm [L, Dh] or [0]
                                  .Arg<ffi::AnyBuffer>()    // k norm [L, Dh] or [0]
                                  .Arg<ffi::AnyBuffer>()    // wo [L, D, H Dh]
                                  .Arg<ffi::AnyBuffer>()    // its scales
                                  .Arg<ffi::AnyBuffer>()    // ffn_norm [L, D]
                                  .Arg<ffi::AnyBuffer>()    // w_gate_up [L, 2F, D]
                                  .Arg<ffi::AnyBuffer>()    // its scales
                                  .Arg<ffi::AnyBuffer>()    // w_down [L, D, F]
                                  .Arg<ffi::AnyBuffer>()    // its scales
                                  .Arg<ffi::AnyBuffer>()    // k cache (aliased to result 1)
                                  .Arg<ffi::AnyBuffer>()    // v cache (aliased to result 2)
                                  .Arg<ffi::AnyBuffer>()    // the final norm [D] f32 (head) or [0]
                                  .Arg<ffi::AnyBuffer>()    // the LM head [V, D] int8 or [0, 0]
                                  .Arg<ffi::AnyBuffer>()    // its scales [V, G] f32 or [0, 0]
                                  .Ret<ffi::AnyBuffer>()    // x_out [B, D] f32
                                  .Ret<ffi::AnyBuffer>()    // k cache
                                  .Ret<ffi::AnyBuffer>()    // v cache
                                  .Ret<ffi::AnyBuffer>()    // workspace uint8
                                  .Ret<ffi::AnyBuffer>()    // head: uint32 [B, 4] packed argmax, bf16 [B, V], or [0]
                                  .Attr<int64_t>("heads")
                                  .Attr<int64_t>("kv_heads")
                                  .Attr<int64_t>("neox")
                                  .Attr<float>("pos_scale")
                                  .Attr<float>("eps")
                                  .Attr<int64_t>("splits")
                                  .Attr<int64_t>("pdl")
                                  .Attr<int64_t>("head"),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(W8A16FusedCudaInto, FusedCudaInto, BindFusedInto<ffi::PlatformStream<cudaStream_t>>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(W8A16FusedCuda, FusedCuda, BindFused<ffi::PlatformStream<cudaStream_t>>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(QkvEpilogueCuda, QkvCuda, BindQkv<ffi::PlatformStream<cudaStream_t>>(),
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxllm
