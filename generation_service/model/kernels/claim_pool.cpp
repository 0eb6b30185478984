// The CPU kernels' parallel loops: pieces claimed by whichever thread is free, on helper threads of our own.
//
// Why not at::parallel_for: it gives each of torch's OpenMP threads one fixed range and returns when every thread
// has run its range. On a 2-core host the gRPC threads, the clients and the retrieval service take a core from one of
// the pass's two threads for a scheduler slice now and then; a pass is some 150 loops, and each loop then waited for
// the descheduled thread to come back and run its half (served passes ran well above their calibrated cost).
// Here a loop is cut into a few pieces per thread, every thread (the caller included) claims the pieces of its own
// share and then what is left of the others' (Slot below), and the loop ends when every piece is done: a thread that is away misses pieces instead
// of holding the loop, and the caller never waits for a helper to wake up. Between passes a helper sleeps after a
// short spin instead of OpenMP's long one, so the Python and gRPC work around a pass gets the core.
//
// Which thread runs a piece does not change its result: callers' pieces write disjoint outputs and each output is
// computed in one piece, so the bits are those of a serial loop.

#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <climits>
#include <cstdint>
#include <mutex>
#include <thread>

#include <linux/futex.h>
#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

inline void cpu_relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// A thread's share of a loop: slot word = epoch (24 bits) | next unclaimed piece (20) | end of the share (20). Its
// owner claims from the front (next + 1), a thread that has finished its own share steals from the back (end - 1);
// both are a compare-and-swap on the one word, so a claim succeeds only within the loop it read, however late the
// claiming thread runs. Why per-thread shares and not one counter: a claim on a line the other core also writes
// costs a cache-line transfer; a 1-row pass is many short loops, and one shared counter made it measurably slower
// even on an idle machine. An owner's claims stay in its own cache; lines move only when a thread steals.
constexpr int kIdxBits = 20;
constexpr uint64_t kIdxMask = (1ull << kIdxBits) - 1;
constexpr uint64_t kEpochMask = (1ull << (64 - 2 * kIdxBits)) - 1;
constexpr int kMaxThreads = 64;

uint64_t pack(uint64_t epoch, uint64_t next, uint64_t end) {
  return (epoch << (2 * kIdxBits)) | (next << kIdxBits) | end;
}
uint64_t next_of(uint64_t w) { return (w >> kIdxBits) & kIdxMask; }
uint64_t end_of(uint64_t w) { return w & kIdxMask; }

// A helper spins this long for the next loop before sleeping. Why this long: a pass's loops are microseconds apart
// (the norms and RoPE run on the caller between them), passes are milliseconds apart (Python, sampling, gRPC).
constexpr auto kSpin = std::chrono::microseconds(100);

long futex(std::atomic<uint32_t>* word, int op, uint32_t value) {
  return syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, nullptr, nullptr, 0);
}

struct alignas(64) Slot {
  std::atomic<uint64_t> share{0};
  std::atomic<int64_t> done{0};  // pieces this thread finished in the current loop
};

class ClaimPool {
 public:
  void run(int64_t n, const std::function<void(int64_t)>& piece) {
    const int threads = std::min(at::get_num_threads(), kMaxThreads);
    if (n <= 1 || threads <= 1 || in_loop_ || !mu_.try_lock()) {  // nested, or another caller's loop running
      for (int64_t i = 0; i < n; ++i) piece(i);
      return;
    }
    start_helpers(threads - 1);
    piece_ = &piece;
    epoch_ = (epoch_ + 1) & kEpochMask;
    active_.store(threads, std::memory_order_relaxed);
    const int slots = std::max(threads, started_ + 1);  // every thread's: one that finds a loop late must find none
    // Every count reset before any share is published. Why: a helper still scanning the loop before (it finished its
    // pieces, then looks for others' to steal) may claim a piece of this loop as soon as one share is out, and counts
    // it in its own slot; were its slot reset after that (the caller descheduled between the two stores), the piece
    // would never be counted and the caller would wait for it forever, spinning in the wait below with one core busy
    // (as a served worker did when each slot's count was reset just before publishing that slot's share).
    for (int t = 0; t < slots; ++t) slots_[t].done.store(0, std::memory_order_relaxed);
    for (int t = 0; t < slots; ++t) {  // contiguous shares, as at::parallel_for's
      const int64_t lo = t < threads ? n * t / threads : 0, hi = t < threads ? n * (t + 1) / threads : 0;
      slots_[t].share.store(pack(epoch_, lo, hi), std::memory_order_release);
    }
    // seq_cst here and in help(): a helper going to sleep and this loop's start must not both miss the other.
    seq_.fetch_add(1, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) futex(&seq_, FUTEX_WAKE_PRIVATE, INT_MAX);
    in_loop_ = true;
    work(0);
    in_loop_ = false;
    for (;;) {  // pieces a helper is still running
      int64_t done = 0;
      for (int t = 0; t < slots; ++t) done += slots_[t].done.load(std::memory_order_acquire);
      if (done >= n) break;
      cpu_relax();
    }
    mu_.unlock();
  }

  // A forked child has none of the parent's helpers: it starts its own on its first loop.
  void after_fork_in_child() {
    new (&mu_) std::mutex();
    started_ = 0;
    sleepers_.store(0);
  }

 private:
  // Thread `self`'s share, then every other thread's from the back.
  void work(int self) {
    Slot& own = slots_[self];
    uint64_t w = own.share.load(std::memory_order_acquire);
    while (next_of(w) < end_of(w)) {
      if (!own.share.compare_exchange_weak(w, w + (1ull << kIdxBits), std::memory_order_acq_rel,
                                           std::memory_order_acquire))
        continue;
      run_piece(own, (int64_t)next_of(w));
      w = own.share.load(std::memory_order_acquire);
    }
    const int threads = active_.load(std::memory_order_relaxed);
    for (int k = 1; k < threads; ++k) {
      Slot& other = slots_[(self + k) % threads];
      uint64_t v = other.share.load(std::memory_order_acquire);
      while (next_of(v) < end_of(v)) {
        if (!other.share.compare_exchange_weak(v, v - 1, std::memory_order_acq_rel, std::memory_order_acquire))
          continue;
        run_piece(own, (int64_t)end_of(v) - 1);
        v = other.share.load(std::memory_order_acquire);
      }
    }
  }

  void run_piece(Slot& own, int64_t i) {
    (*piece_)(i);  // the loop cannot end before this piece is done: piece_ is the claimed loop's
    own.done.fetch_add(1, std::memory_order_release);
  }

  void start_helpers(int wanted) {
    for (; started_ < wanted; ++started_) {
      const int self = started_ + 1;
      std::thread([this, self] { help(self); }).detach();
    }
  }

  void help(int self) {
    in_loop_ = true;  // a piece's own loops run serially on its thread
    uint32_t seen = seq_.load(std::memory_order_acquire);
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + kSpin;
      while (seq_.load(std::memory_order_acquire) == seen) {
        for (int k = 0; k < 64 && seq_.load(std::memory_order_relaxed) == seen; ++k) cpu_relax();
        if (std::chrono::steady_clock::now() < until) continue;
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        if (seq_.load(std::memory_order_seq_cst) == seen) futex(&seq_, FUTEX_WAIT_PRIVATE, seen);
        sleepers_.fetch_sub(1, std::memory_order_acq_rel);
      }
      seen = seq_.load(std::memory_order_acquire);
      work(self);
    }
  }

  std::mutex mu_;
  Slot slots_[kMaxThreads];
  std::atomic<uint32_t> seq_{0};  // bumped when a loop starts; the word sleeping helpers wait on
  std::atomic<int> sleepers_{0};
  // Written by the caller before the shares' release, read by helpers after a claim (acquire).
  const std::function<void(int64_t)>* piece_ = nullptr;
  std::atomic<int> active_{0};  // threads the current loop was cut for
  uint64_t epoch_ = 0;
  int started_ = 0;
  static thread_local bool in_loop_;
};

thread_local bool ClaimPool::in_loop_ = false;

ClaimPool& pool() {
  // Never destroyed: detached helpers may still be asleep in it at exit.
  static ClaimPool* p = [] {
    auto* made = new ClaimPool();
    pthread_atfork(nullptr, nullptr, [] { pool().after_fork_in_child(); });
    return made;
  }();
  return *p;
}

}  // namespace

namespace {
std::atomic<bool> claimed_loops{true};
}

void set_claimed_loops(bool on) { claimed_loops.store(on); }

void claimed_for(int64_t n, const std::function<void(int64_t)>& piece) {
  TORCH_CHECK(n >= 0 && (uint64_t)n <= kIdxMask, "claimed_for: ", n, " pieces (at most ", kIdxMask, ")");
  if (claimed_loops.load(std::memory_order_relaxed)) {
    pool().run(n, piece);
    return;
  }
  at::parallel_for(0, n, 1, [&](int64_t a, int64_t b) {  // torch's fixed ranges, for comparisons
    for (int64_t i = a; i < b; ++i) piece(i);
  });
}
