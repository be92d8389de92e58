// Every decode layer of a step in one kernel (the layers call's `launch` 2; docs/kernels.md).
//
// The layers call's chain launches five kernels a layer; each waits for the whole of the one before
// (griddepcontrol.wait) and costs about 4 us on the H200 whatever its bytes. Here the same work runs as one
// persistent kernel: a layer is five stages of work items, each item what one block of the chain's kernel
// did (the same Body functions, so the same bits):
//
//   stage    items                                   reads               writes
//   kQkv     blocks of norm + QKV (w8a16 Body)       x                   qkv
//   kAttn    (split, kv head, sequence) blocks       qkv, caches         caches (new key), attn
//   kO       blocks of O + residual                  attn, x             x
//   kGateUp  blocks of norm + gate/up + SwiGLU       x                   act
//   kDown    blocks of down + residual               act, x              x
//
// Item i of the step (layer-major, stage order within a layer) belongs to block i % grid, and a block takes
// its items in increasing order. Before reading what the previous stage wrote, an item waits until that
// stage's counter reaches its item count (w8a16::WaitFor: thread 0 polls with acquire loads); every item
// adds 1 to its own stage's counter once its outputs are written (w8a16::Signal). The weight loads of an
// item are issued before its wait, so they overlap the stages still running, as far ahead as blocks are
// free: a block that reaches a later layer's item streams its weights while earlier stages finish.
//
// No deadlock: the grid is at most what the GPU holds at once (every block resident), an item depends only
// on items of earlier stages, and every block finishes its earlier-stage items before waiting on a later
// one. Replay-safe: the counters are zeroed by a memset before each launch. Activations written inside the
// kernel are read through L2 (kCoherent; never the read-only path, which is not kept coherent).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>

#include "attention_cuda.cuh"
#include "qkv_cuda.cuh"
#include "w8a16_cuda.cuh"

namespace jaxllm {
namespace layers1 {

enum Stage { kQkv, kAttn, kO, kGateUp, kDown, kStages };
constexpr int kCounterStride = 32;   // int32 between counters: one 128-byte line each
constexpr int kMinBlocksPerSm = 3;   // register budget: 80 a thread, so at least 3 blocks of 256 per SM
constexpr int kMaxHeadsPerKv = w8a16::kThreads / 32;   // an attention item's warps: one per query head

// A stacked W8A16 matrix [L, N, K] and its scales [L, N, groups].
struct Mat {
  const int8_t* w = nullptr;
  const float* s = nullptr;
  int n = 0, k = 0, groups = 0;
  uint32_t chunk_div = 0;
  __host__ __device__ const int8_t* W(int layer) const { return w + size_t(layer) * n * k; }
  __host__ __device__ const float* S(int layer) const { return s + size_t(layer) * n * groups; }
};

struct Params {
  const float* x_in = nullptr;   // [1, D] the first layer's residual input
  float* x = nullptr;            // [1, D] the residual stream (out)
  __nv_bfloat16 *qkv = nullptr, *attn = nullptr, *act = nullptr;   // workspace: [N], [H Dh], [F]
  float* ws = nullptr;             // attention partials [1, H, P, Dh + 2]
  int32_t* tickets = nullptr;      // attention tickets [1, G] (zero)
  int32_t* done = nullptr;         // [L, kStages] counters, kCounterStride apart (zero)
  const float *attn_norm = nullptr, *ffn_norm = nullptr;   // [L, D]
  const float *bqkv = nullptr, *qn = nullptr, *kn = nullptr;   // [L, N], [L, Dh], [L, Dh] or null
  Mat qkv_w, o_w, gu_w, down_w;
  qkv::Args pa;                    // the attention's prologue (per-layer fields set per item)
  const int32_t* lengths = nullptr;
  int layers = 0, d = 0, h = 0, g = 0, s = 0, splits = 0;
  float eps = 0.f;
  int items[kStages] = {};         // work items per stage of a layer
  int per_layer = 0;
  unsigned sleep_ns = 128;         // between a wait's polls (JAXLLM_ONE_KERNEL_SLEEP)
  bool nosync = false;             // JAXLLM_ONE_KERNEL_NOSYNC=1: no waits (wrong results; the time without them)
};

__device__ __forceinline__ int32_t* Counter(const Params& p, int layer, int stage) {
  return p.done + (size_t(layer) * kStages + stage) * kCounterStride;
}

// One configuration's item, not inlined: each stage's configurations are chosen at run time, and inlined
// side by side they took the kernel to 127-153 registers where each alone needs at most 84.
template <typename K>
__device__ __noinline__ void MatBody(int j, int nitems, const void* x, const int8_t* w, const float* s, void* y,
                                     int n, int k, int groups, uint32_t chunk_div, w8a16::Fuse fu) {
  w8a16::Body<__nv_bfloat16, K::MT, K::TPR, K::ROWS, K::U, K::C, K::F>(j, nitems, 0, x, w, s, y, 1, n, k, groups,
                                                                        chunk_div, fu);
}

// One matmul stage's item j: EX the stage's fusions (kCoherent added), the configuration the chain's
// Dispatch takes for one row of x.
template <unsigned EX>
__device__ __forceinline__ void MatItem(int j, int nitems, const Mat& m, int layer, const void* x, void* y,
                                        const w8a16::Fuse& fu) {
  w8a16::ChooseRow<__nv_bfloat16, EX | w8a16::kCoherent>(m.n, m.k, [&](auto c) {
    MatBody<decltype(c)>(j, nitems, x, m.W(layer), m.S(layer), y, m.n, m.k, m.groups, m.chunk_div, fu);
  });
}

// The attention item (split, kv head) of the one sequence, not inlined either (its tile takes 64 registers).
template <int D>
__device__ __noinline__ void AttnBody(int split, int kv, const int32_t* lengths, float* ws, __nv_bfloat16* out,
                                      int32_t* tickets, int layer, int h, int g, int s, int splits, qkv::Args pa,
                                      w8a16::Dep dep) {
  using bf16 = __nv_bfloat16;
  attn1::Body<bf16, D, true>(split, kv, 0, nullptr, static_cast<const bf16*>(pa.kc), static_cast<const bf16*>(pa.vc),
                             lengths, ws, out, tickets, layer, 1, h, g, s, splits, 1, pa, dep);
}

template <int D>
__global__ void __launch_bounds__(w8a16::kThreads, kMinBlocksPerSm) Kernel(Params p) {
  using namespace w8a16;
  const int total = p.per_layer * p.layers;
  for (int it = blockIdx.x; it < total; it += gridDim.x) {
    const int layer = it / p.per_layer;
    int j = it - layer * p.per_layer, stage = 0;
    while (j >= p.items[stage]) j -= p.items[stage++];
    // What this item reads was written by the previous stage (for kQkv: the previous layer's down).
    Dep dep;
    if (stage > 0) dep = {Counter(p, layer, stage - 1), p.items[stage - 1], p.sleep_ns};
    else if (layer > 0) dep = {Counter(p, layer - 1, kDown), p.items[kDown], p.sleep_ns};
    if (p.nosync) dep.on = nullptr;
    const float* xcur = layer == 0 ? p.x_in : p.x;
    switch (stage) {
      case kQkv: {
        Fuse fu;
        fu.norm_w = p.attn_norm + size_t(layer) * p.d;
        fu.eps = p.eps;
        fu.dep = dep;
        MatItem<kNorm>(j, p.items[kQkv], p.qkv_w, layer, xcur, p.qkv, fu);
        break;
      }
      case kAttn: {
        const int n = p.qkv_w.n, dh = D;
        qkv::Args pa = p.pa;
        pa.bias = p.bqkv ? p.bqkv + size_t(layer) * n : nullptr;
        pa.qn = p.qn ? p.qn + size_t(layer) * dh : nullptr;
        pa.kn = p.kn ? p.kn + size_t(layer) * dh : nullptr;
        pa.layer = layer;
        AttnBody<D>(j % p.splits, j / p.splits, p.lengths, p.ws, p.attn, p.tickets, layer, p.h, p.g, p.s, p.splits, pa,
                    dep);
        break;
      }
      case kO: {
        Fuse fu;
        fu.res = xcur;
        fu.dep = dep;
        MatItem<kResidual>(j, p.items[kO], p.o_w, layer, p.attn, p.x, fu);
        break;
      }
      case kGateUp: {
        Fuse fu;
        fu.norm_w = p.ffn_norm + size_t(layer) * p.d;
        fu.eps = p.eps;
        fu.dep = dep;
        MatItem<kNorm | kSwiGLU>(j, p.items[kGateUp], p.gu_w, layer, p.x, p.act, fu);
        break;
      }
      default: {
        Fuse fu;
        fu.res = p.x;
        fu.dep = dep;
        MatItem<kResidual>(j, p.items[kDown], p.down_w, layer, p.act, p.x, fu);
        break;
      }
    }
    if (!p.nosync) Signal(Counter(p, layer, stage));
    else __syncthreads();
  }
}

// Blocks of a matmul stage: the chain's grid for this shape (kBalance: a whole number of blocks per SM).
template <unsigned EX>
inline int MatItems(const Mat& m, int sms) {
  return w8a16::ChooseRow<__nv_bfloat16, EX>(m.n, m.k, [&](auto c) {
    using K = decltype(c);
    int blocks = (m.n + K::kRowsPerBlock - 1) / K::kRowsPerBlock;
    if constexpr ((K::F & w8a16::kBalance) != 0)
      blocks = std::min((blocks + sms - 1) / sms * sms, (EX & w8a16::kSwiGLU) ? m.n / 2 : m.n);
    return blocks;
  });
}

// Whether the one-kernel form takes this geometry (else the chain runs): one sequence, a kv head's query
// heads within one item's warps.
inline bool Supported(int b, int h, int g, int dh) {
  return b == 1 && h % g == 0 && h / g <= kMaxHeadsPerKv && (dh == 64 || dh == 128);
}

// Dynamic shared memory of an item: the largest staging of x (norm, or int16 chunks) of the two norm stages.
inline size_t SharedBytes(int d) {
  return std::max(w8a16::NormStageBytes<__nv_bfloat16>(1, d), w8a16::XStageBytes(1, d));
}

// Fills the item counts and launches (the counters already zeroed on the stream).
template <int D>
cudaError_t Launch(cudaStream_t stream, Params p) {
  auto kernel = Kernel<D>;
  const size_t smem = SharedBytes(p.d);
  w8a16::Residency res;
  if (cudaError_t e = w8a16::ResidencyOf(reinterpret_cast<const void*>(kernel), smem, &res); e != cudaSuccess) return e;
  p.items[kQkv] = MatItems<w8a16::kNorm>(p.qkv_w, res.sms);
  p.items[kAttn] = p.splits * p.g;
  p.items[kO] = MatItems<w8a16::kResidual>(p.o_w, res.sms);
  p.items[kGateUp] = MatItems<w8a16::kNorm | w8a16::kSwiGLU>(p.gu_w, res.sms);
  p.items[kDown] = MatItems<w8a16::kResidual>(p.down_w, res.sms);
  p.per_layer = 0;
  for (int i = 0; i < kStages; ++i) p.per_layer += p.items[i];
  const int total = p.per_layer * p.layers;
  const int grid = std::min(total, res.sms * res.per_sm);   // every block resident at once
  static const char* sleep_env = std::getenv("JAXLLM_ONE_KERNEL_SLEEP");
  if (sleep_env && *sleep_env) p.sleep_ns = unsigned(std::atoi(sleep_env));
  p.nosync = EnvFlag("JAXLLM_ONE_KERNEL_NOSYNC", false);
  kernel<<<grid, w8a16::kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace layers1
}  // namespace jaxllm
