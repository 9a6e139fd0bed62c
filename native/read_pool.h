// A few worker threads that run the reads of one fault resolve side by side.
//
// A resolve that finds several experts absent reads each record into its own row: the reads are
// independent, and one thread copying from the page cache (plus the checksum pass) reaches a
// fraction of what the memory system gives several. The stream waits for the whole resolve, so
// on a GPU host with idle cores the reads of a resolve go to this pool: the calling thread takes
// items too, so a pool of 0 workers runs them in order on the caller.
//
// Workers are created on first use and live as long as the process (detached, never joined: a
// thread blocked on the condition variable at exit is harmless, a std::thread destroyed while
// joinable would terminate the process). They only run C++ closures: never Python, never the GIL.
#pragma once

#include <cstddef>
#include <functional>

namespace asyncside::faults {

// Run fn(0) .. fn(n - 1), on the caller and up to `read_threads()` workers; returns when all ran.
// fn must not throw.
void parallel_reads(size_t n, const std::function<void(size_t)>& fn);

// Workers used by parallel_reads: ASYNCSIDE_FAULT_READ_THREADS when set, else min(7, cores / 2 - 1),
// so 0 on a machine of 2 or 3 cores (the compute thread and the event loop need them) and 7 on 16.
size_t read_threads();
// Set the number of workers (tests; a pool already started keeps its threads but uses only n).
void set_read_threads(size_t n);

// Background reads (streamed resolves, expert_faults.h): `job` runs on one of a few threads of
// their own and submit_background returns at once. These threads spend their time waiting for
// the disk, not computing, so there are some even where the compute leaves no core idle:
// ASYNCSIDE_FAULT_BACKGROUND_THREADS when set (>= 1), else max(2, read_threads()). Jobs must not throw.
void submit_background(std::function<void()> job);
size_t background_threads();

}  // namespace asyncside::faults
