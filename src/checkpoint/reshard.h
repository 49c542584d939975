#pragma once
// Resharding reads (#20, elastic restore; the first piece): which byte ranges of which saved shards fill a
// shard of another layout. A saved tensor is a set of boxes of one global tensor (row-wise, column-wise,
// table-wise, or a DTensor's Shard(d) pieces), each stored row-major and contiguous in some rank's file; a
// shard the new job wants is another box. The plan is computed locally from the saved boxes (their offsets
// and sizes are in the files' headers and names), with no collective, and reads only the bytes the new box
// needs: each overlap is read in runs as long as both layouts are contiguous over it.
//
// Torch-free: boxes, element sizes and byte offsets only; the caller maps dtypes and files.
#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "checkpoint/storage.h"
#include "ettkit/checkpoint/shard_names.h"
#include "ettkit/checkpoint/step_pieces.h"

#pragma GCC visibility push(default)

namespace ettkit::checkpoint::detail {

using ettkit::checkpoint::StepPiece;
using ettkit::checkpoint::StepTensor;

/// An N-dimensional box of a global tensor: where it starts and how large it is, per dimension.
struct Box {
  std::vector<int64_t> offsets;
  std::vector<int64_t> sizes;
  int64_t numel() const;
};

/// One saved piece of the tensor: its box, and where its first byte is (row-major, contiguous) in the
/// file of `source` (an index the caller gives meaning to: an old rank).
struct SavedPiece {
  int source = 0;
  Box box;
  uint64_t byte_offset = 0;
};

/// Copy `length` bytes from `source`'s file at `src_offset` to byte `dst_offset` of the wanted box (row-major).
struct CopyRange {
  int source = 0;
  uint64_t src_offset = 0;
  uint64_t dst_offset = 0;
  uint64_t length = 0;
};

/// The reads that fill `want` (row-major, `element_size` bytes per element) from `saved`, in order of the
/// destination. Each element of `want` is read exactly once; where saved pieces overlap (a replicated
/// tensor saved by every rank), the first piece in `saved` order that holds an element provides it.
/// `name` names the tensor in errors. Throws InvalidArgument when ranks differ, a box has a negative
/// offset or size or lies outside `global_shape`, or some element of `want` is in no saved piece (naming
/// the first one missing).
std::vector<CopyRange> plan_reshard(const std::string& name, const std::vector<int64_t>& global_shape,
                                    const std::vector<SavedPiece>& saved, const Box& want, uint64_t element_size);

/// Bytes the plan reads in all (the sum of its lengths; equals want.numel() * element_size).
uint64_t planned_bytes(const std::vector<CopyRange>& plan);

/// The grammar of the names parsed here is ettkit/checkpoint/shard_names.h's.
using ettkit::checkpoint::split_shard_name;

/// The reads that fill the destination tensor `name` (shape `shape`, safetensors dtype `dtype`) from what a
/// step written at another world size or layout saved of its key, `saved` (step_tensors, step_pieces.h: the
/// replica rule's one owner; nullptr when no old rank saved it). The CopyRange sources are old ranks;
/// src_offset is from the start of that file. A shard name reads the pieces of the same tensor that overlap
/// it; the global shape is the extent of the saved pieces (which must cover the wanted box). A whole-tensor
/// name reads the copy step_tensors chose (the lowest old rank's: a tensor saved without shards is taken as
/// replicated). Across kinds (a layout change): a whole-tensor name of a tensor saved in pieces reads them
/// all, and they must make up exactly `shape`; a shard name of a tensor saved whole reads its box of that
/// copy, which must be `*global_shape` (required then: the box alone does not say which tensor it is a part
/// of). `global_shape`, when given for a shard name, must also equal the extent of the saved pieces.
/// InvalidArgument naming the tensor when no old rank saved it, a dtype or global shape differs, or the
/// pieces do not cover it.
std::vector<CopyRange> plan_destination(const std::string& name, const std::vector<int64_t>& shape,
                                        const std::string& dtype, const StepTensor* saved,
                                        const std::vector<int64_t>* global_shape = nullptr);
/// The same, `indexes[r]` being old rank r's safetensors index (step_tensors of them: CorruptData for a
/// hostile index).
std::vector<CopyRange> plan_destination(const std::string& name, const std::vector<int64_t>& shape,
                                        const std::string& dtype, const std::vector<const SafetensorsIndex*>& indexes,
                                        const std::vector<int64_t>* global_shape = nullptr);

}  // namespace ettkit::checkpoint::detail

#pragma GCC visibility pop
