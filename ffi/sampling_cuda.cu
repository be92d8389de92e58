// The sampler's candidates on the GPU (jaxllm_top_candidates): the K largest logits of each row and their ids,
// descending, exactly what jaxllm.sampling.top_candidates (lax.top_k twice) gives, without XLA's sorts (its
// TopK kernel takes k <= 16; k = 128 becomes a sort of the 16384 candidates, tens of microseconds a step).
//
// Each value is a 64-bit key, (order-preserving bits of the value) << 32 | ~index, so that keys are distinct
// and order as top_k does: larger value first, then the lower index (-0.0 counts as +0.0).
//   1. BlockMax (all SMs): the key of each block of 128 logits' maximum, with the block's ~index below it:
//      ws [B, 2n] uint32 (n uint64 keys).
//   2. Select, one block of 1024 threads per row: the K blocks with the largest keys hold the top K values
//      (a block whose maximum ranks below K holds nothing that does); a radix select (rounds of 8 bits,
//      shared-memory histograms, stopping once the digits chosen separate exactly K keys) finds a bound for
//      the K-th largest block key, the K blocks at or above it are kept, the same select over those of their
//      K x 128 values that reach the K-th block maximum finds the K-th largest value key, and each of the K
//      keys at or above it is written at its rank (the number of the K keys larger than it).
// Command-buffer compatible: kernels on XLA's stream, nothing allocated, no host read.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "common.h"
#include "w8a16_cuda.cuh"   // OrderedBits

namespace jaxllm {
namespace {

constexpr int kBlock = 128;          // logits per block (jaxllm.sampling.CANDIDATE_BLOCK)
constexpr int kMaxK = 128;           // candidates (jaxllm.sampling.MAX_TOP_K)
constexpr int kThreads = 1024;       // Select's block
constexpr int kMaxBlocks = 8 * kThreads;   // blocks of a row Select holds (8 keys a thread): V <= 1M

// The LM-head argmax's packing (w8a16::OrderedBits of the value, then ~index), with -0.0 counted as +0.0.
__device__ __forceinline__ uint64_t KeyOf(float v, int64_t i) {
  return (uint64_t(w8a16::OrderedBits(v == 0.f ? 0.f : v)) << 32) | uint32_t(~uint32_t(i));
}
__device__ __forceinline__ float ValueOf(uint64_t key) {   // OrderedBits undone

  const uint32_t o = uint32_t(key >> 32);
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}
__device__ __forceinline__ int32_t IndexOf(uint64_t key) { return int32_t(~uint32_t(key)); }

// ws[b, i]: the key of block i's maximum with ~i as its low half (the block's rank among blocks). A warp a block.
// (fmaxf skips NaN: a row with NaN logits samples no token anyway, jaxllm.sampling.NONFINITE.)
__global__ void __launch_bounds__(256) BlockMax(const float* __restrict__ x, uint64_t* __restrict__ ws, int64_t V,
                                                int n) {
  const int lane = threadIdx.x & 31, i = blockIdx.x * 8 + (threadIdx.x >> 5), b = blockIdx.y;
  if (i >= n) return;
  const float* row = x + size_t(b) * V;
  float m = -INFINITY;
#pragma unroll
  for (int j = 0; j < kBlock / 32; ++j) {
    const int64_t e = int64_t(i) * kBlock + j * 32 + lane;
    if (e < V) m = fmaxf(m, row[e]);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  if (lane == 0) ws[size_t(b) * n + i] = KeyOf(m, i);   // the block's index below its maximum
}

struct SelectShared {
  unsigned hist[2][256];   // a round's histogram, and the next one's (cleared meanwhile)
  uint64_t keys[kMaxK];
  int blocks[kMaxK];
  int count;
  int digit[2], rem[2], done[2];
};

// A lower bound of the k-th largest (1-based) of the block's nonzero keys (PER a thread; 0 pads, below every
// real key; at least k real keys) such that exactly k keys are at or above it. Rounds of 8 bits from the top:
// count the keys that match the digits chosen so far by their next digit (warp-aggregated shared atomics:
// the top digits of similar logits are mostly the same), pick the digit where the k-th falls; stop early
// once every key of that digit is among the k (then prefix | digit, the lower bits zero, is the bound).
// Two barriers a round: the histograms alternate, the next one cleared while this one is scanned.
template <int PER>
__device__ uint64_t SelectKth(const uint64_t (&keys)[PER], int k, SelectShared& sh) {
  for (int i = threadIdx.x; i < 256; i += blockDim.x) sh.hist[0][i] = 0;
  __syncthreads();
  uint64_t prefix = 0, mask = 0;
  int rem = k;
  for (int round = 0, shift = 56; shift >= 0; ++round, shift -= 8) {
    const int cur = round & 1;
    unsigned* h = sh.hist[cur];
#pragma unroll
    for (int j = 0; j < PER; ++j) {
      const bool in = keys[j] != 0 && (keys[j] & mask) == prefix;
      const unsigned d = in ? unsigned(keys[j] >> shift) & 255u : 256u;
      const unsigned peers = __match_any_sync(0xffffffffu, d);
      if (in && int(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&h[d], unsigned(__popc(peers)));
    }
    __syncthreads();
    if (threadIdx.x < 32) {
      // Lane l holds digits 255 - 8l ... 248 - 8l (the largest first).
      const int lane = threadIdx.x;
      unsigned c[8], s = 0;
#pragma unroll
      for (int t = 0; t < 8; ++t) { c[t] = h[255 - 8 * lane - t]; s += c[t]; }
      unsigned incl = s;
#pragma unroll
      for (int off = 1; off < 32; off <<= 1) {
        const unsigned o = __shfl_up_sync(0xffffffffu, incl, off);
        if (lane >= off) incl += o;
      }
      unsigned before = incl - s;   // keys in larger digits than this lane's
      if (before < unsigned(rem) && unsigned(rem) <= incl) {
#pragma unroll
        for (int t = 0; t < 8; ++t) {
          if (before + c[t] >= unsigned(rem)) {
            sh.digit[cur] = 255 - 8 * lane - t;
            sh.rem[cur] = rem - int(before);
            sh.done[cur] = c[t] == unsigned(rem) - before;
            break;
          }
          before += c[t];
        }
      }
    } else {
      for (int i = threadIdx.x - 32; i < 256; i += blockDim.x - 32) sh.hist[cur ^ 1][i] = 0;
    }
    __syncthreads();
    prefix |= uint64_t(sh.digit[cur]) << shift;
    mask |= uint64_t(255) << shift;
    rem = sh.rem[cur];
    if (sh.done[cur]) break;
  }
  return prefix;
}

// One block per row: vals [B, K] f32 and ids [B, K] int32, descending. Needs n >= K blocks.
__global__ void __launch_bounds__(kThreads) Select(const float* __restrict__ x, const uint64_t* __restrict__ ws,
                                                   float* __restrict__ vals, int32_t* __restrict__ ids, int64_t V,
                                                   int n, int K) {
  __shared__ SelectShared sh;
  const int b = blockIdx.x, t = threadIdx.x;
  // 1. The K blocks with the largest maxima.
  uint64_t bk[kMaxBlocks / kThreads];
#pragma unroll
  for (int j = 0; j < kMaxBlocks / kThreads; ++j) {
    const int i = t + j * kThreads;
    bk[j] = i < n ? ws[size_t(b) * n + i] : 0;
  }
  if (t == 0) sh.count = 0;
  const uint64_t tb = SelectKth(bk, K, sh);   // (its barriers order the count's reset before the adds below)
#pragma unroll
  for (int j = 0; j < kMaxBlocks / kThreads; ++j)
    if (bk[j] >= tb && bk[j] != 0) sh.blocks[atomicAdd(&sh.count, 1)] = IndexOf(bk[j]);
  __syncthreads();
  // 2. Their K x 128 values (in whatever order the blocks landed: the keys carry the order). The K-th largest
  // value is at least the K-th largest block maximum (K distinct values reach it), so only values whose
  // ordered bits reach the bound's take part.
  const uint32_t floor_bits = uint32_t(tb >> 32);
  constexpr int PER = kMaxK * kBlock / kThreads;
  uint64_t ck[PER];
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int s = t + j * kThreads;   // slot: block s / 128 of the kept ones, element s % 128 of it
    ck[j] = 0;
    if (s < K * kBlock) {
      const int64_t e = int64_t(sh.blocks[s / kBlock]) * kBlock + s % kBlock;
      if (e < V) {
        const uint64_t key = KeyOf(x[size_t(b) * V + e], e);
        if (uint32_t(key >> 32) >= floor_bits) ck[j] = key;
      }
    }
  }
  __syncthreads();
  if (t == 0) sh.count = 0;
  const uint64_t tv = SelectKth(ck, K, sh);
#pragma unroll
  for (int j = 0; j < PER; ++j)
    if (ck[j] >= tv && ck[j] != 0) sh.keys[atomicAdd(&sh.count, 1)] = ck[j];
  __syncthreads();
  // 3. Exactly K distinct keys: each one's place is the number of keys above it.
  if (t < K) {
    const uint64_t key = sh.keys[t];
    int place = 0;
    for (int i = 0; i < K; ++i) place += sh.keys[i] > key;
    vals[size_t(b) * K + place] = ValueOf(key);
    ids[size_t(b) * K + place] = IndexOf(key);
  }
}

ffi::Error TopCandidatesCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> vals,
                             ffi::Result<ffi::AnyBuffer> ids, ffi::Result<ffi::AnyBuffer> ws) {
  const std::string name = "jaxllm_top_candidates: ";
  auto xd = x.dimensions(), vd = vals->dimensions(), id = ids->dimensions(), wd = ws->dimensions();
  if (x.element_type() != ffi::F32 || xd.size() != 2)
    return ffi::Error::InvalidArgument(name + "x must be f32 [B, V], got " + DimsString(xd));
  const int64_t B = xd[0], V = xd[1], n = (V + kBlock - 1) / kBlock;
  const int64_t K = vd.size() == 2 ? vd[1] : 0;
  if (vals->element_type() != ffi::F32 || ids->element_type() != ffi::S32 || vd.size() != 2 || id.size() != 2 ||
      vd[0] != B || id[0] != B || id[1] != K || K < 1 || K > kMaxK)
    return ffi::Error::InvalidArgument(name + "vals must be f32 [B, K] and ids int32 [B, K] with 1 <= K <= " +
                                       std::to_string(kMaxK) + ", got " + DimsString(vd) + " and " + DimsString(id));
  if (n < K || n > kMaxBlocks)
    return ffi::Error::InvalidArgument(name + "V must hold K to " + std::to_string(kMaxBlocks) + " blocks of " +
                                       std::to_string(kBlock) + ", got V = " + std::to_string(V));
  if (ws->element_type() != ffi::U32 || wd.size() != 2 || wd[0] != B || wd[1] != 2 * n)
    return ffi::Error::InvalidArgument(name + "workspace must be uint32 [B, 2 ceil(V / 128)], got " + DimsString(wd));
  if (B == 0) return ffi::Error::Success();
  const float* xp = static_cast<const float*>(x.untyped_data());
  uint64_t* wp = static_cast<uint64_t*>(ws->untyped_data());
  BlockMax<<<dim3(unsigned((n + 7) / 8), unsigned(B)), 256, 0, stream>>>(xp, wp, V, int(n));
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) {
    Select<<<unsigned(B), kThreads, 0, stream>>>(xp, wp, static_cast<float*>(vals->untyped_data()),
                                                 static_cast<int32_t*>(ids->untyped_data()), V, int(n), int(K));
    e = cudaGetLastError();
  }
  if (e != cudaSuccess) return ffi::Error::Internal(name + "launch: " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

// Test variant: vals aliases a poisoned input buffer (one more argument), so unwritten elements show.
ffi::Error TopCandidatesCudaInto(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> vals,
                                 ffi::Result<ffi::AnyBuffer> ids, ffi::Result<ffi::AnyBuffer> ws) {
  return TopCandidatesCuda(stream, x, vals, ids, ws);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TopCandidatesCudaIntoHandler, TopCandidatesCudaInto,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()    // the poisoned vals, aliased to result 0
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>(),
                              {ffi::Traits::kCmdBufferCompatible});
XLA_FFI_DEFINE_HANDLER_SYMBOL(TopCandidatesCudaHandler, TopCandidatesCuda,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()    // x [B, V] f32
                                  .Ret<ffi::AnyBuffer>()    // vals [B, K] f32
                                  .Ret<ffi::AnyBuffer>()    // ids [B, K] int32
                                  .Ret<ffi::AnyBuffer>(),   // workspace [B, 2 ceil(V / 128)] uint32
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxllm
