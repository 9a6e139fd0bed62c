// What this extension needs from MLX, in one place.
//
// Pinned version: MLX 0.32.4. The extension links against libmlx from the MLX wheel and uses
// headers that are not MLX's public API, so the MLX that builds it must be the MLX that runs it.
// pyproject.toml pins the same version twice (build-system.requires and the runtime
// dependencies); the static_assert below stops a build against any other MLX. Moving to a new MLX
// means re-reading every entry below against its sources, then changing all three pins together.
//
// Public MLX API used:
//   mlx/array.h, mlx/stream.h      arrays (status(), event(), is_available(), copy_shared_buffer,
//                                  set_data), streams, default_stream
//   mlx/primitives.h               subclassing Primitive (eval_cpu / eval_gpu / output_shapes /
//                                  is_equivalent / name): the completion signal, the stream gate,
//                                  the failing test primitive, the device-pool upload
//   mlx/allocator.h                allocator::malloc for primitive outputs
//   mlx/transforms.h               async_eval
//
// MLX internals the completion bridge depends on (may change in any MLX release):
//   mlx/scheduler.h                scheduler::n_active_tasks() (MLX's count of task groups in
//                                  flight) and scheduler::enqueue(stream, fn): a backlogged CPU
//                                  stream gets its completion post queued directly.
//   mlx/transforms.cpp             the eval throttle's limit, MAX_ACTIVE_TASKS = 10: async_eval
//                                  blocks its caller above it. Mirrored as kMlxMaxActiveTasks in
//                                  bridge.cpp; not in any header.
//   mlx/backend/cpu/encoder.h      cpu::get_command_encoder(stream): dispatch() a task on the
//                                  CPU stream, set_output_array().
//   mlx/backend/cuda/device.h      cu::get_command_encoder(stream), CommandEncoder::
//                                  add_completed_handler (the CUDA completion path),
//                                  set_input_array / set_output_array / add_graph_node (the
//                                  upload's child graph of memcpy nodes). Without the fmt headers
//                                  bridge_cuda.cpp declares the two entry points it calls itself.
//   mlx/backend/cuda/allocator.h   cu::CudaBuffer::data: a device pool's device address, read
//                                  without array::data<T>() (which migrates the buffer to managed
//                                  memory).
//   mlx/backend/metal/device.h     metal::get_command_encoder(stream).get_command_buffer() and
//                                  addCompletedHandler (the Metal completion path; not verified).
//
// Facts about MLX's behaviour the design relies on (not expressed in any header):
//   - a pool array created once, evaluated and never written through MLX ops keeps its buffer
//     address; writing its bytes from outside (preadv into the rows) is seen by later reads;
//   - streams are thread-local: graphs are built on the event loop thread only;
//   - on a GPU stream every async_eval commits one command buffer (a graph launch on CUDA).
#pragma once

#include "mlx/version.h"

static_assert(MLX_VERSION_MAJOR == 0 && MLX_VERSION_MINOR == 32 && MLX_VERSION_PATCH == 4,
              "asyncside is pinned to MLX 0.32.4 (see native/mlx_dependency.h): it uses MLX internals "
              "that may change in any release");
