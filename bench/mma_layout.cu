// Is the tensor-core W8A16 kernel (ffi/w8a16_mma.cuh) slowed by how its loads meet device memory? A warp's
// weight load takes 64 bytes from each of 8 rows (the mma fragment's rows), so its bytes come in 64-byte pieces
// of rows K bytes apart. This times, on the 7B matmuls at 16 and 64 rows:
//   - the kernel on the engine's row-major [N, K] weights (the dispatch's configurations);
//   - the same kernel on the same weights repacked so that a warp's load is 1 KB in one piece (TILED: [N / 16,
//     K / 64, 32 lanes, 2 halves, 16 bytes]);
//   - either, with x's loads issued a chunk ahead of their use (XPF), every variant's output checked equal to the
//     row-major kernel's bit for bit;
//   - loads only, in the kernel's pattern on either layout, and a plain contiguous read of the same bytes.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I ffi -I bench -I $(python3 -c "import jax; \
//     print(jax.ffi.include_dir())") bench/mma_layout.cu -o /tmp/mma_layout && /tmp/mma_layout out.jsonl
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "fills.cuh"
#include "graph_timer.cuh"
#include "w8a16_cuda.cuh"

using bf16 = __nv_bfloat16;
namespace mma = jaxllm::w8a16::mma;

// Row-major [N, K] -> TILED: 16 bytes a thread, piece (tile, chunk, lane, half).
__global__ void Repack(const uint4* src, uint4* dst, int n, int k) {
  const int chunks = k / 64;
  const size_t total = size_t(n) * k / 16;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < total; i += size_t(gridDim.x) * blockDim.x) {
    const int h = int(i % 2), lane = int(i / 2 % 32);
    const size_t tq = i / 64, tile = tq / chunks, q = tq % chunks;
    const size_t row = tile * 16 + 8 * h + lane / 4;
    dst[i] = src[(row * k + q * 64 + 16 * (lane % 4)) / 16];
  }
}

// Loads only, in Kernel<MT, RT, KS, U, TILED>'s pattern (its grid, its warps' K ranges, U chunks in flight).
template <int RT, int KS, int U, bool TILED>
__global__ void __launch_bounds__(KS * 32) LoadsOnly(const int8_t* __restrict__ w, int n, int k, uint32_t* sink) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int chunks = k / 64, row0 = blockIdx.x * 16 * RT;
  const int begin = warp * chunks / KS, end = (warp + 1) * chunks / KS;
  const int8_t* wrow[RT][2];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h)
      wrow[r][h] = TILED ? w + (size_t(min(blockIdx.x * RT + r, n / 16 - 1)) * chunks * 32 + lane) * 32 + 16 * h
                         : w + size_t(min(row0 + 16 * r + 8 * h + g, n - 1)) * k + 16 * c;
  uint32_t acc = 0;
  for (int base = begin; base < end; base += U) {
    uint4 v[U][RT][2];
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          v[u][r][h] = base + u < end ? mma::LoadWeights(wrow[r][h] + size_t(base + u) * (TILED ? 1024 : 64))
                                      : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) acc ^= v[u][r][h].x ^ v[u][r][h].y ^ v[u][r][h].z ^ v[u][r][h].w;
  }
  if (acc == 0x9e3779b9u) *sink = acc;
}


struct Shape {
  const char* name;
  int n, k;
};
int main(int argc, char** argv) {
  FILE* out = argc > 1 ? std::fopen(argv[1], "a") : nullptr;
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  uint32_t* sink;
  CHECK(cudaMalloc(&sink, 4));
  int per_sm = 0;
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, ReadOnce, 256, 0));
  const Shape shapes[] = {{"gate_up_7b", 37888, 3584}, {"down_7b", 3584, 18944}, {"qkv_7b", 4608, 3584}, {"o_7b", 3584, 3584}};
  for (const Shape& sh : shapes) {
    const size_t wbytes = size_t(sh.n) * sh.k, groups = sh.k / 64;
    const int copies = int(std::max<size_t>(2, 2 * size_t(prop.l2CacheSize) / wbytes + 1)), calls = std::max(16, copies);
    int8_t *q, *qt;
    float* s;
    bf16 *x, *y, *y2;
    CHECK(cudaMalloc(&q, wbytes * copies));
    CHECK(cudaMalloc(&qt, wbytes * copies));
    CHECK(cudaMalloc(&s, sh.n * groups * 4 * copies));
    CHECK(cudaMalloc(&x, size_t(64) * sh.k * 2));
    CHECK(cudaMalloc(&y, size_t(64) * sh.n * 2 * copies));
    CHECK(cudaMalloc(&y2, size_t(64) * sh.n * 2));
    FillInt8<<<2048, 256, 0, st>>>(q, wbytes * copies, 1);
    FillScale<<<1024, 256, 0, st>>>(s, sh.n * groups * copies, 2);
    FillBf16<<<64, 256, 0, st>>>(x, size_t(64) * sh.k, 3);
    for (int j = 0; j < copies; ++j)
      Repack<<<2048, 256, 0, st>>>(reinterpret_cast<const uint4*>(q + wbytes * j), reinterpret_cast<uint4*>(qt + wbytes * j),
                                   sh.n, sh.k);
    CHECK(cudaGetLastError());
    CHECK(cudaStreamSynchronize(st));
    auto time = [&](const std::function<cudaError_t(int)>& fn) {
      return PerCallUs(st, calls, [&](int i) { CHECK(fn(i % copies)); });
    };
    auto report = [&](int m, const std::string& what, float us, const char* extra = "") {
      std::printf("  %-12s M=%-2d %-36s %8.2f us %6.0f GB/s %s\n", sh.name, m, what.c_str(), us, wbytes / us / 1e3, extra);
      if (out) {
        std::fprintf(out, "{\"shape\": \"%s\", \"n\": %d, \"k\": %d, \"m\": %d, \"what\": \"%s\", \"us\": %.3f, \"gpu\": \"%s\"%s}\n",
                     sh.name, sh.n, sh.k, m, what.c_str(), us, prop.name, extra);
        std::fflush(out);
      }
    };
    const float contiguous = time([&](int j) {
      ReadOnce<<<prop.multiProcessorCount * per_sm, 256, 0, st>>>(reinterpret_cast<const uint4*>(q + wbytes * j),
                                                                   wbytes / 16, nullptr, 0, sink);
      return cudaGetLastError();
    });
    report(0, "contiguous read", contiguous);
    // The configurations the rule and the autotune take for these shapes at 16 and 64 rows.
    auto run = [&]<int MT, int RT, int KS, int U>() {
      const int m = 8 * MT;
      const std::string name = "mt" + std::to_string(MT) + "_rt" + std::to_string(RT) + "_ks" + std::to_string(KS) +
                               "_u" + std::to_string(U);
      const dim3 grid((sh.n + 16 * RT - 1) / (16 * RT));
      for (bool tiled : {false, true}) {
        const int8_t* w = tiled ? qt : q;
        for (bool xpf : {false, true}) {
          const float us = time([&](int j) {
            const int8_t* wj = w + wbytes * j;
            const float* sj = s + sh.n * groups * j;
            bf16* yj = y + size_t(64) * sh.n * j;
            if (tiled) return xpf ? mma::Launch<MT, RT, KS, U, true, true>(st, x, wj, sj, yj, m, sh.n, sh.k)
                                  : mma::Launch<MT, RT, KS, U, true, false>(st, x, wj, sj, yj, m, sh.n, sh.k);
            return xpf ? mma::Launch<MT, RT, KS, U, false, true>(st, x, wj, sj, yj, m, sh.n, sh.k)
                       : mma::Launch<MT, RT, KS, U, false, false>(st, x, wj, sj, yj, m, sh.n, sh.k);
          });
          // copy 0 against the row-major kernel without XPF: the same bits (the same sums in the same order)
          CHECK((mma::Launch<MT, RT, KS, U, false, false>(st, x, q, s, y, m, sh.n, sh.k)));
          if (tiled) CHECK((xpf ? mma::Launch<MT, RT, KS, U, true, true>(st, x, qt, s, y2, m, sh.n, sh.k)
                                : mma::Launch<MT, RT, KS, U, true, false>(st, x, qt, s, y2, m, sh.n, sh.k)));
          else CHECK((xpf ? mma::Launch<MT, RT, KS, U, false, true>(st, x, q, s, y2, m, sh.n, sh.k)
                          : mma::Launch<MT, RT, KS, U, false, false>(st, x, q, s, y2, m, sh.n, sh.k)));
          std::vector<uint16_t> a(size_t(m) * sh.n), b(a.size());
          CHECK(cudaMemcpyAsync(a.data(), y, a.size() * 2, cudaMemcpyDeviceToHost, st));
          CHECK(cudaMemcpyAsync(b.data(), y2, b.size() * 2, cudaMemcpyDeviceToHost, st));
          CHECK(cudaStreamSynchronize(st));
          const bool same = std::memcmp(a.data(), b.data(), a.size() * 2) == 0;
          report(m, name + (tiled ? " tiled" : " row-major") + (xpf ? " xpf" : ""), us,
                 same ? ", \"same_bits\": true" : ", \"same_bits\": false");
        }
        const float lo = time([&](int j) {
          if (tiled) LoadsOnly<RT, KS, U, true><<<grid, KS * 32, 0, st>>>(w + wbytes * j, sh.n, sh.k, sink);
          else LoadsOnly<RT, KS, U, false><<<grid, KS * 32, 0, st>>>(w + wbytes * j, sh.n, sh.k, sink);
          return cudaGetLastError();
        });
        report(m, name + (tiled ? " tiled, loads only" : " row-major, loads only"), lo);
      }
    };
    run.template operator()<2, 1, 4, 4>();
    run.template operator()<2, 1, 8, 8>();
    run.template operator()<2, 2, 2, 4>();
    run.template operator()<2, 2, 8, 2>();
    run.template operator()<8, 2, 4, 2>();
    run.template operator()<8, 2, 8, 1>();
    for (void* p : {(void*)q, (void*)qt, (void*)s, (void*)x, (void*)y, (void*)y2}) CHECK(cudaFree(p));
  }
  if (out) std::fclose(out);
  return 0;
}
