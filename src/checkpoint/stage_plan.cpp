// What the stager copies and where (stage_plan.h).
#include "checkpoint/stage_plan.h"

#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>

#include <algorithm>
#include <string>
#include <unordered_map>

#include "ettkit/common/error.h"

namespace ettkit::checkpoint::detail {

namespace {

/// Whether `t` is a Python tensor subclass wrapper (DTensor, ShardedTensor, a Parameter around either,
/// FSDP2's parameters, any `_make_wrapper_subclass` type): its dispatch keys include Python, and its storage
/// is an empty placeholder whose data pointer is null. Its values live in the tensors it wraps.
bool is_python_wrapper(const at::Tensor& t) {
  return t.key_set().has(c10::DispatchKey::Python) || t.key_set().has(c10::DispatchKey::PythonTLSSnapshot);
}

/// The bytes of its storage that `t`'s elements reach: the view's extent from the storage's start.
size_t storage_extent(const at::Tensor& t) {
  const size_t item = t.dtype().itemsize();
  if (t.is_contiguous()) {  // the common case, without a loop over the dimensions
    return t.numel() == 0 ? 0 : (static_cast<size_t>(t.storage_offset()) + static_cast<size_t>(t.numel())) * item;
  }
  return at::detail::computeStorageNbytes(t.sizes(), t.strides(), item, static_cast<size_t>(t.storage_offset()));
}

/// Whether the values of `t` can be staged by copying bytes out of its storage. The copy engine reads
/// `nbytes()` from the data pointer (or strided elements of the storage), which is right only for a plain
/// dense tensor whose own storage holds every element it shows. Anything else is refused (with
/// why_not_plain_dense()), so that no mistake of a caller (Python handing over a wrapper instead of its
/// local tensor) can become a read of memory the tensor does not own. Runs once per tensor per save.
bool is_plain_dense(const at::Tensor& t) {
  static const c10::DispatchKeySet kNotPlain{c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot,
                                             c10::DispatchKey::Functionalize};
  if (t.key_set().has_any(kNotPlain) || t.is_nested() || t.is_quantized() || t.layout() != c10::kStrided ||
      !t.has_storage()) {
    return false;
  }
  const size_t need = storage_extent(t);
  const c10::Storage& storage = t.storage();
  return need == 0 || (storage.data() != nullptr && need <= storage.nbytes());
}

/// Why is_plain_dense(t) is false, for the error message.
std::string why_not_plain_dense(const at::Tensor& t) {
  if (is_python_wrapper(t)) {
    return "a Python tensor subclass (its dispatch keys include Python: a DTensor, a ShardedTensor, a "
           "Parameter wrapping either, or another __torch_dispatch__ wrapper) whose storage does not hold its "
           "values; stage its local tensor(s) instead";
  }
  if (t.key_set().has(c10::DispatchKey::Functionalize)) return "a functional tensor (torch.compile tracing)";
  if (t.is_nested()) return "a nested tensor";
  if (t.is_quantized()) return "a quantized tensor";
  if (t.layout() != c10::kStrided) return "not a dense strided tensor";
  if (!t.has_storage()) return "a tensor without storage";
  const c10::Storage& storage = t.storage();
  const size_t need = storage_extent(t);
  if (storage.data() == nullptr) return "a tensor whose storage has no data";
  return ettkit::detail::concat("a view reaching byte ", need, " of a storage of ", storage.nbytes(), " bytes");
}

}  // namespace

namespace {
/// check_stageable's test of one tensor: InvalidArgument naming it unless it can be staged.
void check_stageable_one(const std::string& name, const at::Tensor& t) {
  ETTKIT_EXPECTS(t.defined(), "state dict entry '", name, "' is an undefined tensor");
  ETTKIT_EXPECTS(t.device().is_cpu() || t.device().is_cuda(), "state dict entry '", name, "' is on device ",
                 t.device(), "; only CPU and CUDA tensors can be staged");
  ETTKIT_EXPECTS(is_plain_dense(t), "state dict entry '", name, "' cannot be staged: it is ",
                 why_not_plain_dense(t), "; ettkit stages plain dense CPU or CUDA tensors");
}
}  // namespace

void check_stageable(const NamedTensors& tensors) {
  for (const auto& [name, t] : tensors) check_stageable_one(name, t);
}

bool check_and_match(const std::vector<PlanEntry>* plan, const NamedTensors& tensors, bool names_known, bool* views) {
  bool match = plan != nullptr && plan->size() == tensors.size();
  bool shows_other = false;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i].second;
    check_stageable_one(tensors[i].first, t);
    // While the tensor is in the cache (AsyncCheckpointer::save's conjugate and negative-bit views).
    shows_other = shows_other || t.is_conj() || t.is_neg();
    if (!match) continue;
    const PlanEntry& e = (*plan)[i];
    // The name last: with a names token it is not compared at all (two heap strings per tensor).
    match = e.dtype == t.scalar_type() && e.device == t.device() &&
            std::equal(e.shape.begin(), e.shape.end(), t.sizes().begin(), t.sizes().end()) &&
            (names_known || e.name == tensors[i].first);
  }
  if (views) *views = shows_other;
  return match;
}

const void* storage_key(const at::Tensor& t) {
  if (!t.defined() || !t.has_storage() || is_python_wrapper(t)) return nullptr;
  return t.storage().data();
}

bool same_structure(const std::vector<PlanEntry>& plan, const NamedTensors& tensors) {
  if (plan.size() != tensors.size()) return false;
  for (size_t i = 0; i < plan.size(); ++i) {
    const at::Tensor& t = tensors[i].second;
    const PlanEntry& e = plan[i];
    if (e.name != tensors[i].first || e.dtype != t.scalar_type() || e.device != t.device()) return false;
    if (!std::equal(e.shape.begin(), e.shape.end(), t.sizes().begin(), t.sizes().end())) return false;
  }
  return true;
}

Layout lay_out(const NamedTensors& tensors) {
  Layout out;
  out.entries = std::make_shared<std::vector<PlanEntry>>();
  out.entries->reserve(tensors.size());
  int64_t off = 0;
  for (const auto& [name, t] : tensors) {
    PlanEntry e{name, t.scalar_type(), t.sizes().vec(), t.device(), static_cast<int64_t>(t.nbytes()), off};
    off += e.nbytes;
    out.entries->push_back(std::move(e));
  }
  out.total_bytes = off;
  return out;
}

void copy_order(const NamedTensors& tensors, const CopyPriority& priority, CopyOrder& out) {
  const size_t n = tensors.size();
  out.cls.clear();
  // Without a priority, the plan's order: kept while the count is the same (the stager's SaveScratch), not
  // written again every save.
  if (out.order.size() != n || !out.identity) {
    out.order.resize(n);
    for (size_t i = 0; i < n; ++i) out.order[i] = i;
    out.identity = true;
  }
  if (priority.empty()) return;
  out.identity = false;
  std::unordered_map<const void*, int> rank_of;
  rank_of.reserve(priority.size());
  for (const auto& [key, c] : priority) {
    if (key) rank_of.emplace(key, std::clamp(c, 0, kRestClass));
  }
  out.cls.assign(n, kRestClass);
  for (size_t i = 0; i < n; ++i) {
    auto it = rank_of.find(storage_key(tensors[i].second));
    if (it != rank_of.end()) out.cls[i] = static_cast<uint8_t>(it->second);
  }
  std::stable_sort(out.order.begin(), out.order.end(), [&](size_t a, size_t b) { return out.cls[a] < out.cls[b]; });
}

CopyOrder copy_order(const NamedTensors& tensors, const CopyPriority& priority) {
  CopyOrder out;
  copy_order(tensors, priority, out);
  return out;
}

}  // namespace ettkit::checkpoint::detail
