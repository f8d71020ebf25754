// GPU-stream path for the streaming primitives: the GPU waits on an event
// that the I/O side signals once a layer's records are in the output buffers,
// instead of the graph hopping GPU -> CPU stream -> GPU around every streamed
// op.
//
// NOT BUILT, NOT TYPE-CHECKED, NEVER RUN. Compiled only when CMake sees an
// Apple build of MLX with Metal and -DHEBRUS_METAL_EVENTS=ON; the Linux
// machine this was written on has neither Metal nor metal-cpp headers (which
// mlx/backend/metal/device.h includes), so not even `clang++ -fsyntax-only`
// could be run against it. The CPU-stream path stays the default: the
// primitives are only placed on a GPU stream when `hebrus-mlx qualify` has
// promoted "streaming.gpu_event" on that machine (AFN-013).
#pragma once

#include <functional>
#include <vector>

#include "mlx/array.h"
#include "mlx/stream.h"

namespace hebrus {

namespace mx = mlx::core;

// Encodes on `gpu`: (1) a signal the host waits on before reading `inputs`
// (they may be produced by earlier GPU work), committing the command buffer
// so that signal is not queued behind (2); then (2) a wait that holds every
// later GPU command until `host_work` has run on the I/O CPU stream. The
// caller has allocated the outputs (host_work writes into them; on Apple
// silicon the buffers are shared with the CPU). An exception in host_work is
// recorded on the event and re-raised by MLX at synchronization; the GPU is
// released either way so it never hangs.
void eval_gpu_via_io(
    mx::Stream gpu,
    const std::vector<mx::array>& keep_alive,
    std::function<void()> host_work);

bool gpu_events_compiled();

} // namespace hebrus
