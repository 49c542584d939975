// The moved verdict (include/ettkit/checkpoint/step_format.h, first_moved_shard): whether a rank's shards in
// a step are where the state being loaded wants them. One function for the C++ loader and Python's checks.
#include <algorithm>
#include <string>

#include "ettkit/checkpoint/step_format.h"

namespace ettkit::checkpoint {
namespace {

/// "key@offsets", as a save names a shard (shard_names.h).
std::string box_name(const std::string& key, const ShardBox& box) {
  std::string name = key + "@";
  for (size_t i = 0; i < box.offsets.size(); ++i) name += (i ? "," : "") + std::to_string(box.offsets[i]);
  return name;
}

/// The name of the first of `key`'s boxes (the key itself when it has none): what a message names for a key
/// only one side lists.
std::string first_name(const std::string& key, const std::vector<ShardBox>& boxes) {
  return boxes.empty() ? key : box_name(key, boxes.front());
}

const ShardBox* at_offsets(const std::vector<ShardBox>& boxes, const std::vector<int64_t>& offsets) {
  auto it = std::find_if(boxes.begin(), boxes.end(), [&](const ShardBox& b) { return b.offsets == offsets; });
  return it == boxes.end() ? nullptr : &*it;
}

/// The first box of `ours` that `theirs` lacks at its offsets or holds at another size or placement.
std::string first_unmatched(const std::string& key, const std::vector<ShardBox>& ours,
                            const std::vector<ShardBox>& theirs) {
  for (const ShardBox& b : ours) {
    const ShardBox* other = at_offsets(theirs, b.offsets);
    if (!other || other->sizes != b.sizes || other->placement != b.placement) return box_name(key, b);
  }
  return {};
}

}  // namespace

std::string first_moved_shard(const ShardLayout& saved, const ShardLayout& wanted, bool partial) {
  for (const std::string& name : wanted.whole) {
    // Saved sharded, wanted whole: the pieces are put together by resharding.
    if (!saved.whole.count(name) && saved.sharded.count(name)) return name;
  }
  for (const auto& [key, boxes] : wanted.sharded) {
    auto it = saved.sharded.find(key);
    if (it == saved.sharded.end()) return first_name(key, boxes);
    if (std::string m = first_unmatched(key, boxes, it->second); !m.empty()) return m;
    if (std::string m = first_unmatched(key, it->second, boxes); !m.empty()) return m;
  }
  if (!partial) {
    for (const auto& [key, boxes] : saved.sharded) {
      if (!wanted.sharded.count(key)) return first_name(key, boxes);
    }
  }
  return {};
}

}  // namespace ettkit::checkpoint
