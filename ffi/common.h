// Shared by the CPU and CUDA handlers: shape checks that turn bad input into ffi::Error.
#pragma once

#include <cstdint>
#include <string>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace jaxllm {

namespace ffi = xla::ffi;

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

// Geometry of one decode-attention call, validated.
struct AttentionShape {
  int64_t b, h, g, s, d, layer, layers;
};

// q [B, H, Dh], k/v [L, B, G, S, Dh] (q's dtype), lengths [B] s32, out [B, H, Dh].
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
    return ffi::Error::InvalidArgument("jaxllm_decode_attention: expected q [B, H, Dh], caches [L, B, G, S, Dh], "
                                       "lengths [B]; got q " + DimsString(qd) + ", k " + DimsString(kd));
  AttentionShape s{qd[0], qd[1], kd[2], kd[3], qd[2], layer, kd[0]};
  for (int i = 0; i < 5; ++i)
    if (kd[i] != vd[i]) return ffi::Error::InvalidArgument("jaxllm_decode_attention: k and v caches differ in shape");
  if (kd[1] != s.b || kd[4] != s.d || ld[0] != s.b || s.g < 1 || s.h % s.g)
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
      .template Attr<int64_t>("layer");       // which of the L stacked weights
}

template <typename Ctx>
auto BindAttention() {
  return ffi::Ffi::Bind()
      .template Ctx<Ctx>()                 // backend context
      .template Arg<ffi::AnyBuffer>()      // q [B, H, Dh]
      .template Arg<ffi::AnyBuffer>()      // k cache [L, B, G, S, Dh]
      .template Arg<ffi::AnyBuffer>()      // v cache [L, B, G, S, Dh]
      .template Arg<ffi::AnyBuffer>();     // lengths [B] int32 (visible), read on the device
}

template <typename Binding>
auto FinishAttention(Binding b) {
  return std::move(b).template Ret<ffi::AnyBuffer>()   // out [B, H, Dh]
      .template Ret<ffi::AnyBuffer>()          // workspace [B, H, P, Dh + 2] f32 (CUDA splits)
      .template Attr<int64_t>("layer");       // which layer of the cache
}

}  // namespace jaxllm
