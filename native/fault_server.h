// The host's side of device fault nodes that resolve on the device (MLX CUDA).
//
// A fault node whose routed experts all have rows never waits for the host; one that misses
// posts its ids into pinned memory and spins on the device until the host answers. The fault
// server is the thread that answers: while any such node may be running it polls each one's
// mailbox (a few loads of host memory per node), and serves a request by resolving the ids in the
// node's fault table, on this thread, as the CUDA driver's callback thread did for a host node.
// A host node costs the GPU a round trip through the driver on every node, hit or miss
// (BENCHMARKS.md, "MLX CUDA"); a posted request costs one only on a miss.
//
// Nodes are registered (enter) when MLX encodes them and leave when their command buffer has
// completed, so the server polls only while work that may post is queued: it spins for a short
// while after its last answer, then polls every few tens of microseconds, and sleeps when nothing
// is registered. The thread starts on first use and lives as long as the process; it runs plain
// C++ only (fault tables, reads): never Python, never the GIL. It never holds a reference to a
// node: the last one to a fault table is dropped by leave()'s caller, since freeing a table's
// pinned memory waits for the device, which may be waiting for this thread. Plain C++: no CUDA.
#pragma once

#include <cstdint>
#include <memory>

namespace asyncside::faults {

// One node that may post requests: poll() serves its request if one is waiting (true when it did).
class Pollable {
 public:
  virtual ~Pollable() = default;
  virtual bool poll() = 0;
};

// `node` may post from now on (until leave(node.get())).
void server_enter(std::shared_ptr<Pollable> node);
void server_leave(const Pollable* node);

// Nodes registered now, and requests served since the process started (tests, benchmarks).
uint64_t server_registered();
uint64_t server_served();

}  // namespace asyncside::faults
