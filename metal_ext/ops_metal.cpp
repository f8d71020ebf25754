// See ops_metal.h: type-checked against MLX's Metal headers + metal-cpp on
// Linux (Apple system headers stubbed), NEVER BUILT WITH THE APPLE SDK,
// LINKED OR RUN.
//
// Only libmlx symbols MLX exports (MLX_API) are used: libmlx is built with
// hidden visibility, and mx::Event / mx::Fence are not exported (their
// constructors and wait/signal live inside libmlx), so the events here are
// plain MTL::SharedEvents (metal-cpp inline calls; the selectors are the
// ones libmlx exports, as for MLX's own extension example) encoded through
// the exported metal::CommandEncoder (end_encoding, get_command_buffer) and
// host tasks go through the exported scheduler::enqueue.
#include "ops_metal.h"

#include <atomic>
#include <stdexcept>

#include "engine.h"
#include "mlx/device.h"

#if HEBRUS_METAL_EVENTS
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <unordered_map>

#include "mlx/backend/metal/device.h"
#include "mlx/backend/metal/metal.h"
#include "mlx/scheduler.h"
#endif

namespace hebrus {

namespace {
std::atomic<bool> g_gpu_events{false};
} // namespace

mx::Stream io_stream() {
  // Unified memory on Apple silicon: a CPU-stream output is directly usable
  // by GPU consumers; MLX orders the cross-stream dependency.
  return mx::default_stream(mx::Device::cpu);
}

mx::Stream op_stream() {
  if (g_gpu_events.load(std::memory_order_relaxed) &&
      mx::default_device() == mx::Device::gpu) {
    return mx::default_stream(mx::Device::gpu);
  }
  return io_stream();
}

bool gpu_events_enabled() {
  return g_gpu_events.load();
}

#if HEBRUS_METAL_EVENTS

namespace {

// One dedicated CPU stream (an MLX scheduler thread) runs every host task,
// in the order the ops were encoded; it never blocks the default CPU stream.
mx::Stream host_stream() {
  static mx::Stream s = mx::new_stream(mx::Device::cpu);
  return s;
}

// Per GPU stream: GPU -> host and host -> GPU events. Each has one writer
// (the GPU queue, resp. the host stream) and values that only grow: the
// n-th op's signal is n, and both sides process ops in encode order.
struct Channel {
  NS::SharedPtr<MTL::SharedEvent> to_host;
  NS::SharedPtr<MTL::SharedEvent> to_gpu;
  uint64_t to_host_value = 0;
  uint64_t to_gpu_value = 0;
  std::atomic<bool> gpu_failed{false};
};

// The channel of `gpu` and this op's values (to_gpu value 0: no GPU wait).
std::tuple<std::shared_ptr<Channel>, uint64_t, uint64_t> reserve(
    mx::Stream gpu,
    bool gpu_waits) {
  static std::mutex mtx;
  static std::unordered_map<int, std::shared_ptr<Channel>> channels;
  std::lock_guard<std::mutex> lk(mtx);
  auto& ch = channels[gpu.index];
  if (!ch) {
    auto c = std::make_shared<Channel>();
    MTL::Device* d = mx::metal::device(gpu.device).mtl_device();
    c->to_host = NS::TransferPtr(d->newSharedEvent());
    c->to_gpu = NS::TransferPtr(d->newSharedEvent());
    if (!c->to_host || !c->to_gpu) {
      throw std::runtime_error("hebrus: could not create Metal shared events");
    }
    ch = std::move(c);
  }
  uint64_t wait_v = ++ch->to_host_value;
  uint64_t signal_v = gpu_waits ? ++ch->to_gpu_value : 0;
  return {ch, wait_v, signal_v};
}

// The first host-task failure since the last check. Recorded before the
// task releases the GPU, so once a step's outputs are ready on the host its
// failure is visible to check_gpu_event_errors().
std::mutex g_error_mtx;
std::string g_error;

void record_error(const char* what) {
  std::lock_guard<std::mutex> lk(g_error_mtx);
  if (g_error.empty()) {
    g_error = what;
  }
}

} // namespace

bool gpu_events_compiled() {
  return true;
}

void set_gpu_events(bool on) {
  if (on && !mx::metal::is_available()) {
    throw StreamError(
        ErrorCode::kBadRequest,
        "gpu_events: no Metal device; streamed ops stay on the CPU stream");
  }
  g_gpu_events = on;
}

void check_gpu_event_errors() {
  std::string msg;
  {
    std::lock_guard<std::mutex> lk(g_error_mtx);
    msg.swap(g_error);
  }
  if (!msg.empty()) {
    throw std::runtime_error(msg);
  }
}

void eval_gpu_via_io(
    mx::Stream gpu,
    const std::vector<mx::array>& inputs,
    const std::vector<mx::array>& outputs,
    std::function<void()> host_work,
    bool gpu_waits) {
  // A failed earlier task fails this eval here (MLX then flushes and
  // rethrows), before more work is queued behind it.
  check_gpu_event_errors();
  auto [ch, wait_v, signal_v] = reserve(gpu, gpu_waits);
  auto& enc = mx::metal::get_command_encoder(gpu);
  // Events are command-buffer commands: no compute encoder may be open.
  enc.end_encoding();
  MTL::CommandBuffer* cbuf = enc.get_command_buffer();
  cbuf->encodeSignalEvent(ch->to_host.get(), wait_v);
  // Metal does not signal a failed buffer's events: do it, flagged, so the
  // host task does not wait forever (as MLX's own commit handler does).
  cbuf->addCompletedHandler([ch = ch, wait_v = wait_v](MTL::CommandBuffer* cb) {
    if (cb->status() == MTL::CommandBufferStatusError) {
      ch->gpu_failed = true;
      if (ch->to_host->signaledValue() < wait_v) {
        ch->to_host->setSignaledValue(wait_v);
      }
    }
  });
  std::vector<std::shared_ptr<mx::array::Data>> keep;
  for (const auto& a : inputs) {
    keep.push_back(a.data_shared_ptr());
  }
  for (const auto& a : outputs) {
    keep.push_back(a.data_shared_ptr());
  }
  mx::scheduler::enqueue(
      host_stream(),
      [ch = ch, wait_v = wait_v, signal_v = signal_v, work = std::move(host_work),
       keep = std::move(keep)]() {
        try {
          ch->to_host->waitUntilSignaledValue(wait_v, UINT64_MAX);
          if (ch->gpu_failed.load()) {
            throw std::runtime_error(
                "hebrus: a GPU command buffer failed before a streamed op's "
                "inputs were ready");
          }
          work();
        } catch (const std::exception& e) {
          record_error(e.what());
        } catch (...) {
          record_error("hebrus: unknown failure in a streamed op's host task");
        }
        // Released however the task ended: a GPU queue waiting on a value
        // nobody sets would hang (and trip the watchdog).
        if (signal_v != 0) {
          ch->to_gpu->setSignaledValue(signal_v);
        }
      });
  if (gpu_waits) {
    // Same buffer, after the signal: every later GPU command waits for the
    // host. Not committed here: MLX's gpu::eval adds a completion handler to
    // the buffer it read before calling eval_gpu, which must still be
    // uncommitted then. MLX commits it (op-count threshold, or the end of
    // the (async_)eval), and the host task starts when the GPU reaches the
    // signal, as with MLX's own CPU-stream fences.
    cbuf->encodeWait(ch->to_gpu.get(), signal_v);
  }
}

#else

bool gpu_events_compiled() {
  return false;
}

void set_gpu_events(bool on) {
  if (on) {
    throw StreamError(
        ErrorCode::kBadRequest,
        "gpu_events: not compiled in this build (Apple + Metal + "
        "-DHEBRUS_METAL_EVENTS=ON only); streamed ops stay on the CPU stream");
  }
  g_gpu_events = false;
}

void check_gpu_event_errors() {}

void eval_gpu_via_io(
    mx::Stream,
    const std::vector<mx::array>&,
    const std::vector<mx::array>&,
    std::function<void()>,
    bool) {
  throw std::runtime_error(
      "hebrus: the GPU-event streaming path is not compiled in this build "
      "(Apple + Metal + HEBRUS_METAL_EVENTS only); streamed ops run on the "
      "CPU stream");
}

#endif

} // namespace hebrus
