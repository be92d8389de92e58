// The sampler's candidates on the GPU (jaxllm_top_candidates): the K largest logits of each row and their ids,
// descending, exactly what jaxllm.sampling.top_candidates (lax.top_k twice) gives, without XLA's sorts (its
// TopK kernel takes k <= 16; k = 128 becomes a sort of the 16384 candidates, tens of microseconds a step);
// and each row's logsumexp, from the same pass over V (XLA's own takes two more passes).
//
// Each value is a 64-bit key, (order-preserving bits of the value) << 32 | ~index, so that keys are distinct
// and order as top_k does: larger value first, then the lower index (-0.0 counts as +0.0).
//   1. BlockMax (all SMs): the key of each block of 128 logits' maximum, with the block's ~index below it,
//      and the block's sum of exp(x - its maximum): the workspace holds B x n uint64 keys, then B x n f32 sums.
//   2. Select, one block of 1024 threads per row: the K blocks with the largest keys hold the top K values
//      (a block whose maximum ranks below K holds nothing that does); a radix select (rounds of 8 bits,
//      shared-memory histograms, stopping once the digits chosen separate exactly K keys) finds a bound for
//      the K-th largest block key, and the K blocks at or above it are kept. Of their K x 128 values only
//      those that reach the K-th block maximum can rank among the K largest: usually a few hundred. Up to 512
//      of them are ranked by counting (a value's place is the number of candidates larger than it), the K
//      with places below K written there; more (values packed into few blocks) take the same radix select
//      for the K-th largest value key, and the K keys at or above it are placed by counting. The row's
//      logsumexp is M + log sum_i s_i exp(m_i - M) over the blocks' maxima m_i and sums s_i (M the largest),
//      summed in a fixed order (the same bits every run).
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
constexpr int kMaxCand = 512;        // candidates ranked by counting; more take the second radix select

#ifdef JAXLLM_SELECT_TIMING   // bench/candidates_sweep.cu: %globaltimer at Select's stages, and the candidates
__device__ unsigned long long select_times[8];
__device__ int select_ncand;
#define STAMP(i)                                                                               \
  do {                                                                                         \
    if (threadIdx.x == 0 && blockIdx.x == 0) {                                               \
      unsigned long long ns;                                                                   \
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(ns));                                   \
      select_times[i] = ns;                                                                    \
    }                                                                                          \
  } while (0)
#else
#define STAMP(i) \
  do {           \
  } while (0)
#endif

// The LM-head argmax's packing (w8a16::OrderedBits of the value, then ~index), with -0.0 counted as +0.0.
__device__ __forceinline__ uint64_t KeyOf(float v, int64_t i) {
  return (uint64_t(w8a16::OrderedBits(v == 0.f ? 0.f : v)) << 32) | uint32_t(~uint32_t(i));
}
__device__ __forceinline__ float ValueOf(uint64_t key) {   // OrderedBits undone

  const uint32_t o = uint32_t(key >> 32);
  return __uint_as_float((o & 0x80000000u) ? (o & 0x7fffffffu) : ~o);
}
__device__ __forceinline__ int32_t IndexOf(uint64_t key) { return int32_t(~uint32_t(key)); }

// keys[b * n + i]: the key of block i's maximum with ~i as its low half (the block's rank among blocks);
// sums[b * n + i]: sum of exp(x - that maximum) over the block (0 for a block of -inf). A warp a block.
// (fmaxf skips NaN, but the sum keeps it: a row with NaN or inf logits gets a NaN logsumexp, and samples no
// token anyway, jaxllm.sampling.NONFINITE.)
__global__ void __launch_bounds__(256) BlockMax(const float* __restrict__ x, uint64_t* __restrict__ keys,
                                                float* __restrict__ sums, int64_t V, int n) {
  const int lane = threadIdx.x & 31, i = blockIdx.x * 8 + (threadIdx.x >> 5), b = blockIdx.y;
  if (i >= n) return;
  const float* row = x + size_t(b) * V;
  float v[kBlock / 32], m = -INFINITY;
#pragma unroll
  for (int j = 0; j < kBlock / 32; ++j) {
    const int64_t e = int64_t(i) * kBlock + j * 32 + lane;
    v[j] = e < V ? row[e] : -INFINITY;
    m = fmaxf(m, v[j]);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));
  float s = 0.f;
  if (m != -INFINITY) {
#pragma unroll
    for (int j = 0; j < kBlock / 32; ++j) s += expf(v[j] - m);
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
  if (lane == 0) {
    keys[size_t(b) * n + i] = KeyOf(m, i);   // the block's index below its maximum
    sums[size_t(b) * n + i] = s;
  }
}

struct SelectShared {
  unsigned hist[2][256];   // a round's histogram, and the next one's (cleared meanwhile)
  uint64_t keys[kMaxK];
  int blocks[kMaxK];
  int count;
  int digit[2], rem[2], done[2];
  uint64_t warp_max[kThreads / 32];
  float warp_sum[kThreads / 32];
  int ncand;
  uint64_t cand[kMaxCand];
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
      if (!__any_sync(0xffffffffu, in)) continue;   // most warps, after the first round or the prefilter
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

// Deterministic sum of one value a thread over the block (fixed order: lanes, then warps).
__device__ float BlockSum(float v, SelectShared& sh) {
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
  if ((threadIdx.x & 31) == 0) sh.warp_sum[threadIdx.x >> 5] = v;
  __syncthreads();
  float s = 0.f;
  for (int w = 0; w < kThreads / 32; ++w) s += sh.warp_sum[w];
  return s;
}

// One block per row: vals [B, K] f32 and ids [B, K] int32, descending, lse [B] f32. Needs n >= K blocks.
__global__ void __launch_bounds__(kThreads) Select(const float* __restrict__ x, const uint64_t* __restrict__ bkeys,
                                                   const float* __restrict__ bsums, float* __restrict__ vals,
                                                   int32_t* __restrict__ ids, float* __restrict__ lse, int64_t V,
                                                   int n, int K) {
  __shared__ SelectShared sh;
  const int b = blockIdx.x, t = threadIdx.x;
  STAMP(0);
  // 1. The K blocks with the largest maxima.
  uint64_t bk[kMaxBlocks / kThreads], top = 0;
  float bs[kMaxBlocks / kThreads];   // the blocks' sums, read now (the logsumexp needs them after the select)
#pragma unroll
  for (int j = 0; j < kMaxBlocks / kThreads; ++j) {
    const int i = t + j * kThreads;
    bk[j] = i < n ? bkeys[size_t(b) * n + i] : 0;
    bs[j] = i < n ? bsums[size_t(b) * n + i] : 0.f;
    top = bk[j] > top ? bk[j] : top;
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) {
    const uint64_t o = __shfl_xor_sync(0xffffffffu, top, off);
    top = o > top ? o : top;
  }
  if ((t & 31) == 0) sh.warp_max[t >> 5] = top;
  if (t == 0) sh.count = sh.ncand = 0;
  const uint64_t tb = SelectKth(bk, K, sh);   // (its barriers order the resets and warp_max before use)
  STAMP(1);
  // The logsumexp over the blocks: M the row's maximum (the largest block key's value).
  for (int w = 0; w < kThreads / 32; ++w) top = sh.warp_max[w] > top ? sh.warp_max[w] : top;
  const float M = ValueOf(top);
  float part = 0.f;
#pragma unroll
  for (int j = 0; j < kMaxBlocks / kThreads; ++j) {
    const int i = t + j * kThreads;
    if (i < n) part += bs[j] == 0.f ? 0.f : bs[j] * expf(ValueOf(bk[j]) - M);   // (0 for -inf blocks, and M -inf)
  }
#pragma unroll
  for (int j = 0; j < kMaxBlocks / kThreads; ++j)
    if (bk[j] >= tb && bk[j] != 0) sh.blocks[atomicAdd(&sh.count, 1)] = IndexOf(bk[j]);
  const float total = BlockSum(part, sh);   // (its barrier also orders the blocks' adds before their reads)
  if (t == 0) lse[b] = M == -INFINITY ? -INFINITY : M + logf(total);
  STAMP(2);
  // 2. Their K x 128 values (in whatever order the blocks landed: the keys carry the order), 16 consecutive
  // ones of a kept block a thread (four 16-byte loads where the row allows). The K-th largest value is at
  // least the K-th largest block maximum (K distinct values reach it), so only values whose ordered bits
  // reach the bound's take part.
  const uint32_t floor_bits = uint32_t(tb >> 32);
  constexpr int PER = kMaxK * kBlock / kThreads;
  const int kept = t * PER / kBlock;   // which kept block; PER divides kBlock
  const int64_t e0 = kept < K ? int64_t(sh.blocks[kept]) * kBlock + t * PER % kBlock : V;
  const float* row = x + size_t(b) * V;
  float v[PER];
  if (e0 + PER <= V && (size_t(b) * V + e0) % 4 == 0) {
#pragma unroll
    for (int q = 0; q < PER / 4; ++q) {
      const float4 f = reinterpret_cast<const float4*>(row + e0)[q];
      v[4 * q] = f.x, v[4 * q + 1] = f.y, v[4 * q + 2] = f.z, v[4 * q + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < PER; ++j) v[j] = e0 + j < V ? row[e0 + j] : 0.f;
  }
  uint64_t ck[PER];
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const uint64_t key = KeyOf(v[j], e0 + j);
    ck[j] = e0 + j < V && uint32_t(key >> 32) >= floor_bits ? key : 0;
  }
  // Those that take part, appended to the shared candidates (a warp's together: one atomic a warp).
  const int lane = t & 31;
#pragma unroll
  for (int j = 0; j < PER; ++j) {
    const unsigned live = __ballot_sync(0xffffffffu, ck[j] != 0);
    if (!live) continue;
    int base = 0;
    if (lane == __ffs(live) - 1) base = atomicAdd(&sh.ncand, __popc(live));
    base = __shfl_sync(0xffffffffu, base, __ffs(live) - 1);
    const int at = base + __popc(live & ((1u << lane) - 1));
    if (ck[j] != 0 && at < kMaxCand) sh.cand[at] = ck[j];
  }
  __syncthreads();
  STAMP(3);
  const int ncand = sh.ncand;
#ifdef JAXLLM_SELECT_TIMING
  if (t == 0 && b == 0) select_ncand = ncand;
#endif
  if (ncand <= kMaxCand) {
    // 3. Few candidates (the usual case): each one's place is the number of candidates above it; the K
    // with places below K are the result.
    for (int c = t; c < ncand; c += kThreads) {
      const uint64_t key = sh.cand[c];
      int place = 0;
      for (int i = 0; i < ncand; ++i) place += sh.cand[i] > key;
      if (place < K) {
        vals[size_t(b) * K + place] = ValueOf(key);
        ids[size_t(b) * K + place] = IndexOf(key);
      }
    }
    STAMP(4);
    return;
  }
  // 3'. Many (values packed into few blocks): a radix select of the K-th largest candidate, then places.
  if (t == 0) sh.count = 0;
  const uint64_t tv = SelectKth(ck, K, sh);
#pragma unroll
  for (int j = 0; j < PER; ++j)
    if (ck[j] >= tv && ck[j] != 0) sh.keys[atomicAdd(&sh.count, 1)] = ck[j];
  __syncthreads();
  if (t < K) {
    const uint64_t key = sh.keys[t];
    int place = 0;
    for (int i = 0; i < K; ++i) place += sh.keys[i] > key;
    vals[size_t(b) * K + place] = ValueOf(key);
    ids[size_t(b) * K + place] = IndexOf(key);
  }
  STAMP(4);
}

ffi::Error TopCandidatesCuda(cudaStream_t stream, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> vals,
                             ffi::Result<ffi::AnyBuffer> ids, ffi::Result<ffi::AnyBuffer> lse,
                             ffi::Result<ffi::AnyBuffer> ws) {
  const std::string name = "jaxllm_top_candidates: ";
  auto xd = x.dimensions(), vd = vals->dimensions(), id = ids->dimensions(), ld = lse->dimensions(),
       wd = ws->dimensions();
  if (x.element_type() != ffi::F32 || xd.size() != 2)
    return ffi::Error::InvalidArgument(name + "x must be f32 [B, V], got " + DimsString(xd));
  const int64_t B = xd[0], V = xd[1], n = (V + kBlock - 1) / kBlock;
  const int64_t K = vd.size() == 2 ? vd[1] : 0;
  if (vals->element_type() != ffi::F32 || ids->element_type() != ffi::S32 || vd.size() != 2 || id.size() != 2 ||
      vd[0] != B || id[0] != B || id[1] != K || K < 1 || K > kMaxK)
    return ffi::Error::InvalidArgument(name + "vals must be f32 [B, K] and ids int32 [B, K] with 1 <= K <= " +
                                       std::to_string(kMaxK) + ", got " + DimsString(vd) + " and " + DimsString(id));
  if (lse->element_type() != ffi::F32 || ld.size() != 1 || ld[0] != B)
    return ffi::Error::InvalidArgument(name + "lse must be f32 [B], got " + DimsString(ld));
  if (n < K || n > kMaxBlocks)
    return ffi::Error::InvalidArgument(name + "V must hold K to " + std::to_string(kMaxBlocks) + " blocks of " +
                                       std::to_string(kBlock) + ", got V = " + std::to_string(V));
  if (ws->element_type() != ffi::U32 || wd.size() != 2 || wd[0] != B || wd[1] != 3 * n)
    return ffi::Error::InvalidArgument(name + "workspace must be uint32 [B, 3 ceil(V / 128)], got " + DimsString(wd));
  if (B == 0) return ffi::Error::Success();
  const float* xp = static_cast<const float*>(x.untyped_data());
  uint64_t* keys = static_cast<uint64_t*>(ws->untyped_data());   // [B, n] uint64, then [B, n] f32
  float* sums = reinterpret_cast<float*>(keys + B * n);
  BlockMax<<<dim3(unsigned((n + 7) / 8), unsigned(B)), 256, 0, stream>>>(xp, keys, sums, V, int(n));
  cudaError_t e = cudaGetLastError();
  if (e == cudaSuccess) {
    Select<<<unsigned(B), kThreads, 0, stream>>>(xp, keys, sums, static_cast<float*>(vals->untyped_data()),
                                                 static_cast<int32_t*>(ids->untyped_data()),
                                                 static_cast<float*>(lse->untyped_data()), V, int(n), int(K));
    e = cudaGetLastError();
  }
  if (e != cudaSuccess) return ffi::Error::Internal(name + "launch: " + cudaGetErrorString(e));
  return ffi::Error::Success();
}

// Test variant: vals aliases a poisoned input buffer (one more argument), so unwritten elements show.
ffi::Error TopCandidatesCudaInto(cudaStream_t stream, ffi::AnyBuffer x, ffi::AnyBuffer, ffi::Result<ffi::AnyBuffer> vals,
                                 ffi::Result<ffi::AnyBuffer> ids, ffi::Result<ffi::AnyBuffer> lse,
                                 ffi::Result<ffi::AnyBuffer> ws) {
  return TopCandidatesCuda(stream, x, vals, ids, lse, ws);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(TopCandidatesCudaIntoHandler, TopCandidatesCudaInto,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()    // the poisoned vals, aliased to result 0
                                  .Ret<ffi::AnyBuffer>()
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
                                  .Ret<ffi::AnyBuffer>()    // lse [B] f32
                                  .Ret<ffi::AnyBuffer>(),   // workspace [B, 3 ceil(V / 128)] uint32
                              {ffi::Traits::kCmdBufferCompatible});

}  // namespace jaxllm
