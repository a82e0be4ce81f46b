#include "prism.h"

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <ctime>
#include <limits>
#include <thread>

#ifdef PRISM_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime_api.h>
#include "holds_cuda.h"
#endif

namespace prism {

#ifndef PRISM_CUDA
class DeviceHolds {};  // holds on a device clock need the CUDA build
#endif

namespace {

double monotonic_s() {  // time.perf_counter's clock
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return double(ts.tv_sec) + double(ts.tv_nsec) * 1e-9;
}

Entry blank(int8_t kind, int64_t value, int32_t ordinal, bool real_peer) {
  Entry e{};
  e.kind = kind;
  e.value = value;
  e.group = -1;
  e.peer_delta = INT32_MIN;
  e.ordinal = ordinal;
  e.mark = e.mark2 = -1;
  e.t = e.t2 = NAN;
  e.mem = -1;
  e.flags = real_peer ? kRealPeer : 0;
  return e;
}

void put(Entry& e, const Mark& m) {
  e.mark = m.event;
  e.t = m.t;
  e.flags |= kHasMark;
}

void require_cuda_build() {
#ifndef PRISM_CUDA
  TORCH_CHECK(false, "prism's native backend was built without CUDA (no nvcc was found when it was "
              "built): set CUDA_HOME to the CUDA toolkit and remove the build cache "
              "(prism_megatron.comm.native.build_dir()) to rebuild it");
#endif
}

}  // namespace

// -- HoldBook ------------------------------------------------------------------------------------

HoldBook::HoldBook(std::vector<HoldRow> rows)
    : rows_(std::move(rows)), ends_(rows_.size(), NAN), begins_(rows_.size(), NAN) {}

void HoldBook::begin(double now) {
  start = now;
  debt = 0;
  std::fill(ends_.begin(), ends_.end(), NAN);
  std::fill(begins_.begin(), begins_.end(), NAN);
}

void HoldBook::stamp(int32_t k, double now) {
  if (k >= 0 && size_t(k) < begins_.size()) begins_[k] = now;
}

double HoldBook::plan(const std::vector<int32_t>& ordinals, double now) {
  double entry = now - debt;  // on the job's timeline
  double latest = -INFINITY;
  for (int32_t k : ordinals) {
    const HoldRow& row = rows_.at(k);
    double begin = begins_[k];
    begins_[k] = NAN;
    double end = std::isnan(begin) || !row.transfer_s ? entry + row.self_s : begin - debt + *row.transfer_s;
    for (const auto& [anchor, ghost_s] : row.terms) {
      double base = anchor < 0 ? start : (size_t(anchor) < ends_.size() ? ends_[anchor] : NAN);
      if (!std::isnan(base)) end = std::max(end, base + ghost_s);
    }
    ends_[k] = end;
    latest = std::max(latest, end);
  }
  if (entry > latest) {  // the backend's own work ran past the group's end: the emulator's time
    debt += entry - latest;
    accrued_s += entry - latest;
  }
  return latest + debt;
}

double HoldBook::goal(const std::vector<int32_t>& ordinals, double now) {
  double goal = -INFINITY;
  for (int32_t k : ordinals) {
    double end = size_t(k) < ends_.size() ? ends_[k] : NAN;
    if (!std::isnan(end)) goal = std::max(goal, end);
  }
  double slack = goal - (now - debt);
  if (slack > 0 && debt > 0) {
    double paid = std::min(debt, slack);
    debt -= paid;
    absorbed_s += paid;
  }
  return goal + debt;
}

std::map<int32_t, double> HoldBook::planned() const {
  std::map<int32_t, double> out;
  for (size_t k = 0; k < ends_.size(); ++k)
    if (!std::isnan(ends_[k])) out[int32_t(k)] = ends_[k];
  return out;
}

// -- Trace ---------------------------------------------------------------------------------------

Trace::Trace(Clock clock, py::object memory_reader, int64_t memory_offset)
    : clock_(clock), memory_reader_(std::move(memory_reader)), memory_offset_(memory_offset) {
  TORCH_CHECK(clock == Clock::kCpu || clock == Clock::kCuda, "a native trace runs on the CPU or CUDA clock");
  entries_.reserve(1 << 14);
  if (clock_ == Clock::kCuda) require_cuda_build();
}

Trace::~Trace() {
#ifdef PRISM_CUDA
  for (auto& [e, device] : events_) cudaEventDestroy(static_cast<cudaEvent_t>(e));
#endif
  if (Py_IsInitialized()) {
    py::gil_scoped_acquire gil;
    memory_reader_ = py::object();
  } else {
    memory_reader_.release();
  }
}

double Trace::now_s() const { return monotonic_s(); }

void Trace::reserve_events(int64_t n) {
  // events are made on the current device (a process may select its GPU after the trace is made)
#ifdef PRISM_CUDA
  int device;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  while (int64_t(events_.size()) < n) {
    cudaEvent_t e;
    C10_CUDA_CHECK(cudaEventCreate(&e));
    events_.emplace_back(e, device);
  }
#else
  (void)n;
#endif
}

Mark Trace::mark() {
  Mark m;
  if (clock_ == Clock::kCpu) {
    m.t = monotonic_s();
    return m;
  }
#ifdef PRISM_CUDA
  int64_t index;
  cudaEvent_t event;
  {
    std::lock_guard<std::mutex> lock(mu_);
    index = events_used_++;
    if (index >= int64_t(events_.size())) reserve_events(index + 1024);  // past the iteration's reserve
    auto& [e, device] = events_[index];
    int current;
    C10_CUDA_CHECK(cudaGetDevice(&current));
    if (device != current) {  // made ahead on another device
      C10_CUDA_CHECK(cudaEventDestroy(static_cast<cudaEvent_t>(e)));
      cudaEvent_t fresh;
      C10_CUDA_CHECK(cudaEventCreate(&fresh));
      e = fresh;
      device = current;
    }
    event = static_cast<cudaEvent_t>(e);
  }
  C10_CUDA_CHECK(cudaEventRecord(event, c10::cuda::getCurrentCUDAStream().stream()));
  m.event = index;
#endif
  return m;
}

bool Trace::idle(const Mark& m) {
#ifdef PRISM_CUDA
  if (clock_ == Clock::kCuda && m.event >= 0) {
    cudaError_t status = cudaEventQuery(static_cast<cudaEvent_t>(events_.at(m.event).first));
    if (status == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not an error: clear it
      return false;
    }
    C10_CUDA_CHECK(status);
    return true;
  }
#endif
  (void)m;
  return false;
}

std::vector<double> Trace::seconds(const std::vector<int64_t>& events, int64_t origin) {
  std::vector<double> out(events.size(), NAN);
#ifdef PRISM_CUDA
  C10_CUDA_CHECK(cudaDeviceSynchronize());
  for (size_t i = 0; i < events.size(); ++i) {
    float ms = 0;
    C10_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(events_.at(origin).first),
                                        static_cast<cudaEvent_t>(events_.at(events[i]).first)));
    out[i] = double(ms) * 1e-3;
  }
#else
  (void)origin;
  require_cuda_build();
#endif
  return out;
}

int64_t Trace::memory_sample() {
#ifdef PRISM_CUDA
  if (clock_ == Clock::kCuda) {
    auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(c10::cuda::current_device());
    return stats.allocated_bytes[size_t(c10::CachingAllocator::StatType::AGGREGATE)].current -
           own_device_bytes();
  }
#endif
  if (memory_reader_.is_none()) return -1;
  py::gil_scoped_acquire gil;
  return memory_reader_().cast<int64_t>() - memory_offset_;
}

void Trace::set_memory_reader(py::object reader, int64_t offset) {
  py::object old = std::move(memory_reader_);
  memory_reader_ = std::move(reader);
  memory_offset_ = offset;
}

int64_t Trace::own_device_bytes() const {
#ifdef PRISM_CUDA
  return memory_offset_ + (device_holds_ ? device_holds_->device_bytes : 0);
#else
  return memory_offset_;
#endif
}

void Trace::push(const Entry& e) {
  // called with mu_ held
  entries_.push_back(e);
}

int32_t Trace::begin(int8_t op, int32_t group, int64_t nbytes, int8_t dtype, int32_t peer_delta, bool real_peer,
                     SharedMark* shared) {
  Entry e = blank(kBegin, nbytes, -1, real_peer);
  e.op = op;
  e.dtype = dtype;
  e.group = group;
  e.peer_delta = peer_delta;
  bool was_idle;
  if (shared && shared->set) {
    put(e, shared->mark);
    was_idle = shared->idle;
  } else {
    Mark m = mark();
    put(e, m);
    was_idle = idle(m);
    if (shared) *shared = SharedMark{m, was_idle, true};
  }
  if (was_idle) e.flags |= kIdle;
#ifdef PRISM_CUDA
  if (clock_ == Clock::kCuda) e.stream = c10::cuda::getCurrentCUDAStream().id();
#endif
  if (labelled_.load(std::memory_order_relaxed)) {
    e.mem = memory_sample();
    if (e.mem >= 0) e.flags |= kHasMem;
  }
  std::lock_guard<std::mutex> lock(mu_);
  e.ordinal = epoch_ > 0 ? ordinal_++ : -1;
  if (epoch_ == 0) e.flags |= kSetup;
  if (e.ordinal >= 0 && size_t(e.ordinal) < holds_.size() && holds_[e.ordinal].present &&
      holds_[e.ordinal].transfer_s) {
    stamp(e.ordinal, was_idle);  // its begin: the backend's own work from here is the emulator's
  }
  push(e);
  return e.ordinal;
}

double Trace::issue(int64_t work, int32_t first_ordinal, int32_t count, bool real_peer) {
  Entry e = blank(kIssue, work, first_ordinal, real_peer);
  put(e, mark());
  std::vector<int32_t> held;
  bool spin = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (first_ordinal >= 0) {
      for (int32_t k = first_ordinal; k < first_ordinal + count; ++k) {
        if (size_t(k) < holds_.size() && holds_[k].present) {
          held.push_back(k);
          spin = spin || !holds_[k].at_wait;
        }
      }
    }
  }
  double slept = 0;
  if (!held.empty()) {
    slept = hold(held, spin);
    if (spin) {  // the hold belongs to no node: the replay computes it
      Mark after = mark();
      e.mark2 = after.event;
      e.t2 = after.t;
      e.flags |= kHasMark2;
    }
  }
  std::lock_guard<std::mutex> lock(mu_);
  push(e);
  last_issue_work_ = work;
  last_issue_size_ = entries_total_ + entries_.size();
  last_issue_drains_ = drains_;
  return slept;
}

bool Trace::wait_begin(int64_t work, int64_t epoch) {
  Entry e = blank(kWaitBegin, work, -1, false);
  bool at_once;
  {
    std::lock_guard<std::mutex> lock(mu_);
    // waited right after its issue: nothing ran in between, so no mark (the recorder agrees: every
    // boundary of its own calls boundary() first)
    at_once = work == last_issue_work_ && entries_total_ + entries_.size() == last_issue_size_ &&
              drains_ == last_issue_drains_ && epoch == epoch_;
  }
  if (!at_once) put(e, mark());
  std::lock_guard<std::mutex> lock(mu_);
  push(e);
  return at_once;
}

void Trace::wait_end(int64_t work, int64_t epoch, int32_t first_ordinal, int32_t count, bool real_peer,
                     bool at_once) {
  Entry e = blank(kWaitEnd, work, first_ordinal, real_peer);
  std::vector<int32_t> held;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (epoch == epoch_ && first_ordinal >= 0) {
      for (int32_t k = first_ordinal; k < first_ordinal + count; ++k) {
        if (size_t(k) < holds_.size() && holds_[k].present && holds_[k].at_wait) held.push_back(k);
      }
    }
  }
  if (!held.empty()) hold_wait(held);  // the replay's stream waits here: belongs to no node
  if (!held.empty() || !at_once || real_peer) put(e, mark());
  std::lock_guard<std::mutex> lock(mu_);
  push(e);
}

void Trace::begin_iteration(bool labelled) {
  std::lock_guard<std::mutex> lock(mu_);
  ++epoch_;
  ordinal_ = 0;
  labelled_ = labelled;
  // the marks of the iteration to come are made now, off its path: as many again as the last took
  int64_t last = events_used_ - events_at_begin_;
  events_at_begin_ = events_used_;
  if (clock_ == Clock::kCuda) reserve_events(events_used_ + 2 * last + 1024);
  if (book_) book_->begin(now_s());
#ifdef PRISM_CUDA
  if (device_holds_) device_holds_->begin();
#endif
}

void Trace::set_holds(std::vector<HoldRow> rows) {
  std::lock_guard<std::mutex> lock(mu_);
  holds_ = rows;
  if (clock_ == Clock::kCpu) {
    book_ = std::make_unique<HoldBook>(std::move(rows));
  } else {
#ifdef PRISM_CUDA
    device_holds_ = std::make_unique<DeviceHolds>(rows, c10::cuda::current_device());
#endif
  }
}

void Trace::stamp(int32_t k, bool was_idle) {
  // called with mu_ held
  if (book_) {
    book_->stamp(k, now_s());
    return;
  }
#ifdef PRISM_CUDA
  // on a device the begin is known only where the stream had nothing queued: it begins there now
  if (device_holds_ && was_idle) device_holds_->stamp(k);
#else
  (void)was_idle;
#endif
}

double Trace::hold(const std::vector<int32_t>& ordinals, bool spin) {
  if (book_) {
    double now = now_s(), goal;
    {
      std::lock_guard<std::mutex> lock(mu_);
      book_->plan(ordinals, now);
      if (!spin) return 0;
      goal = book_->goal(ordinals, now);
    }
    return sleep_until(goal);
  }
#ifdef PRISM_CUDA
  if (device_holds_) device_holds_->hold(ordinals, spin);
#endif
  return 0;
}

void Trace::hold_wait(const std::vector<int32_t>& ordinals) {
  if (book_) {
    double goal;
    {
      std::lock_guard<std::mutex> lock(mu_);
      goal = book_->goal(ordinals, now_s());
    }
    sleep_until(goal);
    return;
  }
#ifdef PRISM_CUDA
  if (device_holds_) device_holds_->wait(ordinals);
#endif
}

double Trace::sleep_until(double goal) {
  // a sleep overshoots by the kernel's timer slack and the wake-up (tens of microseconds): the
  // overshoot measured so far (a moving average) is taken off the next sleeps
  double start = now_s(), seconds = goal - start;
  if (seconds <= 0) return 0;
  double asked = std::max(0.0, seconds - overshoot_s_);
  std::this_thread::sleep_for(std::chrono::duration<double>(asked));
  double took = now_s() - start;
  std::lock_guard<std::mutex> lock(mu_);
  account_.count += 1;
  account_.planned_s += seconds;
  account_.measured_s += took;
  overshoot_s_ = 0.8 * overshoot_s_ + 0.2 * std::max(0.0, took - asked);
  return took;
}

int64_t Trace::boundary() {
  std::lock_guard<std::mutex> lock(mu_);
  ++drains_;
  return int64_t(entries_total_ + entries_.size());
}

py::bytes Trace::take() {
  std::vector<Entry> out;
  {
    std::lock_guard<std::mutex> lock(mu_);
    out.swap(entries_);
    entries_total_ += out.size();
    entries_.reserve(out.capacity());
  }
  return py::bytes(reinterpret_cast<const char*>(out.data()), out.size() * sizeof(Entry));
}

py::dict Trace::hold_report() {
  py::dict d;
#ifdef PRISM_CUDA
  if (device_holds_) return device_holds_->report();
#endif
  d["count"] = account_.count;
  d["planned_s"] = account_.planned_s;
  d["measured_s"] = account_.measured_s;
  d["error_pct"] = account_.planned_s > 0 ? py::object(py::float_((account_.measured_s / account_.planned_s - 1) * 100))
                                          : py::object(py::none());
  d["overhead_accrued_s"] = book_ ? book_->accrued_s : 0.0;
  d["overhead_absorbed_s"] = book_ ? book_->absorbed_s : 0.0;
  return d;
}

}  // namespace prism
