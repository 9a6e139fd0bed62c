// Device side of a queued step's fault node on CUDA: the routed ids go to pinned host memory for
// the host node, and after it the faulted records go from the pinned host mirror to the pool rows,
// and the rows the host node chose go to the node's output. No CUDA runtime calls in a host node
// are allowed, so every copy around it is a kernel (a memcpy node would also keep MLX from
// updating its cached graphs in place).
#include "fault_kernels.h"

namespace asyncside::faults::cuda {

namespace {

__global__ void ids_to_host(const uint32_t* ids, uint32_t* ids_host, uint32_t n) {
  for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) {
    ids_host[i] = ids[i];
  }
}

__global__ void apply_plan(const Plan* plan, const uint32_t* rows_host, uint32_t* out, uint32_t n) {
  const uint64_t tid = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  for (uint64_t i = tid; i < n; i += stride) out[i] = rows_host[i];
  const uint32_t count = plan->count;
  for (uint32_t k = 0; k < count; ++k) {
    const CopyOp op = plan->ops[k];
    const bool wide = ((reinterpret_cast<uintptr_t>(op.src) | reinterpret_cast<uintptr_t>(op.dst)) & 15) == 0;
    uint64_t done = 0;
    if (wide) {
      const uint64_t n16 = op.bytes / 16;
      const uint4* s = reinterpret_cast<const uint4*>(op.src);
      uint4* d = reinterpret_cast<uint4*>(op.dst);
      for (uint64_t i = tid; i < n16; i += stride) d[i] = s[i];
      done = n16 * 16;
    }
    for (uint64_t i = done + tid; i < op.bytes; i += stride) op.dst[i] = op.src[i];
  }
}

}  // namespace

void* ids_to_host_kernel() { return reinterpret_cast<void*>(&ids_to_host); }
void* apply_plan_kernel() { return reinterpret_cast<void*>(&apply_plan); }

}  // namespace asyncside::faults::cuda
