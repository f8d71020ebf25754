// See ops_metal.h: NOT BUILT, NOT TYPE-CHECKED, NEVER RUN (no Metal and no
// metal-cpp headers where it was written). Uses only MLX's own event API
// (mlx/event.h) and the Metal command encoder's wait_event / signal_event /
// commit as declared in MLX 0.32.4's shipped mlx/backend/metal/device.h.
#include "ops_metal.h"

#if HEBRUS_METAL_EVENTS

#include <exception>
#include <memory>
#include <string>

#include "engine.h"
#include "mlx/backend/metal/device.h"
#include "mlx/event.h"
#include "mlx/scheduler.h"

namespace hebrus {

bool gpu_events_compiled() {
  return true;
}

void eval_gpu_via_io(
    mx::Stream gpu,
    const std::vector<mx::array>& keep_alive,
    std::function<void()> host_work) {
  auto& enc = mx::metal::get_command_encoder(gpu);
  for (const auto& a : keep_alive) {
    enc.add_temporary(a);
  }
  // (1) inputs ready on the GPU -> host
  mx::Event inputs_ready(gpu);
  inputs_ready.set_value(1);
  enc.signal_event(inputs_ready, 1);
  // The signal is encoded when this buffer ends; end it now, or the wait in
  // (2) would sit before the signal in the same buffer and never return.
  enc.commit();
  // (2) records ready on the host -> GPU
  mx::Event records_ready(gpu);
  records_ready.set_value(1);
  auto error = std::make_shared<mx::Error>();
  mx::scheduler::enqueue(
      io_stream(),
      [inputs_ready, records_ready, error, keep = keep_alive,
       work = std::move(host_work)]() mutable {
        inputs_ready.wait();
        try {
          work();
        } catch (const std::exception& e) {
          // Released regardless: a GPU waiting on an event nobody signals
          // would hang the queue (and trip the watchdog). MLX re-raises the
          // message where the event is checked.
          error->set_message(std::make_shared<std::string>(e.what()));
          records_ready.set_error(*error);
        }
        records_ready.signal(io_stream());
      });
  enc.wait_event(records_ready, 1);
}

} // namespace hebrus

#else

#include <stdexcept>

namespace hebrus {

bool gpu_events_compiled() {
  return false;
}

void eval_gpu_via_io(
    mx::Stream,
    const std::vector<mx::array>&,
    std::function<void()>) {
  throw std::runtime_error(
      "hebrus: the GPU-event streaming path is not compiled in this build "
      "(Apple + Metal + HEBRUS_METAL_EVENTS only); streamed ops run on the "
      "CPU stream");
}

} // namespace hebrus

#endif
