// GPU-stream path for the streaming primitives: the GPU command stream waits
// on an event that the host signals once a layer's records are in the
// output buffers, instead of the graph hopping GPU -> CPU stream -> GPU
// around every streamed op.
//
// STATUS: NOT RUN ON ANY DEVICE. Compiled only when CMake sees an Apple build
// of MLX with Metal and -DHEBRUS_METAL_EVENTS=ON. Written on Linux without
// Metal: type-checked with `clang++ -fsyntax-only` against MLX 0.32.4's
// shipped Metal headers and Apple's metal-cpp (macOS 26 generation, the one
// MLX 0.32 builds with), with the Apple system headers stubbed
// (tools/check_metal_syntax.py, tests/test_metal_syntax.py); never linked or
// run. The CPU-stream path stays the default: the primitives go on a GPU
// stream only after set_gpu_events(true), which hebrus_mlx does only when
// the machine profile from `hebrus-mlx qualify` has "streaming.gpu_event"
// passed on that Mac (AFN-013).
#pragma once

#include <functional>
#include <vector>

#include "mlx/array.h"
#include "mlx/stream.h"

namespace hebrus {

namespace mx = mlx::core;

// The CPU stream the streaming primitives use by default (and arenas are
// allocated on).
mx::Stream io_stream();

// Where a new streaming primitive is placed: the caller's default GPU stream
// when GPU events are on and the default device is the GPU, else
// io_stream().
mx::Stream op_stream();

bool gpu_events_compiled();
bool gpu_events_enabled();
// Throws StreamError(bad_request) naming gpu_events when asked to turn on in
// a build without the path or without a Metal device.
void set_gpu_events(bool on);

// Host tasks run on one dedicated MLX CPU stream. The first failure of one
// (process-wide) is recorded before the task releases the GPU; this raises
// and clears it as std::runtime_error carrying the task's what() (so a
// StreamError's " [stream:<name>]" tag survives for translate()). No-op if
// nothing failed. eval_gpu_via_io calls it first; hebrus_mlx calls it after
// every step (models/cache.py rollback_on_error), so a step whose host task
// failed raises instead of returning a token computed from unwritten
// records.
void check_gpu_event_errors();

// Encodes on `gpu`, in stream order: a signal the host task waits on (all
// earlier GPU work, including whatever produced `inputs`, is complete and
// visible), then, if `gpu_waits`, a wait that holds every later GPU command
// until `host_work` has run. Nothing is committed here: MLX commits the
// buffer (committing inside eval_gpu would break gpu::eval). `outputs` are
// allocated by the caller (MLX's Metal allocator: shared storage, so
// host_work writes straight into the buffers the GPU consumers read - no
// copy, no CPU-stream op). The task keeps `inputs` and `outputs` alive.
// `gpu_waits = false` is for pass-through ops (release/mark): the GPU never
// waits for them. The GPU is released even when host_work throws, so it
// never hangs; the failure is raised by check_gpu_event_errors().
void eval_gpu_via_io(
    mx::Stream gpu,
    const std::vector<mx::array>& inputs,
    const std::vector<mx::array>& outputs,
    std::function<void()> host_work,
    bool gpu_waits);

} // namespace hebrus
