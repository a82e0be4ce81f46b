// Launchers of the fold's kernels (fold.cu), on raw device pointers; fold_cuda.cpp decides when they apply.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace prism {

enum class FoldType : int8_t { kFloat, kDouble, kHalf, kBFloat16, kInt8, kUInt8, kInt16, kInt32, kInt64 };

struct ScaleItem {
  void* out;
  const void* src;
  int64_t numel;
};

// Up to kScaleBatch buffers of one dtype in one launch (kernel parameters, no device table).
constexpr int kScaleBatch = 64;
struct ScaleBatch {
  ScaleItem items[kScaleBatch];
  int count = 0;
};

// out = src * n for every item, in the dtype's op-math type; `packed`: every pointer is 16-byte aligned.
bool launch_scale(const ScaleBatch& batch, FoldType type, int64_t n, bool packed, int sms, cudaStream_t stream);

// dst (rows x row_bytes) = row repeated, copied in words of `word_bytes` (16, 8, 4, 2 or 1; the
// caller checks that row_bytes and both addresses are multiples of it).
void launch_rows(void* dst, const void* row, int64_t row_bytes, int64_t rows, int word_bytes, int sms,
                 cudaStream_t stream);

}  // namespace prism
