// Holds on a CUDA stream, decided on the device (realtime emulation and pacing on GPU).
//
// A hold (emulate/holds.py) ends at max(own part, end of each path's anchor + its ghost_s), the own
// part being the operation's stamped begin plus its modelled transfer, or, unstamped, `now + self_s`
// where `now` is when the stream reaches the hold. The host runs ahead of the stream and cannot know
// that time without a synchronize, which a real rank never does; so a one-thread kernel on the stream
// decides it on the device's global timer: it reads the time, computes the end from the anchors' ends
// that earlier holds of the iteration wrote to a device buffer, writes its own, and (where the stream
// is held) spins until the latest end of the operations issued with it. It keeps the emulator's debt
// (emulate/holds.py) on the device. A hold costs the host one launch.
#pragma once

#include "prism.h"

#include <cuda_runtime_api.h>

namespace prism {

void launch_hold(cudaStream_t stream, int64_t* ends, const int64_t* rows, int64_t row, int64_t out,
                 int64_t lo, int64_t hi, int64_t acc, int64_t terms, bool plan, bool spin);
void launch_stamp(cudaStream_t stream, int64_t* ends, int64_t slot);

// Device buffer `ends`: slot k the planned end of operation k, then the iteration's start, a slot that
// is always NEVER (the anchor of an unused term), the account (holds that waited, ns asked, ns held,
// ns of the emulator's own time run up, ns of it paid back), the debt, the debt the current group of
// operations found, and n + 1 slots, one per operation and the start: its begin where stamped.
class DeviceHolds {
 public:
  DeviceHolds(const std::vector<HoldRow>& rows, int device);
  ~DeviceHolds();
  void begin();
  void stamp(int32_t k);
  void hold(const std::vector<int32_t>& ordinals, bool spin);
  void wait(const std::vector<int32_t>& ordinals);
  py::dict report();
  int64_t device_bytes = 0;  // what the plan's buffers hold of the caching allocator

 private:
  void launch(int64_t row, int64_t out, int64_t lo, int64_t hi, bool plan, bool spin);
  int device_;
  int64_t n_, start_, never_, acc_, debt_, begins_, terms_;
  at::Tensor rows_, ends_;
  std::vector<int64_t> planned_stream_;  // per ordinal: the stream its plan was issued on (-1: none)
  std::vector<cudaEvent_t> planned_event_;
};

}  // namespace prism
