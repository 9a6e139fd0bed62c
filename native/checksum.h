// Record checksums for the read path: CRC-32 (zlib's crc32, stores written before format version 2)
// and CRC-32C (Castagnoli, the default since version 2). Plain C++, no Python, no MLX.
//
// Both are reflected CRCs with zlib's conventions: the state starts at 0, chaining is
// checksum_update(kind, checksum_update(kind, 0, a, na), b, nb) == checksum of a||b, and the
// CRC-32 values equal Python's zlib.crc32. The fastest path the CPU offers is picked once, at
// first use: on x86-64, carry-less multiply folding (VPCLMULQDQ on 512-bit registers when AVX-512
// is there, else PCLMULQDQ) for both polynomials, SSE4.2's crc32 instruction for CRC-32C tails;
// on aarch64 the ARMv8 CRC instructions (both polynomials); elsewhere slicing-by-8 tables.
#pragma once

#include <cstddef>
#include <cstdint>

namespace asyncside::io {

enum class ChecksumKind { None, Crc32, Crc32c };

// Continue `state` (a checksum of everything before `data`; 0 to start) over n bytes of data.
// ChecksumKind::None returns `state` unchanged. Thread-safe, never throws, never allocates.
uint32_t checksum_update(ChecksumKind kind, uint32_t state, const void* data, size_t n) noexcept;

// Copies n bytes from src to dst (not overlapping) and returns checksum_update(kind, state, src, n),
// loading each source byte once: on x86-64 with VPCLMULQDQ one pass folds every 64-byte line into
// the CRC and stores it (streaming stores when `stream`: for large destinations that are not read
// again soon; fenced before return). Elsewhere: memcpy, then the checksum over the copy in
// cache-sized blocks. Thread-safe, never throws, never allocates.
uint32_t checksum_copy(ChecksumKind kind, uint32_t state, void* dst, const void* src, size_t n, bool stream) noexcept;

// The checksum of a||b from those of a (crc1) and b (crc2, started at 0) and b's length, as
// zlib's crc32_combine. Lets parts of a record be checksummed as they land, in any order.
uint32_t checksum_combine(ChecksumKind kind, uint32_t crc1, uint32_t crc2, uint64_t len2) noexcept;

// "none", "crc32" or "crc32c".
const char* checksum_name(ChecksumKind kind) noexcept;

// Which implementation checksum_update uses for `kind` on this CPU ("vpclmulqdq", "pclmulqdq",
// "armv8-crc", "table", "none"); for benchmarks and bug reports.
const char* checksum_implementation(ChecksumKind kind) noexcept;

// Checksums `n` bytes with checksum_update, then reports whether the upper halves of the AVX
// registers that legacy-SSE code can reach were left in use (XINUSE bits 2 and 6): 1 dirty,
// 0 clean, -1 where the CPU cannot tell (not x86-64, or no XGETBV with ECX=1). Dirty state
// slows the SSE code that the calling thread runs next (MLX's CPU kernels, when a fault in a
// queued step verified a record on the stream thread); tests check it stays clean.
int checksum_leaves_upper_state(ChecksumKind kind, size_t n);

// The portable table implementation, whatever the CPU (tests compare the fast paths with it).
uint32_t checksum_update_portable(ChecksumKind kind, uint32_t state, const void* data, size_t n) noexcept;

}  // namespace asyncside::io
