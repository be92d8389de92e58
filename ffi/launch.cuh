// Kernel launches of the CUDA handlers: programmatic dependent launch (sm_90) and thread-block clusters. Included by
// w8a16_mma.cuh and so by every kernel header (w8a16_cuda.cuh, qkv_cuda.cuh, attention_cuda.cuh).
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace jaxllm {
namespace w8a16 {

// Programmatic dependent launch (sm_90): wait for the grid this one depends on (a no-op without one), and
// let the next grid start launching.
__device__ __forceinline__ void GridDepWait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void GridDepLaunch() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// Launches kernel<<<grid, block, smem, stream>>>(args...); pdl: as a programmatic dependent of the previous
// kernel on the stream (its GridDepWait then waits for that kernel); cluster > 1: in thread-block clusters of
// that many blocks along x (sm_90; gridDim.x a multiple of it).
template <typename... KArgs, typename... Args>
cudaError_t LaunchEx(cudaStream_t stream, bool pdl, dim3 grid, dim3 block, size_t smem, int cluster,
                     void (*kernel)(KArgs...), Args&&... args) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[2];
  int n = 0;
  if (pdl) {
    attr[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[n++].val.programmaticStreamSerializationAllowed = 1;
  }
  if (cluster > 1) {
    attr[n].id = cudaLaunchAttributeClusterDimension;
    attr[n].val.clusterDim.x = unsigned(cluster);
    attr[n].val.clusterDim.y = 1;
    attr[n++].val.clusterDim.z = 1;
  }
  cfg.attrs = attr;
  cfg.numAttrs = n;
  return cudaLaunchKernelEx(&cfg, kernel, std::forward<Args>(args)...);
}
template <typename... KArgs, typename... Args>
cudaError_t LaunchEx(cudaStream_t stream, bool pdl, dim3 grid, dim3 block, size_t smem, void (*kernel)(KArgs...),
                     Args&&... args) {
  return LaunchEx(stream, pdl, grid, block, smem, 1, kernel, std::forward<Args>(args)...);
}

}  // namespace w8a16
}  // namespace jaxllm
