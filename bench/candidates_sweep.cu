// Times the sampler's candidates kernel (ffi/sampling_cuda.cu) by stage on the GPU: BlockMax alone, Select
// alone (on BlockMax's workspace), and both, each as chained launches in one CUDA graph (graph_timer.cuh),
// for the vocabularies of the engine's models. Each result is first checked against a host sort of the same
// keys (every value and id), and its logsumexp against the host's in double precision. Built with Select's
// stage stamps: the last row's (the first block's) stage times, in us: the block keys' select, the
// logsumexp, the candidates' gather, their ranking; and how many candidates that row had.
//
//   nvcc -O3 -std=c++17 -arch=sm_90 -I ffi -I $(python3 -c "import jax.ffi; print(jax.ffi.include_dir())") \
//       bench/candidates_sweep.cu -o /tmp/candidates_sweep && /tmp/candidates_sweep
#define JAXLLM_SELECT_TIMING 1   // Select records %globaltimer at its stages (select_times) and its candidates
#include "graph_timer.cuh"
#include "../ffi/sampling_cuda.cu"   // the kernels (an unnamed namespace: this file's own copy)

#include <cmath>
#include <cstdint>
#include <random>

namespace c = jaxllm;

int main() {
  cudaStream_t st;
  CHECK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  const int K = c::kMaxK;
  for (const int64_t V : {int64_t(151936), int64_t(49152), int64_t(32000)}) {
    for (const int B : {1, 4}) {
      const int n = int((V + c::kBlock - 1) / c::kBlock);
      std::mt19937 rng(uint32_t(V + B));
      std::normal_distribution<float> normal(0.f, 3.f);
      std::vector<float> x(size_t(B) * V);
      for (float& v : x) v = normal(rng);
      float *xd, *vals, *lse;
      int32_t* ids;
      uint64_t* ws;   // keys [B, n], then sums [B, n] f32
      CHECK(cudaMalloc(&xd, x.size() * 4));
      CHECK(cudaMalloc(&vals, size_t(B) * K * 4));
      CHECK(cudaMalloc(&ids, size_t(B) * K * 4));
      CHECK(cudaMalloc(&lse, size_t(B) * 4));
      CHECK(cudaMalloc(&ws, size_t(B) * n * 12));
      float* sums = reinterpret_cast<float*>(ws + size_t(B) * n);
      CHECK(cudaMemcpy(xd, x.data(), x.size() * 4, cudaMemcpyHostToDevice));
      CHECK(cudaMemset(vals, 0xff, size_t(B) * K * 4));   // NaN: unwritten values show
      auto block_max = [&](int) {
        c::BlockMax<<<dim3(unsigned((n + 7) / 8), unsigned(B)), 256, 0, st>>>(xd, ws, sums, V, n);
      };
      auto select = [&](int) { c::Select<<<unsigned(B), c::kThreads, 0, st>>>(xd, ws, sums, vals, ids, lse, V, n, K); };
      block_max(0);
      select(0);
      CHECK(cudaStreamSynchronize(st));
      CHECK(cudaGetLastError());
      std::vector<float> got_v(size_t(B) * K);
      std::vector<int32_t> got_i(size_t(B) * K);
      CHECK(cudaMemcpy(got_v.data(), vals, got_v.size() * 4, cudaMemcpyDeviceToHost));
      CHECK(cudaMemcpy(got_i.data(), ids, got_i.size() * 4, cudaMemcpyDeviceToHost));
      std::vector<float> got_lse(static_cast<size_t>(B));
      CHECK(cudaMemcpy(got_lse.data(), lse, got_lse.size() * 4, cudaMemcpyDeviceToHost));
      unsigned long long stamps[8];
      int ncand = 0;
      CHECK(cudaMemcpyFromSymbol(stamps, c::select_times, sizeof(stamps)));
      CHECK(cudaMemcpyFromSymbol(&ncand, c::select_ncand, sizeof(ncand)));
      int bad = 0;
      double lse_err = 0;
      for (int b = 0; b < B; ++b) {
        std::vector<int32_t> order(static_cast<size_t>(V));
        for (int64_t i = 0; i < V; ++i) order[size_t(i)] = int32_t(i);
        const float* row = x.data() + size_t(b) * V;
        std::partial_sort(order.begin(), order.begin() + K, order.end(), [&](int32_t a, int32_t z) {
          return row[a] > row[z] || (row[a] == row[z] && a < z);
        });
        for (int i = 0; i < K; ++i)
          bad += got_i[size_t(b) * K + i] != order[size_t(i)] || got_v[size_t(b) * K + i] != row[order[size_t(i)]];
        double mx = row[order[0]], sum = 0;
        for (int64_t i = 0; i < V; ++i) sum += std::exp(double(row[i]) - mx);
        lse_err = std::max(lse_err, std::fabs(got_lse[size_t(b)] - (mx + std::log(sum))) / std::fabs(mx + std::log(sum)));
      }
      const float t_max = PerCallUs(st, 32, block_max), t_sel = PerCallUs(st, 32, select);
      const float t_both = PerCallUs(st, 32, [&](int i) { block_max(i); select(i); });
      std::printf("{\"V\": %lld, \"B\": %d, \"mismatches\": %d, \"lse_rel_err\": %.2e, \"block_max_us\": %.2f, "
                  "\"select_us\": %.2f, \"both_us\": %.2f, \"ncand\": %d, \"stages_us\": [%.2f, %.2f, %.2f, %.2f]}\n",
                  (long long)V, B, bad, lse_err, t_max, t_sel, t_both, ncand, (stamps[1] - stamps[0]) * 1e-3,
                  (stamps[2] - stamps[1]) * 1e-3, (stamps[3] - stamps[2]) * 1e-3, (stamps[4] - stamps[3]) * 1e-3);
      CHECK(cudaFree(xd));
      CHECK(cudaFree(vals));
      CHECK(cudaFree(ids));
      CHECK(cudaFree(lse));
      CHECK(cudaFree(ws));
    }
  }
  return 0;
}
