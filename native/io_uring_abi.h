// The slice of the Linux io_uring kernel ABI this project uses, written out here so that the
// extension needs no liburing and no particular kernel-header version at build time. The ABI is
// stable (the kernel never changes these layouts); where the build machine has
// <linux/io_uring.h> we check every size, offset and constant against it at compile time.
#pragma once
#if defined(__linux__)

#include <algorithm>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <sys/mman.h>
#include <sys/syscall.h>

namespace asyncside::uring {

struct SqOffsets {
  uint32_t head, tail, ring_mask, ring_entries, flags, dropped, array, resv1;
  uint64_t user_addr;
};

struct CqOffsets {
  uint32_t head, tail, ring_mask, ring_entries, overflow, cqes, flags, resv1;
  uint64_t user_addr;
};

struct Params {
  uint32_t sq_entries, cq_entries, flags, sq_thread_cpu, sq_thread_idle, features, wq_fd;
  uint32_t resv[3];
  SqOffsets sq_off;
  CqOffsets cq_off;
};

// One submission queue entry (64 bytes). Only the fields a read needs are named.
struct Sqe {
  uint8_t opcode;
  uint8_t flags;
  uint16_t ioprio;
  int32_t fd;
  uint64_t off;
  uint64_t addr;
  uint32_t len;
  uint32_t rw_flags;
  uint64_t user_data;
  uint16_t buf_index;
  uint16_t personality;
  int32_t file_index;
  uint64_t addr3;
  uint64_t pad2;
};

struct Cqe {
  uint64_t user_data;
  int32_t res;
  uint32_t flags;
};

struct FilesUpdate {
  uint32_t offset;
  uint32_t resv;
  uint64_t fds;  // pointer to int32 fds
};

static_assert(sizeof(Sqe) == 64, "io_uring SQE is 64 bytes");
static_assert(sizeof(Cqe) == 16, "io_uring CQE is 16 bytes");
static_assert(sizeof(Params) == 120, "io_uring_params is 120 bytes");

// Opcodes
constexpr uint8_t kOpNop = 0;
constexpr uint8_t kOpReadv = 1;
constexpr uint8_t kOpReadFixed = 4;
// SQE flags
constexpr uint8_t kSqeFixedFile = 1u << 0;
constexpr uint8_t kSqeAsync = 1u << 4;
// Setup flags
constexpr uint32_t kSetupCqSize = 1u << 3;
constexpr uint32_t kSetupClamp = 1u << 4;
// Features
constexpr uint32_t kFeatSingleMmap = 1u << 0;
constexpr uint32_t kFeatNoDrop = 1u << 1;
// Enter flags
constexpr uint32_t kEnterGetEvents = 1u << 0;
// Register opcodes
constexpr unsigned kRegisterBuffers = 0;
constexpr unsigned kRegisterFiles = 2;
constexpr unsigned kRegisterEventfd = 4;
constexpr unsigned kRegisterFilesUpdate = 6;
constexpr unsigned kRegisterIowqMaxWorkers = 19;
// mmap offsets
constexpr long long kOffSqRing = 0;
constexpr long long kOffCqRing = 0x8000000LL;
constexpr long long kOffSqes = 0x10000000LL;

#if defined(SYS_io_uring_setup)
constexpr long kSysSetup = SYS_io_uring_setup;
constexpr long kSysEnter = SYS_io_uring_enter;
constexpr long kSysRegister = SYS_io_uring_register;
#else
// The generic syscall table numbers (x86_64, aarch64 and every architecture since 5.1).
constexpr long kSysSetup = 425;
constexpr long kSysEnter = 426;
constexpr long kSysRegister = 427;
#endif

// A ring's shared memory (its rings in one mapping: IORING_FEAT_SINGLE_MMAP, and its SQEs) and
// the pointers into it, for a ring fd that io_uring_setup made with `p`. Each of the project's rings
// (the host reader's, the fault tables' per-thread ones) keeps one, so the mapping is written once.
struct RingMap {
  void* ring_ = nullptr;
  size_t ring_len_ = 0;
  Sqe* sqes_ = nullptr;
  size_t sqes_len_ = 0;
  uint32_t *sq_head_ = nullptr, *sq_tail_ = nullptr, *cq_head_ = nullptr, *cq_tail_ = nullptr;
  uint32_t sq_mask_ = 0, cq_mask_ = 0;
  Cqe* cqes_ = nullptr;

  // Map `ring_fd`'s rings and SQEs; 0, or the errno of the mmap that failed (nothing mapped then).
  int map_ring(int ring_fd, const Params& p) {
    const size_t len = std::max<size_t>(p.sq_off.array + p.sq_entries * sizeof(uint32_t),
                                        p.cq_off.cqes + p.cq_entries * sizeof(Cqe));
    void* r = ::mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring_fd, kOffSqRing);
    if (r == MAP_FAILED) return errno;
    const size_t sqes_len = p.sq_entries * sizeof(Sqe);
    void* s = ::mmap(nullptr, sqes_len, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, ring_fd, kOffSqes);
    if (s == MAP_FAILED) {
      const int e = errno;
      ::munmap(r, len);
      return e;
    }
    ring_ = r;
    ring_len_ = len;
    sqes_ = static_cast<Sqe*>(s);
    sqes_len_ = sqes_len;
    auto* base = static_cast<uint8_t*>(ring_);
    sq_head_ = reinterpret_cast<uint32_t*>(base + p.sq_off.head);
    sq_tail_ = reinterpret_cast<uint32_t*>(base + p.sq_off.tail);
    sq_mask_ = *reinterpret_cast<uint32_t*>(base + p.sq_off.ring_mask);
    auto* sq_array = reinterpret_cast<uint32_t*>(base + p.sq_off.array);
    for (unsigned i = 0; i < p.sq_entries; ++i) sq_array[i] = i;  // SQE slot i <-> ring index i
    cq_head_ = reinterpret_cast<uint32_t*>(base + p.cq_off.head);
    cq_tail_ = reinterpret_cast<uint32_t*>(base + p.cq_off.tail);
    cq_mask_ = *reinterpret_cast<uint32_t*>(base + p.cq_off.ring_mask);
    cqes_ = reinterpret_cast<Cqe*>(base + p.cq_off.cqes);
    return 0;
  }

  void unmap_ring() {
    if (sqes_ != nullptr) ::munmap(sqes_, sqes_len_);
    if (ring_ != nullptr) ::munmap(ring_, ring_len_);
    sqes_ = nullptr;
    ring_ = nullptr;
  }
};

}  // namespace asyncside::uring

#if __has_include(<linux/io_uring.h>)
#include <linux/io_uring.h>
namespace asyncside::uring::abi_check {
#define ASYNCSIDE_SAME_OFFSET(ours, theirs, field) \
  static_assert(offsetof(ours, field) == offsetof(theirs, field), #field " offset differs from the kernel header")
ASYNCSIDE_SAME_OFFSET(Sqe, io_uring_sqe, opcode);
ASYNCSIDE_SAME_OFFSET(Sqe, io_uring_sqe, flags);
ASYNCSIDE_SAME_OFFSET(Sqe, io_uring_sqe, fd);
ASYNCSIDE_SAME_OFFSET(Sqe, io_uring_sqe, off);
ASYNCSIDE_SAME_OFFSET(Sqe, io_uring_sqe, addr);
ASYNCSIDE_SAME_OFFSET(Sqe, io_uring_sqe, len);
ASYNCSIDE_SAME_OFFSET(Sqe, io_uring_sqe, rw_flags);
ASYNCSIDE_SAME_OFFSET(Sqe, io_uring_sqe, user_data);
ASYNCSIDE_SAME_OFFSET(Sqe, io_uring_sqe, buf_index);
ASYNCSIDE_SAME_OFFSET(Params, io_uring_params, sq_off);
ASYNCSIDE_SAME_OFFSET(Params, io_uring_params, cq_off);
ASYNCSIDE_SAME_OFFSET(Params, io_uring_params, features);
ASYNCSIDE_SAME_OFFSET(SqOffsets, io_sqring_offsets, array);
ASYNCSIDE_SAME_OFFSET(CqOffsets, io_cqring_offsets, cqes);
ASYNCSIDE_SAME_OFFSET(Cqe, io_uring_cqe, res);
#undef ASYNCSIDE_SAME_OFFSET
static_assert(sizeof(io_uring_sqe) == sizeof(Sqe));
static_assert(sizeof(io_uring_params) == sizeof(Params));
static_assert(IORING_OP_READV == kOpReadv && IORING_OP_READ_FIXED == kOpReadFixed && IORING_OP_NOP == kOpNop);
static_assert(IOSQE_ASYNC == kSqeAsync && IOSQE_FIXED_FILE == kSqeFixedFile);
static_assert(IORING_SETUP_CQSIZE == kSetupCqSize && IORING_SETUP_CLAMP == kSetupClamp);
static_assert(IORING_ENTER_GETEVENTS == kEnterGetEvents);
static_assert(IORING_REGISTER_BUFFERS == kRegisterBuffers && IORING_REGISTER_FILES == kRegisterFiles);
static_assert(IORING_REGISTER_EVENTFD == kRegisterEventfd && IORING_REGISTER_FILES_UPDATE == kRegisterFilesUpdate);
static_assert(IORING_REGISTER_IOWQ_MAX_WORKERS == kRegisterIowqMaxWorkers);
static_assert(IORING_OFF_CQ_RING == kOffCqRing && IORING_OFF_SQES == kOffSqes);
static_assert(IORING_FEAT_SINGLE_MMAP == kFeatSingleMmap && IORING_FEAT_NODROP == kFeatNoDrop);
}  // namespace asyncside::uring::abi_check
#endif

#endif  // __linux__
