#pragma once
// What the stager copies and where: the checks a tensor passes before its bytes are read, the snapshot plan
// (name, dtype, shape, device -> arena offset) and the order of the copies. Values only; no arena, no thread.
#include <cstdint>
#include <memory>
#include <vector>

#include "ettkit/checkpoint/checkpointer.h"

namespace ettkit::checkpoint::detail {

/// The copy class of entries not named in a CopyPriority: after every named class.
constexpr int kRestClass = 2;

/// InvalidArgument naming the entry unless every tensor is a defined, plain dense CPU or CUDA tensor whose
/// own storage holds every element it shows (see is_plain_dense in stage_plan.cpp).
void check_stageable(const NamedTensors& tensors);

/// The key CopyPriority and wait_for() match tensors by: their storage. A parameter and the detached
/// tensor a state dict holds share it; so do the per-table views of a fused embedding storage. A Python
/// subclass wrapper has no storage of its own to match (its local tensors do): nullptr.
const void* storage_key(const at::Tensor& t);

/// Whether the cached `plan` still describes `tensors` (same names, dtypes, shapes and devices, in order).
bool same_structure(const std::vector<PlanEntry>& plan, const NamedTensors& tensors);

/// check_stageable() and same_structure() in one pass over the tensors (each tensor is read once per save on
/// the caller's thread, issue #65): throws as check_stageable(); returns whether `plan` (nullptr: none) still
/// describes `tensors`. `names_known`: the caller vouches that the names are the plan's (a names token that
/// matched, SaveBinding), and they are not compared; dtypes, shapes and devices always are. `views`: set to
/// whether a tensor is a conjugate or negative-bit view (in the same pass).
bool check_and_match(const std::vector<PlanEntry>* plan, const NamedTensors& tensors, bool names_known,
                     bool* views = nullptr);

/// A fresh plan: the tensors back to back, in order.
struct Layout {
  std::shared_ptr<std::vector<PlanEntry>> entries;
  int64_t total_bytes = 0;
};
Layout lay_out(const NamedTensors& tensors);

/// The order of the copies: the classes of a CopyPriority first, then the rest; within a class, plan order.
struct CopyOrder {
  std::vector<size_t> order;  // entry indices, in copy order
  std::vector<uint8_t> cls;   // per entry; empty when no priority was given (every entry is class 0)
  bool identity = false;      // `order` is 0, 1, 2, ...
  int class_of(size_t i) const { return cls.empty() ? 0 : cls[i]; }
};
CopyOrder copy_order(const NamedTensors& tensors, const CopyPriority& priority);
/// The same into `out`, reusing its vectors (and, without a priority, its order when already the identity).
void copy_order(const NamedTensors& tensors, const CopyPriority& priority, CopyOrder& out);

}  // namespace ettkit::checkpoint::detail
