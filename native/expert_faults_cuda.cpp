// Queued steps on MLX CUDA: the fault node as kernel nodes of MLX's command graph.
//
// The default form, two kernels:
//   lookup  every routed id -> its pool row, from the device's copy of the layer's table (pinned,
//           mapped; the host keeps it current). When all hit, that is the whole resolve: its uses
//           go to a ring the host replays into its policy later. A miss posts the ids to the
//           fault server (fault_server.h) and spins on the device until it answers: the server
//           resolves them in the fault table (a fault reads its record into the pinned host mirror
//           row, or finds it in the host tier) and plans one copy per segment.
//   plan    the plan's copies, mirror -> pool rows on the device (nothing after a hit).
// The form before it (ASYNCSIDE_CUDA_FAULT_NODE=host), and the one a staged resolve still takes:
//   kernel  ids -> pinned host memory
//   host    resolve (or stage) the ids in the fault table, planning the copies
//   kernel  the plan's copies; the chosen rows -> the output
// A host node costs every node a round trip through the driver's callback thread, hit or miss
// (BENCHMARKS.md, "MLX CUDA"); the lookup costs one only on a miss.
//
// A host node may not call the CUDA runtime, hence the kernels on both sides (memcpy nodes would
// also keep MLX from updating its cached executable graphs in place). Host nodes run on the
// driver's callback thread, the fault server on its own, one request at a time; only C++ objects
// are touched there. The kernels are MLX kernel nodes and the host node a one-node child graph
// under a fixed key: MLX neither walks nor keys a child graph per fault node (a shorter hand-off
// to MLX than one three-node child graph, ASYNCSIDE_CUDA_FAULT_NODE=child; BENCHMARKS.md, "MLX CUDA").
// Compiled only with -DASYNCSIDE_CUDA=ON; verified on the CUDA host, not on this build machine.
#include "expert_faults.h"

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <stdexcept>
#include <string>

#if defined(ASYNCSIDE_CUDA)

#include <cuda.h>
#include <cuda_runtime.h>

#include "fault_kernels.h"
#include "fault_server.h"
#include "host_mirror.h"
#include "mlx/allocator.h"
#include "mlx/backend/cuda/allocator.h"
#include "mlx/backend/cuda/device.h"
#include "mlx/ops.h"

namespace mx = mlx::core;

namespace asyncside::faults {

namespace {

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string("[asyncside] ") + what + ": " + cudaGetErrorString(err));
  }
}

uint8_t* device_ptr(const mx::array& a) {
  // MLX's CUDA buffers carry the device pointer; array::data<T>() would migrate the buffer.
  auto* buf = static_cast<mx::cu::CudaBuffer*>(const_cast<mx::array&>(a).buffer().ptr());
  return static_cast<uint8_t*>(buf->data) + a.offset();
}

template <class T>
T* mapped_alloc(size_t count, T** device) {
  void* host = nullptr;
  check(cudaHostAlloc(&host, count * sizeof(T), cudaHostAllocMapped | cudaHostAllocPortable), "cudaHostAlloc");
  void* dev = nullptr;
  cudaError_t err = cudaHostGetDevicePointer(&dev, host, 0);
  if (err != cudaSuccess) {
    cudaFreeHost(host);
    check(err, "cudaHostGetDevicePointer");
  }
  *device = static_cast<T*>(dev);
  return static_cast<T*>(host);
}

}  // namespace

// Reads land in the host mirror (pinned, mapped); each fault adds the copies to the device pools
// to the plan of the host node running it. The mirror has a row per pool row, or (by_expert) a
// row per expert of the layer: a host tier, where a record read and verified once stays, so that
// a later fault of it is the device copy alone (the bytes never change once kept).
class DeviceRecordSink final : public RecordSink {
 public:
  DeviceRecordSink(std::shared_ptr<io::HostMirror> mirror, std::vector<mx::array> pools, uint64_t stride,
                   std::vector<io::SegmentSpan> segments, uint32_t max_pairs, bool by_expert)
      : mirror_(std::move(mirror)),
        pools_(std::move(pools)),
        host_(mirror_, stride, segments),
        max_pairs_(max_pairs),
        by_expert_(by_expert) {
    if (pools_.size() != mirror_->segments()) {
      throw std::invalid_argument("pools: expected " + std::to_string(mirror_->segments()) + " (one per segment)");
    }
    rows_ = pools_.front().ndim() >= 1 ? pools_.front().shape(0) : 0;
    if (!by_expert_ && rows_ != mirror_->rows()) {
      throw std::invalid_argument("mirror: expected " + std::to_string(rows_) + " rows (one per pool row), got " +
                                  std::to_string(mirror_->rows()));
    }
    for (size_t i = 0; i < pools_.size(); ++i) {
      const auto& a = pools_[i];
      if (a.ndim() < 1 || a.shape(0) != rows_ || rows_ < 1 ||
          a.nbytes() != static_cast<size_t>(rows_) * mirror_->row_nbytes(i) || !a.is_available()) {
        throw std::invalid_argument("pools[" + std::to_string(i) + "]: expected an evaluated pool of " +
                                    std::to_string(rows_) + " rows of " + std::to_string(mirror_->row_nbytes(i)) +
                                    " bytes");
      }
      dev_base_.push_back(device_ptr(a));
      void* m = nullptr;
      check(cudaHostGetDevicePointer(&m, mirror_->host_row(i, 0), 0),
            "cudaHostGetDevicePointer (the host mirror must be pinned and mapped)");
      mirror_dev_.push_back(static_cast<uint8_t*>(m));
    }
    if (by_expert_) held_.assign(static_cast<size_t>(mirror_->rows()), 0);
    // One op per segment of each fault (at most a lent row each), or of each staged expert (at
    // most one per expert, by_expert: the tier has a row per expert).
    const int64_t slots = by_expert_ ? std::max(rows_, mirror_->rows()) : rows_;
    const uint32_t ops = static_cast<uint32_t>(slots * static_cast<int64_t>(pools_.size()));
    plan_ = static_cast<cuda::Plan*>(static_cast<void*>(
        mapped_alloc<uint8_t>(sizeof(cuda::Plan) + ops * sizeof(cuda::CopyOp), reinterpret_cast<uint8_t**>(&plan_dev_))));
    plan_->count = 0;
    plan_->capacity = ops;
    ids_host_ = mapped_alloc<uint32_t>(max_pairs_, &ids_dev_);
    rows_host_ = mapped_alloc<uint32_t>(max_pairs_, &rows_dev_);
  }

  ~DeviceRecordSink() override {
    cudaFreeHost(plan_);
    cudaFreeHost(ids_host_);
    cudaFreeHost(rows_host_);
    if (lookup_host_ != nullptr) cudaFreeHost(lookup_host_);
  }

  int64_t rows() const override { return rows_; }

  int read(int fd, uint64_t offset, int64_t row, int64_t expert) override {
    return host_.read_row(fd, offset, slot(row, expert));
  }
  void set_direct(bool on) override { host_.set_direct(on); }
  uint32_t checksum(io::ChecksumKind kind, int64_t row, int64_t expert) override {
    return host_.checksum_row(kind, slot(row, expert));
  }
  bool holds(int64_t expert) const override {
    return by_expert_ && expert >= 0 && static_cast<size_t>(expert) < held_.size() && held_[static_cast<size_t>(expert)];
  }
  void keep(int64_t expert) override {
    if (by_expert_) held_.at(static_cast<size_t>(expert)) = 1;
  }

  int publish(int64_t row, int64_t expert) override {
    const int64_t from = slot(row, expert);
    for (size_t i = 0; i < pools_.size(); ++i) {
      if (plan_->count >= plan_->capacity) return ENOBUFS;  // cannot happen: one fault per lent row
      const uint64_t nb = mirror_->row_nbytes(i);
      plan_->ops[plan_->count++] = {mirror_dev_[i] + static_cast<uint64_t>(from) * nb,
                                    dev_base_[i] + static_cast<uint64_t>(row) * nb, nb};
    }
    return 0;
  }

  bool stages() const override { return by_expert_ && !staging_.empty(); }

  int stage(int64_t expert, int64_t row) override {
    if (!stages()) return ENOTSUP;
    if (expert < 0 || expert >= mirror_->rows() || row >= rows_) return EINVAL;
    for (size_t i = 0; i < pools_.size(); ++i) {
      if (plan_->count >= plan_->capacity) return ENOBUFS;  // cannot happen: one expert once per node
      const uint64_t nb = mirror_->row_nbytes(i);
      const uint8_t* src = row >= 0 ? dev_base_[i] + static_cast<uint64_t>(row) * nb
                                    : mirror_dev_[i] + static_cast<uint64_t>(expert) * nb;
      plan_->ops[plan_->count++] = {src, staging_dev_[i] + static_cast<uint64_t>(expert) * nb, nb};
    }
    return 0;
  }

  void set_staging(std::vector<mx::array> staging) {
    if (!by_expert_) {
      throw std::invalid_argument("staging: the layer has no host tier (staged copies come from it)");
    }
    if (staging.size() != pools_.size()) {
      throw std::invalid_argument("staging: expected " + std::to_string(pools_.size()) + " arrays (one per segment), got " +
                                  std::to_string(staging.size()));
    }
    std::vector<uint8_t*> dev;
    for (size_t i = 0; i < staging.size(); ++i) {
      const auto& a = staging[i];
      const int64_t n = mirror_->rows();
      if (a.ndim() < 1 || a.shape(0) != n || a.nbytes() != static_cast<size_t>(n) * mirror_->row_nbytes(i) ||
          !a.is_available() || a.dtype() != pools_[i].dtype()) {
        throw std::invalid_argument("staging[" + std::to_string(i) + "]: expected an evaluated array of " +
                                    std::to_string(n) + " rows (one per expert) of " +
                                    std::to_string(mirror_->row_nbytes(i)) + " bytes, the pools' dtype");
      }
      dev.push_back(device_ptr(a));
    }
    staging_ = std::move(staging);
    staging_dev_ = std::move(dev);
  }

  // ---- the device lookup (fault_kernels.h, Lookup) ----
  void table_reset(const std::vector<int32_t>& table) override {
    if (lookup_host_ == nullptr) {
      if (table.empty() || table.size() > cuda::kLookupMaxExperts) return;  // nodes keep the host node
      const uint32_t n = static_cast<uint32_t>(table.size());
      ring_words_ = 1 + (n + 31) / 32;
      // The layout: mailbox, table, ring (all 4-byte words).
      const size_t words = sizeof(cuda::Mailbox) / 4 + n + static_cast<size_t>(kRingCap) * ring_words_;
      uint32_t* dev = nullptr;
      lookup_host_ = mapped_alloc<uint32_t>(words, &dev);
      std::fill(lookup_host_, lookup_host_ + words, 0u);
      box_ = reinterpret_cast<volatile cuda::Mailbox*>(lookup_host_);
      table_host_ = reinterpret_cast<volatile int32_t*>(lookup_host_ + sizeof(cuda::Mailbox) / 4);
      ring_host_ = lookup_host_ + sizeof(cuda::Mailbox) / 4 + n;
      lookup_dev_ = cuda::Lookup{reinterpret_cast<const int32_t*>(dev + sizeof(cuda::Mailbox) / 4),
                                 reinterpret_cast<cuda::Mailbox*>(dev),
                                 dev + sizeof(cuda::Mailbox) / 4 + n,
                                 ids_dev_,
                                 rows_dev_,
                                 plan_dev_,
                                 n,
                                 kRingCap,
                                 ring_words_};
    }
    for (size_t e = 0; e < table.size(); ++e) table_host_[e] = table[e];
    std::atomic_thread_fence(std::memory_order_release);
  }
  void table_changed(int64_t expert, int32_t row) override {
    if (lookup_host_ != nullptr) table_host_[expert] = row;
  }
  bool next_device_use(std::vector<int64_t>& uniq, uint64_t& pairs) override {
    if (lookup_host_ == nullptr) return false;
    const uint32_t head = box_->ring_head;
    if (head == ring_tail_) return false;
    std::atomic_thread_fence(std::memory_order_acquire);  // the record was written before the head
    const uint32_t* rec = ring_host_ + static_cast<size_t>(ring_tail_ % kRingCap) * ring_words_;
    const volatile uint32_t* v = rec;
    pairs = v[0];
    uniq.clear();
    for (uint32_t w = 0; w + 1 < ring_words_; ++w) {
      uint32_t bits = v[1 + w];
      while (bits) {
        const int b = __builtin_ctz(bits);
        uniq.push_back(static_cast<int64_t>(w) * 32 + b);
        bits &= bits - 1;
      }
    }
    std::atomic_thread_fence(std::memory_order_release);  // read before the device may reuse it
    box_->ring_tail = ++ring_tail_;
    return true;
  }
  bool looks_up() const { return lookup_host_ != nullptr; }
  const cuda::Lookup& lookup_dev() const { return lookup_dev_; }
  // The fault server's poll (one thread): answer the waiting request, if any, by resolving its
  // ids in `table`, as a host node would; true when it did.
  bool serve(FaultTable& table) {
    const uint32_t req = box_->request;
    if (req == served_) return false;
    std::atomic_thread_fence(std::memory_order_acquire);  // the ids were written before the request
    const uint32_t n = box_->n;
    std::vector<int64_t> ids(n);
    const volatile uint32_t* src = ids_host_;
    for (uint32_t i = 0; i < n && i < max_pairs_; ++i) ids[i] = src[i];
    begin_plan();
    try {
      table.resolve(std::move(ids), rows_host_);  // a failed fault: logged, its rows read row 0
    } catch (const std::exception& e) {
      std::fill(rows_host_, rows_host_ + std::min(n, max_pairs_), 0u);
      table.failed(e.what());
    } catch (...) {
      std::fill(rows_host_, rows_host_ + std::min(n, max_pairs_), 0u);
      table.failed("an exception that is not a std::exception");
    }
    served_ = req;
    std::atomic_thread_fence(std::memory_order_release);  // rows, plan and table before the answer
    box_->response = req;
    return true;
  }

  void begin_plan() { plan_->count = 0; }

  uint32_t max_pairs() const { return max_pairs_; }
  uint32_t* ids_host() { return ids_host_; }
  uint32_t* ids_dev() { return ids_dev_; }
  uint32_t* rows_host() { return rows_host_; }
  uint32_t* rows_dev() { return rows_dev_; }
  cuda::Plan* plan_dev() { return plan_dev_; }

 private:
  std::shared_ptr<io::HostMirror> mirror_;
  std::vector<mx::array> pools_;
  HostRecordSink host_;
  uint32_t max_pairs_;
  std::vector<uint8_t*> dev_base_;
  std::vector<uint8_t*> mirror_dev_;
  cuda::Plan* plan_ = nullptr;
  cuda::Plan* plan_dev_ = nullptr;
  uint32_t* ids_host_ = nullptr;
  uint32_t* ids_dev_ = nullptr;
  uint32_t* rows_host_ = nullptr;
  uint32_t* rows_dev_ = nullptr;
  bool by_expert_;
  int64_t rows_ = 0;
  std::vector<uint8_t> held_;  // by expert: its verified bytes are in the mirror (kept for good)
  std::vector<mx::array> staging_;  // a row per expert and segment: what staged resolves fill
  std::vector<uint8_t*> staging_dev_;
  // The device lookup: one mapped block (mailbox, table, ring); its device view in lookup_dev_.
  static constexpr uint32_t kRingCap = 256;
  uint32_t* lookup_host_ = nullptr;
  volatile cuda::Mailbox* box_ = nullptr;
  volatile int32_t* table_host_ = nullptr;
  uint32_t* ring_host_ = nullptr;
  uint32_t ring_words_ = 0;
  uint32_t ring_tail_ = 0;  // under the table's lock
  uint32_t served_ = 0;     // the fault server's thread only
  cuda::Lookup lookup_dev_{};

  int64_t slot(int64_t row, int64_t expert) const { return by_expert_ ? expert : row; }
};

namespace {

struct HostCall {
  std::shared_ptr<FaultTable> table;
  DeviceRecordSink* sink;
  uint32_t n;
  bool staged;
};

void CUDART_CB host_fault(void* data) {
  auto* call = static_cast<HostCall*>(data);
  DeviceRecordSink* sink = call->sink;
  sink->begin_plan();
  std::vector<int64_t> ids(call->n);
  for (uint32_t i = 0; i < call->n; ++i) ids[i] = sink->ids_host()[i];
  // A failed fault is in the fault log; the host raises it as FillError when it learns of the
  // step (a host node cannot fail its graph). Rows the step could not get read row 0.
  try {
    if (call->staged) {
      call->table->stage(std::move(ids), sink->rows_host());
    } else {
      call->table->resolve(std::move(ids), sink->rows_host());
    }
  } catch (const std::exception& e) {
    std::fill(sink->rows_host(), sink->rows_host() + call->n, 0u);
    call->table->failed(e.what());
  } catch (...) {
    std::fill(sink->rows_host(), sink->rows_host() + call->n, 0u);
    call->table->failed("an exception that is not a std::exception");
  }
}

// The kernels' driver-API handles. libmlx links its own copy of the CUDA runtime, which knows
// nothing of the kernels registered with ours: a runtime-API kernel node made by MLX's encoder
// from our host stub would name a function MLX's runtime never registered. A CUfunction is the
// driver's, shared by the whole process (looked up once, on the first encoding thread, where MLX
// has made its device current).
CUfunction driver_function(void* stub, const char* what) {
  cudaFunction_t f = nullptr;
  check(cudaGetFuncBySymbol(&f, stub), what);
  return reinterpret_cast<CUfunction>(f);
}

CUfunction ids_to_host_function() {
  static const CUfunction f = driver_function(cuda::ids_to_host_kernel(), "cudaGetFuncBySymbol (ids)");
  return f;
}

CUfunction apply_plan_function() {
  static const CUfunction f = driver_function(cuda::apply_plan_kernel(), "cudaGetFuncBySymbol (plan)");
  return f;
}

CUfunction lookup_rows_function() {
  static const CUfunction f = driver_function(cuda::lookup_rows_kernel(), "cudaGetFuncBySymbol (lookup)");
  return f;
}

// How a (non-staged) fault node is encoded. The default, "device": the lookup kernel and the plan
// kernel, a miss answered by the fault server. ASYNCSIDE_CUDA_FAULT_NODE=host keeps the host node
// on every node (kernel, host node, kernel: the earlier form), =child the same three as one child
// graph (the form before that): kept to measure the encodings side by side.
enum class NodeForm { Device, Host, Child };
NodeForm fault_node_form() {
  static const NodeForm form = [] {
    const char* v = std::getenv("ASYNCSIDE_CUDA_FAULT_NODE");
    const std::string s = v != nullptr ? v : "";
    return s == "child" ? NodeForm::Child : s == "host" ? NodeForm::Host : NodeForm::Device;
  }();
  return form;
}

// A node that may post to the fault server: its table, kept alive until its command buffer ran.
class PostingNode final : public Pollable {
 public:
  PostingNode(std::shared_ptr<FaultTable> table, DeviceRecordSink* sink) : table_(std::move(table)), sink_(sink) {}
  bool poll() override { return sink_->serve(*table_); }

 private:
  std::shared_ptr<FaultTable> table_;
  DeviceRecordSink* sink_;
};

}  // namespace

std::unique_ptr<RecordSink> make_device_sink(std::shared_ptr<io::HostMirror> mirror, std::vector<mx::array> pools,
                                             uint64_t stride, std::vector<io::SegmentSpan> segments,
                                             uint32_t max_pairs, bool by_expert) {
  return std::make_unique<DeviceRecordSink>(std::move(mirror), std::move(pools), stride, std::move(segments),
                                            max_pairs, by_expert);
}

bool device_faults_available() noexcept { return true; }

const char* device_fault_node_form() noexcept {
  switch (fault_node_form()) {
    case NodeForm::Device: return "device";
    case NodeForm::Host: return "host";
    case NodeForm::Child: return "child";
  }
  return "device";
}

void set_device_staging(FaultTable& table, std::vector<mx::array> staging) {
  auto* sink = dynamic_cast<DeviceRecordSink*>(table.sink());
  if (sink == nullptr) throw std::invalid_argument("staging: the table was not built for device pools");
  sink->set_staging(std::move(staging));
}

mx::array prepare_device_ids(const mx::array& ids, mx::Stream stream) {
  return mx::contiguous(mx::astype(ids, mx::uint32, stream), false, stream);
}

void eval_device_faults(const std::shared_ptr<FaultTable>& table, const mx::array& ids, mx::array& out,
                        mx::Stream stream, bool staged) {
  auto* sink = dynamic_cast<DeviceRecordSink*>(table->sink());
  if (sink == nullptr) {
    throw std::runtime_error("[asyncside] expert_rows on a GPU stream needs a fault table built for device pools");
  }
  const uint32_t n = static_cast<uint32_t>(ids.size());
  if (n > sink->max_pairs()) {
    throw std::runtime_error("[asyncside] layer " + std::to_string(table->layer()) + ": a queued step routes " +
                             std::to_string(n) + " pairs, more than the " + std::to_string(sink->max_pairs()) +
                             " its fault table was built for");
  }
  auto& enc = mx::cu::get_command_encoder(stream);
  out.set_data(mx::allocator::malloc(out.nbytes()));
  if (staged && !sink->stages()) {
    throw std::runtime_error("[asyncside] layer " + std::to_string(table->layer()) + ": no staging arrays to stage into");
  }
  const uint32_t* ids_dev = reinterpret_cast<const uint32_t*>(device_ptr(ids));
  uint32_t* out_dev = reinterpret_cast<uint32_t*>(device_ptr(out));
  const cuda::Plan* plan = sink->plan_dev();
  const uint32_t* rows_host_dev = sink->rows_dev();
  uint32_t count = n;
  if (!staged && sink->looks_up() && fault_node_form() == NodeForm::Device) {
    // Two kernel nodes: the lookup (rows from the device's copy of the table; a miss posts to
    // the fault server and waits on the device), then the plan's copies (none after a hit).
    // Ordered by `out` as below; the plan kernel writes no output row (its count is 0).
    cuda::Lookup lookup = sink->lookup_dev();
    uint32_t none = 0;
    void* args_l[] = {&ids_dev, &lookup, &out_dev, &count};
    void* args_p[] = {&plan, &rows_host_dev, &out_dev, &none};
    enc.set_input_array(ids);
    enc.set_output_array(out);
    enc.add_kernel_node_raw(lookup_rows_function(), dim3(1), dim3(cuda::kLookupThreads), dim3(1, 1, 1), 0, args_l);
    enc.set_input_array(out);
    enc.set_output_array(out);
    enc.add_kernel_node_raw(apply_plan_function(), dim3(cuda::kApplyPlanBlocks), dim3(cuda::kApplyPlanThreads),
                            dim3(1, 1, 1), 0, args_p);
    auto node = std::make_shared<PostingNode>(table, sink);
    const Pollable* key = node.get();
    server_enter(std::move(node));
    enc.add_completed_handler([key]() { server_leave(key); });
    return;
  }
  auto call = std::make_shared<HostCall>(HostCall{table, sink, n, staged});
  uint32_t* ids_host_dev = sink->ids_dev();
  void* args1[] = {&ids_dev, &ids_host_dev, &count};
  void* args3[] = {&plan, &rows_host_dev, &out_dev, &count};
  cudaHostNodeParams h{};
  h.fn = host_fault;
  h.userData = call.get();

  if (fault_node_form() == NodeForm::Child) {
    // The three pieces in one child graph, which MLX walks for its key and clones per node.
    enc.set_input_array(ids);
    enc.set_output_array(out);
    cudaGraph_t graph;
    check(cudaGraphCreate(&graph, 0), "cudaGraphCreate");
    try {
      cudaKernelNodeParams k1{};
      k1.func = cuda::ids_to_host_kernel();
      k1.gridDim = dim3(1);
      k1.blockDim = dim3(256);
      k1.kernelParams = args1;
      cudaGraphNode_t n1, n2, n3;
      check(cudaGraphAddKernelNode(&n1, graph, nullptr, 0, &k1), "cudaGraphAddKernelNode (ids)");
      check(cudaGraphAddHostNode(&n2, graph, &n1, 1, &h), "cudaGraphAddHostNode");
      cudaKernelNodeParams k3{};
      k3.func = cuda::apply_plan_kernel();
      k3.gridDim = dim3(cuda::kApplyPlanBlocks);
      k3.blockDim = dim3(cuda::kApplyPlanThreads);
      k3.kernelParams = args3;
      check(cudaGraphAddKernelNode(&n3, graph, &n2, 1, &k3), "cudaGraphAddKernelNode (plan)");
      enc.add_graph_node(graph);
    } catch (...) {
      cudaGraphDestroy(graph);
      throw;
    }
    cudaGraphDestroy(graph);  // the encoder's child-graph node holds its own copy
  } else {
    // The kernels as MLX's own kernel nodes; only the host node needs a child graph, added under
    // a fixed key (nothing for MLX to walk). MLX orders nodes by the buffers they read and write:
    // each of the three reads and writes `out`, which chains them; the first also reads `ids`.
    enc.set_input_array(ids);
    enc.set_output_array(out);
    enc.add_kernel_node_raw(ids_to_host_function(), dim3(1), dim3(256), dim3(1, 1, 1), 0, args1);
    cudaGraph_t graph;
    check(cudaGraphCreate(&graph, 0), "cudaGraphCreate");
    try {
      cudaGraphNode_t hn;
      check(cudaGraphAddHostNode(&hn, graph, nullptr, 0, &h), "cudaGraphAddHostNode");
      enc.set_input_array(out);
      enc.set_output_array(out);
      enc.add_graph_node(graph, "(H)", true);
    } catch (...) {
      cudaGraphDestroy(graph);
      throw;
    }
    cudaGraphDestroy(graph);
    enc.set_input_array(out);
    enc.set_output_array(out);
    enc.add_kernel_node_raw(apply_plan_function(), dim3(cuda::kApplyPlanBlocks), dim3(cuda::kApplyPlanThreads), dim3(1, 1, 1), 0, args3);
  }
  // The host node's state lives until the device is past it.
  enc.add_completed_handler([call]() {});
}

}  // namespace asyncside::faults

namespace asyncside::io {
bool direct_reads_land_in(const void* p) noexcept {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, p) != cudaSuccess) {
    (void)cudaGetLastError();  // memory CUDA does not know: clear the error, it is plain host memory
    return true;
  }
  return attr.type != cudaMemoryTypeManaged;
}
}  // namespace asyncside::io

#else  // no CUDA in this build

namespace asyncside::faults {

std::unique_ptr<RecordSink> make_device_sink(std::shared_ptr<io::HostMirror>, std::vector<mlx::core::array>,
                                             uint64_t, std::vector<io::SegmentSpan>, uint32_t, bool) {
  throw std::runtime_error(
      "[asyncside] fault tables for device pools need the CUDA fault path, which this build lacks "
      "(build with -DASYNCSIDE_CUDA=ON against the MLX CUDA wheel)");
}

bool device_faults_available() noexcept { return false; }

const char* device_fault_node_form() noexcept { return "none"; }

void set_device_staging(FaultTable&, std::vector<mlx::core::array>) {
  throw std::invalid_argument(
      "[asyncside] staging arrays need the CUDA fault path, which this build lacks (build with -DASYNCSIDE_CUDA=ON)");
}

}  // namespace asyncside::faults

namespace asyncside::io {
bool direct_reads_land_in(const void*) noexcept { return true; }
}  // namespace asyncside::io

#endif  // ASYNCSIDE_CUDA
