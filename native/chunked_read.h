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
#include <string>
#include <vector>

#include <sys/uio.h>

namespace asyncside::faults {

// O_DIRECT's block: chunk sizes and split points are multiples of it.
inline constexpr uint64_t kChunkAlign = 4096;

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
// Test hook: false makes every chunked read take the fallback (one preadv), as where io_uring is
// unavailable.
void set_fault_read_uring(bool on);

}  // namespace asyncside::faults
