// Ghost data: what a ghost member contributes, by the session's policy (comm/ghost.py documents the
// semantics: mirror, zeros, random; integer data always mirrored). Every fill works in place on the
// caller's buffers, so a sandbox's memory is a real rank's.
#pragma once

#include "prism.h"

#include <functional>

namespace prism {

// This call's generator, made only if asked for (the random policy): identical on every real member
// for (group, call, salt); or from a given seed. No allocation until then (it is on every operation).
struct GenFn {
  const Session* session = nullptr;
  const std::string* group_id = nullptr;
  c10::Device device = c10::Device(c10::kCPU);
  int64_t seq = 0, salt = 0;
  uint64_t seed = 0;  // where session is null
  at::Generator operator()() const;
};

bool is_python(const at::Tensor& t);  // a tensor subclass (fake execution's FakeTensor)
bool same_memory(const at::Tensor& a, const at::Tensor& b);
at::Generator make_generator(const at::Device& device, uint64_t seed);

// `out` holds the reduction over the r real members: fold in the n - r ghosts in place. For AVG,
// `out` holds the real SUM and the average happens here.
void finish_reduction(const Session& s, at::Tensor& out, Reduce op, int64_t n, int64_t r, const GenFn& gen);

// out = src * n bit for bit as src.mul(n) (out may be src); every tensor of `tensors` *= n in one
// multi-tensor kernel (same dtype and device)
void times_into(at::Tensor& out, const at::Tensor& src, int64_t n);
void times_all(std::vector<at::Tensor>& tensors, int64_t n);

// A ghost's slot `dst`: a copy of `source` (mirror; tiled along dim 0 to dst's rows), zeros, or noise.
void fill(const Session& s, at::Tensor dst, const at::Tensor* source, const GenFn& gen);

// Every row of the contiguous [k, m] `dst` becomes `row`; widen: 1 force the widened copy, 0 the
// plain one, -1 by the device and size (WIDEN_MIN_BYTES in comm/native.py).
void copy_broadcast(at::Tensor dst, const at::Tensor& row, int widen = -1);
constexpr int64_t kWidenMinBytes = int64_t(32) << 20;

// An all-to-all's whole output with one real member under mirror: every slot is `local` with its
// rows repeated or cut to the slot's; false where that does not apply (the caller fills slot by slot).
bool mirror_own_piece(at::Tensor output, const at::Tensor& local, const std::vector<int64_t>& rows);

// dst.copy_(src) for a host tensor: pinned and asynchronous into a GPU tensor.
void copy_from_host(at::Tensor dst, const at::Tensor& src);

}  // namespace prism
