#include "backend.h"

#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

#include <ctime>
#include <sstream>
#include <thread>

namespace prism {

namespace {

// What gloo/NCCL/the store say when the other side of a wait never answers or went away.
bool peer_lost(const std::string& what) {
  for (const char* sign : {"imed out", "imeout", "onnection closed", "onnection reset", "roken pipe"}) {
    if (what.find(sign) != std::string::npos) return true;
  }
  return false;
}

// The error of a wait on other sandboxes that failed because one of them did not answer: it names
// them (virtual ranks) and the bound (comm/native.py PEER_MARK starts it; emulate looks for it).
[[noreturn]] void peer_error(const Session& s, const std::vector<int64_t>& peers, const std::string& where,
                             const std::string& what) {
  std::ostringstream msg;
  msg << "prism: no answer from sandbox rank";
  if (peers.size() != 1) msg << "s";
  for (size_t i = 0; i < peers.size(); ++i) msg << (i ? ", " : " ") << peers[i];
  msg << " to sandbox rank " << s.sandbox_ranks[s.physical_rank] << " in " << where
      << " within emulation.peer_timeout_s: that sandbox stopped, hung or died (raise the timeout if it is "
         "only slow). " << what;
  C10_THROW_ERROR(DistBackendError, msg.str());
}

std::string error_text(const std::exception& e) {
  auto* c10 = dynamic_cast<const c10::Error*>(&e);
  return c10 ? c10->what_without_backtrace() : e.what();
}

int64_t wall_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

int64_t thread_cpu_ns() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

Reduce reduce_of(const c10d::ReduceOp& op) {
  switch (op.op_) {
    case c10d::ReduceOp::SUM: return kSum;
    case c10d::ReduceOp::AVG: return kAvg;
    case c10d::ReduceOp::MAX: return kMax;
    case c10d::ReduceOp::MIN: return kMin;
    case c10d::ReduceOp::PRODUCT: return kProduct;
    default: break;
  }
  TORCH_CHECK_VALUE(false, "reduce op ", int(op.op_), " is not supported by the prism backend; expected "
                    "SUM, AVG, MAX, MIN or PRODUCT");
}

c10d::ReduceOp inner_op(Reduce op) {  // gloo has no AVG: the real members sum, the fold averages
  switch (op) {
    case kMax: return c10d::ReduceOp::MAX;
    case kMin: return c10d::ReduceOp::MIN;
    case kProduct: return c10d::ReduceOp::PRODUCT;
    default: return c10d::ReduceOp::SUM;
  }
}

int64_t nbytes_of(const std::vector<at::Tensor>& tensors) {
  int64_t total = 0;
  for (const auto& t : tensors) total += int64_t(t.nbytes());
  return total;
}

int dtype_of(const std::vector<at::Tensor>& tensors) {
  return tensors.empty() ? -1 : int(tensors[0].scalar_type());
}

std::vector<at::Tensor> flat(const std::vector<std::vector<at::Tensor>>& lists) {
  std::vector<at::Tensor> out;
  for (const auto& l : lists) out.insert(out.end(), l.begin(), l.end());
  return out;
}

std::vector<int64_t> row_sizes(const at::Tensor& t, const std::vector<int64_t>& sizes, int64_t n) {
  if (!sizes.empty()) return sizes;
  TORCH_CHECK_VALUE(t.dim() && t.size(0) % n == 0, "all_to_all: dim 0 (", t.dim() ? t.size(0) : 0,
                    ") is not divisible by the group size ", n, "; pass split sizes");
  return std::vector<int64_t>(n, t.size(0) / n);
}

// What one thread's outermost operation gathers while it runs (a coalesced call runs single ones
// inside and announces one Work for all of them).
struct Running {
  int depth = 0;
  int32_t first_ordinal = -1, count = 0;
  bool real_peer = false;
  int64_t start_ns = 0, cpu_start_ns = 0;
  SharedMark shared;  // the begin mark the members of a coalesced call share (see share_mark)
  bool share_mark = false;
};
thread_local Running running;

}  // namespace

// -- Work ---------------------------------------------------------------------------------------

Work::Work(std::shared_ptr<Session> session, int64_t id, std::vector<at::Tensor> result,
           c10::intrusive_ptr<c10d::Work> inner)
    : c10d::Work(-1, c10d::OpType::UNKNOWN), id(id), session_(std::move(session)),
      result_(std::move(result)), inner_(std::move(inner)) {}

bool Work::wait(std::chrono::milliseconds timeout) {
  bool first = !waited_.exchange(true);
  auto trace = std::atomic_load(&session_->trace);
  bool record = first && traced && trace != nullptr;
  bool listen = first && listened && session_->listening.load();
  bool at_once = false;
  if (record) at_once = trace->wait_begin(id, epoch);
  if (listen) {
    py::gil_scoped_acquire gil;
    session_->on_wait(id, 0);
  }
  bool blocked = inner_ && !inner_->isCompleted();
  if (inner_) {
    try {
      inner_->wait(timeout);
    } catch (const std::exception& e) {
      std::string what = error_text(e);
      if (!peer_lost(what)) throw;
      std::vector<int64_t> others;  // a p2p between sandboxes: the others (its peer among them)
      for (int64_t v : session_->sandbox_ranks) {
        if (v != session_->sandbox_ranks[session_->physical_rank]) others.push_back(v);
      }
      peer_error(*session_, others, "a send/recv", what);
    }
  }
  if (record) trace->wait_end(id, epoch, first_ordinal, count, real_peer, at_once);
  if (listen) {
    py::gil_scoped_acquire gil;
    session_->on_wait(id, 1);
  }
  // the CPU runtime's settle: gloo's worker drops a finished operation's buffers just after it
  if (blocked && session_->settle_after_wait_s > 0) {
    std::this_thread::sleep_for(std::chrono::duration<double>(session_->settle_after_wait_s));
  }
  return true;
}

bool Work::isCompleted() { return inner_ ? inner_->isCompleted() : true; }
bool Work::isSuccess() const { return inner_ ? inner_->isSuccess() : true; }
std::exception_ptr Work::exception() const { return inner_ ? inner_->exception() : nullptr; }
std::vector<at::Tensor> Work::result() { return inner_ ? inner_->result() : result_; }
void Work::synchronize() {
  if (inner_) inner_->synchronize();
}

c10::intrusive_ptr<c10::ivalue::Future> Work::getFuture() {
  if (inner_) return inner_->getFuture();
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
  future->markCompleted(c10::IValue(result_));
  return future;
}

// -- Slots --------------------------------------------------------------------------------------

Slots::Slots(std::vector<at::Tensor> list) : cut_(std::move(list)) {}

Slots::Slots(at::Tensor buffer, std::vector<int64_t> rows)
    : buffer_(std::move(buffer)), rows_(std::move(rows)), cut_(rows_.size()), pieces_(true) {
  starts_.reserve(rows_.size() + 1);
  starts_.push_back(0);
  for (int64_t r : rows_) starts_.push_back(starts_.back() + r);
}

at::Tensor Slots::operator[](int64_t g) {
  at::Tensor& view = cut_[g];
  if (!view.defined()) view = buffer_.dim() ? buffer_.narrow(0, starts_[g], rows_[g]) : buffer_;
  return view;
}

std::optional<at::Tensor> Slots::block(int64_t a, int64_t b) const {
  if (!pieces_ || b - a < 2 || !rows_[a]) return std::nullopt;
  for (int64_t g = a; g < b; ++g)
    if (rows_[g] != rows_[a]) return std::nullopt;
  return buffer_.narrow(0, starts_[a], (b - a) * rows_[a]).view({b - a, -1});
}

// -- Backend ------------------------------------------------------------------------------------

// One operation: autograd off, the host time counted, and the Work announced once by the outermost.
class Backend::Scope {
 public:
  explicit Scope(Backend& b) : b_(b), outer_(running.depth == 0) {
    if (outer_) {
      running = Running{};
      running.start_ns = wall_ns();
      if (b_.session->cpu_timed.load(std::memory_order_relaxed)) running.cpu_start_ns = thread_cpu_ns();
    }
    ++running.depth;
  }
  ~Scope() { --running.depth; }

  c10::intrusive_ptr<c10d::Work> done(std::vector<at::Tensor> result,
                                      c10::intrusive_ptr<c10d::Work> inner = {}) {
    Session& s = *b_.session;
    auto work = c10::make_intrusive<Work>(b_.session, outer_ ? s.next_work_id() : 0, std::move(result),
                                          std::move(inner));
    if (!outer_) return work;
    work->real_peer = running.real_peer;
    double held_s = 0;
    auto trace = std::atomic_load(&s.trace);
    if (trace && running.count) {
      work->traced = true;
      work->epoch = trace->epoch();
      work->first_ordinal = running.first_ordinal;
      work->count = running.count;
      held_s = trace->issue(work->id, running.first_ordinal, running.count, running.real_peer);
    }
    if (s.listening.load(std::memory_order_relaxed)) {
      work->listened = true;
      py::gil_scoped_acquire gil;
      s.on_issue(work->id);
    }
    s.host_ns += wall_ns() - running.start_ns - int64_t(held_s * 1e9);
    if (s.cpu_timed.load(std::memory_order_relaxed)) s.host_cpu_ns += thread_cpu_ns() - running.cpu_start_ns;
    return work;
  }

 private:
  Backend& b_;
  bool outer_;
  // no autograd, no version counters: a backend writes its tensors as NCCL's kernels do
  at::AutoDispatchBelowADInplaceOrView below_autograd_;
};

Backend::Backend(std::shared_ptr<Session> session_, std::vector<int64_t> members_, int group_rank,
                 int32_t index_, std::string group_id_, std::string device_type_, py::object make_inner)
    : c10d::Backend(group_rank, int(members_.size())), session(std::move(session_)),
      members(std::move(members_)), me(group_rank), index(index_), group_id(std::move(group_id_)),
      device_type(std::move(device_type_)), make_inner_(std::move(make_inner)) {
  int n = int(members.size());
  real_set_.assign(n, 0);
  for (int g = 0; g < n; ++g) {
    if (session->physical_of(members[g]) >= 0) {
      real.push_back(g);
      real_set_[g] = 1;
    } else {
      ghosts.push_back(g);
    }
  }
  source_of.resize(n);
  for (int g : real) source_of[g] = g;
  for (size_t j = 0; j < ghosts.size(); ++j) source_of[ghosts[j]] = real[j % real.size()];
  for (size_t i = 0; i < ghosts.size(); ++i) {
    int g = ghosts[i];
    if (!runs.empty() && std::get<2>(runs.back()) == g) std::get<2>(runs.back()) = g + 1;
    else runs.emplace_back(int(i), g, g + 1);
  }
  has_peers = real.size() > 1;
}

Backend::~Backend() {
  if (Py_IsInitialized()) {
    py::gil_scoped_acquire gil;
    make_inner_ = py::object();
    session_object = py::object();
  } else {
    make_inner_.release();
    session_object.release();
  }
}

int64_t Backend::begin(Op op, int64_t nbytes, int dtype, int peer, int reduce) {
  int64_t seq = seq_.fetch_add(1);
  int n = int(members.size());
  int32_t peer_delta = INT32_MIN;
  int64_t peer_rank = -1;
  bool real_peer = has_peers;
  if (peer >= 0) {
    int d = ((peer - me) % n + n) % n;
    peer_delta = d > n / 2 ? d - n : d;
    peer_rank = members[peer];
    real_peer = is_real(peer);
  }
  session->count(index, op, nbytes);
  if (session->listening.load(std::memory_order_relaxed)) {
    py::gil_scoped_acquire gil;
    session->on_event(index, int(op), nbytes, dtype, seq, peer_rank, reduce,
                      peer_delta == INT32_MIN ? py::object(py::none()) : py::object(py::int_(peer_delta)),
                      real_peer);
  }
  auto trace = std::atomic_load(&session->trace);
  if (trace) {
    int32_t ordinal = trace->begin(op, index, nbytes, int8_t(dtype), peer_delta, real_peer,
                                   running.share_mark ? &running.shared : nullptr);
    if (running.count == 0) running.first_ordinal = ordinal;
    ++running.count;
  }
  running.real_peer = running.real_peer || real_peer;
  return seq;
}

void Backend::connect() {
  if (has_peers) inner(device_type);
}

void Backend::wait_inner(const c10::intrusive_ptr<c10d::Work>& work) {
  // the CPU runtime's settle after a wait that blocked (see Work::wait)
  bool blocked = session->settle_after_wait_s > 0 && !work->isCompleted();
  try {
    work->wait();
  } catch (const std::exception& e) {
    std::string what = error_text(e);
    if (!peer_lost(what)) throw;
    std::vector<int64_t> others;
    for (int g : real) {
      if (g != me) others.push_back(members[g]);
    }
    peer_error(*session, others, "a collective of group " + group_id, what);
  }
  if (blocked) std::this_thread::sleep_for(std::chrono::duration<double>(session->settle_after_wait_s));
}

c10::intrusive_ptr<c10d::Backend> Backend::inner(const std::string& type) {
  std::lock_guard<std::mutex> lock(inner_mu_);
  auto it = inners_.find(type);
  if (it != inners_.end()) return it->second;
  // made on first use, which every real member reaches at the same operation
  py::gil_scoped_acquire gil;
  auto made = make_inner_(type).cast<c10::intrusive_ptr<c10d::Backend>>();
  inners_[type] = made;
  return made;
}

c10::intrusive_ptr<c10d::Backend> Backend::inner(const at::Tensor& like) {
  return inner(like.device().type() == c10::DeviceType::CUDA ? std::string("cuda") : std::string("cpu"));
}

int64_t Backend::inner_index(int group_rank) const {
  auto it = std::find(real.begin(), real.end(), group_rank);
  return it == real.end() ? -1 : int64_t(it - real.begin());
}

GenFn Backend::gen(const at::Tensor& like, int64_t seq, int64_t salt) {
  return GenFn{session.get(), &group_id, like.device(), seq, salt, 0};
}

// -- reductions ---------------------------------------------------------------------------------

bool Backend::reduction_provided(at::Tensor& out, Reduce op) {
  // a provider (session.ghost_reductions) knows the ghosts' part: integer data only (counts, loads)
  if (!session->providing_reductions.load() || ghosts.empty() || at::isFloatingType(out.scalar_type()) ||
      at::isComplexType(out.scalar_type()) || !(op == kMax || op == kMin || op == kSum)) {
    return false;
  }
  at::Tensor part;
  {
    py::gil_scoped_acquire gil;
    py::object got = session->ghost_reduction(index, int(kAllReduce), out, int(op));
    if (got.is_none()) return false;
    part = got.cast<at::Tensor>();
  }
  part = part.to(out.device(), out.scalar_type()).reshape(out.sizes());
  if (op == kMax) at::maximum_out(out, out, part);
  else if (op == kMin) at::minimum_out(out, out, part);
  else out.add_(part);
  return true;
}

c10::intrusive_ptr<c10d::Work> Backend::allreduce_one(at::Tensor& t, Reduce op) {
  std::vector<at::Tensor> tensors{t};
  int64_t seq = begin(kAllReduce, int64_t(t.nbytes()), int(t.scalar_type()), -1, op);
  if (has_peers) {
    c10d::AllreduceOptions opts;
    opts.reduceOp = inner_op(op);
    wait_inner(inner(t)->allreduce(tensors, opts));
  }
  if (!reduction_provided(t, op)) {
    finish_reduction(*session, t, op, int64_t(members.size()), int64_t(real.size()), gen(t, seq, 0));
  }
  return {};
}

c10::intrusive_ptr<c10d::Work> Backend::allreduce(std::vector<at::Tensor>& tensors,
                                                  const c10d::AllreduceOptions& opts) {
  Scope scope(*this);
  Reduce op = reduce_of(opts.reduceOp);
  int64_t seq = begin(kAllReduce, nbytes_of(tensors), dtype_of(tensors), -1, op);
  if (has_peers) {
    c10d::AllreduceOptions inner_opts;
    inner_opts.reduceOp = inner_op(op);
    wait_inner(inner(tensors[0])->allreduce(tensors, inner_opts));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!reduction_provided(tensors[i], op)) {
      finish_reduction(*session, tensors[i], op, int64_t(members.size()), int64_t(real.size()),
                       gen(tensors[i], seq, int64_t(i)));
    }
  }
  return scope.done(tensors);
}

c10::intrusive_ptr<c10d::Work> Backend::allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                            const c10d::AllreduceCoalescedOptions& opts) {
  Scope scope(*this);
  Reduce op = reduce_of(opts.reduceOp);
  if (!has_peers && op == kSum && !tensors.empty() && !session->providing_reductions.load() &&
      session->effective(tensors[0].scalar_type()) == Policy::kMirror && !ghosts.empty()) {
    // one real member under mirror: every tensor times n, in one multi-tensor kernel; their begins
    // come before it, with nothing enqueued between them: one mark for all
    bool alike = true;
    running.share_mark = true;
    for (const auto& t : tensors) {
      alike = alike && t.scalar_type() == tensors[0].scalar_type() && t.device() == tensors[0].device() &&
              !is_python(t);
      begin(kAllReduce, int64_t(t.nbytes()), int(t.scalar_type()), -1, op);
    }
    running.share_mark = false;
    if (alike) {
      times_all(tensors, int64_t(members.size()));
      return scope.done(tensors);
    }
    for (auto& t : tensors) times_into(t, t, int64_t(members.size()));
    return scope.done(tensors);
  }
  for (auto& t : tensors) allreduce_one(t, op);
  return scope.done(tensors);
}

c10::intrusive_ptr<c10d::Work> Backend::reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) {
  Scope scope(*this);
  Reduce op = reduce_of(opts.reduceOp);
  int64_t seq = begin(kReduce, nbytes_of(tensors), dtype_of(tensors), -1, op);
  int root = int(opts.rootRank);
  if (has_peers && is_real(root)) {
    c10d::ReduceOptions inner_opts;
    inner_opts.reduceOp = inner_op(op);
    inner_opts.rootRank = inner_index(root);
    inner_opts.rootTensor = opts.rootTensor;
    wait_inner(inner(tensors[0])->reduce(tensors, inner_opts));
  }
  if (root == me) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      finish_reduction(*session, tensors[i], op, int64_t(members.size()), int64_t(real.size()),
                       gen(tensors[i], seq, int64_t(i)));
    }
  }
  return scope.done(tensors);
}

void Backend::fold_into(at::Tensor& out, const at::Tensor& mine, Reduce op, int64_t seq) {
  // out = the reduction of `mine` with the ghosts' part, one real member: out = n * mine under
  // mirror's SUM, in one multiply; otherwise the copy and the fold, as reduce_scatter_one
  int64_t n = int64_t(members.size());
  if (op == kSum && session->effective(out.scalar_type()) == Policy::kMirror && !is_python(out) &&
      !same_memory(out, mine)) {
    times_into(out, mine, n);
    return;
  }
  if (!same_memory(out, mine)) out.copy_(mine);
  finish_reduction(*session, out, op, n, int64_t(real.size()), gen(out, seq, 0));
}

void Backend::reduce_scatter_one(at::Tensor& out, std::vector<at::Tensor> inputs, Reduce op, int64_t seq,
                                 int64_t salt) {
  if (has_peers) {
    std::vector<at::Tensor> outs{out};
    std::vector<std::vector<at::Tensor>> real_inputs(1);
    for (int g : real) real_inputs[0].push_back(inputs[g]);
    c10d::ReduceScatterOptions inner_opts;
    inner_opts.reduceOp = inner_op(op);
    wait_inner(inner(out)->reduce_scatter(outs, real_inputs, inner_opts));
  } else if (!same_memory(out, inputs[me])) {
    out.copy_(inputs[me]);
  }
  finish_reduction(*session, out, op, int64_t(members.size()), int64_t(real.size()), gen(out, seq, salt));
}

c10::intrusive_ptr<c10d::Work> Backend::reduce_scatter(std::vector<at::Tensor>& outputs,
                                                       std::vector<std::vector<at::Tensor>>& inputs,
                                                       const c10d::ReduceScatterOptions& opts) {
  Scope scope(*this);
  Reduce op = reduce_of(opts.reduceOp);
  auto all = flat(inputs);
  int64_t seq = begin(kReduceScatter, nbytes_of(all), dtype_of(all), -1, op);
  for (size_t i = 0; i < outputs.size(); ++i) reduce_scatter_one(outputs[i], inputs[i], op, seq, int64_t(i));
  return scope.done(outputs);
}

c10::intrusive_ptr<c10d::Work> Backend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                             const c10d::ReduceScatterOptions& opts) {
  Scope scope(*this);
  Reduce op = reduce_of(opts.reduceOp);
  int64_t seq = begin(kReduceScatter, int64_t(input.nbytes()), int(input.scalar_type()), -1, op);
  int64_t n = int64_t(members.size());
  if (has_peers && ghosts.empty()) {
    c10d::ReduceScatterOptions inner_opts;
    inner_opts.reduceOp = inner_op(op);
    wait_inner(inner(output)->_reduce_scatter_base(output, input, inner_opts));
    finish_reduction(*session, output, op, n, n, gen(output, seq, 0));
  } else if (!has_peers && input.is_contiguous() && input.numel() == n * output.numel() &&
             input.scalar_type() == output.scalar_type()) {
    // one real member: its own piece, folded on the way in (one kernel where the fold is a scaling)
    at::Tensor mine = input.view(-1).narrow(0, me * output.numel(), output.numel()).view(output.sizes());
    fold_into(output, mine, op, seq);
  } else {
    reduce_scatter_one(output, input.chunk(n), op, seq, 0);
  }
  return scope.done({output});
}

c10::intrusive_ptr<c10d::Work> Backend::reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                        std::vector<at::Tensor>& inputs,
                                                                        const c10d::ReduceScatterOptions& opts) {
  Scope scope(*this);
  for (size_t i = 0; i < outputs.size(); ++i) _reduce_scatter_base(outputs[i], inputs[i], opts);
  return scope.done(outputs);
}

// -- gathers ------------------------------------------------------------------------------------

bool Backend::may_provide(at::ScalarType dtype) const {
  return !ghosts.empty() && !at::isFloatingType(dtype) && !at::isComplexType(dtype) &&
         (session->providing_rows.load() || session->row_offered.load());
}

bool Backend::provided(Slots& slots, Op op) {
  // whether the offered row or a provider (session.ghost_data) filled every ghost slot: integer data
  // only (counts)
  if (ghosts.empty()) return false;
  at::Tensor like = slots[ghosts[0]];
  if (!may_provide(like.scalar_type())) return false;
  if (op == kAllGather) {
    at::Tensor row = session->offered_row_for(like);
    if (row.defined()) {
      for (const auto& [i, a, b] : runs) {  // one copy from the host, then on the device
        at::Tensor first = slots[a];
        first.copy_(row.view(first.sizes()), /*non_blocking=*/true);
        if (b - a == 1) continue;
        auto block = slots.block(a + 1, b);
        if (block) {
          copy_broadcast(*block, first);
        } else {
          for (int k = a + 1; k < b; ++k) slots[k].copy_(first);
        }
      }
      return true;
    }
  }
  if (!session->providing_rows.load()) return false;
  at::Tensor rows;
  {
    py::gil_scoped_acquire gil;
    py::object got = session->ghost_rows(index, int(op), like);
    if (got.is_none()) return false;
    rows = got.cast<at::Tensor>().reshape({int64_t(ghosts.size()), -1});
  }
  for (const auto& [i, a, b] : runs) {
    auto block = slots.block(a, b);
    if (block) {
      copy_from_host(*block, rows.narrow(0, i, b - a));
    } else {
      for (int k = 0; k < b - a; ++k) {
        at::Tensor slot = slots[a + k];
        copy_from_host(slot, rows[i + k].view(slot.sizes()));
      }
    }
  }
  return true;
}

void Backend::fill_slots(Slots& slots, int64_t seq, Op op, std::optional<bool> skip) {
  if (skip.has_value() ? *skip : provided(slots, op)) return;
  at::Tensor local = slots[me];
  if (real.size() == 1 && session->effective(local.scalar_type()) == Policy::kMirror) {
    for (const auto& [i, a, b] : runs) {  // one real member: every ghost mirrors our slot
      std::optional<at::Tensor> block;
      if (slots.pieces() && slots.rows()[a] == slots.rows()[me]) block = slots.block(a, b);
      if (block) {
        copy_broadcast(*block, local);
      } else {
        for (int g = a; g < b; ++g) fill(*session, slots[g], &local, GenFn{});
      }
    }
    return;
  }
  for (int g : ghosts) {
    at::Tensor source = slots[source_of[g]];
    at::Tensor slot = slots[g];
    fill(*session, slot, &source, gen(slot, seq, g));
  }
}

c10::intrusive_ptr<c10d::Work> Backend::allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                                  std::vector<at::Tensor>& inputs,
                                                  const c10d::AllgatherOptions& opts) {
  Scope scope(*this);
  auto all = flat(outputs);
  int64_t seq = begin(kAllGather, nbytes_of(all), dtype_of(all));
  for (size_t i = 0; i < outputs.size(); ++i) {
    auto& outs = outputs[i];
    at::Tensor& inp = inputs[i];
    bool in_place = same_memory(outs[me], inp);
    if (has_peers) {
      std::vector<std::vector<at::Tensor>> real_outs(1);
      for (int g : real) real_outs[0].push_back(outs[g]);
      std::vector<at::Tensor> ins{inp};
      wait_inner(inner(inp)->allgather(real_outs, ins));
    } else if (!in_place) {
      outs[me].copy_(inp);
    }
    if (!(in_place && session->effective(inp.scalar_type()) == Policy::kMirror)) {
      Slots slots(outs);  // in place under mirror: ghosts keep their shards
      fill_slots(slots, seq, kAllGather);
    }
  }
  return scope.done(all);
}

c10::intrusive_ptr<c10d::Work> Backend::_allgather_base(at::Tensor& output, at::Tensor& input,
                                                        const c10d::AllgatherOptions& opts) {
  Scope scope(*this);
  int64_t seq = begin(kAllGather, int64_t(output.nbytes()), int(output.scalar_type()));
  int64_t n = int64_t(members.size());
  if (has_peers && ghosts.empty()) {
    wait_inner(inner(output)->_allgather_base(output, input));
    return scope.done({output});
  }
  bool even = output.is_contiguous() && output.dim() && output.size(0) % n == 0;
  Policy policy = session->effective(output.scalar_type());
  if (!has_peers && even && policy == Policy::kMirror &&
      !may_provide(output.scalar_type())) {
    // the sandbox alone under mirror (what follows, without cutting n slots): every ghost's slot a
    // copy of ours, or, gathering in place, each ghost's own shard kept
    int64_t rows = output.size(0) / n;
    if (!same_memory(input, output.narrow(0, me * rows, rows))) {
      copy_broadcast(output.view({n, -1}), input);
    } else if (session->fresh_gathers.load() > 0) {
      copy_broadcast(output.view({n, -1}), input.detach().clone());
    }
    return scope.done({output});
  }
  Slots slots = even ? Slots(output, std::vector<int64_t>(n, output.size(0) / n)) : Slots(output.chunk(n));
  bool mirror = session->effective(output.scalar_type()) == Policy::kMirror;
  bool in_place = same_memory(input, slots[me]);
  auto real_gather = [&]() {
    std::vector<std::vector<at::Tensor>> real_outs(1);
    for (int g : real) real_outs[0].push_back(slots[g]);
    std::vector<at::Tensor> ins{input};
    wait_inner(inner(input)->allgather(real_outs, ins));
  };
  if (mirror && in_place) {
    // In-place gather of sharded state (distributed optimizer, ZeRO parameters): each ghost owns its
    // shard and keeps its last known value. A fresh buffer (ZeRO-3) has none: every slot gets a copy
    // of ours, one broadcast copy, before the real members'.
    if (session->fresh_gathers.load() > 0 && output.is_contiguous()) {
      copy_broadcast(output.view({n, -1}), input.detach().clone());
    }
    if (has_peers) real_gather();
    return scope.done({output});
  }
  bool given = provided(slots, kAllGather);
  if (!has_peers && mirror && output.is_contiguous() && !given) {
    copy_broadcast(output.view({n, -1}), input);  // one real member: every slot a copy of ours
    return scope.done({output});
  }
  if (has_peers) real_gather();
  else slots[me].copy_(input);
  fill_slots(slots, seq, kAllGather, given);
  return scope.done({output});
}

c10::intrusive_ptr<c10d::Work> Backend::allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                            std::vector<at::Tensor>& inputs,
                                                            const c10d::AllgatherOptions& opts) {
  Scope scope(*this);
  for (size_t i = 0; i < outputs.size(); ++i) {
    std::vector<std::vector<at::Tensor>> outs{outputs[i]};
    std::vector<at::Tensor> ins{inputs[i]};
    allgather(outs, ins, opts);
  }
  return scope.done(flat(outputs));
}

c10::intrusive_ptr<c10d::Work> Backend::allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                        std::vector<at::Tensor>& inputs,
                                                                        const c10d::AllgatherOptions& opts) {
  Scope scope(*this);
  for (size_t i = 0; i < outputs.size(); ++i) _allgather_base(outputs[i], inputs[i], opts);
  return scope.done(outputs);
}

c10::intrusive_ptr<c10d::Work> Backend::gather(std::vector<std::vector<at::Tensor>>& outputs,
                                               std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) {
  Scope scope(*this);
  int root = int(opts.rootRank);
  // bytes: the full gathered output on every member (nccl-tests' size), root or not
  int64_t seq = begin(kGather, nbytes_of(inputs) * int64_t(members.size()), dtype_of(inputs));
  if (!is_real(root)) return scope.done({});  // the data goes to a ghost: nothing to do
  std::vector<at::Tensor> outs = me == root ? outputs[0] : std::vector<at::Tensor>{};
  if (has_peers) {
    c10d::GatherOptions inner_opts;
    inner_opts.rootRank = inner_index(root);
    std::vector<std::vector<at::Tensor>> inner_out;
    if (!outs.empty()) {
      inner_out.emplace_back();
      for (int g : real) inner_out[0].push_back(outs[g]);
    }
    wait_inner(inner(inputs[0])->gather(inner_out, inputs, inner_opts));
  } else if (!outs.empty()) {
    outs[root].copy_(inputs[0]);
  }
  if (!outs.empty()) {
    Slots slots(outs);
    fill_slots(slots, seq, kGather);
  }
  return scope.done(outs);
}

// -- one to all ---------------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Work> Backend::broadcast(std::vector<at::Tensor>& tensors,
                                                  const c10d::BroadcastOptions& opts) {
  Scope scope(*this);
  int root = int(opts.rootRank);
  int64_t seq = begin(kBroadcast, nbytes_of(tensors), dtype_of(tensors));
  if (is_real(root)) {
    if (has_peers) {
      c10d::BroadcastOptions inner_opts;
      inner_opts.rootRank = inner_index(root);
      inner_opts.rootTensor = opts.rootTensor;
      wait_inner(inner(tensors[0])->broadcast(tensors, inner_opts));
    }
    return scope.done(tensors);
  }
  int source = source_of[root];  // ghost root j mirrors real member j mod r
  for (size_t i = 0; i < tensors.size(); ++i) {
    at::Tensor& t = tensors[i];
    if (session->effective(t.scalar_type()) == Policy::kMirror) {
      if (has_peers) {  // all real members agree on the mirrored root's data
        c10d::BroadcastOptions inner_opts;
        inner_opts.rootRank = inner_index(source);
        std::vector<at::Tensor> one{t};
        wait_inner(inner(t)->broadcast(one, inner_opts));
      }
    } else {
      fill(*session, t, nullptr, gen(t, seq, int64_t(i)));
    }
  }
  return scope.done(tensors);
}

c10::intrusive_ptr<c10d::Work> Backend::scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ScatterOptions& opts) {
  Scope scope(*this);
  int root = int(opts.rootRank);
  // bytes: the full input, on every member
  int64_t seq = begin(kScatter, nbytes_of(outputs) * int64_t(members.size()), dtype_of(outputs));
  at::Tensor& out = outputs[0];
  if (is_real(root)) {
    if (has_peers) {
      c10d::ScatterOptions inner_opts;
      inner_opts.rootRank = inner_index(root);
      std::vector<std::vector<at::Tensor>> ins;
      if (me == root) {
        ins.emplace_back();
        for (int g : real) ins[0].push_back(inputs[0][g]);
      }
      std::vector<at::Tensor> outs{out};
      wait_inner(inner(out)->scatter(outs, ins, inner_opts));
    } else if (!same_memory(out, inputs[0][root])) {
      out.copy_(inputs[0][root]);
    }
  } else if (session->effective(out.scalar_type()) != Policy::kMirror) {
    fill(*session, out, nullptr, gen(out, seq, 0));  // mirror keeps the receiver's buffer
  }
  return scope.done(outputs);
}

// -- all-to-all ---------------------------------------------------------------------------------

bool Backend::mirror_alone(at::Tensor& output, at::Tensor& input, const at::Tensor& local,
                           const std::vector<int64_t>& rows) {
  if (real.size() != 1 || !input.dim() || rows[me] != local.size(0) || is_python(output) || is_python(input) ||
      session->effective(output.scalar_type()) != Policy::kMirror ||
      output.storage().data() == input.storage().data()) {
    return false;
  }
  return mirror_own_piece(output, local, rows);
}

void Backend::alltoall_real(Slots& outs, Slots& ins) {
  if (!has_peers) {
    at::Tensor mine = outs[me], theirs = ins[me];
    if (!same_memory(mine, theirs)) mine.copy_(theirs);
    return;
  }
  // real members only: one packed exchange through the inner backend (gloo has no list form)
  std::vector<at::Tensor> pieces;
  std::vector<int64_t> out_counts, in_counts;
  int64_t total = 0;
  for (int g : real) {
    pieces.push_back(ins[g].reshape(-1));
    in_counts.push_back(ins[g].numel());
    out_counts.push_back(outs[g].numel());
    total += outs[g].numel();
  }
  at::Tensor send = at::cat(pieces);
  at::Tensor recv = send.new_empty({total});
  std::vector<int64_t> out_split = out_counts, in_split = in_counts;  // gloo takes its arguments' contents
  wait_inner(inner(send)->alltoall_base(recv, send, out_split, in_split));
  int64_t offset = 0;
  for (size_t k = 0; k < real.size(); ++k) {
    at::Tensor slot = outs[real[k]];
    slot.copy_(recv.narrow(0, offset, out_counts[k]).view(slot.sizes()));
    offset += out_counts[k];
  }
}

c10::intrusive_ptr<c10d::Work> Backend::alltoall_base(at::Tensor& output, at::Tensor& input,
                                                      std::vector<int64_t>& output_split_sizes,
                                                      std::vector<int64_t>& input_split_sizes,
                                                      const c10d::AllToAllOptions& opts) {
  Scope scope(*this);
  int64_t seq = begin(kAllToAll, int64_t(input.nbytes()), int(input.scalar_type()));
  int64_t n = int64_t(members.size());
  if (has_peers && ghosts.empty()) {
    wait_inner(inner(output)->alltoall_base(output, input, output_split_sizes, input_split_sizes));
    return scope.done({output});
  }
  std::vector<int64_t> rows = row_sizes(output, output_split_sizes, n);
  std::vector<int64_t> in_rows = row_sizes(input, input_split_sizes, n);
  auto cut = [](at::Tensor& t, const std::vector<int64_t>& r) {
    if (t.dim() && t.size(0) && t.is_contiguous()) return Slots(t, r);  // pieces of one buffer
    std::vector<at::Tensor> list;
    int64_t start = 0;
    for (int64_t rows_g : r) {
      list.push_back(t.dim() && t.size(0) ? t.narrow(0, start, rows_g) : t);
      start += rows_g;
    }
    return Slots(list);
  };
  Slots outs = cut(output, rows), ins = cut(input, in_rows);
  std::optional<bool> given;
  if (!has_peers) {  // only our own piece moves: the ghosts' are cut only if filled one by one
    given = provided(outs, kAllToAll);
    if (!*given && mirror_alone(output, input, ins[me], rows)) return scope.done({output});
  }
  alltoall_real(outs, ins);
  fill_slots(outs, seq, kAllToAll, given);
  return scope.done({output});
}

c10::intrusive_ptr<c10d::Work> Backend::alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                                 const c10d::AllToAllOptions& opts) {
  Scope scope(*this);
  int64_t seq = begin(kAllToAll, nbytes_of(inputs), dtype_of(inputs));
  Slots outs(outputs), ins(inputs);
  alltoall_real(outs, ins);
  fill_slots(outs, seq, kAllToAll);
  return scope.done(outputs);
}

// -- point to point -----------------------------------------------------------------------------

c10::intrusive_ptr<c10d::Backend> Backend::p2p_backend(const at::Tensor& like) const {
  std::string type = like.is_cuda() ? "cuda" : "cpu";
  auto it = session->p2p.find(type);
  TORCH_CHECK(it != session->p2p.end(), "prism: no real ", type, " backend between the sandboxes for a "
              "send/recv between two of them; the session connects them at init_process_group");
  return it->second;
}

at::Tensor Backend::host_copy(const at::Tensor& t) {
  // a copy outside the device allocator, for the p2p mirror: on GPU pinned and filled asynchronously
  // on the current stream (a real send does not wait for the device; the recv's copy back is
  // stream-ordered after it); on CPU a plain copy the memory tracker never sees
  if (t.is_cuda()) {
    at::Tensor pinned = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
    pinned.copy_(t.detach(), /*non_blocking=*/true);
    return pinned;
  }
  return t.detach().clone(at::MemoryFormat::Contiguous);
}

c10::intrusive_ptr<c10d::Work> Backend::send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) {
  Scope scope(*this);
  begin(kSend, nbytes_of(tensors), dtype_of(tensors), dst_rank);
  int64_t physical = session->physical_of(members[dst_rank]);
  if (physical >= 0) {
    return scope.done(tensors, p2p_backend(tensors[0])->send(tensors, int(physical), tag));
  }
  for (const auto& t : tensors) {
    if (is_python(t)) continue;  // fake execution: shapes only, no bytes to mirror
    // the first one only: mirroring our latest output back into our input would form a loop
    std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
    std::lock_guard<std::mutex> lock(stash_mu_);
    auto& sent = stash_[{shape, int(t.scalar_type())}];
    bool known = std::any_of(sent.begin(), sent.end(), [&](const auto& p) { return p.first == dst_rank; });
    if (!known) sent.emplace_back(dst_rank, host_copy(t));
  }
  return scope.done(tensors);
}

c10::intrusive_ptr<c10d::Work> Backend::recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) {
  Scope scope(*this);
  int64_t seq = begin(kRecv, nbytes_of(tensors), dtype_of(tensors), src_rank);
  int64_t physical = session->physical_of(members[src_rank]);
  if (physical >= 0) {
    return scope.done(tensors, p2p_backend(tensors[0])->recv(tensors, int(physical), tag));
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    at::Tensor& t = tensors[i];
    if (is_python(t)) continue;
    if (session->effective(t.scalar_type()) != Policy::kMirror) {
      fill(*session, t, nullptr, gen(t, seq, int64_t(i)));
      continue;
    }
    // what we sent the other way: a ghost previous stage's activations look like the ones we send
    // on; a ghost next stage's gradients like the ones we send back
    at::Tensor raw;
    {
      std::vector<int64_t> shape(t.sizes().begin(), t.sizes().end());
      std::lock_guard<std::mutex> lock(stash_mu_);
      auto it = stash_.find({shape, int(t.scalar_type())});
      if (it != stash_.end()) {
        for (const auto& [peer, copy] : it->second) {
          if (peer != src_rank) {
            raw = copy;
            break;
          }
        }
      }
    }
    if (!raw.defined() && at::isFloatingType(t.scalar_type())) t.normal_(0, 1, gen(t, seq, int64_t(i))());
    else if (!raw.defined()) t.zero_();
    else t.copy_(raw, /*non_blocking=*/true);
  }
  return scope.done(tensors);
}

c10::intrusive_ptr<c10d::Work> Backend::recvAnysource(std::vector<at::Tensor>& tensors, int tag) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "recv from any source is not supported by the prism backend; "
                              "receive from a named rank");
}

c10::intrusive_ptr<c10d::Work> Backend::barrier(const c10d::BarrierOptions& opts) {
  Scope scope(*this);
  begin(kBarrier, 0, -1);
  if (has_peers) wait_inner(inner(device_type)->barrier(c10d::BarrierOptions()));
  return scope.done({});
}

}  // namespace prism
