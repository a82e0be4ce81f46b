#include "policy.h"

#include <ATen/ATen.h>
#include <c10/core/DispatchKey.h>

#ifdef PRISM_CUDA
#include "fold_cuda.h"
#else
namespace prism {  // the CPU build: ATen's kernels everywhere
inline bool cuda_scale(at::Tensor&, const at::Tensor&, int64_t) { return false; }
inline bool cuda_scale_all(std::vector<at::Tensor>&, int64_t) { return false; }
inline bool cuda_broadcast_rows(at::Tensor&, const at::Tensor&) { return false; }
}  // namespace prism
#endif

namespace prism {

bool is_python(const at::Tensor& t) {
  return t.key_set().has(c10::DispatchKey::Python);
}

bool same_memory(const at::Tensor& a, const at::Tensor& b) {
  if (is_python(a) || is_python(b) || !a.has_storage() || !b.has_storage()) {
    // a fake tensor has no data pointer: its storage and offset tell instead
    if (!a.has_storage() || !b.has_storage()) return false;
    return a.storage().unsafeGetStorageImpl() == b.storage().unsafeGetStorageImpl() &&
           a.storage_offset() * int64_t(a.element_size()) == b.storage_offset() * int64_t(b.element_size());
  }
  return a.data_ptr() == b.data_ptr();
}

at::Generator make_generator(const at::Device& device, uint64_t seed) {
  // a fresh generator of the device's kind, seeded: the default one cloned (no CUDA headers needed)
  at::Generator gen = at::globalContext().defaultGenerator(device).clone();
  gen.set_current_seed(seed);
  return gen;
}

at::Generator GenFn::operator()() const {
  return make_generator(device, session ? session->seed_for(*group_id, seq, salt) : seed);
}

namespace {

bool floating(at::ScalarType t) { return at::isFloatingType(t) || at::isComplexType(t); }

// A Python number as Python passes it to an op: a wrapped 0-dim tensor, computed in the op's own
// precision (C++'s Scalar overloads round the number to the tensor's dtype first).
at::Tensor number(const at::Scalar& v) {
  at::Tensor t = at::scalar_tensor(v, at::TensorOptions().dtype(v.isFloatingPoint() ? at::kDouble : at::kLong));
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}

// n as a multiplier, bit for bit as Python's mul_(n): a 0-dim CPU tensor of the dtype where the dtype
// holds n exactly (CPU and CUDA kernels read it as a scalar argument, in the same compute type), else
// a wrapped number; made once per (n, dtype)
at::Tensor factor_of(int64_t n, at::ScalarType dtype) {
  static std::mutex mu;
  static std::map<std::pair<int64_t, int>, at::Tensor> factors;
  std::lock_guard<std::mutex> lock(mu);
  auto key = std::make_pair(n, int(dtype));
  auto it = factors.find(key);
  if (it == factors.end()) {
    at::Tensor exact = at::scalar_tensor(double(n), at::TensorOptions().dtype(dtype));
    if (exact.item<double>() != double(n)) {
      // not exact in this dtype: a wrapped number, as Python's out.mul_(n) passes it (C++'s Scalar
      // overload would round n to the dtype first)
      exact = at::scalar_tensor(n, at::TensorOptions().dtype(at::kLong));
      exact.unsafeGetTensorImpl()->set_wrapped_number(true);
    }
    it = factors.emplace(key, exact).first;
  }
  return it->second;
}

void times(at::Tensor& out, int64_t n) {
  if (is_python(out)) {
    out.mul_(n);
    return;
  }
  if (out.is_cuda() && cuda_scale(out, out, n)) return;
  out.mul_(factor_of(n, out.scalar_type()));
}

// out *= v and out /= v with v as Python passes it; a fake tensor takes the Scalar (it has no values,
// and a wrapped number handed to Python is read as a number, which a fake one cannot be)
void mul(at::Tensor& out, const at::Scalar& v) {
  if (is_python(out)) out.mul_(v);
  else out.mul_(number(v));
}

void div(at::Tensor& out, const at::Scalar& v, std::optional<c10::string_view> rounding = std::nullopt) {
  if (is_python(out)) out.div_(v, rounding);
  else out.div_(number(v), rounding);
}

void scale(at::Tensor& out, int64_t n, int64_t r) {  // out *= n / r
  if (r == 1) return times(out, n);
  if (floating(out.scalar_type())) mul(out, double(n) / double(r));
  else if (n % r == 0) mul(out, n / r);
  else {
    mul(out, n);
    div(out, r, "floor");
  }
}

void divide(at::Tensor& out, int64_t n) {
  if (floating(out.scalar_type())) div(out, n);
  else div(out, n, "floor");
}

// the max of `count` iid N(0, 1) per element, drawn exactly: Phi^-1(U^(1/count))
at::Tensor normal_extreme(const at::Tensor& like, int64_t count, at::Generator gen) {
  at::Tensor u = at::rand(like.sizes(), gen, like.options().dtype(at::kDouble));
  u.pow_(1.0 / double(count)).clamp_max_(1 - 1e-16);
  return at::special_ndtri(u).to(like.scalar_type());
}

void tile_rows(at::Tensor dst, const at::Tensor& source) {
  // at most two copies (the whole repeats as one broadcast copy, then the rest)
  int64_t rows = dst.size(0), have = source.size(0);
  if (have >= rows) {
    dst.copy_(source.narrow(0, 0, rows));
    return;
  }
  int64_t whole = rows / have;
  std::vector<int64_t> shape{whole, have};
  std::vector<int64_t> expanded{whole};
  for (int64_t d = 0; d < source.dim(); ++d) {
    if (d) shape.push_back(source.size(d));
    expanded.push_back(source.size(d));
  }
  dst.narrow(0, 0, whole * have).view(shape).copy_(source.unsqueeze(0).expand(expanded));
  if (rows > whole * have) {
    dst.narrow(0, whole * have, rows - whole * have).copy_(source.narrow(0, 0, rows - whole * have));
  }
}

void tile_into(at::Tensor dst, const at::Tensor& source) {
  if (dst.dim() == 0 || source.dim() == 0 || dst.sizes().slice(1) != source.sizes().slice(1)) {
    at::Tensor flat_dst = dst.reshape(-1), flat_src = source.reshape(-1);
    tile_rows(flat_dst, flat_src);
    if (!same_memory(flat_dst, dst) || !dst.is_contiguous()) dst.copy_(flat_dst.view(dst.sizes()));
    return;
  }
  tile_rows(dst, source);
}

}  // namespace

void times_into(at::Tensor& out, const at::Tensor& src, int64_t n) {
  if (is_python(out) || is_python(src)) {
    if (!same_memory(out, src)) out.copy_(src);
    out.mul_(n);
    return;
  }
  if (out.is_cuda() && cuda_scale(out, src, n)) return;
  at::mul_out(out, src, factor_of(n, out.scalar_type()));
}

void times_all(std::vector<at::Tensor>& tensors, int64_t n) {
  if (!tensors.empty() && tensors[0].is_cuda() && cuda_scale_all(tensors, n)) return;
  at::Tensor factor = factor_of(n, tensors[0].scalar_type());
  if (tensors.size() == 1 || factor.unsafeGetTensorImpl()->is_wrapped_number()) {
    for (auto& t : tensors) t.mul_(factor);
    return;
  }
  at::_foreach_mul_(tensors, factor);
}

void finish_reduction(const Session& s, at::Tensor& out, Reduce op, int64_t n, int64_t r, const GenFn& gen) {
  int64_t ghosts = n - r;
  if (op == kSum && ghosts && s.policy == Policy::kMirror) {  // nearly every reduction: first, alone
    scale(out, n, r);
    return;
  }
  Policy policy = s.effective(out.scalar_type());
  if (ghosts == 0) {
    if (op == kAvg) divide(out, n);
    return;
  }
  if (policy == Policy::kRandom && is_python(out)) return;  // fake execution: no values to draw
  if (op == kAvg && policy == Policy::kMirror) {  // (n / r) * sum / n: one division, or none
    if (r > 1) divide(out, r);
  } else if (op == kSum || op == kAvg) {
    if (policy == Policy::kMirror) {
      scale(out, n, r);
    } else if (policy == Policy::kRandom) {
      at::Tensor noise = at::randn(out.sizes(), gen(), out.options());
      out.add_(noise, std::sqrt(double(ghosts)));  // the sum of `ghosts` iid N(0, 1)
    }
    if (op == kAvg) divide(out, n);
  } else if (op == kMax || op == kMin) {
    if (policy == Policy::kZeros) {
      if (op == kMax) out.clamp_min_(0);
      else out.clamp_max_(0);
    } else if (policy == Policy::kRandom) {
      at::Tensor extreme = normal_extreme(out, ghosts, gen());
      if (op == kMax) at::maximum_out(out, out, extreme);
      else at::minimum_out(out, out, extreme.neg_());
    }
  } else if (op == kProduct) {
    if (policy == Policy::kZeros) {
      out.zero_();
    } else if (policy == Policy::kRandom) {
      at::Generator g = gen();
      for (int64_t i = 0; i < ghosts; ++i) out.mul_(at::randn(out.sizes(), g, out.options()));
    } else {
      double exponent = double(n) / double(r);
      if (n % r == 0) out.copy_(out.pow(n / r));
      else out.copy_(out.abs().pow(exponent));
    }
  } else {
    TORCH_CHECK_VALUE(false, "reduce op ", int(op), " is not supported by the prism backend; expected "
                      "SUM, AVG, MAX, MIN or PRODUCT");
  }
}

void fill(const Session& s, at::Tensor dst, const at::Tensor* source, const GenFn& gen) {
  Policy policy = s.effective(dst.scalar_type());
  if (dst.numel() == 0) return;
  if (policy == Policy::kZeros ||
      (policy == Policy::kMirror && (source == nullptr || source->numel() == 0))) {
    dst.zero_();
  } else if (policy == Policy::kRandom) {
    if (!is_python(dst)) dst.normal_(0, 1, gen());
  } else if (source->sizes() == dst.sizes()) {
    if (!same_memory(*source, dst)) dst.copy_(*source);
  } else {
    tile_into(dst, *source);
  }
}

void copy_broadcast(at::Tensor dst, const at::Tensor& row, int widen) {
  // On a GPU the copy kernel reads a broadcast source one element per thread: both sides are viewed
  // as the widest type their bytes and addresses allow (from kWidenMinBytes up, where it pays).
  int64_t k = dst.size(0);
  if (widen < 0 && dst.is_cuda() && row.numel() == dst.numel() / std::max<int64_t>(k, 1) && dst.dim() == 2) {
    at::Tensor flat_row = row.is_contiguous() ? row.view(-1) : row;
    if (cuda_broadcast_rows(dst, flat_row)) return;
  }
  bool wide_copy = widen < 0 ? (dst.is_cuda() && int64_t(dst.nbytes()) >= kWidenMinBytes) : widen > 0;
  if (wide_copy && !is_python(dst) && !is_python(row) && dst.scalar_type() == row.scalar_type() &&
      row.dim() && dst.is_contiguous() && row.is_contiguous()) {
    int64_t size = row.element_size();
    int64_t row_bytes = dst.size(-1) * size;
    static const at::ScalarType kWide[] = {at::kComplexDouble, at::kLong, at::kInt, at::kShort};
    for (at::ScalarType wide : kWide) {
      int64_t width = c10::elementSize(wide);
      if (width <= size) break;
      if (!(row_bytes % width || reinterpret_cast<uintptr_t>(dst.data_ptr()) % width ||
            reinterpret_cast<uintptr_t>(row.data_ptr()) % width)) {
        dst.view(wide).copy_(row.view(-1).view(wide).expand({k, -1}));
        return;
      }
    }
  }
  dst.copy_(row.reshape({1, -1}).expand({k, -1}));
}

bool mirror_own_piece(at::Tensor output, const at::Tensor& local, const std::vector<int64_t>& rows) {
  int64_t total = 0;
  for (int64_t r : rows) total += r;
  if (!output.is_contiguous() || !output.dim() || total != output.size(0)) return false;
  int64_t have = local.size(0), n = int64_t(rows.size());
  if (!output.numel()) return true;
  bool equal = std::all_of(rows.begin(), rows.end(), [&](int64_t r) { return r == have; });
  if (equal) {
    copy_broadcast(output.view({n, -1}), local);
    return true;
  }
  if (!have) {
    output.zero_();
    return true;
  }
  if (output.device().type() != c10::DeviceType::CPU || is_python(output)) return false;
  // one gather on CPU: each output row takes row (i - its slot's start) mod have of local
  at::Tensor index = at::empty({total}, at::TensorOptions().dtype(at::kLong));
  int64_t* idx = index.data_ptr<int64_t>();
  int64_t i = 0;
  for (int64_t r : rows)
    for (int64_t j = 0; j < r; ++j) idx[i++] = j % have;
  at::index_select_out(output, local, 0, index);
  return true;
}

void copy_from_host(at::Tensor dst, const at::Tensor& src) {
  if (dst.is_cuda()) dst.copy_(src.pin_memory(), /*non_blocking=*/true);
  else dst.copy_(src);
}

}  // namespace prism
