// The two device kernels of a queued step's fault node on CUDA (compiled by nvcc only when the
// CUDA path is built). Plain C types: shared by fault_kernels.cu and expert_faults_cuda.cpp.
#pragma once

#include <cstdint>

namespace asyncside::faults::cuda {

// One copy the fault handler asks for: `bytes` from pinned, mapped host memory to device memory.
struct CopyOp {
  const uint8_t* src;  // device view of the host mirror row
  uint8_t* dst;        // the pool row on the device
  uint64_t bytes;
};

// Written by the host node, read by the kernel after it (the graph orders them).
struct Plan {
  uint32_t count;
  uint32_t capacity;
  CopyOp ops[1];  // `capacity` entries
};

// apply_plan's launch shape (the grid covers an H200's 132 SMs four warps deep per block; the copy
// is bound by PCIe round trips, which many warps in flight hide) and the descriptors each block
// holds in shared memory at a time.
constexpr unsigned kApplyPlanBlocks = 264;
constexpr unsigned kApplyPlanThreads = 512;
constexpr unsigned kPlanOpsPerPass = 256;

// Kernel entry points, as the void* a cudaKernelNodeParams wants.
void* ids_to_host_kernel();  // (const uint32_t* ids, uint32_t* ids_host, uint32_t n)
void* apply_plan_kernel();   // (const Plan* plan, const uint32_t* rows_host, uint32_t* out, uint32_t n)

}  // namespace asyncside::faults::cuda
