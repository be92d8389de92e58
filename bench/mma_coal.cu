// Times bench/w8a16_mma_coal.cuh (the tensor-core W8A16 arithmetic fed from a block-wide cp.async ring whose
// global reads are whole row segments) beside ffi/w8a16_mma.cuh's configurations (the kernel the engine runs),
// on the 7B matmuls at 16 and 64 rows (13 and 50: part-filled x tiles), and a contiguous read of the same bytes.
// Weights rotate over copies spanning about 1 GB (the step's working set is 7.5 GB; the matmuls' times step up
// between 0.3 and 1 GB: docs/results/2026-12-06-h200-working-set.md). Each configuration's output is checked
// against a plain f32 reference kernel (poisoned first) before it is timed.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I ffi -I bench -I $(python3 -c "import jax; \
//     print(jax.ffi.include_dir())") bench/mma_coal.cu -o /tmp/mma_coal
//   /tmp/mma_coal out.jsonl [shape,shape,...] [m,m,...]
#include <cuda_bf16.h>
#include <cuda_runtime.h>

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
#include "w8a16_mma_coal.cuh"

using bf16 = __nv_bfloat16;
namespace w = jaxllm::w8a16;

__global__ void Reference(const bf16* x, const int8_t* q, const float* s, float* y, int m, int n, int k) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= m * n) return;
  const int row = i % n, mi = i / n, groups = k / 64;
  float acc = 0.f;
  for (int g = 0; g < groups; ++g) {
    float part = 0.f;
    for (int j = g * 64; j < (g + 1) * 64; ++j) part += __bfloat162float(x[size_t(mi) * k + j]) * float(q[size_t(row) * k + j]);
    acc += part * s[size_t(row) * groups + g];
  }
  y[i] = acc;
}

using Fn = cudaError_t (*)(cudaStream_t, const bf16*, const int8_t*, const float*, bf16*, int, int, int);
struct Config {
  std::string name;
  int rows;              // x rows bucket it is timed at: 16 (9-16) or 64 (33-64)
  bool (*fits)(int k);
  Fn fn;
};
bool AnyK(int k) { return k % 64 == 0; }

template <int MT, int RT, int KS, int U>
Config Mma() {
  return {"mma_mt" + std::to_string(MT) + "_rt" + std::to_string(RT) + "_ks" + std::to_string(KS) + "_u" +
              std::to_string(U),
          MT * 8, AnyK, w::mma::Launch<MT, RT, KS, U>};
}
template <int MT, int RT, int WR, int WK, int KB, int S>
Config Coal() {
  return {"coal_mt" + std::to_string(MT) + "_rt" + std::to_string(RT) + "_wr" + std::to_string(WR) + "_wk" +
              std::to_string(WK) + "_kb" + std::to_string(KB) + "_s" + std::to_string(S),
          MT * 8, w::mma_coal::Fits<MT, RT, WR, WK, KB, S>, w::mma_coal::Launch<MT, RT, WR, WK, KB, S>};
}

struct Shape {
  const char* name;
  int n, k;
};

std::vector<std::string> Split(const char* s) {
  std::vector<std::string> out;
  std::string cur;
  for (; *s; ++s) {
    if (*s == ',') { out.push_back(cur); cur.clear(); } else cur += *s;
  }
  if (!cur.empty()) out.push_back(cur);
  return out;
}

int main(int argc, char** argv) {
  FILE* out = argc > 1 ? std::fopen(argv[1], "w") : nullptr;
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const std::vector<std::string> only = argc > 2 ? Split(argv[2]) : std::vector<std::string>{};
  std::vector<int> ms = {16, 64};
  if (argc > 3) {
    ms.clear();
    for (auto& s : Split(argv[3])) ms.push_back(std::atoi(s.c_str()));
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const Shape shapes[] = {{"gate_up_7b", 37888, 3584}, {"down_7b", 3584, 18944}, {"qkv_7b", 4608, 3584},
                          {"o_7b", 3584, 3584},         {"lm_head_7b", 151936, 3584}, {"gate_up_0.5b", 9728, 896}, {"down_0.5b", 896, 4864},
                          {"odd_n", 1000, 1024}};
  const std::vector<Config> configs = {
      // the kernel in use: the rule's and the autotune's usual picks
      Mma<2, 1, 4, 4>(), Mma<2, 1, 8, 8>(), Mma<2, 2, 2, 4>(), Mma<2, 2, 8, 2>(), Mma<2, 1, 2, 4>(),
      Mma<8, 2, 4, 2>(), Mma<8, 2, 8, 1>(), Mma<8, 2, 2, 2>(),
      // the ring at 16 rows: MT, RT, WR, WK, KB, S (the best two of docs/results/2026-12-07-h100-ring.md's first call)
      Coal<2, 1, 4, 4, 8, 3>(), Coal<2, 1, 2, 2, 4, 4>(),
      // at 64 rows
      Coal<8, 2, 4, 2, 4, 2>(), Coal<8, 1, 4, 2, 2, 4>(),
  };
  for (const Shape& sh : shapes) {
    if (!only.empty() && std::find(only.begin(), only.end(), sh.name) == only.end()) continue;
    const size_t wbytes = size_t(sh.n) * sh.k, groups = sh.k / 64;
    const int copies = int(std::max<size_t>(2, std::min<size_t>(256, size_t(1e9) / wbytes + 1)));
    const int calls = std::max(16, copies);
    int8_t* q;
    float* s;
    bf16 *x, *y;
    float* ref;
    uint32_t* sink;
    CHECK(cudaMalloc(&q, wbytes * copies));
    CHECK(cudaMalloc(&s, size_t(sh.n) * groups * 4 * copies));
    CHECK(cudaMalloc(&x, size_t(64) * sh.k * 2));
    CHECK(cudaMalloc(&y, size_t(64) * sh.n * 2 * copies));
    CHECK(cudaMalloc(&ref, size_t(64) * sh.n * 4));
    CHECK(cudaMalloc(&sink, 4));
    FillInt8<<<1024, 256, 0, st>>>(q, wbytes * copies, 1);
    FillScale<<<1024, 256, 0, st>>>(s, size_t(sh.n) * groups * copies, 2);
    FillBf16<<<64, 256, 0, st>>>(x, size_t(64) * sh.k, 3, -1.f, 1.f);
    CHECK(cudaGetLastError());
    const float read_us = PerCallUs(st, calls, [&](int i) {
      const int j = i % copies;
      ReadOnce<<<prop.multiProcessorCount * 8, 256, 0, st>>>(reinterpret_cast<const uint4*>(q + wbytes * j),
                                                             wbytes / 16, s + size_t(sh.n) * groups * j,
                                                             size_t(sh.n) * groups, sink);
    });
    std::printf("\n%s N=%d K=%d: %.1f MB int8, %d copies; contiguous read %.2f us (%.0f GB/s)\n", sh.name, sh.n, sh.k,
                wbytes / 1e6, copies, read_us, wbytes * 1.0625 / read_us / 1e3);
    if (out)
      std::fprintf(out, "{\"shape\": \"%s\", \"n\": %d, \"k\": %d, \"config\": \"read\", \"us\": %.3f, \"copies\": %d}\n",
                   sh.name, sh.n, sh.k, read_us, copies);
    for (int m : ms) {
      Reference<<<(m * sh.n + 255) / 256, 256, 0, st>>>(x, q, s, ref, m, sh.n, sh.k);
      CHECK(cudaGetLastError());
      std::vector<float> r(size_t(m) * sh.n);
      CHECK(cudaMemcpyAsync(r.data(), ref, r.size() * 4, cudaMemcpyDeviceToHost, st));
      CHECK(cudaStreamSynchronize(st));
      const int bucket = m <= 16 ? 16 : 64;
      for (const Config& c : configs) {
        if (c.rows != bucket || !c.fits(sh.k)) continue;
        FillBf16<<<256, 256, 0, st>>>(y, size_t(m) * sh.n, 9, NAN, NAN);   // poison
        CHECK(c.fn(st, x, q, s, y, m, sh.n, sh.k));
        double err = NAN, worst = NAN;
        ErrorVsReference(st, y, r, &err, &worst);
        const bool ok = err < 1e-2 && worst < 5e-2;
        const float us = PerCallUs(st, calls, [&](int i) {
          const int j = i % copies;
          CHECK(c.fn(st, x, q + wbytes * j, s + size_t(sh.n) * groups * j, y + size_t(64) * sh.n * j, m, sh.n, sh.k));
        });
        std::printf("  M=%-3d %-30s %8.2f us %6.0f GB/s  x%.2f read  err %.1e worst %.1e%s\n", m, c.name.c_str(), us,
                    wbytes * 1.0625 / us / 1e3, us / read_us, err, worst, ok ? "" : "  WRONG");
        if (out) {
          std::fprintf(out, "{\"shape\": \"%s\", \"n\": %d, \"k\": %d, \"m\": %d, \"config\": \"%s\", \"us\": %.3f, "
                       "\"read_us\": %.3f, \"rel_err\": %.3e, \"worst\": %.3e, \"ok\": %s}\n", sh.name, sh.n, sh.k, m,
                       c.name.c_str(), us, read_us, err, worst, ok ? "true" : "false");
          std::fflush(out);
        }
      }
    }
    CHECK(cudaFree(q));
    CHECK(cudaFree(s));
    CHECK(cudaFree(x));
    CHECK(cudaFree(y));
    CHECK(cudaFree(ref));
    CHECK(cudaFree(sink));
  }
  if (out) std::fclose(out);
  return 0;
}
