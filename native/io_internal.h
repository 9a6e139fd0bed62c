// Internal state of the read path shared by the backends (not part of the Reader interface).
#pragma once

#include "checksum.h"
#include "io_reader.h"

namespace asyncside::io {

// One layer blob opened for reading, plus where its segments land.
struct Layout {
  uint32_t id = 0;
  std::string path;
  int fd = -1;         // buffered
  int fd_direct = -1;  // O_DIRECT (or F_NOCACHE off Linux), when the reader is direct
  int fixed = -1;      // io_uring registered-file index of fd, or -1
  int fixed_direct = -1;
  uint64_t stride = 0;
  int64_t n_experts = 0;
  std::vector<SegmentSpan> segs;  // in pool order
  std::vector<uint32_t> order;    // segment indices sorted by offset
  uint64_t span_begin = 0;        // first byte of any segment inside the record
  uint64_t span_end = 0;          // one past the last byte of any segment
  std::shared_ptr<Destination> dest;
  // Verification (set_checksums): a fill completes only after its segments, in table order,
  // checksum to checksums[expert]; a mismatch completes it with -EBADMSG.
  ChecksumKind checksum = ChecksumKind::None;
  std::vector<uint32_t> checksums;
  // mapped_reads: the whole blob mapped read-only (buffered readers), or nullptr.
  const uint8_t* map = nullptr;
  uint64_t map_len = 0;
};

// One (expert -> row) read: completes as one Completion when all of its chunks have.
struct Fill {
  uint64_t token = 0;
  Layout* layout = nullptr;
  int64_t expert = 0, row = 0;
  std::atomic<int> chunks_left{0};
  std::atomic<int> result{0};  // first error wins
  // Verified layouts: each chunk's checksum over its segment bytes, and how many, by chunk seq;
  // combined in file (= segment table) order when the last chunk is done. Empty: no check.
  std::vector<uint32_t> part_crc;
  std::vector<uint64_t> part_len;
};

struct ScatterPiece {
  uint64_t slot_off;
  uint8_t* dst;
  uint64_t n;
};

// One contiguous file range of a fill, read by one op at a time (short reads continue).
struct Chunk {
  Fill* fill = nullptr;
  uint32_t seq = 0;     // index among its fill's chunks, in file order
  bool read_by_worker = false;  // io_uring: read with preadv by a copy worker, not through the ring
  bool direct = false;  // through the O_DIRECT fd
  bool staged = false;  // into a staging slot, scattered afterwards
  int slot = -1;
  uint64_t file_off = 0;  // file offset of the chunk's byte 0
  uint64_t need = 0;      // bytes from file_off that must land
  uint64_t req = 0;       // bytes requested in total (>= need; aligned when direct)
  uint64_t done = 0;      // bytes landed so far
  uint64_t op_len = 0;    // bytes the op in flight asked for (the rest of the chunk)
  std::vector<iovec> iov;  // rows mode: destinations covering req bytes
  std::vector<iovec> cur;  // the window of the op in flight (must outlive it)
  std::vector<ScatterPiece> pieces;  // staged mode
  // Rows mode, verified: the running checksum of the chunk's segment bytes [0, crc_pos) (crc_len
  // of them are segment bytes, the rest padding).
  uint32_t crc = 0;
  uint64_t crc_pos = 0, crc_len = 0;
};

}  // namespace asyncside::io
