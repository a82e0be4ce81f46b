#include "prism.h"

#include <torch/csrc/utils/pybind.h>

namespace prism {

const char* const kOpNames[kOpCount] = {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce",
                                        "gather", "scatter", "all_to_all", "send", "recv", "barrier"};

Session::Session(int64_t world_size_, std::vector<int64_t> sandbox_ranks_, int64_t physical_rank_, Policy policy_,
                 uint64_t seed_)
    : world_size(world_size_), physical_rank(physical_rank_), sandbox_ranks(std::move(sandbox_ranks_)),
      policy(policy_), seed(seed_) {
  for (size_t p = 0; p < sandbox_ranks.size(); ++p) physical_.emplace(sandbox_ranks[p], int64_t(p));
}

Session::~Session() {
  py::object* held[] = {&on_event, &on_issue, &on_wait, &ghost_rows, &ghost_reduction};
  if (Py_IsInitialized()) {
    py::gil_scoped_acquire gil;
    for (py::object* o : held) *o = py::object();
  } else {
    for (py::object* o : held) o->release();
  }
}

int64_t Session::physical_of(int64_t virtual_rank) const {
  auto it = physical_.find(virtual_rank);
  return it == physical_.end() ? -1 : it->second;
}

Policy Session::effective(at::ScalarType dtype) const {
  // integer data (sizes, counts, object bytes) is always mirrored
  return at::isFloatingType(dtype) || at::isComplexType(dtype) ? policy : Policy::kMirror;
}

uint64_t Session::seed_for(const std::string& group_id, int64_t seq, int64_t salt) const {
  // FNV-1a over "seed/group/seq/salt": the same on every real member for this call
  std::string key = std::to_string(seed) + "/" + group_id + "/" + std::to_string(seq) + "/" + std::to_string(salt);
  uint64_t h = 1469598103934665603ULL;
  for (unsigned char c : key) {
    h ^= c;
    h *= 1099511628211ULL;
  }
  return h & ((uint64_t(1) << 63) - 1);
}

void Session::offer_row(at::Tensor row) {
  std::lock_guard<std::mutex> lock(row_mu_);
  offered_row_ = row.defined() ? row.detach().reshape({-1}) : at::Tensor();
  row_offered = offered_row_.defined();
}

at::Tensor Session::offered_row_for(const at::Tensor& slot) {
  if (!row_offered.load()) return at::Tensor();
  std::lock_guard<std::mutex> lock(row_mu_);
  const at::Tensor& row = offered_row_;
  if (!row.defined() || row.scalar_type() != slot.scalar_type() || row.numel() != slot.numel()) return at::Tensor();
  return row;
}

void Session::count(int32_t group, int8_t op, int64_t nbytes) {
  std::lock_guard<std::mutex> lock(mu_);
  if (group >= int32_t(counts_.size())) counts_.resize(group + 1, {});
  counts_[group][op] += 1;
  counts_[group][kOpCount + op] += nbytes;
}

std::vector<std::tuple<int32_t, int8_t, int64_t, int64_t>> Session::counts() {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::tuple<int32_t, int8_t, int64_t, int64_t>> out;
  for (size_t g = 0; g < counts_.size(); ++g)
    for (int8_t op = 0; op < kOpCount; ++op)
      if (counts_[g][op]) out.emplace_back(int32_t(g), op, counts_[g][op], counts_[g][kOpCount + op]);
  return out;
}

}  // namespace prism
