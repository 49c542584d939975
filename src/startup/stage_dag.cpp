#include "startup/stage_dag.h"

#include <algorithm>
#include <functional>
#include <queue>

namespace ettkit::startup::detail {

std::vector<size_t> topological_order(const std::vector<std::vector<size_t>>& preds) {
  const size_t n = preds.size();
  std::vector<size_t> indeg(n, 0);
  std::vector<std::vector<size_t>> succs(n);
  for (size_t i = 0; i < n; ++i) {
    indeg[i] = preds[i].size();
    for (size_t p : preds[i]) succs[p].push_back(i);
  }
  std::priority_queue<size_t, std::vector<size_t>, std::greater<>> ready;
  for (size_t i = 0; i < n; ++i) {
    if (indeg[i] == 0) ready.push(i);
  }
  std::vector<size_t> order;
  order.reserve(n);
  while (!ready.empty()) {
    const size_t i = ready.top();
    ready.pop();
    order.push_back(i);
    for (size_t s : succs[i]) {
      if (--indeg[s] == 0) ready.push(s);
    }
  }
  return order;
}

std::vector<size_t> find_cycle(const std::vector<std::vector<size_t>>& preds) {
  // Depth-first search along dependencies; a back edge to a stage on the stack closes a cycle.
  const size_t n = preds.size();
  std::vector<int> color(n, 0);  // 0 new, 1 on the stack, 2 done
  std::vector<size_t> stack;
  std::vector<size_t> found;
  std::function<bool(size_t)> dfs = [&](size_t v) {
    color[v] = 1;
    stack.push_back(v);
    for (size_t p : preds[v]) {
      if (color[p] == 1) {
        found.assign(std::find(stack.begin(), stack.end(), p), stack.end());
        return true;
      }
      if (color[p] == 0 && dfs(p)) return true;
    }
    stack.pop_back();
    color[v] = 2;
    return false;
  };
  for (size_t i = 0; i < n && found.empty(); ++i) {
    if (color[i] == 0) dfs(i);
  }
  return found;
}

}  // namespace ettkit::startup::detail
