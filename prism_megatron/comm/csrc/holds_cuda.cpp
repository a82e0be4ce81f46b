#include "holds_cuda.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/utils/pybind.h>

namespace prism {

namespace {

constexpr int64_t kNever = -(int64_t(1) << 62);
constexpr double kNs = 1e9;

int64_t allocated(int device) {
  auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(c10::DeviceIndex(device));
  return stats.allocated_bytes[size_t(c10::CachingAllocator::StatType::AGGREGATE)].current;
}

}  // namespace

DeviceHolds::DeviceHolds(const std::vector<HoldRow>& rows, int device) : device_(device) {
  n_ = int64_t(rows.size());
  start_ = n_;
  never_ = n_ + 1;
  acc_ = n_ + 2;
  debt_ = acc_ + 5;
  begins_ = acc_ + 7;  // acc + 6: the debt a group found
  terms_ = 1;
  for (const auto& r : rows)
    if (r.present) terms_ = std::max<int64_t>(terms_, int64_t(r.terms.size()));
  int64_t cols = 2 + 2 * terms_;
  std::vector<int64_t> table;
  table.reserve((n_ + 1) * cols);
  for (int64_t k = 0; k <= n_; ++k) {  // the last row is the iteration's start: its end is its entry
    const HoldRow* r = k < n_ && rows[k].present ? &rows[k] : nullptr;
    table.push_back(r ? std::llround(r->self_s * kNs) : 0);
    table.push_back(r && r->transfer_s ? std::llround(*r->transfer_s * kNs) : kNever);
    int64_t used = 0;
    if (r) {
      for (const auto& [anchor, ghost_s] : r->terms) {
        table.push_back(anchor < 0 ? start_ : anchor);
        table.push_back(std::llround(ghost_s * kNs));
        ++used;
      }
    }
    for (; used < terms_; ++used) {
      table.push_back(never_);
      table.push_back(0);
    }
  }
  int64_t before = allocated(device_);
  auto on_device = at::TensorOptions().dtype(at::kLong).device(at::Device(at::kCUDA, device_));
  rows_ = at::from_blob(table.data(), {n_ + 1, cols}, at::TensorOptions().dtype(at::kLong)).to(on_device);
  ends_ = at::full({begins_ + n_ + 1}, kNever, on_device);
  device_bytes = allocated(device_) - before;
  ends_.narrow(0, acc_, begins_ - acc_).zero_();
  planned_stream_.assign(n_, -1);
  planned_event_.assign(n_, nullptr);
}

DeviceHolds::~DeviceHolds() {
  for (cudaEvent_t e : planned_event_)
    if (e) cudaEventDestroy(e);
}

void DeviceHolds::launch(int64_t row, int64_t out, int64_t lo, int64_t hi, bool plan, bool spin) {
  launch_hold(c10::cuda::getCurrentCUDAStream().stream(), ends_.data_ptr<int64_t>(),
              rows_.data_ptr<int64_t>(), row, out, lo, hi, acc_, terms_, plan, spin);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void DeviceHolds::begin() {
  // a new iteration: no debt, no operation stamped, and its start planned
  ends_.narrow(0, begins_, n_ + 1).fill_(kNever);
  ends_.narrow(0, debt_, 1).zero_();
  launch(start_, start_, start_, start_, true, false);
}

void DeviceHolds::stamp(int32_t k) {
  if (k < 0 || k >= n_) return;
  launch_stamp(c10::cuda::getCurrentCUDAStream().stream(), ends_.data_ptr<int64_t>(), begins_ + k);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void DeviceHolds::hold(const std::vector<int32_t>& ordinals, bool spin) {
  size_t last = ordinals.size() - 1;
  for (size_t j = 0; j < ordinals.size(); ++j) {
    int64_t k = ordinals[j];
    launch(k, k, ordinals[0], k, true, spin && j == last);
  }
  if (spin) return;
  // overlapped: an event after the plan lets a wait on another stream read it in order
  auto stream = c10::cuda::getCurrentCUDAStream();
  for (int64_t k : ordinals) {
    if (!planned_event_[k]) C10_CUDA_CHECK(cudaEventCreateWithFlags(&planned_event_[k], cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventRecord(planned_event_[k], stream.stream()));
    planned_stream_[k] = stream.id();
  }
}

void DeviceHolds::wait(const std::vector<int32_t>& ordinals) {
  // hold the current stream until the planned ends; planned on another stream, their plan first
  auto stream = c10::cuda::getCurrentCUDAStream();
  int64_t lo = ordinals[0], hi = ordinals[0];
  for (int64_t k : ordinals) {
    lo = std::min(lo, k);
    hi = std::max(hi, k);
    if (planned_stream_[k] >= 0 && planned_stream_[k] != stream.id()) {
      C10_CUDA_CHECK(cudaStreamWaitEvent(stream.stream(), planned_event_[k], 0));
    }
    planned_stream_[k] = -1;
  }
  launch(0, 0, lo, hi, false, true);
}

py::dict DeviceHolds::report() {
  auto values = ends_.narrow(0, acc_, 5).cpu();
  const int64_t* v = values.data_ptr<int64_t>();
  py::dict d;
  d["count"] = v[0];
  d["planned_s"] = double(v[1]) / kNs;
  d["measured_s"] = double(v[2]) / kNs;
  d["error_pct"] = v[1] > 0 ? py::object(py::float_((double(v[2]) / double(v[1]) - 1) * 100)) : py::object(py::none());
  d["overhead_accrued_s"] = double(v[3]) / kNs;
  d["overhead_absorbed_s"] = double(v[4]) / kNs;
  return d;
}

}  // namespace prism
