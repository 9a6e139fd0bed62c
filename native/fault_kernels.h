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

// apply_plan's launch shape (the grid covers a 132-SM GPU four warps deep per block; the copy
// is bound by PCIe round trips, which many warps in flight hide) and the descriptors each block
// holds in shared memory at a time.
constexpr unsigned kApplyPlanBlocks = 264;
constexpr unsigned kApplyPlanThreads = 512;
constexpr unsigned kPlanOpsPerPass = 256;

// The device lookup (lookup_rows): a fault node whose routed experts all have rows resolves on the
// device, with no host round trip; one that misses posts a request to the host's fault server and
// waits for its answer. Everything here lives in pinned, mapped host memory: written by one side,
// read by the other, one writer per field.
struct Mailbox {
  uint32_t request;   // device: the sequence number of the latest request (0: none yet)
  uint32_t response;  // host: the sequence number of the latest request answered
  uint32_t n;         // device: the routed ids of the request (in the sink's ids_host)
  uint32_t ring_head; // device: records of the use ring written
  uint32_t ring_tail; // host: records of the use ring taken
};

// Every pointer is the device's view of mapped host memory.
struct Lookup {
  const int32_t* table;   // expert -> pool row (-1: absent), kept by the host
  Mailbox* box;
  uint32_t* ring;         // ring_cap records of ring_words: word 0 the routed pairs, then a bit per expert
  uint32_t* ids_host;     // a request's ids, for the host
  const uint32_t* rows_host;  // the host's answer: a row per id
  Plan* plan;             // the copies apply_plan makes next (the host writes it; a hit empties it)
  uint32_t n_experts;
  uint32_t ring_cap;
  uint32_t ring_words;
};

// lookup_rows' launch shape (one block: the node's ids are a step's pairs) and the largest layer
// its bitmask in shared memory covers; a layer with more experts keeps the host node.
constexpr unsigned kLookupThreads = 256;
constexpr unsigned kLookupMaxExperts = 1024;

// Kernel entry points, as the void* a cudaKernelNodeParams wants.
void* ids_to_host_kernel();  // (const uint32_t* ids, uint32_t* ids_host, uint32_t n)
void* apply_plan_kernel();   // (const Plan* plan, const uint32_t* rows_host, uint32_t* out, uint32_t n)
void* lookup_rows_kernel();  // (const uint32_t* ids, Lookup lookup, uint32_t* out, uint32_t n)

}  // namespace asyncside::faults::cuda
