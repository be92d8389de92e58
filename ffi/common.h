// Shared by the CPU and CUDA handlers: shape checks that turn bad input into ffi::Error.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxllm {

namespace ffi = xla::ffi;

// Lab switches: the knobs of past experiments (JAXLLM_PDL_EARLY, JAXLLM_LAYERS_SKIP, ...; docs/benchmarks.md),
// read from the environment only in a lab build (cmake -DJAXLLM_LAB=ON, for bench/). A release build sees
// every one unset: each takes its default, and the compiler folds the other branches away.
#ifdef JAXLLM_LAB
inline const char* LabEnv(const char* name) { return std::getenv(name); }
#else
constexpr const char* LabEnv(const char*) { return nullptr; }
#endif

// An on/off lab switch: unset or empty gives dflt, a value starting with '0' off, else on.
inline bool LabFlag(const char* name, bool dflt) {
  const char* v = LabEnv(name);
  return v == nullptr || v[0] == '\0' ? dflt : v[0] != '0';
}

// An output XLA aliases to an input (input_output_aliases: the caches, the attention's counters) is updated in
// place: the kernels write only what changes. Where a handler is given that output as a buffer of its own (its
// address differs from the input's), it copies the input into it first, so that the result never rests on XLA
// keeping the alias. AliasCopy() is that copy's switch, off only by the lab switch JAXLLM_ALIAS_COPY=0 (to see
// what a broken alias does).
inline bool AliasCopy() {
  static const bool on = LabFlag("JAXLLM_ALIAS_COPY", true);
  return on;
}

// Whether the handler must copy `in` into its aliased output `out` (they differ, and the switch is on).
inline bool AliasBroken(const ffi::AnyBuffer& in, const ffi::AnyBuffer& out) {
  return AliasCopy() && in.untyped_data() != out.untyped_data() && out.size_bytes() > 0;
}

// The host handlers' copy: the input into its aliased output, where they differ.
inline void HoldAliasHost(const ffi::AnyBuffer& in, ffi::AnyBuffer& out) {
  if (AliasBroken(in, out)) std::memcpy(out.untyped_data(), in.untyped_data(), out.size_bytes());
}

#ifdef __CUDACC__
// The CUDA handlers' copy, on the stream (a command buffer records it as a copy node).
inline cudaError_t HoldAlias(cudaStream_t stream, const ffi::AnyBuffer& in, ffi::AnyBuffer& out) {
  if (!AliasBroken(in, out)) return cudaSuccess;
  return cudaMemcpyAsync(out.untyped_data(), in.untyped_data(), out.size_bytes(), cudaMemcpyDeviceToDevice, stream);
}
#endif

inline std::string DimsString(ffi::AnyBuffer::Dimensions d) {
  std::string s = "[";
  for (size_t i = 0; i < d.size(); ++i) s += (i ? ", " : "") + std::to_string(d[i]);
  return s + "]";
}

// Geometry of one W8A16 matmul call, validated.
struct MatmulShape {
  int64_t m, n, k, groups, group, layer;
};

// x [M, K] (f32 | bf16), w [L, N, K] s8, scale [L, N, G] f32, y [M, N] (x's dtype).
inline ffi::Error CheckMatmul(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w, const ffi::AnyBuffer& scale,
                              const ffi::AnyBuffer& y, int64_t layer, MatmulShape* out) {
  auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions(), yd = y.dimensions();
  if (x.element_type() != ffi::F32 && x.element_type() != ffi::BF16)
    return ffi::Error::InvalidArgument("jaxllm_w8a16: x must be f32 or bf16");
  if (y.element_type() != x.element_type())
    return ffi::Error::InvalidArgument("jaxllm_w8a16: y must have x's dtype");
  if (w.element_type() != ffi::S8 || scale.element_type() != ffi::F32)
    return ffi::Error::InvalidArgument("jaxllm_w8a16: w must be int8 and scale float32");
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 3 || yd.size() != 2)
    return ffi::Error::InvalidArgument("jaxllm_w8a16: expected x [M, K], w [L, N, K], scale [L, N, G], y [M, N]; got x " +
                                       DimsString(xd) + ", w " + DimsString(wd) + ", scale " + DimsString(sd) +
                                       ", y " + DimsString(yd));
  MatmulShape s{xd[0], wd[1], wd[2], sd[2], 0, layer};
  if (xd[1] != s.k || sd[0] != wd[0] || sd[1] != s.n || yd[0] != s.m || yd[1] != s.n || s.k < 1 ||
      s.groups < 1 || s.k % s.groups)
    return ffi::Error::InvalidArgument("jaxllm_w8a16: inconsistent shapes x " + DimsString(xd) + ", w " +
                                       DimsString(wd) + ", scale " + DimsString(sd) + ", y " + DimsString(yd));
  s.group = s.k / s.groups;
  if (s.group % 16)
    return ffi::Error::InvalidArgument("jaxllm_w8a16: the scale group (K / G = " + std::to_string(s.group) +
                                       ") must be a multiple of 16");
  if (layer < 0 || layer >= wd[0])
    return ffi::Error::InvalidArgument("jaxllm_w8a16: layer " + std::to_string(layer) + " out of range [0, " +
                                       std::to_string(wd[0]) + ")");
  *out = s;
  return ffi::Error::Success();
}

// Unless the caches kd [L, N, G, S, Dh] hold at least the B rows of the call's `what` (dims wd, B first): an error
// (prefixed by `name`) naming both shapes. The decode kernels read and write rows [0, B) of a cache of N >= B rows.
inline ffi::Error CheckCacheRows(const std::string& name, const char* what, ffi::AnyBuffer::Dimensions wd,
                                 ffi::AnyBuffer::Dimensions kd) {
  if (kd[1] >= wd[0]) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(name + "the caches [L, N, G, S, Dh] need at least the B = " +
                                     std::to_string(wd[0]) + " rows of " + what + " (N >= B); got " + what + " " +
                                     DimsString(wd) + ", caches " + DimsString(kd));
}

// Geometry of one decode-attention call, validated. The caches may hold more rows than the call's batch (a
// server's N slots, a step on the first B of them): b is the batch (q, lengths, out), n the caches' rows, which
// give their strides (a layer is n * g * s * d elements); the call reads rows [0, b).
struct AttentionShape {
  int64_t b, h, g, s, d, layer, layers, n;
};

// q [B, H, Dh], k/v [L, N, G, S, Dh] with N >= B (q's dtype), lengths [B] s32, out [B, H, Dh].
inline ffi::Error CheckAttention(const ffi::AnyBuffer& q, const ffi::AnyBuffer& k, const ffi::AnyBuffer& v,
                                 const ffi::AnyBuffer& lengths, const ffi::AnyBuffer& out, int64_t layer,
                                 AttentionShape* shape) {
  auto qd = q.dimensions(), kd = k.dimensions(), vd = v.dimensions(), ld = lengths.dimensions();
  auto float_type = [](ffi::DataType t) { return t == ffi::F32 || t == ffi::BF16; };
  if (!float_type(q.element_type()) || !float_type(k.element_type()))
    return ffi::Error::InvalidArgument("jaxllm_decode_attention: q and caches must be f32 or bf16");
  if (v.element_type() != k.element_type() || out.element_type() != q.element_type())
    return ffi::Error::InvalidArgument("jaxllm_decode_attention: k and v caches must share a dtype, and the "
                                       "output must have q's");
  if (lengths.element_type() != ffi::S32)
    return ffi::Error::InvalidArgument("jaxllm_decode_attention: lengths must be int32");
  if (qd.size() != 3 || kd.size() != 5 || vd.size() != 5 || ld.size() != 1)
    return ffi::Error::InvalidArgument("jaxllm_decode_attention: expected q [B, H, Dh], caches [L, N, G, S, Dh] "
                                       "(N >= B), lengths [B]; got q " + DimsString(qd) + ", k " + DimsString(kd) +
                                       ", v " + DimsString(vd) + ", lengths " + DimsString(ld));
  AttentionShape s{qd[0], qd[1], kd[2], kd[3], qd[2], layer, kd[0], kd[1]};
  for (int i = 0; i < 5; ++i)
    if (kd[i] != vd[i]) return ffi::Error::InvalidArgument("jaxllm_decode_attention: k and v caches differ in shape");
  if (auto err = CheckCacheRows("jaxllm_decode_attention: ", "q", qd, kd); err.failure()) return err;
  if (kd[4] != s.d || ld[0] != s.b || s.g < 1 || s.h % s.g)
    return ffi::Error::InvalidArgument("jaxllm_decode_attention: inconsistent shapes q " + DimsString(qd) + ", k " +
                                       DimsString(kd) + ", lengths " + DimsString(ld));
  if (layer < 0 || layer >= s.layers)
    return ffi::Error::InvalidArgument("jaxllm_decode_attention: layer " + std::to_string(layer) +
                                       " out of range");
  *shape = s;
  return ffi::Error::Success();
}

// The handlers' signatures, shared by the CPU and CUDA handlers; Ctx is the backend's context
// (ffi::ThreadPool on the CPU, the CUDA stream on the GPU). The "Into" variants, for tests, take one more
// argument: a poisoned buffer that the caller aliases to the first result, so unwritten outputs show.
template <typename Ctx>
auto BindW8A16() {
  return ffi::Ffi::Bind()
      .template Ctx<Ctx>()                 // backend context
      .template Arg<ffi::AnyBuffer>()      // x [M, K] f32|bf16
      .template Arg<ffi::AnyBuffer>()      // w [L, N, K] int8
      .template Arg<ffi::AnyBuffer>();     // scale [L, N, G] f32
}

template <typename Binding>
auto FinishW8A16(Binding b) {
  return std::move(b).template Ret<ffi::AnyBuffer>()   // y [M, N] x's dtype
      .template Attr<int64_t>("layer")        // which of the L stacked weights
      .template Attr<int64_t>("mma");         // GPU, 5 or more rows of bf16 x: w8a16_mma.cuh's kCandidates index, -1
                                              // its rule (jaxllm.tuning; the CPU handler ignores it)
}

template <typename Ctx>
auto BindAttention() {
  return ffi::Ffi::Bind()
      .template Ctx<Ctx>()                 // backend context
      .template Arg<ffi::AnyBuffer>()      // q [B, H, Dh]
      .template Arg<ffi::AnyBuffer>()      // k cache [L, N, G, S, Dh], N >= B (rows [0, B) read)
      .template Arg<ffi::AnyBuffer>()      // v cache [L, N, G, S, Dh]
      .template Arg<ffi::AnyBuffer>();     // lengths [B] int32 (visible), read on the device
}

template <typename Binding>
auto FinishAttention(Binding b) {
  return std::move(b).template Ret<ffi::AnyBuffer>()   // out [B, H, Dh]
      .template Ret<ffi::AnyBuffer>()          // workspace [B, H, P, Dh + 2] f32 (CUDA splits)
      .template Attr<int64_t>("layer");       // which layer of the cache
}

// The one-kernel decode attention: the attention's arguments, then counters [B, G] int32 (zero on entry,
// aliased to the third result); results out, workspace and the counters.
template <typename Binding>
auto BindMergedAttention(Binding b) {
  return std::move(b).template Arg<ffi::AnyBuffer>()   // counters [B, G] int32
      .template Ret<ffi::AnyBuffer>()          // out [B, H, Dh]
      .template Ret<ffi::AnyBuffer>()          // workspace [B, H, P, Dh + 2] f32
      .template Ret<ffi::AnyBuffer>()          // counters (the argument's buffer)
      .template Attr<int64_t>("layer");
}

// ---- the fused decode-step ops (jaxllm/kernels/fused.py) ------------------------------------------------

// What jaxllm_w8a16_fused computes (the `mode` attribute).
enum FusedMode : int64_t {
  kModeNorm = 0,      // y [M, N] T = rms_norm(x f32 [M, K], aux[layer] [K]) . w^T
  kModeNormSwiGLU = 1,// y [M, N / 2] T = silu(gate) * up of the same, w = [gate; up]
  kModeNormArgmax = 2,// y [M, 4] uint32: the greedy token of the same, packed (see w8a16_cuda.cuh kArgmax)
  kModeResidual = 3,  // y [M, N] f32 = aux [M, N] f32 + T(x [M, K] T . w^T)
};

// Validates a fused call; T (bf16 or f32) is the activation dtype: y's for norm modes 0/1, x's for residual,
// the `bf16` attribute's for the argmax. *out gets the matmul geometry (M, N weight rows, K, groups).
inline ffi::Error CheckFused(const ffi::AnyBuffer& x, const ffi::AnyBuffer& w, const ffi::AnyBuffer& scale,
                             const ffi::AnyBuffer& aux, const ffi::AnyBuffer& y, int64_t layer, int64_t norm_layer,
                             int64_t mode, bool bf16, MatmulShape* out) {
  const std::string name = "jaxllm_w8a16_fused: ";
  auto xd = x.dimensions(), wd = w.dimensions(), sd = scale.dimensions(), ad = aux.dimensions(), yd = y.dimensions();
  const ffi::DataType t = bf16 ? ffi::BF16 : ffi::F32;
  if (mode < 0 || mode > 3) return ffi::Error::InvalidArgument(name + "mode must be 0..3, got " + std::to_string(mode));
  if (w.element_type() != ffi::S8 || scale.element_type() != ffi::F32 || aux.element_type() != ffi::F32)
    return ffi::Error::InvalidArgument(name + "w must be int8, scale and aux float32");
  if (xd.size() != 2 || wd.size() != 3 || sd.size() != 3 || yd.size() != 2 || ad.size() != 2)
    return ffi::Error::InvalidArgument(name + "expected x [M, K], w [L, N, K], scale [L, N, G], aux 2-d, y [M, *]; got x " +
                                       DimsString(xd) + ", w " + DimsString(wd) + ", aux " + DimsString(ad) + ", y " +
                                       DimsString(yd));
  MatmulShape s{xd[0], wd[1], wd[2], sd[2], 0, layer};
  if (xd[1] != s.k || sd[0] != wd[0] || sd[1] != s.n || yd[0] != s.m || s.k < 1 || s.groups < 1 || s.k % s.groups ||
      (s.k / s.groups) % 16)
    return ffi::Error::InvalidArgument(name + "inconsistent shapes x " + DimsString(xd) + ", w " + DimsString(wd) +
                                       ", scale " + DimsString(sd));
  if (layer < 0 || layer >= wd[0])
    return ffi::Error::InvalidArgument(name + "layer " + std::to_string(layer) + " out of range");
  s.group = s.k / s.groups;
  const bool norm = mode != kModeResidual;
  if (norm) {
    if (x.element_type() != ffi::F32 || ad[1] != s.k || norm_layer < 0 || norm_layer >= ad[0])
      return ffi::Error::InvalidArgument(name + "the norm modes take x f32 and norm weights [L, K] with norm_layer < L; "
                                         "got aux " + DimsString(ad) + ", norm_layer " + std::to_string(norm_layer));
  } else if (x.element_type() != t || ad[0] != s.m || ad[1] != s.n) {
    return ffi::Error::InvalidArgument(name + "the residual mode takes x in the activation dtype and aux [M, N] f32; "
                                       "got aux " + DimsString(ad));
  }
  const int64_t y_cols = mode == kModeNormSwiGLU ? s.n / 2 : mode == kModeNormArgmax ? 4 : s.n;
  const ffi::DataType y_type = mode == kModeNormArgmax ? ffi::U32 : mode == kModeResidual ? ffi::F32 : t;
  if ((mode == kModeNormSwiGLU && s.n % 2) || yd[1] != y_cols || y.element_type() != y_type)
    return ffi::Error::InvalidArgument(name + "y has the wrong shape or dtype for mode " + std::to_string(mode) + ": " +
                                       DimsString(yd));
  *out = s;
  return ffi::Error::Success();
}

template <typename Ctx>
auto BindFusedArgs() {
  return ffi::Ffi::Bind()
      .template Ctx<Ctx>()
      .template Arg<ffi::AnyBuffer>()      // x [M, K]: f32 residual (norm modes) or activations (residual mode)
      .template Arg<ffi::AnyBuffer>()      // w [L, N, K] int8
      .template Arg<ffi::AnyBuffer>()      // scale [L, N, G] f32
      .template Arg<ffi::AnyBuffer>();     // aux: norm weights [L', K] f32 (norm modes) or residual [M, N] f32
}

template <typename Binding>
auto FinishFused(Binding b) {
  return std::move(b).template Ret<ffi::AnyBuffer>()   // y (see FusedMode)
      .template Attr<int64_t>("layer")     // which of the stacked weights (and norm weights)
      .template Attr<int64_t>("norm_layer")// which row of the norm weights
      .template Attr<int64_t>("mode")
      .template Attr<int64_t>("bf16")      // 1: activation dtype bf16 (0: f32)
      .template Attr<float>("eps");
}

template <typename Ctx>
auto BindFused() { return FinishFused(BindFusedArgs<Ctx>()); }
// The test variant: one more argument, a poisoned buffer aliased to y.
template <typename Ctx>
auto BindFusedInto() { return FinishFused(BindFusedArgs<Ctx>().template Arg<ffi::AnyBuffer>()); }

// Geometry of one QKV epilogue call, validated: b the batch, n the caches' rows (n >= b: their strides; the call
// writes rows [0, b), as AttentionShape).
struct QkvShape {
  int64_t b, h, g, d, s, layers, nqkv, n;
};

// qkv [B, (H + 2G) Dh] T; bias [L, (H + 2G) Dh] or [0] f32; q/k norm [L, Dh] or [0] f32; inv_freq [Dh/2] f32;
// pos, writes [B] int32; caches [L, N, G, S, Dh] T with N >= B; q out [B, H, Dh] T; counters out [B, G] int32.
inline ffi::Error CheckQkv(const ffi::AnyBuffer& qkv, const ffi::AnyBuffer& bias, const ffi::AnyBuffer& qn,
                           const ffi::AnyBuffer& kn, const ffi::AnyBuffer& inv_freq, const ffi::AnyBuffer& pos,
                           const ffi::AnyBuffer& writes, const ffi::AnyBuffer& kc, const ffi::AnyBuffer& vc,
                           const ffi::AnyBuffer& q_out, const ffi::AnyBuffer& counters, int64_t layer,
                           QkvShape* out) {
  const std::string name = "jaxllm_qkv_epilogue: ";
  auto qd = qkv.dimensions(), kd = kc.dimensions(), od = q_out.dimensions(), cd = counters.dimensions();
  const ffi::DataType t = qkv.element_type();
  if ((t != ffi::F32 && t != ffi::BF16) || kc.element_type() != t || vc.element_type() != t ||
      q_out.element_type() != t)
    return ffi::Error::InvalidArgument(name + "qkv, the caches and q must share one dtype, f32 or bf16");
  if (qd.size() != 2 || kd.size() != 5 || od.size() != 3 || cd.size() != 2)
    return ffi::Error::InvalidArgument(name + "expected qkv [B, (H + 2G) Dh], caches [L, N, G, S, Dh] (N >= B), q "
                                       "[B, H, Dh], counters [B, G]; got qkv " + DimsString(qd) + ", k " +
                                       DimsString(kd) + ", q " + DimsString(od) + ", counters " + DimsString(cd));
  QkvShape s{qd[0], od[1], kd[2], kd[4], kd[3], kd[0], qd[1], kd[1]};
  for (int i = 0; i < 5; ++i)
    if (kd[i] != vc.dimensions()[i]) return ffi::Error::InvalidArgument(name + "k and v caches differ in shape");
  if (auto err = CheckCacheRows(name, "qkv", qd, kd); err.failure()) return err;
  if (od[0] != s.b || od[2] != s.d || s.g < 1 || s.h % s.g || s.nqkv != (s.h + 2 * s.g) * s.d ||
      cd[0] != s.b || cd[1] != s.g || counters.element_type() != ffi::S32 || s.d % 2 || s.d > 256)
    return ffi::Error::InvalidArgument(name + "inconsistent shapes qkv " + DimsString(qd) + ", caches " +
                                       DimsString(kd) + ", q " + DimsString(od) + ", counters " + DimsString(cd));
  if (layer < 0 || layer >= s.layers)
    return ffi::Error::InvalidArgument(name + "layer " + std::to_string(layer) + " out of range");
  auto f32_rows = [&](const ffi::AnyBuffer& a, int64_t cols) {
    auto d = a.dimensions();
    return a.element_type() == ffi::F32 &&
           ((d.size() == 1 && d[0] == 0) || (d.size() == 2 && d[1] == cols && layer < d[0]));
  };
  if (!f32_rows(bias, s.nqkv) || !f32_rows(qn, s.d) || !f32_rows(kn, s.d))
    return ffi::Error::InvalidArgument(name + "bias must be f32 [L, N] and q/k norms f32 [L, Dh] (or [0] for none)");
  if ((qn.dimensions().size() == 1) != (kn.dimensions().size() == 1))
    return ffi::Error::InvalidArgument(name + "q and k norms come together");
  if (inv_freq.element_type() != ffi::F32 || inv_freq.dimensions().size() != 1 || inv_freq.dimensions()[0] != s.d / 2)
    return ffi::Error::InvalidArgument(name + "inv_freq must be f32 [Dh / 2]");
  for (const ffi::AnyBuffer* a : {&pos, &writes})
    if (a->element_type() != ffi::S32 || a->dimensions().size() != 1 || a->dimensions()[0] != s.b)
      return ffi::Error::InvalidArgument(name + "pos and writes must be int32 [B]");
  *out = s;
  return ffi::Error::Success();
}

// Row `layer` of an optional stacked f32 operand [L, cols] (nullptr for the [0] that means none).
inline const float* LayerRow(const ffi::AnyBuffer& a, int64_t layer, int64_t cols) {
  return a.dimensions().size() == 1 ? nullptr : static_cast<const float*>(a.untyped_data()) + layer * cols;
}

template <typename Ctx>
auto BindQkv() {
  return ffi::Ffi::Bind()
      .template Ctx<Ctx>()
      .template Arg<ffi::AnyBuffer>()      // qkv [B, (H + 2G) Dh]
      .template Arg<ffi::AnyBuffer>()      // bias [L, N] f32 or [0]
      .template Arg<ffi::AnyBuffer>()      // q norm [L, Dh] f32 or [0]
      .template Arg<ffi::AnyBuffer>()      // k norm [L, Dh] f32 or [0]
      .template Arg<ffi::AnyBuffer>()      // inv_freq [Dh / 2] f32
      .template Arg<ffi::AnyBuffer>()      // pos [B] int32: the RoPE position
      .template Arg<ffi::AnyBuffer>()      // writes [B] int32: the cache position (>= S: not written)
      .template Arg<ffi::AnyBuffer>()      // k cache [L, N, G, S, Dh], N >= B (rows [0, B) written): result 1
      .template Arg<ffi::AnyBuffer>()      // v cache, aliased to result 2
      .template Ret<ffi::AnyBuffer>()      // q [B, H, Dh], rotated
      .template Ret<ffi::AnyBuffer>()      // k cache
      .template Ret<ffi::AnyBuffer>()      // v cache
      .template Ret<ffi::AnyBuffer>()      // counters [B, G] int32, zeroed (for the one-kernel attention)
      .template Attr<int64_t>("layer")
      .template Attr<int64_t>("neox")      // 1: RoPE pairs (i, i + Dh/2), else (2i, 2i + 1)
      .template Attr<float>("pos_scale")   // positions are divided by it (linear RoPE scaling; 1 for none)
      .template Attr<float>("eps");
}

}  // namespace jaxllm
