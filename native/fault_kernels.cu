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

// The plan's copies are spread over every thread of the grid as one run of 16-byte units (an
// op that is not 16-byte aligned counts in bytes): unit g of the run goes to thread g mod S. An
// earlier form let every op start at thread 0, so the first threads did a unit of every op one
// after the other, each a round trip over PCIe (a record is nine segments, six of them 18 KB:
// 1,152 units, while 9,216 of the grid's threads never had any work), and the plan of a prefill
// chunk's ~20 faults a resolve took that many round trips in a row. Each block reads the
// descriptors once into shared memory; each thread keeps up to four loads in flight.
__global__ void apply_plan(const Plan* plan, const uint32_t* rows_host, uint32_t* out, uint32_t n) {
  const uint32_t S = gridDim.x * blockDim.x;
  const uint32_t tid = blockIdx.x * blockDim.x + threadIdx.x;
  for (uint32_t i = tid; i < n; i += S) out[i] = rows_host[i];
  __shared__ uint32_t s_count;
  __shared__ CopyOp s_ops[kPlanOpsPerPass];
  if (threadIdx.x == 0) s_count = plan->count;
  __syncthreads();
  const uint32_t count = s_count;
  uint32_t base = 0;  // units of the run before the current op, modulo S
  for (uint32_t first = 0; first < count; first += kPlanOpsPerPass) {
    const uint32_t m = count - first < kPlanOpsPerPass ? count - first : kPlanOpsPerPass;
    for (uint32_t k = threadIdx.x; k < m; k += blockDim.x) s_ops[k] = plan->ops[first + k];
    __syncthreads();
    for (uint32_t k = 0; k < m; ++k) {
      const CopyOp op = s_ops[k];
      const bool wide = ((reinterpret_cast<uintptr_t>(op.src) | reinterpret_cast<uintptr_t>(op.dst) | op.bytes) & 15) == 0;
      const uint64_t units = wide ? op.bytes / 16 : op.bytes;
      uint64_t i = (tid + S - base) % S;  // this thread's first unit of the op
      if (wide) {
        const uint4* src = reinterpret_cast<const uint4*>(op.src);
        uint4* dst = reinterpret_cast<uint4*>(op.dst);
        for (; i + 3ull * S < units; i += 4ull * S) {
          const uint4 a = src[i], b = src[i + S], c = src[i + 2ull * S], d = src[i + 3ull * S];
          dst[i] = a;
          dst[i + S] = b;
          dst[i + 2ull * S] = c;
          dst[i + 3ull * S] = d;
        }
        for (; i < units; i += S) dst[i] = src[i];
      } else {
        for (; i < units; i += S) op.dst[i] = op.src[i];
      }
      base = static_cast<uint32_t>((base + units % S) % S);
    }
    __syncthreads();  // every thread is done with s_ops before the next pass loads it
  }
}

constexpr uint32_t kNoId = 0xFFFFFFFFu;  // a pair routed to no expert (expert_faults.h, kNoExpert)

// A fault node on the device. Every routed expert with a row (the host's table, read over PCIe)
// gets it at once; when all have one, the node's uses go to the ring (the host replays them into
// its policy later, in order) and the plan is emptied: no host round trip at all. Otherwise (a
// miss, an id out of range, or a full ring) thread 0 posts the ids to the host's fault server and
// spins until it answers with a row for every id and the plan of copies apply_plan makes next.
__global__ void lookup_rows(const uint32_t* ids, Lookup L, uint32_t* out, uint32_t n) {
  __shared__ uint32_t mask[kLookupMaxExperts / 32];
  __shared__ uint32_t pairs;
  __shared__ uint32_t head;
  __shared__ int miss, fast;
  const uint32_t words = (L.n_experts + 31) / 32;
  for (uint32_t w = threadIdx.x; w < words; w += blockDim.x) mask[w] = 0;
  if (threadIdx.x == 0) {
    pairs = 0;
    miss = 0;
  }
  __syncthreads();
  const volatile int32_t* table = L.table;
  uint32_t mine = 0;
  for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) {
    const uint32_t e = ids[i];
    if (e == kNoId) {
      out[i] = 0;
      continue;
    }
    const int32_t r = e < L.n_experts ? table[e] : -1;
    if (r < 0) {
      miss = 1;  // several threads may store it: all store 1
      continue;
    }
    out[i] = static_cast<uint32_t>(r);
    atomicOr(&mask[e >> 5], 1u << (e & 31));
    ++mine;
  }
  if (mine) atomicAdd(&pairs, mine);
  __syncthreads();
  volatile Mailbox* box = L.box;
  if (threadIdx.x == 0) {
    // One thread reads the host's ring tail, so that the block takes one decision.
    head = box->ring_head;
    fast = !miss && head - box->ring_tail < L.ring_cap;
  }
  __syncthreads();
  if (fast) {
    volatile uint32_t* rec = L.ring + static_cast<size_t>(head % L.ring_cap) * L.ring_words;
    if (threadIdx.x == 0) rec[0] = pairs;
    for (uint32_t w = threadIdx.x; w < words; w += blockDim.x) rec[1 + w] = mask[w];
    __threadfence_system();
    __syncthreads();
    if (threadIdx.x == 0) {
      static_cast<volatile Plan*>(L.plan)->count = 0;
      __threadfence_system();
      box->ring_head = head + 1;  // the record is whole before the host can see it
      __threadfence_system();
    }
    return;
  }
  volatile uint32_t* ids_host = L.ids_host;
  for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) ids_host[i] = ids[i];
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    box->n = n;
    const uint32_t seq = box->request + 1;
    __threadfence_system();
    box->request = seq;
    __threadfence_system();
    while (box->response != seq) __nanosleep(200);
    __threadfence_system();
  }
  __syncthreads();
  const volatile uint32_t* rows = L.rows_host;
  for (uint32_t i = threadIdx.x; i < n; i += blockDim.x) out[i] = rows[i];
}

}  // namespace

void* lookup_rows_kernel() { return reinterpret_cast<void*>(&lookup_rows); }
void* ids_to_host_kernel() { return reinterpret_cast<void*>(&ids_to_host); }
void* apply_plan_kernel() { return reinterpret_cast<void*>(&apply_plan); }

}  // namespace asyncside::faults::cuda
