// MLX CUDA upload path. Compiled for real only with -DASYNCSIDE_CUDA=ON (on the GPU machine);
// CPU and Metal builds get the stubs at the bottom, which say what is missing.
#include "cuda_upload.h"

#include <stdexcept>
#include <string>

#if defined(ASYNCSIDE_CUDA)

#include <algorithm>
#include <chrono>
#include <cstring>

#include <cuda_runtime.h>

#include "mlx/backend/cuda/allocator.h"
#include "mlx/backend/cuda/device.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace asyncside::cuda {
namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("[asyncside] ") + what + ": " + cudaGetErrorString(err));
  }
}

// The device address of an evaluated pool without touching its host view: MLX's CUDA buffers
// carry the device pointer; array::data<T>() would migrate the buffer to managed memory.
uint8_t* device_ptr(const mx::array& a) {
  auto* buf = static_cast<mx::cu::CudaBuffer*>(const_cast<mx::array&>(a).buffer().ptr());
  return static_cast<uint8_t*>(buf->data) + a.offset();
}

class UploadRows : public mx::Primitive {
 public:
  UploadRows(mx::Stream s, std::shared_ptr<io::HostMirror> mirror, std::vector<int64_t> rows)
      : mx::Primitive(s), mirror_(std::move(mirror)), rows_(std::move(rows)) {}

  void eval_cpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error("[asyncside] upload_rows runs on a GPU stream (device pools) only");
  }

  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override {
    auto& out = outputs[0];
    auto& enc = mx::cu::get_command_encoder(stream());
    out.set_data(mx::allocator::malloc(out.nbytes()));
    // One child graph of memcpy nodes; the encoder orders it after earlier work on this stream,
    // and marking the pools as outputs orders later readers of the pools after it.
    cudaGraph_t graph;
    check(cudaGraphCreate(&graph, 0), "cudaGraphCreate");
    try {
      // Rows sorted into runs of consecutive rows: one memcpy node per segment per run (the
      // mirror and the pools share a layout, so a run is contiguous on both sides).
      std::vector<int64_t> rows = rows_;
      std::sort(rows.begin(), rows.end());
      rows.erase(std::unique(rows.begin(), rows.end()), rows.end());
      for (size_t i = 0; i < inputs.size(); ++i) {
        enc.set_input_array(inputs[i]);
        uint8_t* dst = device_ptr(inputs[i]);
        const uint64_t nb = mirror_->row_nbytes(i);
        for (size_t a = 0; a < rows.size();) {
          size_t b = a + 1;
          while (b < rows.size() && rows[b] == rows[b - 1] + 1) ++b;
          const uint64_t first = static_cast<uint64_t>(rows[a]);
          cudaGraphNode_t node;
          check(cudaGraphAddMemcpyNode1D(&node, graph, nullptr, 0, dst + first * nb, mirror_->host_row(i, rows[a]),
                                         nb * (b - a), cudaMemcpyHostToDevice),
                "cudaGraphAddMemcpyNode1D");
          a = b;
        }
      }
      enc.set_output_array(out);
      enc.add_graph_node(graph);
    } catch (...) {
      cudaGraphDestroy(graph);
      throw;
    }
    cudaGraphDestroy(graph);  // the encoder's child-graph node holds its own clone
    // The mirror must outlive the copy: hold it until the stream has run past it.
    enc.add_completed_handler([keep = mirror_]() {});
  }

  const char* name() const override { return "AsyncsideUploadRows"; }
  bool is_equivalent(const mx::Primitive&) const override { return false; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>&) override { return {mx::Shape{1}}; }

 private:
  std::shared_ptr<io::HostMirror> mirror_;
  std::vector<int64_t> rows_;
};

bool pin(void* ptr, uint64_t nbytes) {
  // Mapped: the fault path's kernels read mirror rows straight from host memory.
  return cudaHostRegister(ptr, nbytes, cudaHostRegisterMapped | cudaHostRegisterPortable) == cudaSuccess;
}
void unpin(void* ptr) { cudaHostUnregister(ptr); }

}  // namespace

bool available() noexcept { return true; }

void install_pin_hooks() { io::set_pin_hooks(&pin, &unpin); }

mx::array upload_rows(std::shared_ptr<io::HostMirror> mirror, std::vector<mx::array> pools,
                      std::vector<int64_t> rows, mx::Stream stream) {
  if (pools.size() != mirror->segments()) {
    throw std::invalid_argument("pools: expected " + std::to_string(mirror->segments()) +
                                " (one per segment), got " + std::to_string(pools.size()));
  }
  for (size_t i = 0; i < pools.size(); ++i) {
    const auto& a = pools[i];
    if (a.ndim() < 1 || a.shape(0) != mirror->rows() ||
        a.nbytes() != static_cast<size_t>(mirror->rows()) * mirror->row_nbytes(i)) {
      throw std::invalid_argument("pools[" + std::to_string(i) + "]: expected " + std::to_string(mirror->rows()) +
                                  " rows of " + std::to_string(mirror->row_nbytes(i)) + " bytes");
    }
    if (!a.is_available()) {
      throw std::invalid_argument("pools[" + std::to_string(i) + "]: must be evaluated before uploads");
    }
  }
  for (int64_t r : rows) {
    if (r < 0 || r >= mirror->rows()) {
      throw std::out_of_range("rows: " + std::to_string(r) + " is outside [0, " + std::to_string(mirror->rows()) + ")");
    }
  }
  return mx::array(mx::Shape{1}, mx::uint8, std::make_shared<UploadRows>(stream, std::move(mirror), std::move(rows)),
                   std::move(pools));
}

double h2d_bandwidth(uint64_t nbytes, int iters) {
  void* host = nullptr;
  void* dev = nullptr;
  check(cudaHostAlloc(&host, nbytes, cudaHostAllocDefault), "cudaHostAlloc");
  cudaError_t err = cudaMalloc(&dev, nbytes);
  if (err != cudaSuccess) {
    cudaFreeHost(host);
    check(err, "cudaMalloc");
  }
  std::memset(host, 1, nbytes);
  cudaMemcpy(dev, host, nbytes, cudaMemcpyHostToDevice);  // warm-up
  cudaDeviceSynchronize();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) cudaMemcpy(dev, host, nbytes, cudaMemcpyHostToDevice);
  cudaDeviceSynchronize();
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  cudaFree(dev);
  cudaFreeHost(host);
  return static_cast<double>(nbytes) * iters / s;
}

}  // namespace asyncside::cuda

#else  // no CUDA in this build

namespace asyncside::cuda {

bool available() noexcept { return false; }
void install_pin_hooks() {}

mlx::core::array upload_rows(std::shared_ptr<io::HostMirror>, std::vector<mlx::core::array>, std::vector<int64_t>,
                             mlx::core::Stream) {
  throw std::runtime_error(
      "[asyncside] device pools need the CUDA upload path, which this build lacks "
      "(build with -DASYNCSIDE_CUDA=ON against the MLX CUDA wheel)");
}

double h2d_bandwidth(uint64_t, int) {
  throw std::runtime_error("[asyncside] h2d_bandwidth needs a CUDA build");
}

}  // namespace asyncside::cuda

#endif
