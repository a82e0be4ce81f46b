// The ghost fold on a GPU without ATen's per-call setup (fold.cu): each returns false where it does
// not apply (a tensor not contiguous, of another device, dtype or a subclass), and the caller takes
// ATen's path, which computes the same values.
#pragma once

#include <ATen/ATen.h>

#include <vector>

namespace prism {

bool cuda_scale(at::Tensor& out, const at::Tensor& src, int64_t n);   // out = src * n
bool cuda_scale_all(std::vector<at::Tensor>& tensors, int64_t n);     // each *= n, one launch
bool cuda_broadcast_rows(at::Tensor& dst, const at::Tensor& row);     // every row of [k, m] dst = row

}  // namespace prism
