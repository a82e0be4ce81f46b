// The prism backend's per-operation path, native (see prism_megatron/comm/native.py for why).
//
// Three objects, all owned through Python:
//   Session   one emulated process: ghost policy, physical peers, counters, providers, listeners,
//             and its Trace;
//   Trace     what a recorder needs of every operation (marks, issue, waits) as fixed-size entries a
//             Python recorder reads between its own boundaries; the holds of realtime emulation;
//   Backend   a c10d::Backend over one virtual group, as torch.distributed calls it.
// Python is entered only where a Python object must answer: listeners (tests, live recorders),
// ghost-data providers (integer data only), a Python clock (fake execution), a CPU memory reader.
#pragma once

#include <ATen/ATen.h>
#include <pybind11/pybind11.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <cmath>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

namespace prism {

namespace py = pybind11;

enum class Policy : int8_t { kMirror = 0, kZeros = 1, kRandom = 2 };

// Operation codes; OP_NAMES in comm/native.py lists the same names in this order.
enum Op : int8_t {
  kAllReduce = 0, kAllGather, kReduceScatter, kBroadcast, kReduce, kGather, kScatter, kAllToAll,
  kSend, kRecv, kBarrier, kOpCount
};
extern const char* const kOpNames[kOpCount];

// ReduceOp codes as CommEvent.reduce_op names them (-1: none).
enum Reduce : int8_t { kSum = 0, kAvg, kMax, kMin, kProduct };

enum EntryKind : int8_t { kBegin = 0, kIssue = 1, kWaitBegin = 2, kWaitEnd = 3 };
enum EntryFlag : int8_t {
  kRealPeer = 1, kIdle = 2, kHasMem = 4, kHasMark = 8, kHasMark2 = 16, kSetup = 32
};

// One trace entry; comm/native.py's ENTRY_DTYPE mirrors this layout (72 bytes).
struct Entry {
  int8_t kind;
  int8_t op;
  int8_t flags;
  int8_t dtype;       // at::ScalarType, or -1
  int32_t group;      // the backend's index in the session's group table
  int32_t peer_delta; // p2p: signed distance along the group; INT32_MIN otherwise
  int32_t ordinal;    // the operation's ordinal in its iteration (-1 in the setup)
  int64_t value;      // begin: bytes; issue and waits: the work's id
  int64_t mark;       // a CUDA event of the pool, or -1
  double t;           // a time mark (CPU or Python clock), NaN where the mark is an event
  int64_t mark2;      // issue: the mark after a hold that spun (-1: none)
  double t2;
  int64_t stream;     // CUDA stream id (0 on CPU)
  int64_t mem;        // allocated bytes sampled at a begin (labelled iterations), -1: none
};
static_assert(sizeof(Entry) == 72, "Entry layout changed: update ENTRY_DTYPE in comm/native.py");

// A mark: an event index (CUDA clock) or a time in seconds (CPU and Python clocks).
struct Mark {
  int64_t event = -1;
  double t = NAN;
};

enum class Clock : int8_t { kCpu = 1, kCuda = 2 };

struct SharedMark {
  Mark mark;
  bool idle = false, set = false;
};

// One operation's hold (emulate/holds.py `Hold`), in nanoseconds of the job's timeline.
struct HoldRow {
  bool present = false;
  double self_s = 0;
  std::vector<std::pair<int32_t, double>> terms;  // (anchor ordinal or -1 for the start, ghost_s)
  bool at_wait = false;
  std::optional<double> transfer_s;
};

// The plan arithmetic of the holds on a host clock (trace/clock.py documents it): an iteration's
// planned ends on the job's timeline (the clock less the debt the emulator's own time ran up).
class HoldBook {
 public:
  explicit HoldBook(std::vector<HoldRow> rows);
  void begin(double now);
  void stamp(int32_t k, double now);
  double plan(const std::vector<int32_t>& ordinals, double now);
  double goal(const std::vector<int32_t>& ordinals, double now);
  const std::vector<HoldRow>& rows() const { return rows_; }
  std::map<int32_t, double> planned() const;  // the ends planned so far this iteration
  double debt = 0, accrued_s = 0, absorbed_s = 0, start = 0;

 private:
  std::vector<HoldRow> rows_;
  std::vector<double> ends_, begins_;
};

class DeviceHolds;  // holds.cu (CUDA builds)

struct HoldAccount {  // what holds were asked for and what they lasted
  int64_t count = 0;
  double planned_s = 0, measured_s = 0;
};

class Trace {
 public:
  Trace(Clock clock, py::object memory_reader, int64_t memory_offset);
  ~Trace();

  // -- marks (also what a Python clock of the same kind calls for its own boundaries) --
  Mark mark();
  bool idle(const Mark& m);
  std::vector<double> seconds(const std::vector<int64_t>& events, int64_t origin);
  void reserve_events(int64_t n);
  int64_t events_used() const { return events_used_; }

  // -- the per-operation record (called by backends, with the GIL released) --
  // `shared`: where set, the mark (and idle probe) of an earlier begin with nothing enqueued since
  // (the members of a coalesced call); where unset, this begin's are stored in it
  int32_t begin(int8_t op, int32_t group, int64_t nbytes, int8_t dtype, int32_t peer_delta, bool real_peer,
                struct SharedMark* shared = nullptr);
  double issue(int64_t work, int32_t first_ordinal, int32_t count, bool real_peer);  // seconds held
  bool wait_begin(int64_t work, int64_t epoch);  // returns whether the wait came at once
  void wait_end(int64_t work, int64_t epoch, int32_t first_ordinal, int32_t count, bool real_peer,
                bool at_once);

  // -- iterations, holds, and the reader's side (called from Python) --
  void begin_iteration(bool labelled);
  void set_holds(std::vector<HoldRow> rows);
  py::bytes take();
  int64_t boundary();  // a boundary of the reader's own: returns how many entries were recorded so far
  int64_t epoch() const { return epoch_; }
  py::dict hold_report();
  int64_t own_device_bytes() const;
  void set_memory_reader(py::object reader, int64_t offset);  // the CPU's (a CUDA clock reads the allocator)
  Clock clock() const { return clock_; }

 private:
  void push(const Entry& e);
  int64_t memory_sample();
  void stamp(int32_t k, bool idle);
  double hold(const std::vector<int32_t>& ordinals, bool spin);
  void hold_wait(const std::vector<int32_t>& ordinals);
  double now_s() const;
  double sleep_until(double goal);

  Clock clock_;
  py::object memory_reader_;
  int64_t memory_offset_;
  std::mutex mu_;
  std::vector<Entry> entries_;
  size_t entries_total_ = 0;  // entries taken so far
  std::atomic<bool> labelled_{true};  // set between iterations, read by every begin
  int64_t epoch_ = 0;  // 0: the setup; k: iteration k
  int32_t ordinal_ = 0;
  int64_t drains_ = 0;
  int64_t last_issue_work_ = -1, last_issue_drains_ = -1;
  size_t last_issue_size_ = 0;
  std::vector<HoldRow> holds_;
  std::unique_ptr<HoldBook> book_;
  HoldAccount account_;
  double overshoot_s_ = 0;
  // CUDA clock: a pool of timing events, indices only grow (marks stay valid until the end)
  std::vector<std::pair<void*, int>> events_;  // (event, the device it was made on)
  int64_t events_used_ = 0, events_at_begin_ = 0;
  std::unique_ptr<DeviceHolds> device_holds_;
};

class Backend;

class Session : public std::enable_shared_from_this<Session> {
 public:
  Session(int64_t world_size, std::vector<int64_t> sandbox_ranks, int64_t physical_rank,
          Policy policy, uint64_t seed);
  ~Session();

  int64_t world_size, physical_rank;
  std::vector<int64_t> sandbox_ranks;
  Policy policy;
  uint64_t seed;

  int64_t physical_of(int64_t virtual_rank) const;  // -1: a ghost
  Policy effective(at::ScalarType dtype) const;
  uint64_t seed_for(const std::string& group_id, int64_t seq, int64_t salt) const;

  // counters per (group index, op): calls and bytes
  void count(int32_t group, int8_t op, int64_t nbytes);
  std::vector<std::tuple<int32_t, int8_t, int64_t, int64_t>> counts();

  // host time spent in operations (wall, and thread CPU time where cpu_timed)
  std::atomic<int64_t> host_ns{0}, host_cpu_ns{0}, ops{0};
  std::atomic<bool> cpu_timed{false};
  std::atomic<int32_t> fresh_gathers{0};
  double settle_after_wait_s = 0;  // the CPU runtime's settle after a blocking wait

  // Python: listeners of every operation (None: nobody listens), ghost-data providers
  py::object on_event = py::none(), on_issue = py::none(), on_wait = py::none();
  py::object ghost_rows = py::none(), ghost_reduction = py::none();
  std::atomic<bool> listening{false}, providing_rows{false}, providing_reductions{false};

  // One integer row offered ahead of the all-gather that needs it (the routing model's ghost token
  // counts, offered once per router call, in pinned host memory on GPU): every ghost's slot of an
  // integer all-gather whose slot has the row's dtype and length gets a copy, without asking Python.
  // Host memory, so that the rank's device allocations stay those of a real rank.
  void offer_row(at::Tensor row);
  at::Tensor offered_row_for(const at::Tensor& slot);  // undefined: none offered matches
  std::atomic<bool> row_offered{false};

  std::shared_ptr<Trace> trace;  // set while a native recorder attaches
  std::map<std::string, c10::intrusive_ptr<c10d::Backend>> p2p;  // device type -> real backend

  int64_t next_work_id() { return ++work_ids_; }

 private:
  std::mutex mu_, row_mu_;
  at::Tensor offered_row_;
  std::unordered_map<int64_t, int64_t> physical_;
  std::vector<std::array<int64_t, 2 * kOpCount>> counts_;
  std::atomic<int64_t> work_ids_{0};
};

}  // namespace prism
