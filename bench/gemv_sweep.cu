// Times every configuration of the W8A16 kernel template (ffi/w8a16_cuda.cuh) on the model's matmul shapes,
// as the decode step uses them: n and 2n launches back to back in one CUDA graph, per-call time the
// difference over n (launch gaps and graph overhead cancel), weights rotated over copies spanning 2x the L2
// so every call reads from device memory. Each configuration's output is checked against a plain reference
// kernel first (relative L2 error, poisoned output). With -DWITH_CUBLAS, cuBLAS's bf16 GEMM of the same
// shape is timed the same way beside it.
//
//   bash bench/build_gemv_sweep.sh 90 /tmp/gemv_sweep      (the GPU's compute capability; on Hopper sm_90a, for
//   the wgmma candidate, bench/w8a16_wgmma.cuh, which a build for another target skips; cuBLAS when found)
//   /tmp/gemv_sweep [out.jsonl [shape,shape,...]]     (GEMV_MS=1,2,4: the rows of x timed, up to 64 (the
//   tensor-core kernels' configurations at 8, 16, 32, 64, and at 13, 27, 50 for part-filled tiles: GEMV_MS=
//   13,16,27,32,50,64 with the shape odd_n checks their edges); default 1, 2, 4)
//
// Shapes: the Qwen2.5-0.5B matmuls (qkv, o, gate_up, down, lm_head) and those of the larger presets, named
// <matmul>_<preset> (qkv_7b: Qwen2.5-7B's fused q/k/v weights, ...).
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#ifdef WITH_CUBLAS
#include <cublas_v2.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>
#include <vector>

#include "fills.cuh"
#include "graph_timer.cuh"
#include "w8a16_cuda.cuh"
#include "w8a16_mma_staged.cuh"
#include "w8a16_wgmma.cuh"

using bf16 = __nv_bfloat16;
namespace w = jaxllm::w8a16;

// Dequantized bf16 copy of the weights, for cuBLAS.
__global__ void Dequant(const int8_t* q, const float* s, bf16* out, size_t n_rows, int k, int groups) {
  const size_t total = n_rows * k;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16(float(q[i]) * s[(i / k) * groups + (i % k) / (k / groups)]);
}
// Reference: one thread per output, plain loops in f32.
__global__ void Reference(const bf16* x, const int8_t* q, const float* s, float* y, int m, int n, int k, int groups) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= m * n) return;
  const int row = i % n, mi = i / n, group = k / groups;
  float acc = 0.f;
  for (int g = 0; g < groups; ++g) {
    float part = 0.f;
    for (int j = g * group; j < (g + 1) * group; ++j)
      part += __bfloat162float(x[size_t(mi) * k + j]) * float(q[size_t(row) * k + j]);
    acc += part * s[size_t(row) * groups + g];
  }
  y[i] = acc;
}

constexpr int kRows = 64;   // the most rows of x timed (GEMV_MS)

struct Shape {
  const char* name;
  int n, k;
};

using LaunchFn = std::function<cudaError_t(cudaStream_t, const bf16*, const int8_t*, const float*, bf16*, int, int,
                                           int, int)>;
struct Config {
  std::string name;
  int mt;           // rows of x the configuration is timed at
  bool (*fits)(int k);   // whether it takes this K (streaming variants: one round per row)
  LaunchFn fn;
  bool matmul = true;    // false: a reference point (read floor, empty kernel), its output not checked
};

// Reference points for the matmuls' times in this harness: reading the weight bytes once with the
// matmul's own load (16 bytes, L2 prefetch hint), U loads in flight per thread, over one load round of
// blocks (ONE_WAVE) or a grid of the resident blocks; nothing else. A word is written only if the xor of
// all loads hits a value it does not, so the loads cannot be dropped. n16 = 0 gives an empty kernel.
template <int U>
__global__ void __launch_bounds__(w::kThreads) ReadFloor(const uint4* p, size_t n16, uint32_t* sink) {
  const size_t stride = size_t(gridDim.x) * blockDim.x;
  uint32_t acc = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n16; i += stride * U) {
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) v[u] = i + u * stride < n16 ? w::LoadW<true>(p + i + u * stride) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

// The same, also loading each chunk's f32 group scale as the matmul does (one 4-byte load per 16-byte load).
template <int U>
__global__ void __launch_bounds__(w::kThreads) ReadFloorScaled(const uint4* p, const float* s, uint32_t n16,
                                                               uint32_t chunks, uint32_t chunk_div, int groups,
                                                               uint32_t* sink) {
  const uint32_t stride = gridDim.x * blockDim.x;
  uint32_t acc = 0;
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n16; i += stride * U) {
    uint4 v[U];
    float sv[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const uint32_t c = i + u * stride, row = c / chunks;
      v[u] = c < n16 ? w::LoadW<true>(p + c) : make_uint4(0, 0, 0, 0);
      sv[u] = c < n16 ? __ldg(s + size_t(row) * groups + w::DivSmall(int(c - row * chunks), chunk_div)) : 0.f;
    }
#pragma unroll
    for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w ^ __float_as_uint(sv[u]);
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}

template <int U>
Config MakeReadFloorScaled() {
  return {std::string("read_floor_scaled_u") + std::to_string(U) + "_one_wave", 1, [](int) { return true; },
          [](cudaStream_t st, const bf16*, const int8_t* q, const float* s, bf16* y, int, int n, int k, int g) {
            const size_t n16 = size_t(n) * k / 16;
            const int per_round = w::kThreads * U;
            ReadFloorScaled<U><<<int((n16 + per_round - 1) / per_round), w::kThreads, 0, st>>>(
                reinterpret_cast<const uint4*>(q), s, uint32_t(n16), uint32_t(k / 16), w::DivMagic(uint32_t(k / g / 16)),
                g, reinterpret_cast<uint32_t*>(y));
            return cudaGetLastError();
          },
          false};
}

// The same over blocks of 256 x U chunks (U = 7: the blocks of the matmul's 4-row teams at K 896), each
// block also reading x (bf16: the first K / 8 threads, one 16-byte load each, after the weights) as the
// matmul's blocks do: all blocks the same copy, or (XREP) block b copy b % kXCopies.
constexpr int kXCopies = 64, kXMaxK = 4864;
__device__ uint4 g_x_copies[kXCopies * kXMaxK * 2 / 16];
template <int U, bool X, bool XREP>
__global__ void __launch_bounds__(w::kThreads) ReadFloorX(const uint4* p, size_t n16, const uint4* x, int x16,
                                                          uint32_t* sink) {
  const size_t base = size_t(blockIdx.x) * w::kThreads * U + threadIdx.x;
  uint4 v[U];
#pragma unroll
  for (int u = 0; u < U; ++u) v[u] = base + u * w::kThreads < n16 ? w::LoadW<true>(p + base + u * w::kThreads) : make_uint4(0, 0, 0, 0);
  uint4 xv = make_uint4(0, 0, 0, 0);
  if (X && int(threadIdx.x) < x16) xv = __ldg((XREP ? g_x_copies + (blockIdx.x % kXCopies) * x16 : x) + threadIdx.x);
  uint32_t acc = xv.x ^ xv.y ^ xv.z ^ xv.w;
#pragma unroll
  for (int u = 0; u < U; ++u) acc ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
  if (acc == 0x9e3779b9u) *sink = acc;
}

template <int U, bool X, bool XREP>
Config MakeReadFloorX() {
  return {std::string("read_floor_block_u") + std::to_string(U) + (X ? (XREP ? "_x_per_block" : "_x_shared") : ""), 1,
          [](int k) { return k <= kXMaxK; },
          [](cudaStream_t st, const bf16* x, const int8_t* q, const float*, bf16* y, int, int n, int k, int) {
            const size_t n16 = size_t(n) * k / 16;
            const int blocks = int((n16 + w::kThreads * U - 1) / (w::kThreads * U));
            ReadFloorX<U, X, XREP><<<blocks, w::kThreads, 0, st>>>(reinterpret_cast<const uint4*>(q), n16,
                                                                   reinterpret_cast<const uint4*>(x), k * 2 / 16,
                                                                   reinterpret_cast<uint32_t*>(y));
            return cudaGetLastError();
          },
          false};
}

template <int U, bool ONE_WAVE>
Config MakeReadFloor() {
  return {std::string("read_floor_u") + std::to_string(U) + (ONE_WAVE ? "_one_wave" : "_resident"), 1,
          [](int) { return true; },
          [](cudaStream_t st, const bf16*, const int8_t* q, const float*, bf16* y, int, int n, int k, int) {
            const size_t n16 = size_t(n) * k / 16;
            const int per_round = w::kThreads * U;
            int blocks = int((n16 + per_round - 1) / per_round);
            if (!ONE_WAVE) {
              w::Residency res;
              if (cudaError_t e = w::ResidencyOf(reinterpret_cast<const void*>(ReadFloor<U>), 0, &res); e != cudaSuccess)
                return e;
              blocks = res.sms * res.per_sm;
            }
            ReadFloor<U><<<blocks, w::kThreads, 0, st>>>(reinterpret_cast<const uint4*>(q), n16,
                                                         reinterpret_cast<uint32_t*>(y));
            return cudaGetLastError();
          },
          false};
}

Config MakeEmpty() {
  return {"empty_kernel", 1, [](int) { return true; },
          [](cudaStream_t st, const bf16*, const int8_t* q, const float*, bf16* y, int, int, int, int) {
            ReadFloor<1><<<1, w::kThreads, 0, st>>>(reinterpret_cast<const uint4*>(q), 0, reinterpret_cast<uint32_t*>(y));
            return cudaGetLastError();
          },
          false};
}

const char* ConvName(w::Conv c) { return c == w::Conv::kI2F ? "i2f" : c == w::Conv::kMagic ? "magic" : "int16"; }

template <int MT, int TPR, int ROWS, int U, w::Conv C, unsigned F = 0>
Config Make() {
  char buf[96];
  std::snprintf(buf, sizeof buf, "mt%d_tpr%d_rows%d_u%d_%s%s%s%s%s", MT, TPR, ROWS, U, ConvName(C),
                F & w::kHint ? "_hint" : "", F & w::kStageX ? "_xs" : "", F & w::kXFirst ? "_xfirst" : "",
                F & w::kBalance ? "_bal" : "");
  return {buf, MT, [](int k) { return !(F & w::kStageX) || w::XStageBytes(MT, k) <= w::kMaxXStageBytes; },
          [](cudaStream_t st, const bf16* x, const int8_t* q, const float* s, bf16* y, int m, int n, int k, int g) {
            return w::Launch<bf16, MT, TPR, ROWS, U, C, F>(st, x, q, s, y, m, n, k, g);
          }};
}

// A tensor-core kernel's configuration at M = m rows: every one of them launches as (stream, x, w, scale, y, m,
// n, k) and takes any K that is a multiple of the 64-input chunk.
using TensorCoreLaunch = cudaError_t (*)(cudaStream_t, const bf16*, const int8_t*, const float*, bf16*, int, int, int);
Config TensorCores(const char* name, int m, TensorCoreLaunch launch) {
  return {name, m, [](int k) { return k % w::mma::kChunk == 0; },
          [launch](cudaStream_t st, const bf16* x, const int8_t* q, const float* s, bf16* y, int m, int n, int k, int) {
            return launch(st, x, q, s, y, m, n, k);
          }};
}

// The tensor-core kernel (w8a16_mma.cuh) timed at M rows: MT tiles of 8 rows of x, RT 16-row tiles of w a warp, KS
// warps splitting K, U chunks in flight.
template <int MT, int RT, int KS, int U>
Config MakeMma(int m) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "mma_mt%d_rt%d_ks%d_u%d", MT, RT, KS, U);
  return TensorCores(buf, m, w::mma::Launch<MT, RT, KS, U>);
}

// The candidate with x staged once per block (bench/w8a16_mma_staged.cuh): KS groups of NW warps, RT 16-row tiles
// of w a warp, slabs of U chunks.
template <int MT, int RT, int NW, int KS, int U>
Config MakeStaged(int m) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "mmastaged_mt%d_rt%d_nw%d_ks%d_u%d", MT, RT, NW, KS, U);
  return TensorCores(buf, m, w::mma_staged::Launch<MT, RT, NW, KS, U>);
}

// The Hopper candidate (bench/w8a16_wgmma.cuh; built with -arch=sm_90a): wgmma with N rows of x a block, KS
// groups of NW warpgroups, S ring slots.
template <int N, int NW, int KS, int S, int U>
Config MakeWg(int m) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "wgmma_n%d_nw%d_ks%d_s%d_u%d", N, NW, KS, S, U);
  return TensorCores(buf, m, w::wgmma::Launch<N, NW, KS, S, U>);
}

// Its warp-specialized version (KernelWs): a producer warp and NW consumer warpgroups a group, S ring slots.
template <int N, int NW, int KS, int S, bool OVERLAP = false>
Config MakeWs(int m) {
  char buf[96];
  std::snprintf(buf, sizeof buf, "wgmmaws_n%d_nw%d_ks%d_s%d%s", N, NW, KS, S, OVERLAP ? "_overlap" : "");
  return TensorCores(buf, m, w::wgmma::LaunchWs<N, NW, KS, S, OVERLAP>);
}

template <int ROWS, int U, bool HINT = false, int MINB = 1, w::Conv C = w::Conv::kMagic>
Config MakeStream() {
  char buf[96];
  std::snprintf(buf, sizeof buf, "stream_rows%d_u%d%s%s%s", ROWS, U, HINT ? "_hint" : "",
                MINB > 1 ? ("_minb" + std::to_string(MINB)).c_str() : "", C == w::Conv::kInt16 ? "_int16" : "");
  return {buf, 1, w::StreamFits<U>, [](cudaStream_t st, const bf16* x, const int8_t* q, const float* s, bf16* y, int, int n,
                             int k, int g) { return w::LaunchStream<bf16, ROWS, U, HINT, MINB, C>(st, x, q, s, y, n, k, g); }};
}

int main(int argc, char** argv) {
  FILE* out = argc > 1 ? std::fopen(argv[1], "w") : nullptr;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);   // a line at a time into a log, also when killed
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const int kGroup = 64;
  const Shape shapes[] = {
      {"qkv", 1152, 896}, {"o", 896, 896}, {"gate_up", 9728, 896}, {"down", 896, 4864}, {"lm_head", 151936, 896},
      // llama-3.2-1b, qwen2.5-1.5b, qwen2.5-3b, qwen2.5-7b, llama-3.1-8b, qwen2.5-14b (N = outputs, K = inputs).
      {"qkv_1b", 3072, 2048}, {"o_1b", 2048, 2048}, {"gate_up_1b", 16384, 2048}, {"down_1b", 2048, 8192},
      {"lm_head_1b", 128256, 2048},
      {"qkv_1.5b", 2048, 1536}, {"gate_up_1.5b", 17920, 1536}, {"down_1.5b", 1536, 8960},
      {"lm_head_1.5b", 151936, 1536},
      {"qkv_3b", 2560, 2048}, {"gate_up_3b", 22016, 2048}, {"down_3b", 2048, 11008},
      {"qkv_7b", 4608, 3584}, {"o_7b", 3584, 3584}, {"gate_up_7b", 37888, 3584}, {"down_7b", 3584, 18944},
      {"lm_head_7b", 151936, 3584},
      {"qkv_8b", 6144, 4096}, {"o_8b", 4096, 4096}, {"gate_up_8b", 28672, 4096}, {"down_8b", 4096, 14336},
      {"lm_head_8b", 128256, 4096},
      {"qkv_14b", 7168, 5120}, {"o_14b", 5120, 5120}, {"gate_up_14b", 27648, 5120}, {"down_14b", 5120, 13824},
      {"lm_head_14b", 152064, 5120},
      // N not a multiple of a block's rows (rows past N), for the tensor-core kernels' edges
      {"odd_n", 1000, 896}};
  constexpr w::Conv kI2F = w::Conv::kI2F, kMagic = w::Conv::kMagic, kInt16 = w::Conv::kInt16;
  constexpr unsigned kH = w::kHint, kS = w::kStageX, kA = w::kXFirst, kB = w::kBalance;
  std::vector<Config> configs = {
      // M = 1. The first is the earlier kernel's scheme (warp per row, conversion instruction).
      Make<1, 32, 1, 4, kI2F>(), Make<1, 32, 2, 2, kMagic, kH>(), Make<1, 32, 4, 2, kMagic, kH>(),
      Make<1, 64, 1, 1, kMagic, kH>(), Make<1, 64, 2, 1, kMagic, kH>(), Make<1, 128, 1, 1, kMagic, kH>(),
      Make<1, 256, 1, 2, kMagic, kH>(), Make<1, 32, 1, 2, kInt16, kH>(), Make<1, 32, 2, 2, kInt16, kH>(),
      Make<1, 32, 4, 2, kInt16, kH>(), Make<1, 64, 1, 1, kInt16, kH>(), Make<1, 64, 1, 2, kInt16, kH>(),
      Make<1, 128, 1, 2, kInt16, kH>(), Make<1, 256, 1, 2, kInt16, kH>(),
      Make<1, 32, 1, 2, kInt16, kH | kS>(), Make<1, 32, 2, 2, kInt16, kH | kS>(),
      Make<1, 32, 4, 2, kInt16, kH | kS>(), Make<1, 64, 1, 1, kInt16, kH | kS>(),
      Make<1, 64, 2, 1, kInt16, kH | kS>(), Make<1, 128, 1, 2, kInt16, kH | kS>(),
      Make<1, 256, 1, 2, kInt16, kH | kS>(),
      // Streaming (M = 1, short K).
      MakeStream<2, 2, true>(), MakeStream<1, 2, true, 3>(), MakeStream<1, 2, true, 4>(),
      MakeStream<1, 2, true, 1, kInt16>(), MakeStream<2, 2, true, 1, kInt16>(), MakeStream<4, 2, true, 1, kInt16>(),
      MakeStream<1, 2, true, 3, kInt16>(), MakeStream<2, 2, true, 3, kInt16>(), MakeStream<1, 2, true, 4, kInt16>(),
      MakeStream<2, 2, true, 2, kInt16>(),
      // Reference points: an empty kernel, and reading the weight bytes with nothing else.
      MakeEmpty(), MakeReadFloor<1, true>(), MakeReadFloor<2, true>(), MakeReadFloor<4, true>(),
      MakeReadFloor<2, false>(), MakeReadFloor<4, false>(), MakeReadFloorScaled<1>(), MakeReadFloorScaled<2>(),
      MakeReadFloorX<7, false, false>(), MakeReadFloorX<7, true, false>(), MakeReadFloorX<7, true, true>(),
      // M = 2 and 4.
      Make<2, 32, 2, 2, kMagic, kH>(), Make<2, 64, 1, 2, kMagic, kH>(), Make<2, 128, 1, 2, kMagic, kH>(),
      Make<2, 32, 2, 2, kInt16, kH>(), Make<2, 32, 4, 2, kInt16, kH>(), Make<2, 64, 1, 2, kInt16, kH>(),
      Make<2, 128, 1, 2, kInt16, kH>(), Make<4, 32, 2, 2, kMagic, kH>(), Make<4, 32, 4, 2, kMagic, kH>(),
      Make<4, 64, 1, 2, kMagic, kH>(), Make<4, 128, 1, 2, kMagic, kH>(), Make<4, 32, 2, 2, kInt16, kH>(),
      Make<4, 32, 4, 2, kInt16, kH>(), Make<4, 64, 1, 2, kInt16, kH>(), Make<4, 128, 1, 2, kInt16, kH>(),
      Make<2, 32, 2, 2, kInt16, kH | kS>(), Make<2, 32, 4, 2, kInt16, kH | kS>(),
      Make<2, 64, 1, 2, kInt16, kH | kS>(), Make<2, 128, 1, 2, kInt16, kH | kS>(),
      Make<4, 32, 2, 2, kInt16, kH | kS>(), Make<4, 32, 4, 2, kInt16, kH | kS>(),
      Make<4, 64, 1, 2, kInt16, kH | kS>(), Make<4, 128, 1, 2, kInt16, kH | kS>(),
      // Teams of 8 and 16 lanes (K 896 = 8 lanes x 7 chunks, 16 x 3.5).
      Make<1, 8, 1, 7, kInt16, kH | kS>(), Make<1, 8, 2, 7, kInt16, kH | kS>(),
      Make<1, 16, 1, 4, kInt16, kH | kS>(), Make<1, 16, 2, 4, kInt16, kH | kS>(),
      Make<2, 16, 1, 4, kInt16, kH | kS>(), Make<4, 16, 1, 4, kInt16, kH | kS>(),
      // x staged before the weight loads are issued (kA), rows shared evenly between the SMs (kB).
      Make<1, 32, 2, 2, kInt16, kH | kS | kA>(), Make<1, 32, 4, 2, kInt16, kH | kS | kA>(),
      Make<1, 16, 2, 4, kInt16, kH | kS | kA>(), Make<1, 32, 4, 2, kInt16, kH | kS | kB>(),
      Make<1, 16, 2, 4, kInt16, kH | kS | kB>(), Make<1, 32, 2, 2, kInt16, kH | kS | kA | kB>(),
      Make<1, 32, 4, 2, kInt16, kH | kS | kA | kB>(), Make<1, 16, 2, 4, kInt16, kH | kS | kA | kB>(),
      Make<1, 64, 1, 1, kMagic, kH | kB>(), Make<2, 32, 2, 2, kInt16, kH | kS | kA>(),
      Make<2, 32, 4, 2, kInt16, kH | kS | kA>(), Make<2, 32, 2, 2, kInt16, kH | kS | kA | kB>(),
      Make<2, 16, 2, 4, kInt16, kH | kS | kA | kB>(), Make<4, 32, 2, 2, kInt16, kH | kS | kA>(),
      Make<4, 32, 4, 2, kInt16, kH | kS | kA>(), Make<4, 32, 2, 2, kInt16, kH | kS | kA | kB>(),
      Make<4, 16, 2, 4, kInt16, kH | kS | kA | kB>(),
      // Long K (the 1-14B shapes: K 1536-5120, and 8192-18944 for down), x staged as int16 chunks.
      Make<1, 32, 1, 4, kInt16, kH | kS>(), Make<1, 32, 2, 4, kInt16, kH | kS>(), Make<1, 32, 1, 8, kInt16, kH | kS>(),
      Make<1, 32, 2, 8, kInt16, kH | kS>(), Make<1, 32, 4, 4, kInt16, kH | kS>(), Make<1, 64, 2, 4, kInt16, kH | kS>(),
      Make<1, 64, 1, 4, kInt16, kH | kS>(), Make<1, 64, 4, 2, kInt16, kH | kS>(), Make<1, 128, 2, 2, kInt16, kH | kS>(),
      Make<1, 128, 2, 4, kInt16, kH | kS>(), Make<1, 256, 2, 2, kInt16, kH | kS>(),
      Make<1, 32, 2, 4, kInt16, kH | kS | kA | kB>(), Make<1, 32, 4, 4, kInt16, kH | kS | kA | kB>(),
      Make<1, 64, 2, 4, kInt16, kH | kS | kA | kB>(), Make<1, 16, 2, 8, kInt16, kH | kS | kA | kB>(),
      Make<1, 128, 2, 4, kInt16, kH | kS | kB>(), Make<1, 128, 4, 2, kInt16, kH | kS | kB>(),
      Make<1, 256, 4, 2, kInt16, kH | kB>(), Make<1, 256, 2, 2, kInt16, kH | kB>(), Make<1, 256, 4, 4, kInt16, kH | kB>(),
      Make<1, 256, 8, 2, kInt16, kH | kB>(), Make<1, 256, 2, 4, kInt16, kH | kS | kB>(),
      MakeStream<1, 8, true, 1, kInt16>(), MakeStream<2, 8, true, 1, kInt16>(), MakeStream<1, 4, true, 1, kInt16>(),
      Make<2, 32, 2, 4, kInt16, kH | kS | kA>(), Make<2, 64, 2, 4, kInt16, kH | kS | kA>(),
      Make<2, 128, 2, 2, kInt16, kH | kS>(), Make<4, 32, 2, 4, kInt16, kH | kS | kA>(),
      Make<4, 64, 2, 4, kInt16, kH | kS | kA>(), Make<4, 128, 2, 2, kInt16, kH | kS>(),
  };
  for (Config c : {MakeMma<1, 1, 8, 4>(8), MakeMma<1, 1, 4, 4>(8), MakeMma<1, 1, 16, 2>(8),
                   MakeMma<2, 1, 8, 4>(16), MakeMma<2, 1, 4, 4>(16), MakeMma<2, 2, 8, 2>(16), MakeMma<2, 1, 16, 2>(16),
                   MakeMma<2, 1, 8, 8>(16), MakeMma<4, 1, 8, 2>(32), MakeMma<4, 1, 8, 4>(32), MakeMma<4, 2, 8, 2>(32),
                   MakeMma<4, 1, 4, 4>(32), MakeMma<8, 2, 8, 2>(64), MakeMma<8, 1, 8, 2>(64), MakeMma<8, 2, 4, 2>(64),
                   MakeMma<8, 1, 8, 4>(64), MakeMma<8, 2, 8, 1>(64),
                   // x staged once per block (M = 16, 32, 64)
                   MakeStaged<2, 2, 4, 1, 2>(16), MakeStaged<2, 1, 4, 2, 4>(16), MakeStaged<2, 2, 2, 2, 4>(16),
                   MakeStaged<2, 1, 2, 4, 4>(16), MakeStaged<2, 4, 2, 2, 2>(16),
                   MakeStaged<4, 2, 4, 1, 2>(32), MakeStaged<4, 1, 4, 2, 2>(32), MakeStaged<4, 2, 2, 2, 2>(32),
                   MakeStaged<4, 1, 8, 1, 2>(32), MakeStaged<4, 1, 2, 4, 2>(32),
                   MakeStaged<8, 1, 4, 1, 2>(64), MakeStaged<8, 2, 4, 1, 1>(64), MakeStaged<8, 1, 8, 1, 2>(64),
                   MakeStaged<8, 2, 2, 2, 2>(64), MakeStaged<8, 1, 4, 2, 2>(64), MakeStaged<8, 2, 4, 2, 1>(64),
                   MakeStaged<8, 1, 2, 4, 2>(64), MakeStaged<8, 2, 2, 2, 1>(64),
                   // row counts that leave a tile part-filled (x rows past M), against the reference
                   MakeStaged<2, 2, 4, 1, 2>(13), MakeStaged<4, 2, 4, 1, 2>(27), MakeStaged<8, 1, 4, 1, 2>(50),
                   MakeStaged<8, 2, 2, 2, 1>(50), MakeMma<2, 1, 8, 4>(13), MakeMma<8, 2, 8, 1>(50)})
    configs.push_back(c);
  // More of the kernel's own configurations at 16 rows (the 7B batch-16 step): fewer warps a block, longer chunk
  // groups (docs/results/2026-12-06-h100-mma-pipe.md).
  for (Config c : {MakeMma<2, 1, 2, 8>(16), MakeMma<2, 1, 4, 8>(16), MakeMma<2, 2, 4, 2>(16), MakeMma<2, 2, 8, 1>(16),
                   MakeMma<2, 1, 2, 4>(16),
                   // a warp a block owning all of K (no reduction in shared memory), and more warps splitting K
                   MakeMma<2, 1, 1, 4>(16), MakeMma<2, 1, 1, 8>(16), MakeMma<2, 2, 1, 4>(16), MakeMma<2, 2, 2, 4>(16),
                   MakeMma<2, 1, 16, 4>(16), MakeMma<2, 1, 12, 4>(16), MakeMma<2, 2, 16, 2>(16),
                   MakeMma<8, 2, 16, 1>(64), MakeMma<8, 2, 2, 2>(64), MakeMma<8, 2, 1, 2>(64)})
    configs.push_back(c);
  for (Config c : {MakeWg<16, 1, 1, 4, 2>(16), MakeWg<16, 1, 2, 4, 2>(16), MakeWg<16, 1, 1, 3, 1>(16),
                   MakeWg<16, 1, 4, 3, 2>(16), MakeWg<16, 1, 1, 3, 2>(16), MakeWg<16, 1, 2, 3, 1>(16),
                   MakeWg<32, 1, 1, 4, 2>(32), MakeWg<32, 1, 2, 4, 2>(32), MakeWg<32, 1, 1, 3, 1>(32),
                   MakeWg<64, 1, 1, 4, 2>(64), MakeWg<64, 1, 1, 3, 1>(64), MakeWg<64, 2, 1, 4, 2>(64),
                   MakeWg<64, 1, 2, 3, 1>(64),
                   MakeWg<16, 1, 2, 4, 2>(13), MakeWg<64, 1, 1, 3, 1>(50), MakeWg<64, 2, 1, 4, 2>(50)})
    configs.push_back(c);
  for (Config c : {MakeWs<16, 1, 1, 4>(16), MakeWs<16, 1, 1, 8>(16), MakeWs<16, 1, 2, 6>(16), MakeWs<16, 1, 4, 4>(16),
                   MakeWs<16, 2, 1, 6>(16), MakeWs<16, 1, 2, 6, true>(16), MakeWs<64, 1, 1, 6>(64),
                   MakeWs<64, 1, 2, 4>(64), MakeWs<64, 2, 1, 4>(64), MakeWs<64, 1, 1, 8>(64),
                   MakeWs<64, 1, 2, 4, true>(64),
                   MakeWs<16, 1, 2, 6>(13), MakeWs<64, 1, 1, 6>(50), MakeWs<64, 2, 1, 4>(50)})
    configs.push_back(c);
  const bool wgmma_built = w::wgmma::Available();
  if (!wgmma_built) std::printf("(not built for sm_90a: the wgmma candidate's configurations are skipped)\n");
  std::vector<int> ms = {1, 2, 4};
  if (const char* e = std::getenv("GEMV_MS")) {
    ms.clear();
    for (const char* p = e; *p;) {
      ms.push_back(std::atoi(p));
      while (*p && *p != ',') ++p;
      if (*p) ++p;
    }
  }
#ifdef WITH_CUBLAS
  cublasHandle_t handle;
  if (cublasCreate(&handle) != CUBLAS_STATUS_SUCCESS) { std::fprintf(stderr, "cublasCreate failed\n"); return 1; }
  cublasSetStream(handle, st);
  void* cublas_ws;
  CHECK(cudaMalloc(&cublas_ws, 32 << 20));
  cublasSetWorkspace(handle, cublas_ws, 32 << 20);
#endif
  const std::string only = argc > 2 ? std::string(",") + argv[2] + "," : "";   // shapes to run (default all)
  for (const Shape& sh : shapes) {
    if (!only.empty() && only.find(std::string(",") + sh.name + ",") == std::string::npos) continue;
    const size_t wbytes = size_t(sh.n) * sh.k, groups = sh.k / kGroup;
    const int copies = int(std::min<size_t>(256, std::max<size_t>(2, (2 * size_t(prop.l2CacheSize)) / wbytes + 1)));
    const int calls = std::max(16, copies);
    int8_t* q;
    float* s;
    bf16 *x, *y;
    float* ref;
    CHECK(cudaMalloc(&q, wbytes * copies));
    CHECK(cudaMalloc(&s, size_t(sh.n) * groups * 4 * copies));
    CHECK(cudaMalloc(&x, size_t(kRows) * sh.k * 2));
    CHECK(cudaMalloc(&y, size_t(kRows) * sh.n * 2 * copies));
    CHECK(cudaMalloc(&ref, size_t(kRows) * sh.n * 4));
    FillInt8<<<1024, 256, 0, st>>>(q, wbytes * copies, 1);
    FillScale<<<1024, 256, 0, st>>>(s, size_t(sh.n) * groups * copies, 2);
    FillBf16<<<64, 256, 0, st>>>(x, size_t(kRows) * sh.k, 3, -1.f, 1.f);
    CHECK(cudaGetLastError());
    for (int m : ms) {
      if (m < 1 || m > kRows) continue;
      Reference<<<(m * sh.n + 255) / 256, 256, 0, st>>>(x, q, s, ref, m, sh.n, sh.k, int(groups));
      CHECK(cudaGetLastError());
      std::vector<float> r(size_t(m) * sh.n);
      CHECK(cudaMemcpyAsync(r.data(), ref, r.size() * 4, cudaMemcpyDeviceToHost, st));
      CHECK(cudaStreamSynchronize(st));
      const double floor_us = wbytes / 4.3e6;   // bytes / (4.3 TB/s, the copy bandwidth measured here)
      std::printf("\n%s N=%d K=%d M=%d: %.2f MB int8, %d copies, %d calls; floor at 4.3 TB/s %.2f us\n", sh.name, sh.n,
                  sh.k, m, wbytes / 1e6, copies, calls, floor_us);
      for (const Config& c : configs) {
        if (c.mt != m || !c.fits(sh.k)) continue;
        // odd_n checks the tensor-core kernels' edges only
        if (std::string(sh.name) == "odd_n" && c.name.find("mma") == std::string::npos) continue;
        if (c.name.rfind("wgmma", 0) == 0 && !wgmma_built) continue;
        auto check = [&](double& err, double& worst) { ErrorVsReference(st, y, r, &err, &worst); };
        double err = NAN, worst = NAN, err_after = NAN, worst_after = NAN;
        if (c.matmul) {
          FillBf16<<<256, 256, 0, st>>>(y, size_t(m) * sh.n, 9, NAN, NAN);   // poison
          CHECK(c.fn(st, x, q, s, y, m, sh.n, sh.k, int(groups)));
          check(err, worst);
        }
        const float us = PerCallUs(st, calls, [&](int i) {
          const int j = i % copies;
          CHECK(c.fn(st, x, q + wbytes * j, s + size_t(sh.n) * groups * j, y + size_t(kRows) * sh.n * j, m, sh.n, sh.k,
                     int(groups)));
        });
        if (c.matmul) check(err_after, worst_after);   // copy 0 again, as the timed calls left it
        const bool ok = err < 1e-2 && worst < 5e-2 && err_after < 1e-2 && worst_after < 5e-2;
        if (c.matmul)
          std::printf("  %-28s %8.2f us %7.0f GB/s  err %.2e worst %.2e%s\n", c.name.c_str(), us, wbytes / us / 1e3,
                      std::max(err, err_after), std::max(worst, worst_after), ok ? "" : "  WRONG");
        else
          std::printf("  %-28s %8.2f us %7.0f GB/s  (reference point)\n", c.name.c_str(), us, wbytes / us / 1e3);
        if (out)
          std::fprintf(out, "{\"shape\": \"%s\", \"n\": %d, \"k\": %d, \"m\": %d, \"config\": \"%s\", \"us\": %.3f, "
                       "\"gbps\": %.1f, \"rel_err\": %s, \"worst\": %s, \"ok\": %s, \"floor_us\": %.3f, \"matmul\": %s}\n",
                       sh.name, sh.n, sh.k, m, c.name.c_str(), us, wbytes / us / 1e3,
                       c.matmul ? std::to_string(std::max(err, err_after)).c_str() : "null",
                       c.matmul ? std::to_string(std::max(worst, worst_after)).c_str() : "null",
                       c.matmul ? (ok ? "true" : "false") : "null", floor_us, c.matmul ? "true" : "false");
        if (out) std::fflush(out);      // a sweep cut short by its time limit keeps what it measured
      }
#ifdef WITH_CUBLAS
      bf16* wd;
      const int bcopies = std::max(2, copies / 2);   // bf16 weights are twice the bytes
      CHECK(cudaMalloc(&wd, wbytes * 2 * bcopies));
      for (int j = 0; j < bcopies; ++j)
        Dequant<<<1024, 256, 0, st>>>(q + wbytes * j, s + size_t(sh.n) * groups * j, wd + wbytes * j, sh.n, sh.k,
                                      int(groups));
      const float one = 1.f, zero = 0.f;
      const float us = PerCallUs(st, calls, [&](int i) {
        const int j = i % bcopies;
        // y^T [N, M] = W [N, K] . x^T [K, M], column-major view: W^T is K x N col-major.
        if (cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, sh.n, m, sh.k, &one, wd + wbytes * j, CUDA_R_16BF, sh.k, x,
                         CUDA_R_16BF, sh.k, &zero, y + size_t(kRows) * sh.n * (j % copies), CUDA_R_16BF, sh.n,
                         CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT) != CUBLAS_STATUS_SUCCESS) {
          std::fprintf(stderr, "cublasGemmEx failed\n");
          std::exit(1);
        }
      });
      std::printf("  %-28s %8.2f us %7.0f GB/s (bf16 bytes)\n", "cublas_bf16", us, 2 * wbytes / us / 1e3);
      if (out)
        std::fprintf(out, "{\"shape\": \"%s\", \"n\": %d, \"k\": %d, \"m\": %d, \"config\": \"cublas_bf16\", \"us\": "
                     "%.3f, \"gbps\": %.1f}\n", sh.name, sh.n, sh.k, m, us, 2 * wbytes / us / 1e3);
      CHECK(cudaFree(wd));
#endif
    }
    CHECK(cudaFree(q));
    CHECK(cudaFree(s));
    CHECK(cudaFree(x));
    CHECK(cudaFree(y));
    CHECK(cudaFree(ref));
  }
  if (out) std::fclose(out);
  return 0;
}
