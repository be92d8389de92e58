// The decode step's W8A16 matmuls as the step runs them, without XLA: every layer's q/k/v, O, gate/up and down, then
// the LM head, each through w8a16::Dispatch (the engine's rule: GEMV kernels at M <= 4, tensor cores above) on
// stacked [L, N, K] weights, back to back in one CUDA graph. Beside it, the same launches with the weights of only
// two layers (a small working set), each shape alone (its L launches in a row, as bench/gemv_sweep.cu times
// it), and a read-only kernel in place of every matmul (the bytes at the copy rate, under the same launches).
// Which of these the chain's time follows says whether the step's matmuls lose time to their neighbours, to
// the working set, or in themselves. At 16 and 64 rows also the chain with each tensor-core matmul a
// programmatic dependent of the one before (its first weight loads before its wait): what overlapping the
// kernels' edges would give. And each shape over 1, 2, 4, 8 and every layer's weights, beside the read-only kernel:
// how its time grows with the working set.
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I ffi -I $(python3 -c "import jax; \
//     print(jax.ffi.include_dir())") bench/matmul_chain.cu -o /tmp/matmul_chain
//   /tmp/matmul_chain out.jsonl 7b,0.5b 1,16,64
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "fills.cuh"
#include "graph_timer.cuh"
#include "w8a16_cuda.cuh"

using bf16 = __nv_bfloat16;
namespace w = jaxllm::w8a16;



// mma::Dispatch's rule at 9-16 and 33-64 rows (ffi/w8a16_mma.cuh), each matmul launched as a programmatic
// dependent of the one before when PDL: its blocks issue their first weight loads, then wait for it.
template <bool PDL>
cudaError_t RuleLaunch(cudaStream_t st, const bf16* x, const int8_t* w, const float* s, bf16* y, int m, int n, int k) {
  namespace mm = w::mma;
  const int tiles = (n + 15) / 16;
  const bool many = tiles >= 288, head = tiles >= 4096;
  if (m <= 16) {
    if (head) return mm::Launch<2, 2, 2, 4, PDL>(st, x, w, s, y, m, n, k);
    return many ? mm::Launch<2, 1, 4, 4, PDL>(st, x, w, s, y, m, n, k)
                : mm::Launch<2, 1, 8, 8, PDL>(st, x, w, s, y, m, n, k);
  }
  return tiles >= 2000 ? mm::Launch<8, 2, 4, 2, PDL>(st, x, w, s, y, m, n, k)
                       : mm::Launch<8, 2, 8, 1, PDL>(st, x, w, s, y, m, n, k);
}

struct Model {
  const char* name;
  int d, qkv, ff, vocab, layers;
};
constexpr Model kModels[] = {
    {"7b", 3584, 4608, 18944, 151936, 28},     // Qwen2.5-7B
    {"0.5b", 896, 1152, 4864, 151936, 24},     // Qwen2.5-0.5B
};

struct Weight {   // [L, N, K] int8 and [L, N, K / 64] f32
  int n, k, layers;
  int8_t* q;
  float* s;
  size_t bytes() const { return size_t(n) * k; }
  size_t groups() const { return size_t(k) / 64; }
};

Weight Alloc(int n, int k, int layers, uint32_t seed, cudaStream_t st) {
  Weight wt{n, k, layers, nullptr, nullptr};
  CHECK(cudaMalloc(&wt.q, wt.bytes() * layers));
  CHECK(cudaMalloc(&wt.s, size_t(n) * wt.groups() * 4 * layers));
  FillInt8<<<2048, 256, 0, st>>>(wt.q, wt.bytes() * layers, seed);
  FillScale<<<1024, 256, 0, st>>>(wt.s, size_t(n) * wt.groups() * layers, seed + 1);
  CHECK(cudaGetLastError());
  return wt;
}

int main(int argc, char** argv) {
  FILE* out = argc > 1 ? std::fopen(argv[1], "a") : nullptr;
  const std::string models = argc > 2 ? std::string(",") + argv[2] + "," : ",7b,";
  std::vector<int> ms = {1, 16, 64};
  if (argc > 3) {
    ms.clear();
    for (const char* p = argv[3]; *p;) {
      ms.push_back(std::atoi(p));
      while (*p && *p != ',') ++p;
      if (*p) ++p;
    }
  }
  cudaDeviceProp prop;
  CHECK(cudaGetDeviceProperties(&prop, 0));
  std::printf("device %s, %d SMs, L2 %d MB\n", prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20);
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  int sms = 0, per_sm = 0;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, ReadOnce, 256, 0));
  for (const Model& md : kModels) {
    if (models.find(std::string(",") + md.name + ",") == std::string::npos) continue;
    const int L = md.layers;
    Weight qkv = Alloc(md.qkv, md.d, L, 11, st), o = Alloc(md.d, md.d, L, 13, st),
           gu = Alloc(2 * md.ff, md.d, L, 17, st), down = Alloc(md.d, md.ff, L, 19, st),
           head = Alloc(md.vocab, md.d, 1, 23, st);
    const int kMaxM = 64;
    bf16 *xd, *xf, *y;
    uint32_t* sink;
    CHECK(cudaMalloc(&xd, size_t(kMaxM) * md.d * 2));
    CHECK(cudaMalloc(&xf, size_t(kMaxM) * md.ff * 2));
    CHECK(cudaMalloc(&y, size_t(kMaxM) * md.vocab * 2));
    CHECK(cudaMalloc(&sink, 4));
    FillBf16<<<64, 256, 0, st>>>(xd, size_t(kMaxM) * md.d, 5);
    FillBf16<<<64, 256, 0, st>>>(xf, size_t(kMaxM) * md.ff, 7);
    CHECK(cudaStreamSynchronize(st));
    const double total = double(L) * (qkv.bytes() + o.bytes() + gu.bytes() + down.bytes()) + head.bytes();
    const double total_s = total / 64 * 4;
    std::printf("\n%s: %d layers, %.3f GB int8 + %.3f GB scales\n", md.name, L, total / 1e9, total_s / 1e9);

    for (int m : ms) {
      // One matmul: w's layer `layer` (x from xd, or xf when K is the feed-forward width), or its read-only stand-in.
      auto matmul = [&](const Weight& wt, int layer, bool read_only, int how = 0) {   // how: 1 rule, 2 rule + PDL
        const int8_t* q = wt.q + wt.bytes() * layer;
        const float* s = wt.s + size_t(wt.n) * wt.groups() * layer;
        if (read_only) {
          ReadOnce<<<sms * per_sm, 256, 0, st>>>(reinterpret_cast<const uint4*>(q), wt.bytes() / 16, s,
                                                  size_t(wt.n) * wt.groups(), sink);
          CHECK(cudaGetLastError());
          return;
        }
        const bf16* x = wt.k == md.ff ? xf : xd;
        if (how) {
          CHECK(how == 2 ? RuleLaunch<true>(st, x, q, s, y, m, wt.n, wt.k) : RuleLaunch<false>(st, x, q, s, y, m, wt.n, wt.k));
          return;
        }
        const jaxllm::MatmulShape sh{m, wt.n, wt.k, int64_t(wt.groups()), 64, 0};
        CHECK(w::Dispatch<bf16>(st, sh, x, q, s, y));
      };
      // One step: every layer's four matmuls, layer l reading layer (l % span)'s weights, then the head.
      auto step = [&](int span, bool read_only, int how = 0) {
        for (int l = 0; l < L; ++l) {
          matmul(qkv, l % span, read_only, how);
          matmul(o, l % span, read_only, how);
          matmul(gu, l % span, read_only, how);
          matmul(down, l % span, read_only, how);
        }
        matmul(head, 0, read_only, how);
      };
      auto report = [&](const char* what, double us) {
        std::printf("  M=%-3d %-40s %9.1f us  %6.0f GB/s\n", m, what, us, (total + total_s) / us / 1e3);
        if (out) {
          std::fprintf(out, "{\"model\": \"%s\", \"m\": %d, \"what\": \"%s\", \"us\": %.2f, \"bytes\": %.0f, \"gpu\": \"%s\"}\n",
                       md.name, m, what, us, total + total_s, prop.name);
          std::fflush(out);
        }
      };
      report("chain, every layer its own weights", PerCallUs(st, 2, [&](int) { step(L, false); }));
      report("chain, two layers' weights", PerCallUs(st, 2, [&](int) { step(2, false); }));
      report("read-only chain, every layer its own", PerCallUs(st, 2, [&](int) { step(L, true); }));
      if (m > 8 && (m <= 16 || m > 32)) {   // the rule's tensor-core configurations, without and with PDL
        report("chain, the rule (bench copy)", PerCallUs(st, 2, [&](int) { step(L, false, 1); }));
        report("chain, the rule with PDL", PerCallUs(st, 2, [&](int) { step(L, false, 2); }));
      }
      // Each shape alone: its L launches in a row, rotating over the weights of 1, 2, 4, 8 and every layer, the matmul
      // and the read-only kernel, per call x L (the working set's size: a share of a small one kept in L2 falls
      // smoothly as it grows; anything with a reach would step). Every layer's and two layers' times are summed below.
      double alone = 0, alone2 = 0;
      for (const Weight* wt : {&qkv, &o, &gu, &down}) {
        float every = 0.f, two = 0.f;
        std::printf("    %5d x %-5d by layers rotated (matmul / read-only us):", wt->n, wt->k);
        for (int span : {1, 2, 4, 8, L}) {
          const float mm = PerCallUs(st, L, [&](int i) { matmul(*wt, i % span, false); });
          const float ro = PerCallUs(st, L, [&](int i) { matmul(*wt, i % span, true); });
          if (span == 2) two = mm;
          if (span == L) every = mm;
          std::printf("  %d: %.2f / %.2f", span, mm, ro);
          if (out)
            std::fprintf(out, "{\"model\": \"%s\", \"m\": %d, \"what\": \"span\", \"n\": %d, \"k\": %d, \"span\": %d, "
                         "\"us\": %.3f, \"us_read_only\": %.3f, \"gpu\": \"%s\"}\n", md.name, m, wt->n, wt->k, span, mm, ro,
                         prop.name);
        }
        std::printf("\n    %5d x %-5d alone: %.2f us a call (every layer), %.2f (two layers)\n", wt->n, wt->k, every, two);
        if (out)
          std::fprintf(out, "{\"model\": \"%s\", \"m\": %d, \"what\": \"alone\", \"n\": %d, \"k\": %d, \"us\": %.3f, "
                       "\"us_two_layers\": %.3f, \"gpu\": \"%s\"}\n", md.name, m, wt->n, wt->k, every, two, prop.name);
        alone += double(every) * L;
        alone2 += double(two) * L;
      }
      const float h = PerCallUs(st, 4, [&](int) { matmul(head, 0, false); });
      report("each shape alone (every layer), summed", alone + h);
      report("each shape alone (two layers), summed", alone2 + h);
    }
    for (Weight* wt : {&qkv, &o, &gu, &down, &head}) {
      CHECK(cudaFree(wt->q));
      CHECK(cudaFree(wt->s));
    }
    CHECK(cudaFree(xd));
    CHECK(cudaFree(xf));
    CHECK(cudaFree(y));
    CHECK(cudaFree(sink));
  }
  if (out) std::fclose(out);
  return 0;
}
