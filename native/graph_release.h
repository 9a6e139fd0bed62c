// Dropping a scheduled step's graph on a thread of its own, not the event loop's.
//
// A StepPlan holds every node of a step until the step is scheduled; by then MLX has detached
// the nodes from each other, so the plan's references are often the last ones, and dropping them
// frees each node's descriptor and, once computed, its buffer. For a decode step of the embedded
// model (about 1,400 nodes) that took milliseconds of the event loop's thread, in one piece, every
// token: the largest single span behind the demo's loop lag (BENCHMARKS.md, "Loop lag"). A release thread drops
// them instead, on a core the loop does not need. (CPU steps only: see StepPlan::finish.)
//
// The thread is started on first use and lives as long as the process (detached; see
// read_pool.h). It only drops MLX arrays (atomic reference counts; MLX's stream threads drop the
// arrays of their tasks the same way): never Python, never the GIL. At exit `stop_releases()`
// (registered with Python's atexit) makes later releases happen on the caller and waits for one
// in progress, so nothing is freed while MLX's own statics are destroyed. In a child process
// after fork the thread does not exist: releases happen on the caller there.
// ASYNCSIDE_GRAPH_RELEASE=caller makes every release happen on the caller (A/B runs).
#pragma once

#include <cstddef>
#include <vector>

#include "mlx/array.h"

namespace asyncside::plan {

// Drop `arrays` (moved from) on the release thread.
void release_later(std::vector<mlx::core::array>&& arrays);

// Vectors handed to the release thread and not yet dropped.
size_t pending_releases();

// Block until every vector handed over so far has been dropped (tests).
void wait_for_releases();

// From now on, drop on the caller; returns once a release in progress has finished.
void stop_releases();

}  // namespace asyncside::plan
