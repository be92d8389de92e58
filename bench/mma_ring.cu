// Does the tensor-core W8A16 kernel (ffi/w8a16_mma.cuh) reach the weights' bandwidth at 16 and 64 rows when its
// weight loads go through shared memory? The kernel in use loads U chunks of weights into registers, then
// converts and multiplies them: a warp has loads in flight only between its groups, and U costs 16 registers a
// chunk. Ring<MT, RT, KS, S, XR> keeps the kernel's work split and arithmetic (the same sums in the same order,
// so the same bits) but streams each lane's weight bytes and scales with cp.async into a per-warp ring of S
// chunks in shared memory: S - 1 chunks always in flight, no registers held for them. Each lane reads back only
// what it copied itself, so the ring needs no barrier. XR: x's bytes go through the ring too (else read
// through L1 at use, as the kernel does).
//
// Timed against the kernel's configurations on the 7B matmuls (and the LM head) at 16 and 64 rows; every ring
// configuration's output is compared bit for bit with the kernel of the same MT, RT and KS. A stage of the ring
// holds U chunks (one wait, then U chunks' arithmetic, which the compiler may interleave).
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90a,code=sm_90a -I ffi -I bench -I $(python3 -c "import jax; \
//     print(jax.ffi.include_dir())") bench/mma_ring.cu -o /tmp/mma_ring && /tmp/mma_ring out.jsonl
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

__device__ __forceinline__ void CpAsync16(void* dst, const void* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(s), "l"(src));
}
__device__ __forceinline__ void CpAsync4(void* dst, const void* src) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(s), "l"(src));
}
__device__ __forceinline__ void CpCommit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void CpWait() { asm volatile("cp.async.wait_group %0;" ::"n"(N)); }

// Shared memory a warp's ring takes: S slots of RT x 2 halves x 32 lanes of 16 weight bytes, as many scales (4
// bytes), and (XR) MT x 32 lanes x 32 bytes of x; then the kernel's partial tiles, which reuse the rings' space.
template <int MT, int RT, bool XR>
__host__ __device__ constexpr size_t SlotBytes() { return size_t(RT) * 2 * 32 * (16 + 4) + (XR ? size_t(MT) * 32 * 32 : 0); }
template <int MT, int RT, int KS, int S, int U, bool XR>
__host__ __device__ constexpr size_t RingSmem() {
  const size_t rings = size_t(KS) * S * U * SlotBytes<MT, RT, XR>();
  return rings > mma::SmemBytes(MT, RT, KS) ? rings : mma::SmemBytes(MT, RT, KS);
}

template <int MT, int RT, int KS, int S, int U, bool XR>
__global__ void __launch_bounds__(KS * 32) Ring(const bf16* __restrict__ x, const int8_t* __restrict__ w,
                                                const float* __restrict__ scale, bf16* __restrict__ y, int m, int n,
                                                int k) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int chunks = k / 64, row0 = blockIdx.x * 16 * RT, xrow0 = blockIdx.y * 8 * MT;
  const int begin = warp * chunks / KS, end = (warp + 1) * chunks / KS;
  unsigned char* ring = smem + size_t(warp) * S * U * SlotBytes<MT, RT, XR>();
  // slot layout: weights [RT][2][32 lanes] uint4, scales [RT][2][32 lanes] float, x [MT][32 lanes][2] uint4
  auto wslot = [&](int s, int r, int h) {
    return reinterpret_cast<uint4*>(ring + s * SlotBytes<MT, RT, XR>()) + (r * 2 + h) * 32 + lane;
  };
  auto sslot = [&](int s, int r, int h) {
    return reinterpret_cast<float*>(ring + s * SlotBytes<MT, RT, XR>() + RT * 2 * 32 * 16) + (r * 2 + h) * 32 + lane;
  };
  auto xslot = [&](int s, int t) {
    return reinterpret_cast<uint4*>(ring + s * SlotBytes<MT, RT, XR>() + RT * 2 * 32 * 20) + (t * 32 + lane) * 2;
  };

  const int8_t* wrow[RT][2];
  const float* srow[RT][2];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int row = min(row0 + 16 * r + 8 * h + g, n - 1);
      wrow[r][h] = w + size_t(row) * k + 16 * c;
      srow[r][h] = scale + size_t(row) * chunks;
    }
  const bf16* xrow[MT];
  bool xlive[MT];
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    const int row = xrow0 + 8 * t + g;
    xlive[t] = row < m;
    xrow[t] = x + size_t(xlive[t] ? row : 0) * k + 16 * c;
  }
  // Group i (chunks begin + U i ..., U of them) into slots (i % S) U ...: one commit group, empty past the warp's
  // range so that the count stays even.
  auto issue = [&](int i) {
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int q = begin + U * i + u;
      if (q >= end) break;
      const int s = (i % S) * U + u;
#pragma unroll
      for (int r = 0; r < RT; ++r)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          CpAsync16(wslot(s, r, h), wrow[r][h] + size_t(q) * 64);
          CpAsync4(sslot(s, r, h), srow[r][h] + q);
        }
      if constexpr (XR) {
#pragma unroll
        for (int t = 0; t < MT; ++t)
          if (xlive[t]) {
            const bf16* p = xrow[t] + size_t(q) * 64;
            CpAsync16(xslot(s, t), p);
            CpAsync16(xslot(s, t) + 1, p + 8);
          }
      }
    }
    CpCommit();
  };

  float acc[RT][MT][4];
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[r][t][i] = 0.f;

#pragma unroll
  for (int i = 0; i < S - 1; ++i) issue(i);
  for (int i = 0; begin + U * i < end; ++i) {
    issue(i + S - 1);
    CpWait<S - 1>();   // group i (this lane's own copies) has landed
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int q = begin + U * i + u, s = (i % S) * U + u;
    if (q >= end) break;
    uint4 xv[MT][2];
#pragma unroll
    for (int t = 0; t < MT; ++t) {
      if constexpr (XR) {
        xv[t][0] = xlive[t] ? xslot(s, t)[0] : make_uint4(0, 0, 0, 0);
        xv[t][1] = xlive[t] ? xslot(s, t)[1] : make_uint4(0, 0, 0, 0);
      } else {
        const uint4* p = reinterpret_cast<const uint4*>(xrow[t] + size_t(q) * 64);
        xv[t][0] = xlive[t] ? __ldg(p) : make_uint4(0, 0, 0, 0);
        xv[t][1] = xlive[t] ? __ldg(p + 1) : make_uint4(0, 0, 0, 0);
      }
    }
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      const uint4 w0 = *wslot(s, r, 0), w1 = *wslot(s, r, 1);
      const float sc0 = *sslot(s, r, 0), sc1 = *sslot(s, r, 1);
      uint32_t a[4][4];
      const uint32_t q0[4] = {w0.x, w0.y, w0.z, w0.w};
      const uint32_t q1[4] = {w1.x, w1.y, w1.z, w1.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        mma::Int8x4ToBf16(q0[j], a[j][0], a[j][2]);
        mma::Int8x4ToBf16(q1[j], a[j][1], a[j][3]);
      }
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        const uint32_t xw[8] = {xv[t][0].x, xv[t][0].y, xv[t][0].z, xv[t][0].w,
                                xv[t][1].x, xv[t][1].y, xv[t][1].z, xv[t][1].w};
        float part[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
        for (int j = 0; j < 4; ++j) mma::Mma(part, a[j], xw[2 * j], xw[2 * j + 1], part);
        acc[r][t][0] += part[0] * sc0;
        acc[r][t][1] += part[1] * sc0;
        acc[r][t][2] += part[2] * sc1;
        acc[r][t][3] += part[3] * sc1;
      }
    }
  }
  }
  CpWait<0>();
  __syncthreads();   // every warp done with its ring: the partial tiles take the space

  float* partial = reinterpret_cast<float*>(smem);
  float* mine = partial + size_t(warp) * 8 * MT * 16 * RT;
#pragma unroll
  for (int r = 0; r < RT; ++r)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) mine[(8 * t + 2 * c + i % 2) * 16 * RT + 16 * r + g + 8 * (i / 2)] = acc[r][t][i];
  __syncthreads();
  for (int o = threadIdx.x; o < 8 * MT * 16 * RT; o += KS * 32) {
    const int xr = o / (16 * RT), wr = o % (16 * RT), row = row0 + wr, xm = xrow0 + xr;
    if (row >= n || xm >= m) continue;
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < KS; ++i) sum += partial[size_t(i) * 8 * MT * 16 * RT + o];
    y[size_t(xm) * n + row] = __float2bfloat16(sum);
  }
}

template <int MT, int RT, int KS, int S, int U, bool XR>
cudaError_t LaunchRing(cudaStream_t st, const bf16* x, const int8_t* w, const float* scale, bf16* y, int m, int n,
                       int k) {
  auto kernel = Ring<MT, RT, KS, S, U, XR>;
  constexpr size_t smem = RingSmem<MT, RT, KS, S, U, XR>();
  if constexpr (smem > (48 << 10)) {
    static const cudaError_t opted = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (opted != cudaSuccess) return opted;
  }
  const dim3 grid((n + 16 * RT - 1) / (16 * RT), (m + 8 * MT - 1) / (8 * MT));
  kernel<<<grid, KS * 32, smem, st>>>(x, w, scale, y, m, n, k);
  return cudaGetLastError();
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
  const Shape shapes[] = {{"gate_up_7b", 37888, 3584}, {"down_7b", 3584, 18944}, {"qkv_7b", 4608, 3584},
                          {"o_7b", 3584, 3584}, {"gate_up_0.5b", 9728, 896}, {"lm_head_7b", 151936, 3584}};
  for (const Shape& sh : shapes) {
    const size_t wbytes = size_t(sh.n) * sh.k, groups = sh.k / 64;
    const int copies = int(std::max<size_t>(2, 2 * size_t(prop.l2CacheSize) / wbytes + 1)), calls = std::max(16, copies);
    int8_t* q;
    float* s;
    bf16 *x, *y, *y2;
    CHECK(cudaMalloc(&q, wbytes * copies));
    CHECK(cudaMalloc(&s, sh.n * groups * 4 * copies));
    CHECK(cudaMalloc(&x, size_t(64) * sh.k * 2));
    CHECK(cudaMalloc(&y, size_t(64) * sh.n * 2 * copies));
    CHECK(cudaMalloc(&y2, size_t(64) * sh.n * 2));
    FillInt8<<<2048, 256, 0, st>>>(q, wbytes * copies, 1);
    FillScale<<<1024, 256, 0, st>>>(s, sh.n * groups * copies, 2);
    FillBf16<<<64, 256, 0, st>>>(x, size_t(64) * sh.k, 3);
    CHECK(cudaGetLastError());
    CHECK(cudaStreamSynchronize(st));
    auto time = [&](const std::function<cudaError_t(const int8_t*, const float*, bf16*)>& fn) {
      return PerCallUs(st, calls, [&](int i) {
        const int j = i % copies;
        CHECK(fn(q + wbytes * j, s + sh.n * groups * j, y + size_t(64) * sh.n * j));
      });
    };
    auto report = [&](int m, const std::string& what, float us, const char* extra = "") {
      std::printf("  %-12s M=%-2d %-28s %8.2f us %6.0f GB/s %s\n", sh.name, m, what.c_str(), us, wbytes / us / 1e3, extra);
      if (out) {
        std::fprintf(out, "{\"shape\": \"%s\", \"n\": %d, \"k\": %d, \"m\": %d, \"what\": \"%s\", \"us\": %.3f, \"gpu\": \"%s\"%s}\n",
                     sh.name, sh.n, sh.k, m, what.c_str(), us, prop.name, extra);
        std::fflush(out);
      }
    };
    report(0, "contiguous read", time([&](const int8_t* qj, const float*, bf16*) {
      ReadOnce<<<prop.multiProcessorCount * per_sm, 256, 0, st>>>(reinterpret_cast<const uint4*>(qj), wbytes / 16,
                                                                   nullptr, 0, sink);
      return cudaGetLastError();
    }));
    auto same_as = [&](int m, auto&& reference, auto&& candidate) {
      CHECK(reference(q, s, y));
      CHECK(candidate(q, s, y2));
      std::vector<uint16_t> a(size_t(m) * sh.n), b(a.size());
      CHECK(cudaMemcpyAsync(a.data(), y, a.size() * 2, cudaMemcpyDeviceToHost, st));
      CHECK(cudaMemcpyAsync(b.data(), y2, b.size() * 2, cudaMemcpyDeviceToHost, st));
      CHECK(cudaStreamSynchronize(st));
      return std::memcmp(a.data(), b.data(), a.size() * 2) == 0;
    };
    // The kernel in use at (MT, RT, KS, U), then its ring at S = 4 and 8, x through L1 and through the ring.
    auto run = [&]<int MT, int RT, int KS, int U>() {
      const int m = 8 * MT;
      const std::string cfg = "mt" + std::to_string(MT) + "_rt" + std::to_string(RT) + "_ks" + std::to_string(KS);
      auto kernel = [&](const int8_t* wj, const float* sj, bf16* yj) {
        return mma::Launch<MT, RT, KS, U>(st, x, wj, sj, yj, m, sh.n, sh.k);
      };
      report(m, cfg + "_u" + std::to_string(U), time(kernel));
      auto ring = [&]<int S, int RU, bool XR>() {
        if constexpr (RingSmem<MT, RT, KS, S, RU, XR>() > (227 << 10)) return;   // past an SM's shared memory
        auto fn = [&](const int8_t* wj, const float* sj, bf16* yj) {
          return LaunchRing<MT, RT, KS, S, RU, XR>(st, x, wj, sj, yj, m, sh.n, sh.k);
        };
        const float us = time(fn);
        report(m, cfg + " ring s" + std::to_string(S) + "u" + std::to_string(RU) + (XR ? " xr" : ""), us,
               same_as(m, kernel, fn) ? ", \"same_bits\": true" : ", \"same_bits\": false");
      };
      ring.template operator()<4, 1, false>();
      ring.template operator()<2, 2, false>();
      ring.template operator()<3, 2, false>();
      ring.template operator()<2, 4, false>();
      ring.template operator()<3, 4, false>();
      ring.template operator()<2, 4, true>();
      ring.template operator()<3, 2, true>();
    };
    run.template operator()<2, 1, 4, 4>();
    run.template operator()<2, 1, 8, 8>();
    run.template operator()<2, 2, 2, 4>();
    run.template operator()<8, 2, 4, 2>();
    run.template operator()<8, 2, 8, 1>();
    for (void* p : {(void*)q, (void*)s, (void*)x, (void*)y, (void*)y2}) CHECK(cudaFree(p));
  }
  if (out) std::fclose(out);
  return 0;
}
