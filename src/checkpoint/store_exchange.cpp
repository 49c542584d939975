// StoreExchange: gathers, a value from rank 0, and the worst verdict over the c10d Store (store_exchange.h).
#include "checkpoint/store_exchange.h"

#include <chrono>

#include "ettkit/common/error.h"

namespace ettkit::checkpoint::detail {

using json = StoreExchange::json;

namespace {

/// Where a value came from, for the messages: the key and the rank that should have written it.
std::string source_of(const std::string& key, int rank) {
  return "rank " + std::to_string(rank) + "'s value under the Store key '" + key + "'";
}

/// What worst_verdict's ranks write: {"v": 0..max_verdict, "why": text}.
void check_verdict(const json& v, const std::string& source, int max_verdict) {
  const bool ok = v.is_object() && v.contains("v") && v["v"].is_number_integer() && v["v"].get<int64_t>() >= 0 &&
                  v["v"].get<int64_t>() <= max_verdict && v.contains("why") && v["why"].is_string();
  ETTKIT_CHECK(ok, CorruptData, source, " does not hold a verdict {\"v\": 0-", max_verdict, ", \"why\": text}");
}

}  // namespace

StoreExchange::StoreExchange(c10d::Store& store, PeerMonitor* peers, double timeout_s)
    : store_(store), peers_(peers), timeout_s_(timeout_s) {}

void StoreExchange::publish(const std::string& key, const std::string& text) {
  if (peers_ != nullptr) {
    peers_->set(key, text);
  } else {
    store_.set(key, bytes_of(text));
  }
}

void StoreExchange::wait(const std::vector<std::string>& keys, const std::vector<int>& watch, const std::string& what) {
  if (peers_ != nullptr) {
    peers_->wait_keys(keys, watch, timeout_s_, what);
  } else {
    store_.wait(keys, std::chrono::milliseconds(static_cast<int64_t>(timeout_s_ * 1000)));
  }
}

std::string StoreExchange::await_from(const std::string& key, int from, const std::string& what) {
  wait({key}, {from}, what);
  return string_of(store_.get(key));
}

std::vector<json> StoreExchange::gather(const std::string& prefix, const std::vector<int>& ranks, int self,
                                        const std::string& what, const std::string& expected, const Check& check) {
  std::vector<std::string> keys;
  std::vector<int> watch;
  for (int r : ranks) {
    keys.push_back(prefix + std::to_string(r));
    if (r != self) watch.push_back(r);
  }
  wait(keys, watch, what);
  std::vector<json> values;
  values.reserve(keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    const std::string source = what + ": " + source_of(keys[i], ranks[i]);
    values.push_back(decode(string_of(store_.get(keys[i])), source, expected));
    if (check) check(values.back(), source);
  }
  return values;
}

std::vector<json> StoreExchange::all_gather(const std::string& prefix, int rank, int world, const json& mine,
                                            const std::string& what, const std::string& expected, const Check& check) {
  publish(prefix + std::to_string(rank), mine);
  std::vector<int> ranks;
  for (int r = 0; r < world; ++r) ranks.push_back(r);
  return gather(prefix, ranks, rank, what, expected, check);
}

std::string StoreExchange::from_rank0(const std::string& key, int rank, const std::string& mine,
                                      const std::string& what) {
  if (rank == 0) {
    publish(key, mine);
    return mine;
  }
  return await_from(key, 0, what);
}

RankVerdict StoreExchange::worst_verdict(const std::string& prefix, int rank, int world, const RankVerdict& mine,
                                         int max_verdict, const std::function<int(int)>& severity,
                                         const std::string& what) {
  if (world == 1) return mine;
  const json value{{"v", mine.verdict}, {"why", mine.why}};
  auto check = [max_verdict](const json& v, const std::string& source) { check_verdict(v, source, max_verdict); };
  std::vector<json> all = all_gather(prefix, rank, world, value, what, "a verdict {\"v\": 0-" +
                                     std::to_string(max_verdict) + ", \"why\": text}", check);
  RankVerdict worst = mine;
  for (int r = 0; r < world; ++r) {
    const json& v = all[static_cast<size_t>(r)];
    const int verdict = v["v"].get<int>();
    if (severity(verdict) > severity(worst.verdict)) worst = {verdict, "rank " + std::to_string(r) + ": " + v["why"].get<std::string>()};
  }
  return worst;
}

json StoreExchange::decode(const std::string& text, const std::string& source, const std::string& expected) {
  json value = json::parse(text, nullptr, /*allow_exceptions=*/false);
  ETTKIT_CHECK(!value.is_discarded(), CorruptData, source, " is not JSON (", text.size(), " bytes); expected ",
               expected);
  return value;
}

}  // namespace ettkit::checkpoint::detail
