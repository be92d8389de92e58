// A candidate for ffi/w8a16_mma.cuh at 16-64 rows of x on Hopper (sm_90a), timed beside it by
// bench/gemv_sweep.cu: the warpgroup MMA (wgmma.mma_async) with the weights as the A operand from registers
// and x as the B operand from shared memory.
//
// Why: ffi/w8a16_mma.cuh (mma.sync) takes its x fragments through registers, so each warp reads x (from L1/L2)
// for each 16 rows of w it owns: 8 bytes of x per weight byte at 64 rows with one 16-row tile a warp (the H100
// sweep of 2026-12-05: gate/up at 64 rows 1.19 TB/s, RT 1 -> 2 doubling it); its 64-row configuration holds
// 252 registers a thread and no loads in flight while it computes. Here the tensor cores read x from shared
// memory themselves (one copy a block, shared by the block's warpgroups), the accumulators are N/2 registers
// a thread for N rows of x, and the MMA runs asynchronously while the next chunk's x is staged.
//
// Arithmetic, as ffi/w8a16_mma.cuh: the same exact int8 -> bf16 conversion in registers, each 64-input scale
// group (chunk) accumulated apart (a fresh f32 fragment, scale-d = 0 on its first k16 step) and scaled per row
// of w before it is added, so the result is exact up to f32 accumulation.
//
// The K permutation (as ffi/w8a16_mma.cuh, so a thread's weights of a chunk are one 16-byte load per row): in
// k16 step j the logical inputs {2c, 2c+1, 2c+8, 2c+9} of thread c of a quad are the physical inputs
// 16c + 4j + {0, 1, 2, 3}. The A fragment of wgmma (per warp: rows 16w..16w+15) has mma.sync's layout, so the
// map is the same; B is read by the hardware in logical order, so x is stored permuted: with a chunk's 64
// inputs as 32 bf16 pairs (pair p = inputs 2p, 2p+1), the 8-input group kg = 2j + h (h: the k16 step's half)
// holds pairs {kg, kg + 8, kg + 16, kg + 24}. Shared memory holds each chunk of x as no-swizzle K-major core
// matrices (8 rows of x x 16 bytes, 128 contiguous bytes): core matrix (row group n8, input group kg) at
// (8 n8 + kg) x 128 bytes, so a k16 step's descriptor starts at kg = 2j with LBO = 128 (kg to kg + 1) and
// SBO = 1024 (n8 to n8 + 1).
//
// Work split: a block is KS groups of NW warpgroups (128 threads each). The groups split K, U chunks a step;
// the NW warpgroups of a group own 64 rows of w each and share the group's x. Each step's x, weights and scales
// are copied (cp.async) into a ring of S slots, S - 1 steps ahead; x is permuted from its slot into one of two
// buffers one step ahead; the weights go from the slot to registers, are converted, and the step's MMAs run.
// The groups' partial tiles meet in shared memory at the end.
//
// Measured (H100 80GB, 2026-12-05, docs/results/2026-12-05-h100-tensor-cores.md): right (the sweep's relative
// error 1.66e-3, ffi/w8a16_mma.cuh's; the descriptor with LBO and SBO exchanged gives 1.0), but slower than
// ffi/w8a16_mma.cuh on the 7B layer matmuls; faster on the LM head at 16, 32 and 64 rows (237.5, 319.3, 366.2 us
// against 268.1, 341.6, 429.8). Each step waits on one chain (copies landed, the group's barrier, the weights
// converted, the MMAs waited for, the barrier again). The versions timed (a first one loading the weights into
// registers, the ring, several chunks a step, the carve-out) are compared in that write-up. KernelWs
// below (a producer warp, mbarriers per ring slot) is the next version. It is right, but on an H100 it is never the
// fastest of the sweep's four tensor-core kernels at 13, 16, 50 or 64 rows, and the slowest at 16, 50 and 64 on
// every 7B shape (docs/results/2026-12-06-h100-perf.md). Neither is dispatched.
#pragma once

#include "w8a16_mma.cuh"

namespace jaxllm {
namespace w8a16 {
namespace wgmma {

using mma::Int8x4ToBf16;
using mma::kChunk;

// The shared-memory matrix descriptor (no swizzle): start address, LBO, SBO, each in 16-byte units.
__device__ __forceinline__ uint64_t Descriptor(uint32_t smem_addr, uint32_t lbo, uint32_t sbo) {
  return uint64_t((smem_addr >> 4) & 0x3FFF) | (uint64_t((lbo >> 4) & 0x3FFF) << 16) |
         (uint64_t((sbo >> 4) & 0x3FFF) << 32);
}

// wgmma exists only in code built for sm_90a (-gencode arch=compute_90a,code=sm_90a); built for another target
// the kernel compiles to a trap, and Available() says so (bench/gemv_sweep.cu then skips its configurations).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define JAXLLM_WGMMA(...) asm volatile(__VA_ARGS__)
#else
#define JAXLLM_WGMMA(...) __trap()
#endif
__global__ void Probe(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *out = 1;
#else
  *out = 0;
#endif
}
inline bool Available() {
  int* d = nullptr;
  int h = 0;
  if (cudaMalloc(&d, sizeof(int)) != cudaSuccess) return false;
  Probe<<<1, 1>>>(d);
  const bool ok = cudaMemcpy(&h, d, sizeof(int), cudaMemcpyDeviceToHost) == cudaSuccess;
  cudaFree(d);
  return ok && h == 1;
}

__device__ __forceinline__ void Fence() { JAXLLM_WGMMA("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void Commit() { JAXLLM_WGMMA("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void WaitAll() { JAXLLM_WGMMA("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }
// Shared-memory writes by ordinary stores made visible to the MMA's (async proxy) reads (sm_90 and up; below,
// where no kernel of this file may run, a trap).
__device__ __forceinline__ void FenceProxy() {
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void GroupSync(int id, int threads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// d (+)= A . B for 64 rows of w x N rows of x x 16 inputs; scale_d = 0: d = A . B.
template <int N> struct Mma;
#define JAXLLM_WG_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), \
  "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
template <> struct Mma<16> {
  __device__ __forceinline__ static void Run(float (&d)[8], const uint32_t (&a)[4], uint64_t desc, int scale_d) {
    JAXLLM_WGMMA(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1, 0;\n}\n"
        : JAXLLM_WG_D8(0)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
  }
};
template <> struct Mma<32> {
  __device__ __forceinline__ static void Run(float (&d)[16], const uint32_t (&a)[4], uint64_t desc, int scale_d) {
    JAXLLM_WGMMA(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, "
        "p, 1, 1, 0;\n}\n"
        : JAXLLM_WG_D8(0), JAXLLM_WG_D8(8)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
  }
};
template <> struct Mma<64> {
  __device__ __forceinline__ static void Run(float (&d)[32], const uint32_t (&a)[4], uint64_t desc, int scale_d) {
    JAXLLM_WGMMA(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 "
        "{%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, "
        "%22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, {%32, %33, %34, %35}, %36, p, 1, 1, 0;\n}\n"
        : JAXLLM_WG_D8(0), JAXLLM_WG_D8(8), JAXLLM_WG_D8(16), JAXLLM_WG_D8(24)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(scale_d));
  }
};
#undef JAXLLM_WG_D8
// Waits until at most PENDING committed groups of this warpgroup's MMAs are still running.
template <int PENDING> __device__ __forceinline__ void WaitGroup() {
  JAXLLM_WGMMA("wgmma.wait_group.sync.aligned %0;" ::"n"(PENDING) : "memory");
}
#undef JAXLLM_WGMMA

// mbarriers (shared::cta, 64-bit): init with an arrival count; arrive; wait for the phase of the given parity
// to complete; an arrival made when this thread's earlier cp.async copies have landed.
__device__ __forceinline__ void BarInit(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void BarArrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void BarWait(uint32_t bar, uint32_t parity) {   // try_wait: sm_90 and up
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
  asm volatile(
      "{\n.reg .pred done;\nWAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT;\n}\n" ::"r"(bar), "r"(parity) : "memory");
#else
  __trap();
#endif
}
__device__ __forceinline__ void BarArriveOnCopies(uint32_t bar) {
  asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}

__device__ __forceinline__ void CopyAsync16(uint32_t dst, const void* src, bool ok) {   // zeros when !ok
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(ok ? 16 : 0) : "memory");
}
__device__ __forceinline__ void CopyAsync4(uint32_t dst, const void* src, bool ok) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(src), "r"(ok ? 4 : 0) : "memory");
}
__device__ __forceinline__ void CopyCommit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int PENDING> __device__ __forceinline__ void CopyWait() {
  asm volatile("cp.async.wait_group %0;" ::"n"(PENDING) : "memory");
}

// A K group's shared memory, in bytes: S ring slots, each U chunks of [x as loaded: N rows at a pitch of
// 144 bytes (16 bytes of padding: the permuting reads below meet no bank twice) | w: 64 NW rows x 64 bytes |
// scales: 64 NW f32], then two buffers of U chunks of x permuted (N rows x 128 bytes a chunk).
constexpr int kXPitch = 144;
__host__ __device__ constexpr int ChunkBytes(int n, int nw) { return n * kXPitch + nw * 64 * 64 + nw * 64 * 4; }
__host__ __device__ constexpr int CanonBytes(int n) { return n * kChunk * 2; }
__host__ __device__ constexpr int GroupBytes(int n, int nw, int s, int u) {
  return s * u * ChunkBytes(n, nw) + 2 * u * CanonBytes(n);
}
constexpr size_t SmemBytes(int n, int nw, int ks, int s, int u) {
  const size_t staged = size_t(ks) * GroupBytes(n, nw, s, u), partial = size_t(ks) * n * 64 * nw * 4;
  return staged > partial ? staged : partial;
}

// The end of a block: each consumer thread's accumulators (the D fragment of its warp's 16 rows: acc[4t + e]
// at row rowl + 8 (e / 2), x row 8t + 2c + e % 2) into the groups' partial tiles [KS][N][64 NW] f32 over the
// block's shared memory, then their sums to y by all `threads` of the block. Called by every thread; `acc` is
// read only where `holds` (producer warps hold none).
template <int N, int NW, int KS>
__device__ __forceinline__ void StorePartialSums(unsigned char* smem, const float (&acc)[N / 2], bool holds,
                                                 int group, int rowl, int threads, __nv_bfloat16* __restrict__ y,
                                                 int m, int n, int wrow0, int xrow0) {
  constexpr int kRowsW = 64 * NW;
  __syncthreads();
  float* partial = reinterpret_cast<float*>(smem);
  if (holds) {
    const int c = threadIdx.x % 4;
    float* mine = partial + size_t(group) * N * kRowsW;
#pragma unroll
    for (int t = 0; t < N / 8; ++t)
#pragma unroll
      for (int e = 0; e < 4; ++e) mine[(8 * t + 2 * c + e % 2) * kRowsW + rowl + 8 * (e / 2)] = acc[4 * t + e];
  }
  __syncthreads();
  for (int o = threadIdx.x; o < N * kRowsW; o += threads) {
    const int xr = o / kRowsW, wr = o % kRowsW, row = wrow0 + wr, xm = xrow0 + xr;
    if (row >= n || xm >= m) continue;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < KS; ++i) sum += partial[size_t(i) * N * kRowsW + o];
    y[size_t(xm) * n + row] = __float2bfloat16(sum);
  }
}

// Launches a kernel of this file on the grid of 64 NW rows of w by N rows of x, with `smem` bytes of dynamic
// shared memory (the opt-in above 48 KB and the largest carve-out, which may otherwise keep more L1 and so fewer
// blocks an SM, set once a kernel).
template <int N, int NW, size_t SMEM, auto KERNEL>   // KERNEL a template argument: one `opted` a kernel
cudaError_t LaunchOn(int threads, cudaStream_t stream, const __nv_bfloat16* x, const int8_t* w, const float* scale,
                     __nv_bfloat16* y, int m, int n, int k) {
  static_assert(SMEM <= (227 << 10), "more shared memory than an SM has");
  static const cudaError_t opted = [] {
    cudaError_t e = cudaFuncSetAttribute(KERNEL, cudaFuncAttributeMaxDynamicSharedMemorySize, int(SMEM));
    return e != cudaSuccess ? e : cudaFuncSetAttribute(KERNEL, cudaFuncAttributePreferredSharedMemoryCarveout,
                                                       int(cudaSharedmemCarveoutMaxShared));
  }();
  if (opted != cudaSuccess) return opted;
  const dim3 grid((n + 64 * NW - 1) / (64 * NW), (m + N - 1) / N);
  KERNEL<<<grid, threads, SMEM, stream>>>(x, w, scale, y, m, n, k);
  return cudaGetLastError();
}

// One block: rows [64 NW blockIdx.x, +64 NW) of w, rows [N blockIdx.y, +N) of x.
// x [M, K] bf16, w [N, K] int8, scale [N, K / 64] f32, y [M, N] bf16. K % 64 == 0.
//
// A group takes its K range U chunks a step. Step i's chunks go through: cp.async of their x, weights and
// scales into ring slot i % S (issued S - 1 steps ahead); x permuted from the slot into buffer i % 2 (one step
// ahead, while step i - 1's MMAs run); the weights read from the slot into registers, converted, and the
// step's 4 U MMAs (each chunk into its own accumulator), one wait. One barrier a step.
template <int N, int NW, int KS, int S, int U>
__global__ void __launch_bounds__(NW * KS * 128) Kernel(const __nv_bfloat16* __restrict__ x,
                                                        const int8_t* __restrict__ w, const float* __restrict__ scale,
                                                        __nv_bfloat16* __restrict__ y, int m, int n, int k) {
  static_assert(N == 16 || N == 32 || N == 64, "wgmma n16, n32 or n64");
  static_assert(KS >= 1 && KS <= 15 && NW * KS <= 8, "one named barrier a group (ids 1..15), 1024 threads");
  static_assert(S >= 3, "step i + 1 lands while step i computes");
  constexpr int kGroupThreads = NW * 128, kRowsW = 64 * NW, kSlot = U * ChunkBytes(N, NW);
  extern __shared__ __align__(128) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int group = warp / (4 * NW), wg = (warp / 4) % NW, wig = warp % 4;
  const int gtid = threadIdx.x % kGroupThreads;
  const int chunks = k / kChunk, xrow0 = blockIdx.y * N, wrow0 = blockIdx.x * kRowsW;
  const int begin = group * chunks / KS, end = (group + 1) * chunks / KS;
  unsigned char* gsmem = smem + size_t(group) * GroupBytes(N, NW, S, U);
  const uint32_t gaddr = static_cast<uint32_t>(__cvta_generic_to_shared(gsmem));
  const uint32_t canon_addr = gaddr + S * kSlot;
  // Within a slot's chunk u (at u ChunkBytes): x, then w at kWOff, the scales at kSOff.
  constexpr int kWOff = N * kXPitch, kSOff = kWOff + NW * 64 * 64;

  // Copies of step i's chunks into its slot (all of the group's threads; rows past M or N and chunks past the
  // range are zeros).
  auto issue = [&](int step) {
    const uint32_t base = gaddr + (step % S) * kSlot;
    const int c0 = begin + step * U;
    for (int i = gtid; i < U * N * 8; i += kGroupThreads) {   // x: 8 pieces of 16 bytes a row and chunk
      const int u = i / (N * 8), r = (i / 8) % N, q = i % 8, xm = xrow0 + r;
      const bool ok = c0 + u < end && xm < m;
      CopyAsync16(base + u * ChunkBytes(N, NW) + r * kXPitch + 16 * q,
                  x + (ok ? size_t(xm) * k + size_t(c0 + u) * kChunk + 8 * q : 0), ok);
    }
    for (int i = gtid; i < U * kRowsW * 4; i += kGroupThreads) {   // w: 4 pieces of 16 bytes a row and chunk
      const int u = i / (kRowsW * 4), r = (i / 4) % kRowsW, q = i % 4, row = wrow0 + r;
      const bool ok = c0 + u < end && row < n;
      CopyAsync16(base + u * ChunkBytes(N, NW) + kWOff + r * 64 + 16 * q,
                  w + (ok ? size_t(row) * k + size_t(c0 + u) * kChunk + 16 * q : 0), ok);
    }
    for (int i = gtid; i < U * kRowsW; i += kGroupThreads) {
      const int u = i / kRowsW, r = i % kRowsW, row = wrow0 + r;
      const bool ok = c0 + u < end && row < n;
      CopyAsync4(base + u * ChunkBytes(N, NW) + kSOff + 4 * r, scale + (ok ? size_t(row) * chunks + c0 + u : 0), ok);
    }
    CopyCommit();
  };
  // x of step i's slot into permuted buffer i % 2: with a chunk's 64 inputs as 32 bf16 pairs, pair p = 8c + kg
  // goes to word c of row r of core matrix (r / 8, kg). Lanes take (q / 2, r % 8) so that the stores meet 32
  // banks; each thread reads a 16-byte piece q of row r (pairs 4q .. 4q + 3).
  auto permute = [&](int step) {
    const unsigned char* src = gsmem + (step % S) * kSlot;
    uint32_t* dst = reinterpret_cast<uint32_t*>(gsmem + S * kSlot + (step % 2) * U * CanonBytes(N));
    for (int i = gtid; i < U * N * 8; i += kGroupThreads) {
      const int u = i / (N * 8), cq = i % 4, r8 = (i / 4) % 8, qh = (i / 32) % 2, rg = (i / 64) % (N / 8);
      const int r = 8 * rg + r8, q = 2 * cq + qh;
      const uint4 v = *reinterpret_cast<const uint4*>(src + u * ChunkBytes(N, NW) + r * kXPitch + 16 * q);
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int e = 0; e < 4; ++e) dst[u * (CanonBytes(N) / 4) + (rg * 8 + 4 * qh + e) * 32 + r8 * 4 + cq] = words[e];
    }
  };

  float acc[N / 2], part[U][N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
  const int rowl = 64 * wg + 16 * wig + g;   // this thread's local rows of w: rowl and rowl + 8
  const int steps = (end - begin + U - 1) / U;

  for (int i = 0; i < S - 1; ++i) issue(i);
  CopyWait<S - 2>();                          // step 0 landed (this thread's copies)
  GroupSync(group + 1, kGroupThreads);
  permute(0);
  FenceProxy();
  for (int i = 0; i < steps; ++i) {
    CopyWait<S - 3>();                        // step i + 1 landed
    GroupSync(group + 1, kGroupThreads);      // ... for all; step i permuted; step i - 1 done by all
    issue(i + S - 1);
    const unsigned char* slot = gsmem + (i % S) * kSlot;
    uint32_t a[U][4][4];
    float sc[U][2];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const unsigned char* ch = slot + u * ChunkBytes(N, NW);
      const uint4 wq0 = *reinterpret_cast<const uint4*>(ch + kWOff + rowl * 64 + 16 * c);
      const uint4 wq1 = *reinterpret_cast<const uint4*>(ch + kWOff + (rowl + 8) * 64 + 16 * c);
      sc[u][0] = reinterpret_cast<const float*>(ch + kSOff)[rowl];
      sc[u][1] = reinterpret_cast<const float*>(ch + kSOff)[rowl + 8];
      const uint32_t q0[4] = {wq0.x, wq0.y, wq0.z, wq0.w}, q1[4] = {wq1.x, wq1.y, wq1.z, wq1.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        Int8x4ToBf16(q0[j], a[u][j][0], a[u][j][2]);   // row g: inputs 4j, 4j+1 | 4j+2, 4j+3 (physical)
        Int8x4ToBf16(q1[j], a[u][j][1], a[u][j][3]);   // row g + 8
      }
    }
    Fence();
    const uint32_t cb = canon_addr + (i % 2) * U * CanonBytes(N);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int j = 0; j < 4; ++j)
        Mma<N>::Run(part[u], a[u][j], Descriptor(cb + u * CanonBytes(N) + 2 * j * 128, 128, 1024), j);
    Commit();
    if (i + 1 < steps) permute(i + 1);
    WaitAll();
    // Fragment: part[4t + 0, 1] = (row g, x rows 8t + 2c, + 1), part[4t + 2, 3] = (row g + 8, the same).
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int t = 0; t < N / 8; ++t) {
        acc[4 * t + 0] += part[u][4 * t + 0] * sc[u][0];
        acc[4 * t + 1] += part[u][4 * t + 1] * sc[u][0];
        acc[4 * t + 2] += part[u][4 * t + 2] * sc[u][1];
        acc[4 * t + 3] += part[u][4 * t + 3] * sc[u][1];
      }
    FenceProxy();
  }
  CopyWait<0>();

  StorePartialSums<N, NW, KS>(smem, acc, true, group, rowl, NW * KS * 128, y, m, n, wrow0, xrow0);
}

template <int N, int NW, int KS, int S, int U>
cudaError_t Launch(cudaStream_t stream, const __nv_bfloat16* x, const int8_t* w, const float* scale,
                   __nv_bfloat16* y, int m, int n, int k) {
  return LaunchOn<N, NW, SmemBytes(N, NW, KS, S, U), Kernel<N, NW, KS, S, U>>(NW * KS * 128, stream, x, w, scale, y,
                                                                              m, n, k);
}

// ---- v4: warp-specialized (a producer warp a group, mbarriers per ring slot) ----------------------------------
//
// The same arithmetic as Kernel, without its per-step chain through the group's barrier: each K group has one
// producer warp that fills a ring of S slots (x, weights and scales of one chunk, by cp.async; the slot's
// `full` mbarrier completes when the copies land) and NW consumer warpgroups that wait on `full`, run the
// chunk's MMAs, and arrive on the slot's `empty` mbarrier once the MMAs that read it are done; the producer
// waits on `empty` before it fills the slot again. x is stored as it comes (K-major core matrices in natural
// order: core matrix (n8, kg) holds rows 8 n8.. of inputs 8 kg..8 kg + 7, a 16-byte copy a row), and the
// weights' fragments are taken in natural order too: for k16 step j, thread c of a quad needs bytes
// 16j + {2c, 2c + 1, 2c + 8, 2c + 9} of its row, one byte permute of two words of the row's 16 bytes. A
// consumer sums each chunk once its MMAs are done; OVERLAP: it issues chunk i's MMAs before it sums chunk
// i - 1's (two accumulators), but ptxas then serializes the MMAs (its warning C7514).
__host__ __device__ constexpr int WsSlotBytes(int n, int nw) { return n * kChunk * 2 + nw * 64 * 64 + nw * 64 * 4; }
// A group's ring: S slots, then its 2 S mbarriers in 128 bytes (S <= 8), so each group's ring stays 128-aligned.
__host__ __device__ constexpr int WsGroupBytes(int n, int nw, int s) { return s * WsSlotBytes(n, nw) + 128; }
constexpr size_t WsSmemBytes(int n, int nw, int ks, int s) {
  const size_t ring = size_t(ks) * WsGroupBytes(n, nw, s);
  const size_t partial = size_t(ks) * n * 64 * nw * 4;
  return ring > partial ? ring : partial;
}

template <int N, int NW, int KS, int S, bool OVERLAP>
__global__ void __launch_bounds__(KS * (NW * 128 + 32)) KernelWs(const __nv_bfloat16* __restrict__ x,
                                                                const int8_t* __restrict__ w,
                                                                const float* __restrict__ scale,
                                                                __nv_bfloat16* __restrict__ y, int m, int n, int k) {
  static_assert(N == 16 || N == 32 || N == 64, "wgmma n16, n32 or n64");
  static_assert(S >= 2 && S <= 8, "a ring of 2-8 slots (its mbarriers in 128 bytes)");
  static_assert(size_t(KS) * N * 64 * NW * 4 <= size_t(S) * WsSlotBytes(N, NW),
                "the partial tiles (written over the rings at the end) stay clear of group 0's mbarriers");
  constexpr int kConsumers = KS * NW * 128, kRowsW = 64 * NW, kSlot = WsSlotBytes(N, NW);
  constexpr int kXBytes = N * kChunk * 2, kWOff = kXBytes, kSOff = kWOff + NW * 64 * 64;
  extern __shared__ __align__(128) unsigned char smem[];
  const bool producer = threadIdx.x >= kConsumers;
  const int group = producer ? (threadIdx.x - kConsumers) / 32 : threadIdx.x / (NW * 128);
  const int chunks = k / kChunk, xrow0 = blockIdx.y * N, wrow0 = blockIdx.x * kRowsW;
  const int begin = group * chunks / KS, end = (group + 1) * chunks / KS, steps = end - begin;
  unsigned char* ring = smem + size_t(group) * WsGroupBytes(N, NW, S);
  const uint32_t ring_addr = static_cast<uint32_t>(__cvta_generic_to_shared(ring));
  const uint32_t full0 = ring_addr + S * kSlot, empty0 = full0 + 8 * S;   // mbarriers: [S] full, [S] empty
  if (producer && threadIdx.x % 32 == 0)
    for (int i = 0; i < S; ++i) {
      BarInit(full0 + 8 * i, 32);          // the producer's lanes, each when its copies have landed
      BarInit(empty0 + 8 * i, 4 * NW);     // the consumer warps, each when its MMAs on the slot are done
    }
  __syncthreads();

  float acc[N / 2];
#pragma unroll
  for (int i = 0; i < N / 2; ++i) acc[i] = 0.f;
  int rowl = 0;
  if (producer) {
    const int lane = threadIdx.x % 32;
    for (int i = 0; i < steps; ++i) {
      const int slot = i % S, ci = begin + i;
      if (i >= S) BarWait(empty0 + 8 * slot, ((i / S) + 1) & 1);
      const uint32_t base = ring_addr + slot * kSlot;
      for (int p = lane; p < N * 8; p += 32) {   // x: piece (row r, input group kg); lanes along r % 8
        const int r8 = p % 8, kg = (p / 8) % 8, rg = p / 64, r = 8 * rg + r8, xm = xrow0 + r;
        const bool ok = xm < m;
        CopyAsync16(base + (rg * 8 + kg) * 128 + r8 * 16,
                    x + (ok ? size_t(xm) * k + size_t(ci) * kChunk + 8 * kg : 0), ok);
      }
      for (int p = lane; p < kRowsW * 4; p += 32) {   // w: 4 pieces of 16 bytes a row
        const int r = p / 4, q = p % 4, row = wrow0 + r;
        const bool ok = row < n;
        CopyAsync16(base + kWOff + r * 64 + 16 * q, w + (ok ? size_t(row) * k + size_t(ci) * kChunk + 16 * q : 0), ok);
      }
      for (int r = lane; r < kRowsW; r += 32) {
        const bool ok = wrow0 + r < n;
        CopyAsync4(base + kSOff + 4 * r, scale + (ok ? size_t(wrow0 + r) * chunks + ci : 0), ok);
      }
      BarArriveOnCopies(full0 + 8 * slot);
    }
    asm volatile("cp.async.wait_all;" ::: "memory");
  } else {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    const int wg = (warp / 4) % NW, wig = warp % 4;
    rowl = 64 * wg + 16 * wig + g;                 // this thread's local rows of w: rowl and rowl + 8
    const uint32_t sel = (c & 1) ? 0x7632u : 0x5410u;
    float pa[N / 2], pb[N / 2], sa[2] = {0.f, 0.f}, sb[2] = {0.f, 0.f};
    uint32_t aa[4][4], ab[4][4];
    // Chunk i into (a, p, sc): wait for its slot, take the weights' fragments, run its MMAs; then sum chunk
    // i - 1 (p_prev, sc_prev) once its MMAs are done, and free its slot.
    auto step = [&](int i, uint32_t (&a)[4][4], float (&p)[N / 2], float (&sc)[2], float (&p_prev)[N / 2],
                    const float (&sc_prev)[2]) {
      const int slot = i % S;
      BarWait(full0 + 8 * slot, (i / S) & 1);
      FenceProxy();
      const unsigned char* base = ring + slot * kSlot;
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const uint4* row = reinterpret_cast<const uint4*>(base + kWOff + (rowl + 8 * h) * 64);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const uint4 v = row[j];                                  // inputs 16j .. 16j + 15 of the row
          const uint32_t lo = (c & 2) ? v.y : v.x, hi = (c & 2) ? v.w : v.z;
          Int8x4ToBf16(__byte_perm(lo, hi, sel), a[j][h], a[j][2 + h]);   // (2c, 2c+1) | (2c+8, 2c+9)
        }
        sc[h] = reinterpret_cast<const float*>(base + kSOff)[rowl + 8 * h];
      }
      Fence();
#pragma unroll
      for (int j = 0; j < 4; ++j)
        Mma<N>::Run(p, a[j], Descriptor(ring_addr + slot * kSlot + 2 * j * 128, 128, 1024), j);
      Commit();
      if constexpr (!OVERLAP) {   // this chunk summed at once (ptxas then keeps the MMAs asynchronous)
        WaitGroup<0>();
#pragma unroll
        for (int t = 0; t < N / 8; ++t) {
          acc[4 * t + 0] += p[4 * t + 0] * sc[0];
          acc[4 * t + 1] += p[4 * t + 1] * sc[0];
          acc[4 * t + 2] += p[4 * t + 2] * sc[1];
          acc[4 * t + 3] += p[4 * t + 3] * sc[1];
        }
        if (lane == 0) BarArrive(empty0 + 8 * slot);
      } else if (i > 0) {
        WaitGroup<1>();
#pragma unroll
        for (int t = 0; t < N / 8; ++t) {
          acc[4 * t + 0] += p_prev[4 * t + 0] * sc_prev[0];
          acc[4 * t + 1] += p_prev[4 * t + 1] * sc_prev[0];
          acc[4 * t + 2] += p_prev[4 * t + 2] * sc_prev[1];
          acc[4 * t + 3] += p_prev[4 * t + 3] * sc_prev[1];
        }
        if (lane == 0) BarArrive(empty0 + 8 * ((i - 1) % S));
      }
    };
    int i = 0;
    for (; i + 1 < steps; i += 2) {
      step(i, aa, pa, sa, pb, sb);
      step(i + 1, ab, pb, sb, pa, sa);
    }
    if (i < steps) step(i, aa, pa, sa, pb, sb);
    WaitGroup<0>();
    auto sum_last = [&](const float (&p)[N / 2], const float (&sc)[2]) {
#pragma unroll
      for (int t = 0; t < N / 8; ++t) {
        acc[4 * t + 0] += p[4 * t + 0] * sc[0];
        acc[4 * t + 1] += p[4 * t + 1] * sc[0];
        acc[4 * t + 2] += p[4 * t + 2] * sc[1];
        acc[4 * t + 3] += p[4 * t + 3] * sc[1];
      }
    };
    if constexpr (OVERLAP) {
      if (steps % 2)         // the last chunk's (each branch names its arrays: no run-time indexing)
        sum_last(pa, sa);
      else if (steps > 0)
        sum_last(pb, sb);
    }
  }

  StorePartialSums<N, NW, KS>(smem, acc, !producer, group, rowl, KS * (NW * 128 + 32), y, m, n, wrow0, xrow0);
}

template <int N, int NW, int KS, int S, bool OVERLAP>
cudaError_t LaunchWs(cudaStream_t stream, const __nv_bfloat16* x, const int8_t* w, const float* scale,
                     __nv_bfloat16* y, int m, int n, int k) {
  return LaunchOn<N, NW, WsSmemBytes(N, NW, KS, S), KernelWs<N, NW, KS, S, OVERLAP>>(KS * (NW * 128 + 32), stream,
                                                                                   x, w, scale, y, m, n, k);
}

}  // namespace wgmma
}  // namespace w8a16
}  // namespace jaxllm
