// Device-pool uploads (MLX CUDA): copy rows of a pinned host mirror into device pool rows with
// a memcpy node on MLX's own CUDA stream. Declarations are always visible; the definitions exist
// only in builds with ASYNCSIDE_CUDA (elsewhere upload_rows throws a clear error).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "host_mirror.h"
#include "mlx/array.h"
#include "mlx/stream.h"

namespace asyncside::cuda {

// True when this build carries the CUDA upload path.
bool available() noexcept;

// A lazy uint8[1] array; evaluating it (on a GPU stream) copies mirror row rows[k] to device pool
// row rows[k] of every segment. pools[i] holds segment i. The mirror and pools stay alive until
// the copy ran (the primitive holds them).
mlx::core::array upload_rows(std::shared_ptr<io::HostMirror> mirror, std::vector<mlx::core::array> pools,
                             std::vector<int64_t> rows, mlx::core::Stream stream);

// Page-lock the mirror allocations (installed as io::set_pin_hooks at import on CUDA builds).
void install_pin_hooks();

// Pinned host -> device cudaMemcpy bandwidth in bytes/s (the physical limit beside our uploads).
double h2d_bandwidth(uint64_t nbytes, int iters);

}  // namespace asyncside::cuda
