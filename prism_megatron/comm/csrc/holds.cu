// The hold and stamp kernels (holds_cuda.h), one thread each, on the device's global timer.
#include <cstdint>
#include <cuda_runtime.h>

namespace prism {

namespace {

constexpr int64_t kNever = -(int64_t(1) << 62);

__device__ __forceinline__ int64_t now_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return int64_t(t);
}

// ends: planned ends on the job's timeline (the timer less the debt); acc..: the account, the debt,
// the debt the current group of operations (issued together: ordinals lo..out) found, then each
// operation's begin on the stream (a stamp, or NEVER)
__global__ void hold_kernel(volatile int64_t* ends, const int64_t* rows, int64_t row, int64_t out, int64_t lo,
                            int64_t hi, int64_t acc, int64_t terms, bool plan, bool spin) {
  int64_t entry = now_ns();
  int64_t debt = ends[acc + 5];
  if (plan) {  // rows[row] = (self ns, transfer ns or NEVER, then (anchor slot, ghost ns) per term)
    if (out == lo) ends[acc + 6] = debt;  // the group's first: what it plans against
    int64_t found = ends[acc + 6];
    const int64_t* base = rows + (2 + 2 * terms) * row;
    int64_t transfer = base[1];
    int64_t begin = ends[acc + 7 + out];
    bool stamped = begin != kNever && transfer != kNever;
    int64_t end = stamped ? begin - found + transfer : entry - found + base[0];
    for (int64_t t = 0; t < terms; ++t) {
      int64_t at = ends[base[2 + 2 * t]] + base[3 + 2 * t];
      end = at > end ? at : end;
    }
    ends[out] = end;
    int64_t latest = ends[lo];  // the group so far: its issue past the latest end is the emulator's
    for (int64_t k = lo + 1; k <= out; ++k) latest = ends[k] > latest ? ends[k] : latest;
    int64_t over = entry - found - latest;
    int64_t again = found + (over > 0 ? over : 0);
    ends[acc + 3] = ends[acc + 3] + (again - debt);
    debt = again;
  }
  if (spin) {
    int64_t goal = ends[lo];
    for (int64_t k = lo + 1; k <= hi; ++k) goal = ends[k] > goal ? ends[k] : goal;
    int64_t slack = goal - (entry - debt);
    if (slack > 0 && debt > 0) {  // pay back what this hold can of the debt
      int64_t paid = debt < slack ? debt : slack;
      debt -= paid;
      ends[acc + 4] = ends[acc + 4] + paid;
    }
    ends[acc + 5] = debt;  // before the spin: a hold on another stream reads it meanwhile
    goal += debt;
    int64_t now = entry;
    while (now < goal) now = now_ns();
    if (goal > entry) {
      ends[acc] = ends[acc] + 1;
      ends[acc + 1] = ends[acc + 1] + (goal - entry);
      ends[acc + 2] = ends[acc + 2] + (now - entry);
    }
  } else {
    ends[acc + 5] = debt;
  }
}

__global__ void stamp_kernel(int64_t* ends, int64_t slot) { ends[slot] = now_ns(); }

}  // namespace

void launch_hold(cudaStream_t stream, int64_t* ends, const int64_t* rows, int64_t row, int64_t out,
                 int64_t lo, int64_t hi, int64_t acc, int64_t terms, bool plan, bool spin) {
  hold_kernel<<<1, 1, 0, stream>>>(ends, rows, row, out, lo, hi, acc, terms, plan, spin);
}

void launch_stamp(cudaStream_t stream, int64_t* ends, int64_t slot) {
  stamp_kernel<<<1, 1, 0, stream>>>(ends, slot);
}

}  // namespace prism
