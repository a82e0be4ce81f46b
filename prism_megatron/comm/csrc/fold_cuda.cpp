#include "fold_cuda.h"

#include <c10/core/DispatchKey.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include "fold_kernels.h"

namespace prism {

namespace {

bool fold_type(at::ScalarType t, FoldType* out) {
  switch (t) {
    case at::kFloat: *out = FoldType::kFloat; return true;
    case at::kDouble: *out = FoldType::kDouble; return true;
    case at::kHalf: *out = FoldType::kHalf; return true;
    case at::kBFloat16: *out = FoldType::kBFloat16; return true;
    case at::kChar: *out = FoldType::kInt8; return true;
    case at::kByte: *out = FoldType::kUInt8; return true;
    case at::kShort: *out = FoldType::kInt16; return true;
    case at::kInt: *out = FoldType::kInt32; return true;
    case at::kLong: *out = FoldType::kInt64; return true;
    default: return false;
  }
}

// a plain dense CUDA tensor on the current device (the launch goes to its current stream)
bool plain(const at::Tensor& t, c10::DeviceIndex device) {
  return t.is_cuda() && t.get_device() == device && t.is_contiguous() &&
         !t.key_set().has(c10::DispatchKey::Python) && t.has_storage();
}

int sms(c10::DeviceIndex device) {
  static int counts[64] = {0};
  int& c = counts[device & 63];
  if (!c) C10_CUDA_CHECK(cudaDeviceGetAttribute(&c, cudaDevAttrMultiProcessorCount, device));
  return c;
}

bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

}  // namespace

bool cuda_scale(at::Tensor& out, const at::Tensor& src, int64_t n) {
  FoldType type;
  c10::DeviceIndex device = c10::cuda::current_device();
  if (!fold_type(out.scalar_type(), &type) || src.scalar_type() != out.scalar_type() ||
      src.numel() != out.numel() || !plain(out, device) || !plain(src, device)) {
    return false;
  }
  if (out.numel() == 0) return true;
  ScaleBatch batch;
  batch.items[0] = ScaleItem{out.data_ptr(), src.const_data_ptr(), out.numel()};
  batch.count = 1;
  bool packed = aligned(batch.items[0].out) && aligned(batch.items[0].src);
  launch_scale(batch, type, n, packed, sms(device), c10::cuda::getCurrentCUDAStream(device).stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

bool cuda_scale_all(std::vector<at::Tensor>& tensors, int64_t n) {
  if (tensors.empty()) return true;
  FoldType type;
  c10::DeviceIndex device = c10::cuda::current_device();
  if (!fold_type(tensors[0].scalar_type(), &type)) return false;
  for (const auto& t : tensors) {
    if (t.scalar_type() != tensors[0].scalar_type() || !plain(t, device)) return false;
  }
  cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device).stream();
  for (size_t first = 0; first < tensors.size(); first += kScaleBatch) {
    ScaleBatch batch;
    bool packed = true;
    for (size_t i = first; i < tensors.size() && batch.count < kScaleBatch; ++i) {
      if (!tensors[i].numel()) continue;
      void* p = tensors[i].data_ptr();
      batch.items[batch.count++] = ScaleItem{p, p, tensors[i].numel()};
      packed = packed && aligned(p);
    }
    if (batch.count) launch_scale(batch, type, n, packed, sms(device), stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

bool cuda_broadcast_rows(at::Tensor& dst, const at::Tensor& row) {
  c10::DeviceIndex device = c10::cuda::current_device();
  if (dst.dim() != 2 || dst.scalar_type() != row.scalar_type() || !plain(dst, device) || !plain(row, device) ||
      row.numel() != dst.size(1)) {
    return false;
  }
  int64_t row_bytes = int64_t(row.nbytes());
  if (dst.numel() == 0) return true;
  auto d = reinterpret_cast<uintptr_t>(dst.data_ptr()), r = reinterpret_cast<uintptr_t>(row.const_data_ptr());
  int word = 16;
  while (word > 1 && (row_bytes % word || d % word || r % word)) word /= 2;
  launch_rows(dst.data_ptr(), row.const_data_ptr(), row_bytes, dst.size(0), word, sms(device),
              c10::cuda::getCurrentCUDAStream(device).stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return true;
}

}  // namespace prism
