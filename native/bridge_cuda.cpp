// CUDA completion hook for the completion bridge (compiled only with -DASYNCSIDE_CUDA=ON).
// Not verified on this machine (no GPU here): it is built and exercised on the CUDA host.
#if defined(ASYNCSIDE_CUDA)

#include <functional>
#include <utility>

#include "bridge.h"

#if __has_include(<fmt/format.h>)
#include "mlx/backend/cuda/device.h"
#else
// mlx/backend/cuda/device.h includes <fmt/format.h>, which the MLX wheel does not ship. Declare
// the two entry points we call exactly as MLX 0.32.4 exports them (class MLX_API CommandEncoder
// in mlx/backend/cuda/device.h): the linker binds by these names, and we never touch the layout.
namespace mlx::core::cu {
class CommandEncoder {
 public:
  void add_completed_handler(std::function<void()> task);
};
CommandEncoder& get_command_encoder(Stream s);
}  // namespace mlx::core::cu
#endif

namespace asyncside::bridge {

void cuda_add_completed_handler(mlx::core::Stream s, std::function<void()> fn) {
  // The encoder hands completed handlers to its worker thread once the device has finished every
  // command committed before them (MLX commits the encoder at the end of each eval), so the
  // ticket posts after x's kernels ran. The worker thread only runs our C++ post().
  mlx::core::cu::get_command_encoder(s).add_completed_handler(std::move(fn));
}

}  // namespace asyncside::bridge

#endif  // ASYNCSIDE_CUDA
