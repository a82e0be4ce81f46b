// The c10d::Backend of one virtual group, and its Work (comm/backend.py documents the semantics).
#pragma once

#include "policy.h"
#include "prism.h"

#include <functional>

namespace prism {

// An operation's Work: completed when returned (ghost peers only), or the inner backend's p2p work
// with a real peer. Its first wait is what the trace records (which operation a stream waits for).
class Work : public c10d::Work {
 public:
  Work(std::shared_ptr<Session> session, int64_t id, std::vector<at::Tensor> result,
       c10::intrusive_ptr<c10d::Work> inner);
  bool wait(std::chrono::milliseconds timeout = kNoTimeout) override;
  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  std::vector<at::Tensor> result() override;
  void synchronize() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  const int64_t id;
  int64_t epoch = -1;
  int32_t first_ordinal = -1, count = 0;
  bool real_peer = false, traced = false, listened = false;

 private:
  std::shared_ptr<Session> session_;
  std::vector<at::Tensor> result_;
  c10::intrusive_ptr<c10d::Work> inner_;
  std::atomic<bool> waited_{false};
};

// A group's output as one slot per member: given tensors, or the dim-0 pieces of one contiguous buffer
// (`pieces`), cut when asked for and once.
class Slots {
 public:
  explicit Slots(std::vector<at::Tensor> list);
  Slots(at::Tensor buffer, std::vector<int64_t> rows);
  at::Tensor operator[](int64_t g);
  int64_t size() const { return int64_t(cut_.size()); }
  bool pieces() const { return pieces_; }
  // slots a..b-1 as one [b - a, -1] view of the buffer when they are equal pieces of it
  std::optional<at::Tensor> block(int64_t a, int64_t b) const;
  const std::vector<int64_t>& rows() const { return rows_; }

 private:
  at::Tensor buffer_;
  std::vector<int64_t> rows_, starts_;
  std::vector<at::Tensor> cut_;
  bool pieces_ = false;
};

class Backend : public c10d::Backend {
 public:
  Backend(std::shared_ptr<Session> session, std::vector<int64_t> members, int group_rank, int32_t index,
          std::string group_id, std::string device_type, py::object make_inner);
  ~Backend() override;

  const std::string getBackendName() const override { return "prism"; }
  void connect();  // the real members' inner backend now, while every one of them creates the group

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& tensors,
                                           const c10d::BroadcastOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& tensors,
                                           const c10d::AllreduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& tensors,
                                                     const c10d::AllreduceCoalescedOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& tensors, const c10d::ReduceOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& outputs,
                                           std::vector<at::Tensor>& inputs,
                                           const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& output, at::Tensor& input,
                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& outputs,
                                                     std::vector<at::Tensor>& inputs,
                                                     const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::AllgatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& outputs,
                                        std::vector<at::Tensor>& inputs, const c10d::GatherOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& outputs,
                                         std::vector<std::vector<at::Tensor>>& inputs,
                                         const c10d::ScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& outputs,
                                                std::vector<std::vector<at::Tensor>>& inputs,
                                                const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                                      const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& outputs,
                                                                 std::vector<at::Tensor>& inputs,
                                                                 const c10d::ReduceScatterOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& output, at::Tensor& input,
                                               std::vector<int64_t>& output_split_sizes,
                                               std::vector<int64_t>& input_split_sizes,
                                               const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& outputs, std::vector<at::Tensor>& inputs,
                                          const c10d::AllToAllOptions& opts) override;
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& tensors, int dst_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& tensors, int src_rank, int tag) override;
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& tensors, int tag) override;
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& opts) override;

  const std::shared_ptr<Session> session;
  const std::vector<int64_t> members;
  const int me;
  const int32_t index;
  const std::string group_id, device_type;
  std::vector<int> real, ghosts, source_of;  // source_of[g]: the real member slot g mirrors
  std::vector<std::tuple<int, int, int>> runs;  // runs of consecutive ghosts: (position, first, end)
  bool has_peers;
  py::object session_object = py::none();  // the Python VirtualSession (create_prism_group reads it)

 private:
  class Scope;
  int64_t begin(Op op, int64_t nbytes, int dtype, int peer = -1, int reduce = -1);
  c10::intrusive_ptr<c10d::Backend> inner(const std::string& device_type);
  void wait_inner(const c10::intrusive_ptr<c10d::Work>& work);
  c10::intrusive_ptr<c10d::Backend> inner(const at::Tensor& like);
  int64_t inner_index(int group_rank) const;
  bool is_real(int g) const { return real_set_[g]; }
  GenFn gen(const at::Tensor& like, int64_t seq, int64_t salt);
  bool reduction_provided(at::Tensor& out, Reduce op);
  bool may_provide(at::ScalarType dtype) const;  // a provider or the offered row may fill ghosts
  bool provided(Slots& slots, Op op);
  void fill_slots(Slots& slots, int64_t seq, Op op, std::optional<bool> skip = std::nullopt);
  bool mirror_alone(at::Tensor& output, at::Tensor& input, const at::Tensor& local, const std::vector<int64_t>& rows);
  void fold_into(at::Tensor& out, const at::Tensor& mine, Reduce op, int64_t seq);
  void reduce_scatter_one(at::Tensor& out, std::vector<at::Tensor> inputs, Reduce op, int64_t seq, int64_t salt);
  void alltoall_real(Slots& outs, Slots& ins);
  c10::intrusive_ptr<c10d::Work> allreduce_one(at::Tensor& t, Reduce op);
  at::Tensor host_copy(const at::Tensor& t);
  c10::intrusive_ptr<c10d::Backend> p2p_backend(const at::Tensor& like) const;

  std::vector<char> real_set_;
  std::atomic<int64_t> seq_{0};
  std::mutex inner_mu_, stash_mu_;
  std::map<std::string, c10::intrusive_ptr<c10d::Backend>> inners_;
  py::object make_inner_;
  // the p2p mirror: (shape, dtype) -> the first tensor sent to each peer, in the order first sent
  std::map<std::pair<std::vector<int64_t>, int>, std::vector<std::pair<int, at::Tensor>>> stash_;
};

}  // namespace prism
