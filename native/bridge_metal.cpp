// Metal completion hook for the completion bridge (compiled only on Apple, ASYNCSIDE_METAL).
// Not verified here: no Apple machine is available to this project.
#if defined(ASYNCSIDE_METAL)

#include <functional>
#include <utility>

#include "bridge.h"
#include "mlx/backend/metal/device.h"

namespace asyncside::bridge {

void metal_add_completed_handler(mlx::core::Stream s, std::function<void()> fn) {
  // The handler fires on Metal's completion thread once the command buffer that is current on
  // this stream (and so every buffer committed before it) has finished on the GPU.
  auto& enc = mlx::core::metal::get_command_encoder(s);
  enc.get_command_buffer()->addCompletedHandler(
      [fn = std::move(fn)](MTL::CommandBuffer*) { fn(); });
}

}  // namespace asyncside::bridge

#endif  // ASYNCSIDE_METAL
