// The one-kernel decode attention (jaxllm_decode_attention_merged, and the fused step's attention).
//
// A block per (split p, kv head g, sequence b) with one warp per query head of the group (R = H / G warps):
// each warp walks the block's tiles of TP positions (tiles p, p + stride, ...; stride P, or C when fold x C
// tiles fit one cluster, see Launch), its lanes splitting the keys
// (LPP lanes per position, 128 bytes of the row each) for the scores and the head dims (D / 32 per lane)
// for the weighted sum.
// Softmax is online in base 2 (q carries log2 e). A sequence whose visible keys fit the first stride tiles uses
// `used` = ceil(len / TP) (at most stride) blocks; with one, it writes `out` itself. Otherwise the splits are
// merged in two levels:
//   - in a thread-block cluster (C blocks along x, C = 2..8; sm_90): each block sends its unnormalized
//     partials (acc [D], m, l) into the shared memory of the cluster's first block (distributed shared
//     memory, st.async), counted on that block's transaction barrier, and block 0 merges them once their
//     bytes are in. No global memory, fence or atomic: with all used blocks in one cluster (len <= C tiles)
//     the merged result is the output.
//   - across clusters (or blocks, without clusters): partials ws[b, h, i] in global memory, a ticket from
//     counters[b, g], and the block that draws the last one resets the counter and merges.
//
// The kernel is kept small on purpose: the two-kernel form (cuda_kernels.cu) unrolls over the heads and
// runs to 60-110 KB of machine code, and measured 8.3 us per call even at one visible key on the H200
// (docs/kernels.md): code fetched anew every layer, as the weights stream through L2 between calls.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>

#include "qkv_cuda.cuh"   // qkv::Args, qkv::HeadRow
#include "w8a16_cuda.cuh"   // GridDepWait, GridDepLaunch, LaunchEx (launch.cuh, through it)

namespace jaxllm {
namespace attn1 {

constexpr int kMaxSplits = 256;
constexpr int kMaxGroup = 16;   // query heads per kv head (warps per block)
constexpr int kMaxCluster = 8;  // blocks of a cluster (the portable maximum)
constexpr int kMaxSlotBytes = 40 * 1024;   // the cluster merge's slots, C x R x (D + 2) f32 (static q_s: <= 8 KB more)

// Cluster barrier halves (sm_90): arrive (release unless relaxed) and wait (acquire).
__device__ __forceinline__ void ClusterArrive(bool relaxed) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (relaxed) asm volatile("barrier.cluster.arrive.relaxed;" ::: "memory");
  else asm volatile("barrier.cluster.arrive.release;" ::: "memory");
#endif
}
__device__ __forceinline__ void ClusterWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.acquire;" ::: "memory");
#endif
}
// Address of `p` (this block's shared memory) in the shared memory of block `rank` of the cluster.
__device__ __forceinline__ float* ClusterShared(float* p, int rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint64_t out;
  asm volatile("mapa.u64 %0, %1, %2;" : "=l"(out) : "l"(p), "r"(rank));
  return reinterpret_cast<float*>(out);
#else
  return p;
#endif
}

// The cluster merge's transaction barrier (sm_90) in block 0's shared memory: the other blocks' partials arrive by
// st.async, each store counting its bytes on it, and block 0 waits for those bytes instead of a second cluster
// barrier (lab switch JAXLLM_ATTN_MBAR=0: the barrier, for comparison).
__device__ __forceinline__ uint32_t SharedAddr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void MbarInit(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(SharedAddr(bar)) : "memory");
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
// Two floats into block `rank`'s shared memory at the address `p` has here, counted on that block's barrier `bar`.
__device__ __forceinline__ void SendPair(float* p, uint64_t* bar, int rank, float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t dst, rbar;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(dst) : "r"(SharedAddr(p)), "r"(rank));
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(rbar) : "r"(SharedAddr(bar)), "r"(rank));
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v2.f32 [%0], {%1, %2}, [%3];"
               ::"r"(dst), "f"(a), "f"(b), "r"(rbar) : "memory");
#endif
}
// Block 0: expect `bytes` more on its barrier (its one arrival), then every thread waits for the phase.
__device__ __forceinline__ void MbarExpectArrive(uint64_t* bar, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("{ .reg .b64 st; mbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1; }"
               ::"r"(SharedAddr(bar)), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void MbarWait(uint64_t* bar) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  uint32_t done = 0;
  while (!done)
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%1], 0; "
                 "selp.u32 %0, 1, 0, p; }" : "=r"(done) : "r"(SharedAddr(bar)) : "memory");
#endif
}

template <typename T> __device__ __forceinline__ float Elem(const uint32_t* w, int e);
template <> __device__ __forceinline__ float Elem<float>(const uint32_t* w, int e) { return __uint_as_float(w[e]); }
template <> __device__ __forceinline__ float Elem<__nv_bfloat16>(const uint32_t* w, int e) {
  const uint32_t x = w[e >> 1];
  return __uint_as_float((e & 1) ? (x & 0xffff0000u) : (x << 16));
}
template <typename T, int D>
struct Geo {
  static constexpr int EK = 128 / int(sizeof(T));         // key elements a lane holds (128 bytes)
  static constexpr int LPP = D / EK;                       // lanes per position: 1, 2 or 4
  static constexpr int TP = 32 / LPP;                      // positions per tile
  static constexpr int KW = 32;                            // 4-byte words of a lane's key part
  static constexpr int DV = D / 32;                        // head dims per lane in the weighted sum
  static constexpr int VW = DV * int(sizeof(T)) / 4;       // their words: 1, 2 or 4
};

// Cache loads: read-only (ld.global.nc), or (CG) through L2 (ld.global.cg), which also sees what this
// kernel wrote before a barrier (the prologue's new key and value).
template <bool CG, typename V>
__device__ __forceinline__ V Ld(const V* p) {
  if constexpr (CG) return __ldcg(p);
  else return __ldg(p);
}

template <int N, bool CG>
__device__ __forceinline__ void Words(const void* p, bool ok, uint32_t* out) {
  if constexpr (N == 1) {
    out[0] = ok ? Ld<CG>(static_cast<const uint32_t*>(p)) : 0u;
  } else if constexpr (N == 2) {
    const uint2 v = ok ? Ld<CG>(static_cast<const uint2*>(p)) : make_uint2(0, 0);
    out[0] = v.x; out[1] = v.y;
  } else {
    const uint4 v = ok ? Ld<CG>(static_cast<const uint4*>(p)) : make_uint4(0, 0, 0, 0);
    out[0] = v.x; out[1] = v.y; out[2] = v.z; out[3] = v.w;
  }
}

// The copy of a tile's keys in shared memory: lane l of a warp reads 128 bytes of a key (part `part` of position
// kp, l = kp * LPP + part) in 8 loads of 16 bytes; its piece i is stored at i ^ SwizzleOf(kp, part) = i ^ (l & 7)
// within those 128 bytes. Unswizzled, the 8 lanes of a quarter warp load piece i of 8 parts 128 bytes apart, all
// from the same 4 banks: 8 wavefronts where one does, on each of the 8 loads of every warp of the block.
// Swizzled, they load from 8 different 16-byte columns of banks. swz: 7, or 0 for no swizzle
// (lab switch JAXLLM_ATTN_SWIZZLE=0, for comparison).
template <typename T, int D>
__device__ __forceinline__ int SwizzleOf(int kp, int part, int swz) {
  return (kp * Geo<T, D>::LPP + part) & swz;
}

template <typename T, int D>
struct Tile {
  uint32_t k[Geo<T, D>::KW];                 // this lane's 128 bytes of its position's key
  uint32_t v[Geo<T, D>::TP][Geo<T, D>::VW];  // this lane's dims of every position's value

  // From the block's copy of the tile in shared memory (ks, vs [TP][D], positions past the length zeroed; the
  // keys' 16-byte pieces swizzled by SwizzleOf with mask swz), with position `patch` (or none: -1) taken from
  // nk / nv [D] instead: the new key and value, appended after the copy was made.
  __device__ __forceinline__ void LoadShared(const T* ks, const T* vs, const T* nk, const T* nv, int base, int patch,
                                             int swz, int lane) {
    using G = Geo<T, D>;
    const int kp = lane / G::LPP, part = lane % G::LPP;
    const bool patched = base + kp == patch;
    const uint4* krow = reinterpret_cast<const uint4*>(patched ? nk : ks + kp * D) + part * (G::KW / 4);
    const int sw = patched ? 0 : SwizzleOf<T, D>(kp, part, swz);
#pragma unroll
    for (int i = 0; i < G::KW / 4; ++i) {
      const uint4 w = krow[i ^ sw];
      k[4 * i] = w.x; k[4 * i + 1] = w.y; k[4 * i + 2] = w.z; k[4 * i + 3] = w.w;
    }
#pragma unroll
    for (int j = 0; j < G::TP; ++j) {
      const uint32_t* vw = reinterpret_cast<const uint32_t*>((base + j == patch ? nv : vs + j * D) + lane * G::DV);
#pragma unroll
      for (int e = 0; e < G::VW; ++e) v[j][e] = vw[e];
    }
  }

  template <bool CG>
  __device__ __forceinline__ void Load(const T* kh, const T* vh, int base, int len, int lane) {
    using G = Geo<T, D>;
    const int kp = base + lane / G::LPP;
    const uint4* ks = reinterpret_cast<const uint4*>(kh + size_t(kp) * D + (lane % G::LPP) * G::EK);
#pragma unroll
    for (int i = 0; i < G::KW / 4; ++i) {
      const uint4 w = kp < len ? Ld<CG>(ks + i) : make_uint4(0, 0, 0, 0);
      k[4 * i] = w.x; k[4 * i + 1] = w.y; k[4 * i + 2] = w.z; k[4 * i + 3] = w.w;
    }
#pragma unroll
    for (int j = 0; j < G::TP; ++j) Words<G::VW, CG>(vh + size_t(base + j) * D + lane * G::DV, base + j < len, v[j]);
  }
};

// 16 bytes global -> shared without registers (cp.async, sm_80+; through L2 only); ok false: zeros.
__device__ __forceinline__ void CopyAsync16(void* dst, const void* src, bool ok) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(ok ? 16 : 0) : "memory");
#else
  *static_cast<uint4*>(dst) = ok ? *static_cast<const uint4*>(src) : make_uint4(0, 0, 0, 0);
#endif
}
__device__ __forceinline__ void CopyAsyncWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  asm volatile("cp.async.wait_all;" ::: "memory");
#endif
}

// PRO: the QKV epilogue is this kernel's prologue (the fused step's layers call): q is not given, each warp
// computes its query head from the QKV projection (pa.qkv), and the block whose tiles hold the write position
// (block 0 when no visible tile does) appends the new key and value to the caches first. A block reads that tile
// from its copy (pre, below) with the new key and value substituted, or, without a copy or where the tile is not
// its first, through L2 (the others read-only). The same bits as the epilogue kernel then this one.
// pre >= 0 (PRO only, inputs loaded before the wait): the byte offset in dynamic shared memory of a copy of the
// block's first tile ([2][TP][D]: keys, values), made before the wait (cp.async; the cache holds those positions
// since earlier steps), the owner's new key and value substituted as the warps read it: the tile's load is then
// off the path that waits for the QKV projection.
// C: blocks per cluster along x (1: no cluster; gridDim.x is then a multiple of C, and blocks p >= used idle).
// fold: with C + 1 to fold x C visible tiles (and C > 1) the stride is C: the first cluster walks them all.
template <typename T, int D, bool PRO = false>
__global__ void __launch_bounds__(32 * kMaxGroup)
    Kernel(const T* __restrict__ q, const T* k, const T* v, const int32_t* __restrict__ lengths,
           float* __restrict__ ws, T* __restrict__ out, int32_t* __restrict__ counters, int layer, int N, int H, int G,
           int S, int P, int C, int pre, int swz, int mbar, int fold, qkv::Args pa) {
  using Ge = Geo<T, D>;
  constexpr int EK = Ge::EK, LPP = Ge::LPP, TP = Ge::TP, DV = Ge::DV;
  const int p = blockIdx.x, g = blockIdx.y, b = blockIdx.z, lane = threadIdx.x & 31, r = threadIdx.x >> 5;
  const int R = H / G, h = g * R + r;
  // The splits' stride over `tiles` visible tiles: P, or C where up to fold x C tiles fit one cluster's C blocks
  // (fold 2: a block walks a second tile rather than a second cluster merging through global memory).
  // (head dim 128 only: below it the stride is P at compile time, the code as before the fold)
  auto stride_of = [&](int tiles) { return D >= 128 && C > 1 && tiles > C && tiles <= fold * C ? C : P; };
  // PRO: what the prologue reads besides the QKV row was written before the layers call started (its inputs
  // lengths, writes and pos; the bias, norm weights and frequencies): loaded before the wait, off its path.
  int len_in = 0, at = -1;
  qkv::HeadConsts<D> hq, hk;
  float vbias[D / 32];
  auto load_inputs = [&] {
    len_in = lengths[b];
    at = pa.writes[b];
    hq = qkv::LoadHeadConsts<D>(pa, b, h, H, lane);
    if (r == 0) {
      hk = qkv::LoadHeadConsts<D>(pa, b, H + g, H, lane);
#pragma unroll
      for (int j = 0; j < D / 32; ++j) vbias[j] = pa.bias ? pa.bias[(H + G + g) * D + lane + 32 * j] : 0.f;
    }
  };
  const size_t head = ((size_t(layer) * N + b) * G + g) * size_t(S) * D;   // cache[layer, b, g, 0, 0] (N rows)
  extern __shared__ float slots[];   // the cluster merge's slots, then (pre) the tile's copy
  T* tile_s = nullptr;               // pre: this block's copy of its first tile, keys then values
  if constexpr (PRO) {
    if (pa.early) w8a16::GridDepLaunch();   // the layers call's early trigger: the next kernel may launch now
    if (!pa.late_inputs) {
      load_inputs();
      const int len0 = min(max(len_in, 1), S);
      const int tiles0 = (len0 + TP - 1) / TP;
      if (pre >= 0 && p < min(stride_of(tiles0), tiles0)) {
        tile_s = reinterpret_cast<T*>(reinterpret_cast<char*>(slots) + pre);
        constexpr int kRowChunks = D * int(sizeof(T)) / 16, kChunks = TP * kRowChunks, kPer = 16 / int(sizeof(T));
        constexpr int kPart = Ge::KW / 4;   // 16-byte pieces of a lane's part of a key
        const int base = p * TP;
        for (int i = threadIdx.x; i < 2 * kChunks; i += blockDim.x) {
          const int kv = i / kChunks, row = i % kChunks / kRowChunks, col = i % kRowChunks;
          const bool ok = base + row < len0;
          const T* src = (kv ? v : k) + head + size_t(ok ? base + row : 0) * D + col * kPer;
          const int at_col = kv ? col : col ^ SwizzleOf<T, D>(row, col / kPart, swz);   // keys swizzled
          CopyAsync16(tile_s + (kv * TP + row) * D + at_col * kPer, src, ok);
        }
      }
    }
  }
  w8a16::GridDepWait();
  if constexpr (PRO) {
    if (pa.stop == 1) return;            // JAXLLM_ATTN_STOP=wait (timing only)
    if (pa.late_inputs) load_inputs();   // JAXLLM_PREFETCH=0: the same loads after the wait (for comparison)
  } else {
    len_in = lengths[b];
  }
  const int len = min(max(len_in, 1), S);
  const int tiles = (len + TP - 1) / TP, stride = stride_of(tiles), used = min(stride, tiles);
  // Whether this block's cluster merges its splits itself (the same for every block of a cluster; never with a
  // timing stop, whose blocks leave early).
  const bool clustered = C > 1 && used > 1 && pa.stop == 0;
  __shared__ __align__(8) uint64_t merge_bar;   // (mbar) block 0's transaction barrier
  if (clustered) {
    if (p / C * C >= used) return;   // no block of this cluster has a tile
    if (mbar && p % C == 0) MbarInit(&merge_bar);   // (before the arrive below: the others wait on it to send)
    ClusterArrive(true);             // first phase: this block has started (waited on before writing to block 0)
  } else if (p >= used) {
    return;
  }
  const bool work = p < used;   // (false only for idle blocks of a clustered merge)
  __shared__ float q_s[kMaxGroup][D];
  __shared__ __align__(16) T new_kv[2][D];   // pre: the owner's new key and value
  const float q_scale = rsqrtf(float(D)) * 1.4426950408889634f;
  float m = -INFINITY, l = 0.f, acc[DV];
#pragma unroll
  for (int e = 0; e < DV; ++e) acc[e] = 0.f;
  if (work) {
    int tile_at = -1;   // PRO: the tile that holds the new key (in this block's range or not)
    int patch = -1;     // pre: the position of the tile's copy that the new key and value replace
    if constexpr (PRO) {
      // Every load of the QKV row this warp needs goes out before any is used: its query head, and, in the
      // block that appends, warp 0's key head and values (they used to wait for the query head's arithmetic,
      // and the key head's, one round trip to L2 after another).
      tile_at = at >= 0 && at < S ? at / TP : -1;
      const int owner = tile_at < tiles ? tile_at % stride : 0;
      const bool append = r == 0 && tile_at >= 0 && p == owner;
      if (tile_s != nullptr && tile_at == p) patch = at;
      qkv::HeadRow<D> qrow, krow;
      float vx[D / 32];
      qrow.template Load<T>(pa, b, h, H, G, lane);
      if (append) {
        krow.template Load<T>(pa, b, H + g, H, G, lane);
        const T* row = static_cast<const T*>(pa.qkv) + size_t(b) * (H + 2 * G) * D + (H + G + g) * D;
#pragma unroll
        for (int j = 0; j < D / 32; ++j) vx[j] = ToF32(row[lane + 32 * j]);
      }
      qrow.template Apply<T>(pa, hq, [&](int e, T x) { q_s[r][e] = ToF32(x) * q_scale; });
      if (append) {
        T* kd = static_cast<T*>(pa.kc) + head + size_t(at) * D;
        T* vd = static_cast<T*>(pa.vc) + head + size_t(at) * D;
        krow.template Apply<T>(pa, hk, [&](int e, T x) {
          kd[e] = x;
          new_kv[0][e] = x;
        });
#pragma unroll
        for (int j = 0; j < D / 32; ++j) {   // qkv::Biased with the bias loaded before the wait
          const T x = FromF32<T>(pa.bias ? qkv::AddBias<T>(vx[j], vbias[j]) : vx[j]);
          vd[lane + 32 * j] = x;
          new_kv[1][lane + 32 * j] = x;
        }
      }
      if (tile_s != nullptr) CopyAsyncWait();   // this thread's part of the tile's copy
      __syncthreads();   // the new key and value are in the cache (and new_kv), the copy complete
      if (pa.stop == 2) return;   // JAXLLM_ATTN_STOP=prologue (timing only)
    } else {
      for (int d = lane; d < D; d += 32) q_s[r][d] = ToF32(q[(size_t(b) * H + h) * D + d]) * q_scale;
    }
    const T* kh = k + head;
    const T* vh = v + head;
    const float* qr = q_s[r] + (lane % LPP) * EK;
    __syncwarp();
    for (int c = p; c < tiles; c += stride) {
      const int base = c * TP;
      Tile<T, D> cur;   // (no prefetch of the next tile: the other warps and blocks on the SM hide the latency)
      if (PRO && tile_s != nullptr && c == p) cur.LoadShared(tile_s, tile_s + TP * D, new_kv[0], new_kv[1], base, patch, swz, lane);
      else if (PRO && c == tile_at) cur.template Load<true>(kh, vh, base, len, lane);
      else cur.template Load<false>(kh, vh, base, len, lane);
      float s = 0.f;
#pragma unroll
      for (int e = 0; e < EK; ++e) s = fmaf(qr[e], Elem<T>(cur.k, e), s);
#pragma unroll
      for (int off = 1; off < LPP; off <<= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
      if (base + lane / LPP >= len) s = -INFINITY;
      float mx = s;
#pragma unroll
      for (int off = 16; off >= LPP; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, off));
      const float m_new = fmaxf(m, mx);   // finite: the tile's first position is visible
      const float pr = exp2f(s - m_new);
      float sum = pr;
#pragma unroll
      for (int off = 16; off >= LPP; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      const float alpha = exp2f(m - m_new);
      l = l * alpha + sum;   // the shuffles above summed each position once (over lanes of one key part)
      m = m_new;
#pragma unroll
      for (int e = 0; e < DV; ++e) acc[e] *= alpha;
#pragma unroll
      for (int j = 0; j < TP; ++j) {
        const float pj = __shfl_sync(0xffffffffu, pr, j * LPP);
#pragma unroll
        for (int e = 0; e < DV; ++e) acc[e] = fmaf(pj, Elem<T>(cur.v[j], e), acc[e]);
      }
    }
  }
  if (!(PRO && pa.early)) w8a16::GridDepLaunch();
  if (pa.stop == 3) return;   // JAXLLM_ATTN_STOP=tiles (timing only)
  T* o_out = out + (size_t(b) * H + h) * D + lane * DV;
  if (used == 1) {
#pragma unroll
    for (int e = 0; e < DV; ++e) o_out[e] = FromF32<T>(acc[e] / l);
    return;
  }
  int parts = used, part = p;   // the partials merged through global memory, and this block's index among them
  if (clustered) {
    // Level 1: every block's partials into block 0's slots [C][R][D + 2]; block 0 merges them.
    const int rank = p % C, cl = p / C;
    ClusterWait();   // every block of the cluster has started: block 0's shared memory is there
    const int nu = min(C, used - cl * C);   // blocks of this cluster with tiles (the first nu)
    if (mbar) {   // the partials by st.async, counted on block 0's barrier; block 0 waits for their bytes
      float* own = slots + (size_t(rank) * R + r) * (D + 2);
      if (rank != 0) {
        if (work) {
#pragma unroll
          for (int e = 0; e < DV; e += 2) SendPair(own + lane * DV + e, &merge_bar, 0, acc[e], acc[e + 1]);
          if (lane == 0) SendPair(own + D, &merge_bar, 0, m, l);
        }
        return;
      }
#pragma unroll
      for (int e = 0; e < DV; ++e) own[lane * DV + e] = acc[e];
      if (lane == 0) { own[D] = m; own[D + 1] = l; }
      if (threadIdx.x == 0) MbarExpectArrive(&merge_bar, uint32_t(nu - 1) * R * (D + 2) * sizeof(float));
      __syncwarp();
      MbarWait(&merge_bar);
    } else {
      if (work) {
        float* dst = ClusterShared(slots, 0) + (size_t(rank) * R + r) * (D + 2);
#pragma unroll
        for (int e = 0; e < DV; ++e) dst[lane * DV + e] = acc[e];
        if (lane == 0) { dst[D] = m; dst[D + 1] = l; }
      }
      ClusterArrive(false);   // second phase: the slots are written (release)
      if (rank != 0) return;
      ClusterWait();
    }
    float mm = -INFINITY;
    for (int i = 0; i < nu; ++i) mm = fmaxf(mm, slots[(i * R + r) * (D + 2) + D]);
    float a[DV], ll = 0.f;
#pragma unroll
    for (int e = 0; e < DV; ++e) a[e] = 0.f;
    for (int i = 0; i < nu; ++i) {
      const float* si = slots + (i * R + r) * (D + 2);
      const float f = exp2f(si[D] - mm);
      ll = fmaf(f, si[D + 1], ll);
#pragma unroll
      for (int e = 0; e < DV; ++e) a[e] = fmaf(f, si[lane * DV + e], a[e]);
    }
    if (used <= C) {   // one cluster held every tile: this is the output
#pragma unroll
      for (int e = 0; e < DV; ++e) o_out[e] = FromF32<T>(a[e] / ll);
      return;
    }
    m = mm;
    l = ll;
#pragma unroll
    for (int e = 0; e < DV; ++e) acc[e] = a[e];
    parts = (used + C - 1) / C;
    part = cl;
  }
  // Level 2: partials in global memory, merged by the block that draws the last ticket.
  float* o = ws + ((size_t(b) * H + h) * P + part) * (D + 2);
#pragma unroll
  for (int e = 0; e < DV; ++e) o[lane * DV + e] = acc[e];
  if (lane == 0) { o[D] = m; o[D + 1] = l; }
  __shared__ int is_last;
  __threadfence();   // the partials are visible device-wide before the ticket
  __syncthreads();
  if (threadIdx.x == 0) is_last = atomicAdd(counters + size_t(b) * G + g, 1) == parts - 1;
  __syncthreads();
  if (!is_last) return;
  if (threadIdx.x == 0) counters[size_t(b) * G + g] = 0;   // every ticket drawn: the counter resets itself
  __threadfence();
  // Merge this warp's head over the partials; other blocks wrote them: loads through L2 (ld.cg).
  const float* wr = ws + (size_t(b) * H + h) * P * (D + 2);
  float mm = -INFINITY;
  for (int i = lane; i < parts; i += 32) mm = fmaxf(mm, __ldcg(wr + i * (D + 2) + D));
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) mm = fmaxf(mm, __shfl_xor_sync(0xffffffffu, mm, off));
  float a[DV], ll = 0.f;
#pragma unroll
  for (int e = 0; e < DV; ++e) a[e] = 0.f;
#pragma unroll 8
  for (int i = 0; i < parts; ++i) {
    const float* wi = wr + i * (D + 2);
    const float f = exp2f(__ldcg(wi + D) - mm);
    ll = fmaf(f, __ldcg(wi + D + 1), ll);
#pragma unroll
    for (int e = 0; e < DV; ++e) a[e] = fmaf(f, __ldcg(wi + lane * DV + e), a[e]);
  }
#pragma unroll
  for (int e = 0; e < DV; ++e) o_out[e] = FromF32<T>(a[e] / ll);
}

// Blocks per cluster for P splits of R heads: the largest of 8, 4, 2 that P reaches (a cluster of blocks
// that mostly idle buys nothing) and whose slots fit kMaxSlotBytes; 1 (no cluster) below sm_90, with P = 1,
// or with lab switch JAXLLM_ATTN_CLUSTER=0 (for comparison).
template <int D>
int ClusterSize(int P, int R) {
  static const int enabled = [] {
    int dev = 0, major = 0;
    if (!LabFlag("JAXLLM_ATTN_CLUSTER", true)) return 0;
    if (cudaGetDevice(&dev) != cudaSuccess || cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return major >= 9 ? 1 : 0;
  }();
  if (!enabled) return 1;
  for (int c = kMaxCluster; c > 1; c /= 2)
    if (c <= P && size_t(c) * R * (D + 2) * sizeof(float) <= size_t(kMaxSlotBytes)) return c;
  return 1;
}

// Launches the kernel: q [B, H, D], caches [L, N, G, S, D] with N >= B (a block of sequence b reads and, with the
// prologue, writes row b at the caches' own strides), ws [B, H, P, D + 2] f32, counters [B, G] (zero).
// pdl: launched as a programmatic dependent of the previous kernel on the stream (it waits for it first).
// With a prologue (pa.qkv set, the fused step's layers call) q is unused and the caches are written.
template <typename T, int D>
cudaError_t Launch(cudaStream_t stream, const T* q, const T* k, const T* v, const int32_t* lengths, float* ws, T* out,
                   int32_t* counters, int layer, int B, int N, int H, int G, int S, int P, bool pdl = false,
                   const qkv::Args& pa = {}) {
  const int R = H / G, C = ClusterSize<D>(P, R);
  const dim3 grid((P + C - 1) / C * C, G, B), block(32 * R);
  size_t smem = C > 1 ? size_t(C) * R * (D + 2) * sizeof(float) : 0;
  // The prologue's copy of the first tile (lab switch JAXLLM_ATTN_PRELOAD=0: none, for comparison), where it
  // fits beside the slots and the static q_s and new_kv without the opt-in to more than 48 KB.
  static const bool preload = LabFlag("JAXLLM_ATTN_PRELOAD", true);
  using Ge = Geo<T, D>;
  const size_t at = (smem + 15) / 16 * 16, tile = 2 * size_t(Ge::TP) * D * sizeof(T);
  const size_t fixed = size_t(kMaxGroup) * D * sizeof(float) + 2 * D * sizeof(T) + 64;
  const bool pre = pa.qkv != nullptr && preload && !pa.late_inputs && at + tile + fixed <= size_t(48 << 10);
  if (pre) smem = at + tile;
  static const int swz = LabFlag("JAXLLM_ATTN_SWIZZLE", true) ? 7 : 0;
  static const int mbar = LabFlag("JAXLLM_ATTN_MBAR", true) ? 1 : 0;
  // Head dim 128: with C + 1 to 2 x C visible tiles the first cluster walks them, two a block, instead of a second
  // cluster merging through global memory (lab switch JAXLLM_ATTN_FOLD=0: a split a tile, for comparison). The
  // 7B step at batch 1 and 128-256 keys: 3.058 ms against 3.093-3.099 (H100, one run against two); the splits
  // capped at 8 there, 2.6% off. Not at head dim 64: the same cap lost 4.4% at the 0.5B shape with 2-3 tiles a
  // block (512-640 keys), and its fold was not measured. More tiles a block lost at 7B too (capped at 8: +3.3%
  // at 512 keys, +21% at 2048). Batch > 1 not measured. docs/results/2026-12-07-h100-attention-fold.md.
  static const int fold = LabFlag("JAXLLM_ATTN_FOLD", true) ? 2 : 0;   // (the kernel ignores it below 128)
  auto kernel = pa.qkv != nullptr ? Kernel<T, D, true> : Kernel<T, D, false>;
  return w8a16::LaunchEx(stream, pdl, grid, block, smem, C, kernel, q, k, v, lengths, ws, out, counters, layer, N, H,
                         G, S, P, C, pre ? int(at) : -1, swz, mbar, fold, pa);
}

}  // namespace attn1
}  // namespace jaxllm
