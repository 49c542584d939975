#pragma once
// A bounded multi-producer / single-consumer queue of trivially copyable events (Vyukov's bounded
// queue). Producers never block and never allocate: try_push() fails when the queue is full, and the
// caller counts the drop. Each cell carries a sequence number that says whether it is free for position
// p (seq == p), published for p (seq == p + 1), or not yet recycled.
//
// Protocol: producers claim a position with a CAS on enqueue_pos_, write the payload, then publish it by
// storing seq = pos + 1 (release). The single consumer reads a cell once its seq == pos + 1 (acquire),
// copies the payload and frees it for the next lap (seq = pos + capacity).

#include <atomic>
#include <cstdint>
#include <memory>
#include <type_traits>

namespace ettkit::ett::detail {

template <typename T>
class BoundedMpscQueue {
  static_assert(std::is_trivially_copyable_v<T>, "events must be trivially copyable");

 public:
  /// `capacity` is rounded up to a power of two.
  explicit BoundedMpscQueue(uint32_t capacity) {
    uint64_t n = 1;
    while (n < capacity) n <<= 1;
    mask_ = n - 1;
    cells_ = std::make_unique<Cell[]>(n);
    for (uint64_t i = 0; i < n; ++i) cells_[i].seq.store(i, std::memory_order_relaxed);
  }

  bool try_push(const T& value) noexcept {
    uint64_t pos = enqueue_pos_.load(std::memory_order_relaxed);
    Cell* cell;
    for (;;) {
      cell = &cells_[pos & mask_];
      uint64_t seq = cell->seq.load(std::memory_order_acquire);
      auto diff = static_cast<int64_t>(seq) - static_cast<int64_t>(pos);
      if (diff == 0) {
        if (enqueue_pos_.compare_exchange_weak(pos, pos + 1, std::memory_order_relaxed)) break;
      } else if (diff < 0) {
        return false;  // full: the cell still holds an event from the previous lap
      } else {
        pos = enqueue_pos_.load(std::memory_order_relaxed);
      }
    }
    cell->value = value;
    cell->seq.store(pos + 1, std::memory_order_release);
    return true;
  }

  /// Single consumer only.
  bool try_pop(T& out) noexcept {
    uint64_t pos = dequeue_pos_.load(std::memory_order_relaxed);
    Cell& cell = cells_[pos & mask_];
    uint64_t seq = cell.seq.load(std::memory_order_acquire);
    if (static_cast<int64_t>(seq) - static_cast<int64_t>(pos + 1) < 0) return false;  // empty / unpublished
    out = cell.value;
    cell.seq.store(pos + mask_ + 1, std::memory_order_release);
    dequeue_pos_.store(pos + 1, std::memory_order_release);
    return true;
  }

  /// Positions claimed by producers so far (a flush target).
  uint64_t enqueued() const noexcept { return enqueue_pos_.load(std::memory_order_acquire); }
  /// Positions consumed so far.
  uint64_t dequeued() const noexcept { return dequeue_pos_.load(std::memory_order_acquire); }
  uint64_t capacity() const noexcept { return mask_ + 1; }

 private:
  struct Cell {
    std::atomic<uint64_t> seq{0};
    T value{};
  };
  std::unique_ptr<Cell[]> cells_;
  uint64_t mask_ = 0;
  // Separate cache lines: producers hammer enqueue_pos_, the consumer dequeue_pos_.
  alignas(64) std::atomic<uint64_t> enqueue_pos_{0};
  alignas(64) std::atomic<uint64_t> dequeue_pos_{0};
};

}  // namespace ettkit::ett::detail
