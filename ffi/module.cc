// The Python module: handlers as PyCapsules, registered by jaxllm/kernels/ffi.py.
#include <pybind11/pybind11.h>

#include "xla/ffi/api/c_api.h"

namespace jaxllm {
extern "C" XLA_FFI_Error* W8A16MatmulCpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* DecodeAttentionCpuHandler(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* W8A16MatmulCpuInto(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* DecodeAttentionCpuIntoHandler(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* DecodeAttentionMergedCpuHandler(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* W8A16FusedCpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* W8A16FusedCpuInto(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* QkvEpilogueCpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* LowBitMatmulCpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* LowBitMatmulCpuInto(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* Q6KMatmulCpu(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* Q6KMatmulCpuInto(XLA_FFI_CallFrame*);
#ifdef JAXLLM_WITH_CUDA
extern "C" XLA_FFI_Error* W8A16MatmulCuda(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* DecodeAttentionCudaHandler(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* W8A16MatmulCudaInto(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* DecodeAttentionCudaIntoHandler(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* PrefillAttentionCudaHandler(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* PrefillAttentionCudaIntoHandler(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* DecodeAttentionMergedCudaHandler(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* W8A16FusedCuda(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* W8A16FusedCudaInto(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* QkvEpilogueCuda(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* DecodeLayersCuda(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* TopCandidatesCudaHandler(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* TopCandidatesCudaIntoHandler(XLA_FFI_CallFrame*);
extern "C" XLA_FFI_Error* W8A16TuneCuda(XLA_FFI_CallFrame*);
int MmaCandidateCount();
#endif
}  // namespace jaxllm

namespace {
template <typename F>
pybind11::capsule Capsule(F* fn) {
  return pybind11::capsule(reinterpret_cast<void*>(fn));
}
}  // namespace

PYBIND11_MODULE(_ffi, m) {
  m.doc() = "jaxllm's XLA FFI handlers";
  m.def("cpu_targets", [] {
    pybind11::dict d;
    d["jaxllm_w8a16"] = Capsule(jaxllm::W8A16MatmulCpu);
    d["jaxllm_decode_attention"] = Capsule(jaxllm::DecodeAttentionCpuHandler);
    d["jaxllm_w8a16_into"] = Capsule(jaxllm::W8A16MatmulCpuInto);
    d["jaxllm_decode_attention_into"] = Capsule(jaxllm::DecodeAttentionCpuIntoHandler);
    d["jaxllm_decode_attention_merged"] = Capsule(jaxllm::DecodeAttentionMergedCpuHandler);
    d["jaxllm_w8a16_fused"] = Capsule(jaxllm::W8A16FusedCpu);
    d["jaxllm_w8a16_fused_into"] = Capsule(jaxllm::W8A16FusedCpuInto);
    d["jaxllm_qkv_epilogue"] = Capsule(jaxllm::QkvEpilogueCpu);
    d["jaxllm_lowbit"] = Capsule(jaxllm::LowBitMatmulCpu);
    d["jaxllm_lowbit_into"] = Capsule(jaxllm::LowBitMatmulCpuInto);
    d["jaxllm_q6k"] = Capsule(jaxllm::Q6KMatmulCpu);
    d["jaxllm_q6k_into"] = Capsule(jaxllm::Q6KMatmulCpuInto);
    return d;
  });
  m.def("cuda_targets", [] {
    pybind11::dict d;
#ifdef JAXLLM_WITH_CUDA
    d["jaxllm_w8a16"] = Capsule(jaxllm::W8A16MatmulCuda);
    d["jaxllm_decode_attention"] = Capsule(jaxllm::DecodeAttentionCudaHandler);
    d["jaxllm_w8a16_into"] = Capsule(jaxllm::W8A16MatmulCudaInto);
    d["jaxllm_decode_attention_into"] = Capsule(jaxllm::DecodeAttentionCudaIntoHandler);
    d["jaxllm_prefill_attention"] = Capsule(jaxllm::PrefillAttentionCudaHandler);
    d["jaxllm_prefill_attention_into"] = Capsule(jaxllm::PrefillAttentionCudaIntoHandler);
    d["jaxllm_decode_attention_merged"] = Capsule(jaxllm::DecodeAttentionMergedCudaHandler);
    d["jaxllm_w8a16_fused"] = Capsule(jaxllm::W8A16FusedCuda);
    d["jaxllm_w8a16_fused_into"] = Capsule(jaxllm::W8A16FusedCudaInto);
    d["jaxllm_qkv_epilogue"] = Capsule(jaxllm::QkvEpilogueCuda);
    d["jaxllm_decode_layers"] = Capsule(jaxllm::DecodeLayersCuda);
    d["jaxllm_top_candidates"] = Capsule(jaxllm::TopCandidatesCudaHandler);
    d["jaxllm_top_candidates_into"] = Capsule(jaxllm::TopCandidatesCudaIntoHandler);
    d["jaxllm_w8a16_tune"] = Capsule(jaxllm::W8A16TuneCuda);
#endif
    return d;
  });
#ifdef JAXLLM_WITH_CUDA
  m.attr("with_cuda") = true;
  m.attr("mma_candidates") = jaxllm::MmaCandidateCount();   // the tensor-core configurations jaxllm.tuning times
#else
  m.attr("with_cuda") = false;
  m.attr("mma_candidates") = 0;
#endif
  // A lab build (cmake -DJAXLLM_LAB=ON) reads the lab switches from the environment; jaxllm/lab.py asks.
#ifdef JAXLLM_LAB
  m.attr("lab_build") = true;
#else
  m.attr("lab_build") = false;
#endif
}
