// Chunked O_DIRECT reads for the fault tables (expert_faults.h).
//
// A faulted record read O_DIRECT as one request keeps one request per miss in flight; a disk
// that gives more with depth (a virtio or NVMe device) is then left idle between requests. The
// host fill path splits its reads into ops of at most ReaderOptions.chunk_bytes for this reason
// (io_reader.h); the fault tables do the same here: the record's vector is split at block-aligned
// boundaries into requests of at most `fault_read_chunk()` bytes, all submitted at once on a
// small io_uring ring of the calling thread, and the call returns once every one landed. Each
// reading thread (the stream, the read pool's workers, the background readers) has its own ring,
// so no thread waits on another's work. Where a ring cannot be set up, the record is read with
// preadv as one request, as before (counted in fault_counters()["chunk_fallbacks"]).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include <sys/uio.h>

namespace asyncside::faults {

// O_DIRECT's block: chunk sizes and split points are multiples of it.
inline constexpr uint64_t kChunkAlign = 4096;
// The most pieces an ordered read keeps in flight (a reading thread's ring holds no more).
inline constexpr unsigned kMaxFaultReadWindow = 32;

// preadv until every byte of `iov` landed, from `offset`; 0 or an errno (ENODATA: end of file
// first).
int preadv_full(int fd, std::vector<iovec> iov, uint64_t offset);

// Read the file bytes [offset, offset + sum of iov lengths) into `iov` (O_DIRECT: offset, every
// buffer and every length block aligned), as requests of at most `fault_read_chunk()` bytes in
// flight at once; a chunk of 0, or a read no larger than one chunk, is one preadv. 0 or an errno
// of the first failed request (ENODATA: the file ended first); returns only once no request is
// in flight.
int read_direct_chunked(int fd, const std::vector<iovec>& iov, uint64_t offset);

// The chunk size in bytes (0: whole records). Its default is ASYNCSIDE_FAULT_READ_CHUNK when set,
// else 1 MiB (ReaderOptions.chunk_bytes' default).
uint64_t fault_read_chunk();
// Set it: 0, or a multiple of kChunkAlign up to 1 GiB; throws std::invalid_argument otherwise.
void set_fault_read_chunk(uint64_t bytes);
// Check ASYNCSIDE_FAULT_READ_CHUNK (throws std::invalid_argument naming it on a bad value);
// called when the extension loads, so a bad value fails there and not inside a read.
void check_fault_read_chunk_env();
// One file range of an ordered read: `left` bytes at `off` into `iov` (O_DIRECT aligned).
struct ReadPiece {
  std::vector<iovec> iov;
  uint64_t off = 0;
  uint64_t left = 0;
};

// Whether this process reads in order at all: io_uring exists here (Linux; probed once) and is on.
// Elsewhere (macOS) a streamed resolve's records keep a background job each, side by side, since
// one thread reading them one after another would have a single request in flight.
bool ordered_reads_possible();
// Whether read_ordered can run on the calling thread (io_uring on and this thread's ring set up).
bool ordered_reads_ready();

// Read `n` pieces through the calling thread's ring, submitted in index order with at most
// `window` in flight, so that the disk serves them about in that order: a streamed resolve's
// first record lands first instead of sharing the disk with every other one. `prepare(i)` builds
// piece i just before its first submission (a caller reuses a landed piece's buffer for a later
// one); `landed(i, err)` is called on this thread as each piece ends, 0 or its errno (ENODATA: the
// file ended first). Stops submitting at the first failure and returns once the kernel holds no
// piece: 0 or the first errno. A piece never submitted, or taken back, gets no landed() call.
// Only where ordered_reads_ready().
int read_ordered(int fd, size_t n, unsigned window, const std::function<ReadPiece&(size_t)>& prepare,
                 const std::function<void(size_t, int)>& landed);

// Read `records` (file offset, bytes: O_DIRECT aligned, a partial last block rounded up) one after
// another through the calling thread's ring, as a streamed resolve's ordered read does: pieces of
// at most `piece` bytes, `window` in flight, into scratch buffers whose bytes are dropped. The
// disk's answer to a window, for choosing one (asyncside/read_window.py). 0 or the first errno;
// the time from the first submission to the last landing into `ns`. Only where
// ordered_reads_ready() (else ENOSYS).
int time_ordered_reads(int fd, const std::vector<std::pair<uint64_t, uint64_t>>& records, uint64_t piece,
                       unsigned window, int64_t& ns);

// Pieces a streamed resolve's ordered read keeps in flight; 0: no ordered reads, each record its
// own background job, side by side. Its default is ASYNCSIDE_FAULT_READ_WINDOW when set, else 4:
// with 1 MiB pieces, enough depth for the disks measured (BENCHMARKS.md, "Streamed reads in
// order"), few enough that the first record is not slowed by the next ones.
unsigned fault_read_window();
// Set it: 0, or 1 to 32 (the ring's size); throws std::invalid_argument otherwise.
void set_fault_read_window(unsigned pieces);
// Whether the window was chosen for the process (ASYNCSIDE_FAULT_READ_WINDOW, or
// set_fault_read_window since the last reset): a runtime then keeps it instead of measuring its
// disk for one of its own.
bool fault_read_window_chosen();
// Back to the default (the variable's value where set), as when the extension loaded.
void reset_fault_read_window();
// Check ASYNCSIDE_FAULT_READ_WINDOW (throws std::invalid_argument naming it on a bad value).
void check_fault_read_window_env();

// Test hook: false makes every chunked read take the fallback (one preadv), as where io_uring is
// unavailable.
void set_fault_read_uring(bool on);

}  // namespace asyncside::faults
