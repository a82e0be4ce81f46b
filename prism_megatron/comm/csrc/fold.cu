// The ghost fold's own kernels (fold_cuda.h): a scaling and a row broadcast, each one plain launch.
//
// ATen's elementwise ops build a TensorIterator on every call, which on the host costs several
// times a kernel launch; a sandbox folds its ghosts into hundreds of collectives per iteration, on
// the path a real rank spends in NCCL's launch. These kernels take contiguous buffers only (the
// caller falls back to ATen otherwise) and compute what ATen's mul computes: each element in the
// op-math type (float for half and bfloat16), times n converted to that type, rounded back.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "fold_kernels.h"

namespace prism {

namespace {

template <typename T> struct OpMath { using type = T; };
template <> struct OpMath<c10::Half> { using type = float; };
template <> struct OpMath<c10::BFloat16> { using type = float; };

template <typename T, int V> struct alignas(sizeof(T) * V) Pack { T v[V]; };

template <typename T, int V>
__global__ void scale_kernel(ScaleBatch batch, typename OpMath<T>::type factor) {
  using M = typename OpMath<T>::type;
  const ScaleItem item = batch.items[blockIdx.y];
  T* out = static_cast<T*>(item.out);
  const T* src = static_cast<const T*>(item.src);
  int64_t stride = int64_t(blockDim.x) * gridDim.x;
  int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t packs = item.numel / V;
  for (int64_t i = first; i < packs; i += stride) {
    Pack<T, V> p = reinterpret_cast<const Pack<T, V>*>(src)[i];
#pragma unroll
    for (int j = 0; j < V; ++j) p.v[j] = T(M(p.v[j]) * factor);
    reinterpret_cast<Pack<T, V>*>(out)[i] = p;
  }
  for (int64_t i = packs * V + first; i < item.numel; i += stride) out[i] = T(M(src[i]) * factor);
}

template <typename W>
__global__ void rows_kernel(W* dst, const W* row, int64_t row_words, int64_t words) {
  int64_t stride = int64_t(blockDim.x) * gridDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < words; i += stride) {
    dst[i] = row[i % row_words];
  }
}

int blocks_for(int64_t work, int threads, int sms) {
  int64_t wanted = (work + threads - 1) / threads;
  int64_t cap = int64_t(sms) * 8;
  return int(wanted < 1 ? 1 : (wanted > cap ? cap : wanted));
}

template <typename T>
void launch_scale_typed(const ScaleBatch& batch, int64_t n, bool packed, int sms, cudaStream_t stream) {
  using M = typename OpMath<T>::type;
  constexpr int V = 16 / sizeof(T) > 0 ? 16 / sizeof(T) : 1;
  constexpr int threads = 256;
  int64_t most = 0;
  for (int i = 0; i < batch.count; ++i) most = batch.items[i].numel > most ? batch.items[i].numel : most;
  dim3 grid(blocks_for(packed ? most / V + 1 : most, threads, sms), batch.count);
  M factor = static_cast<M>(n);
  if (packed) scale_kernel<T, V><<<grid, threads, 0, stream>>>(batch, factor);
  else scale_kernel<T, 1><<<grid, threads, 0, stream>>>(batch, factor);
}

}  // namespace

bool launch_scale(const ScaleBatch& batch, FoldType type, int64_t n, bool packed, int sms, cudaStream_t stream) {
  switch (type) {
    case FoldType::kFloat: launch_scale_typed<float>(batch, n, packed, sms, stream); return true;
    case FoldType::kDouble: launch_scale_typed<double>(batch, n, packed, sms, stream); return true;
    case FoldType::kHalf: launch_scale_typed<c10::Half>(batch, n, packed, sms, stream); return true;
    case FoldType::kBFloat16: launch_scale_typed<c10::BFloat16>(batch, n, packed, sms, stream); return true;
    case FoldType::kInt8: launch_scale_typed<int8_t>(batch, n, packed, sms, stream); return true;
    case FoldType::kUInt8: launch_scale_typed<uint8_t>(batch, n, packed, sms, stream); return true;
    case FoldType::kInt16: launch_scale_typed<int16_t>(batch, n, packed, sms, stream); return true;
    case FoldType::kInt32: launch_scale_typed<int32_t>(batch, n, packed, sms, stream); return true;
    case FoldType::kInt64: launch_scale_typed<int64_t>(batch, n, packed, sms, stream); return true;
  }
  return false;
}

void launch_rows(void* dst, const void* row, int64_t row_bytes, int64_t rows, int word_bytes, int sms,
                 cudaStream_t stream) {
  constexpr int threads = 256;
  int64_t row_words = row_bytes / word_bytes, words = row_words * rows;
  int grid = blocks_for(words, threads, sms);
  switch (word_bytes) {
    case 16:
      rows_kernel<<<grid, threads, 0, stream>>>(static_cast<uint4*>(dst), static_cast<const uint4*>(row), row_words, words);
      break;
    case 8:
      rows_kernel<<<grid, threads, 0, stream>>>(static_cast<uint2*>(dst), static_cast<const uint2*>(row), row_words, words);
      break;
    case 4:
      rows_kernel<<<grid, threads, 0, stream>>>(static_cast<uint32_t*>(dst), static_cast<const uint32_t*>(row), row_words, words);
      break;
    case 2:
      rows_kernel<<<grid, threads, 0, stream>>>(static_cast<uint16_t*>(dst), static_cast<const uint16_t*>(row), row_words, words);
      break;
    default:
      rows_kernel<<<grid, threads, 0, stream>>>(static_cast<uint8_t*>(dst), static_cast<const uint8_t*>(row), row_words, words);
  }
}

}  // namespace prism
