// The peer replica (#23 item 3), two ranks in one process over an in-process c10d Backend and a HashStore:
// a rank whose memory tier is gone gets its step back from its partner, bit for bit; a replica that fails
// its checksums sends both ranks to the disk tier together; enable_peer_replica() checks its arguments; and a
// hostile announcement (a file name with a path in it, a run id with one, a message that is not JSON, from a
// Store client that sends no bytes) is ignored without writing or removing anything, while the stream stays in
// step for the sender's own announcement under the same key. The same paths over gloo with SIGKILL run in
// tests/python/test_checkpoint_memory_tier.py.
#include "checkpoint/peer_replica.h"

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <condition_variable>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>
#include <tuple>

#include "checkpoint/peer_monitor.h"
#include "checkpoint/storage.h"
#include "checkpoint/fake_p2p_backend.h"
#include "ett/test_dir.h"
#include "ettkit/checkpoint/checkpointer.h"

namespace fs = std::filesystem;
using ettkit::InvalidArgument;
using ettkit::testing::TempDir;
using namespace ettkit::checkpoint;
namespace ckd = ettkit::checkpoint::detail;

namespace {

using ettkit::testing::FakeP2PBackend;
using ettkit::testing::Mailbox;

NamedTensors state(int rank, int64_t step) {
  return {{"w", at::full({1 << 15}, static_cast<double>(100 * rank + step))}, {"i", at::arange(77, at::kLong) * step}};
}
NamedTensors zeros_like_state() { return {{"w", at::zeros({1 << 15})}, {"i", at::zeros({77}, at::kLong)}}; }

/// One rank's client of a shared Store whose get() of a key ending in `held_suffix` waits, once, until the
/// test releases it: a rank's writer stopped at a chosen point of a save's protocol, with every other key
/// (heartbeats, the peer replica's announcements and acknowledgements) served as usual.
class HeldStore : public c10d::Store {
 public:
  HeldStore(c10::intrusive_ptr<c10d::Store> inner, std::string held_suffix)
      : inner_(std::move(inner)), suffix_(std::move(held_suffix)) {}
  /// Blocks until a get() of the held key waits.
  void wait_until_held() {
    std::unique_lock<std::mutex> lk(mu_);
    cv_.wait(lk, [&] { return holding_; });
  }
  void release() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      released_ = true;
    }
    cv_.notify_all();
  }

  std::vector<uint8_t> get(const std::string& key) override {
    if (key.size() >= suffix_.size() && key.compare(key.size() - suffix_.size(), suffix_.size(), suffix_) == 0) {
      std::unique_lock<std::mutex> lk(mu_);
      holding_ = true;
      cv_.notify_all();
      cv_.wait(lk, [&] { return released_; });
    }
    return inner_->get(key);
  }
  c10::intrusive_ptr<c10d::Store> clone() override { return inner_->clone(); }
  void set(const std::string& key, const std::vector<uint8_t>& value) override { inner_->set(key, value); }
  std::vector<uint8_t> compareSet(const std::string& key, const std::vector<uint8_t>& current,
                                  const std::vector<uint8_t>& value) override {
    return inner_->compareSet(key, current, value);
  }
  int64_t add(const std::string& key, int64_t value) override { return inner_->add(key, value); }
  bool deleteKey(const std::string& key) override { return inner_->deleteKey(key); }
  bool check(const std::vector<std::string>& keys) override { return inner_->check(keys); }
  int64_t getNumKeys() override { return inner_->getNumKeys(); }
  void wait(const std::vector<std::string>& keys) override { inner_->wait(keys); }
  void wait(const std::vector<std::string>& keys, const std::chrono::milliseconds& timeout) override {
    inner_->wait(keys, timeout);
  }

 private:
  c10::intrusive_ptr<c10d::Store> inner_;
  std::string suffix_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool holding_ = false;
  bool released_ = false;
};

/// Two ranks ("nodes": one memory root each) of one job, opened together.
struct Pair {
  const TempDir& dir;
  c10::intrusive_ptr<c10d::Store> store = c10::make_intrusive<c10d::HashStore>();
  std::shared_ptr<Mailbox> box = std::make_shared<Mailbox>();
  std::unique_ptr<AsyncCheckpointer> ck[2];
  c10::intrusive_ptr<c10d::Store> rank_store[2];  // a rank's own client of `store`, when a test gives one

  explicit Pair(const TempDir& d) : dir(d) {}

  std::string root(int r) const { return dir.str() + "/node-" + std::to_string(r); }

  void open(bool replica = true) {
    std::thread t[2];
    for (int r = 0; r < 2; ++r) {
      t[r] = std::thread([&, r] {
        CheckpointerOptions o;
        o.directory = dir.str() + "/ck";
        o.use_current_recorder = false;
        o.rank = r;
        o.world_size = 2;
        o.commit_timeout_s = 30;
        o.memory_tier.root = root(r);
        o.memory_tier.job_id = "replica-test";
        fs::create_directories(o.memory_tier.root);
        ck[r] = std::make_unique<AsyncCheckpointer>(o, rank_store[r] ? rank_store[r] : store);
        if (replica) ck[r]->enable_peer_replica(c10::make_intrusive<FakeP2PBackend>(r, 2, box), 1);
      });
    }
    for (auto& x : t) x.join();
  }
  /// `fn(rank)` on both ranks at once (saves and loads are collective).
  template <class F>
  void both(F fn) {
    std::thread t[2];
    for (int r = 0; r < 2; ++r) t[r] = std::thread([&, r] { fn(r); });
    for (auto& x : t) x.join();
  }
  void close(bool discard) {
    both([&](int r) { ck[r]->close(discard); });
    ck[0].reset();
    ck[1].reset();
  }
  /// Rank r's memory-tier directory, by the tier's own naming (not "the first entry of the root": a listing's
  /// order is the file system's).
  std::string rank_dir(int r) const {
    const std::string directory = fs::canonical(dir.str() + "/ck").string();
    return root(r) + "/" + ckd::MemoryTier::job_dir_name("replica-test", directory) + "/rank-" + std::to_string(r);
  }
  /// Where rank `holder` keeps its partner's replicas.
  std::string replica_shelf(int holder) const {
    return rank_dir(holder) + "/replica-of-rank-" + std::to_string(1 - holder);
  }
};

void flip_byte(const std::string& path, uint64_t offset) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(static_cast<std::streamoff>(offset));
  char c = 0;
  f.read(&c, 1);
  c = static_cast<char>(c ^ 0x5a);
  f.seekp(static_cast<std::streamoff>(offset));
  f.write(&c, 1);
}

}  // namespace

TEST(PeerReplica, ARankWhoseTierIsGoneGetsItsStepBackFromItsPartner) {
  TempDir d;
  Pair p(d);
  p.open();
  p.both([&](int r) {
    ASSERT_TRUE(p.ck[r]->save(2, state(r, 2)).wait());
    ASSERT_TRUE(p.ck[r]->save(4, state(r, 4), "x" + std::to_string(r), Tier::kMemory).wait());
  });
  // wait() returned after the partner committed its copy.
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(p.ck[r]->replicas_sent(), 1);
    EXPECT_EQ(ckd::list_step_dirs(p.replica_shelf(r)), std::vector<int64_t>{4});
  }
  p.close(/*discard=*/false);
  ettkit::detail::remove_tree(p.root(1));  // rank 1's node is lost (not remove_all: common/remove_tree.h)
  fs::create_directories(p.root(1));
  p.open();
  std::optional<LoadResult> got[2];
  NamedTensors into[2] = {zeros_like_state(), zeros_like_state()};
  p.both([&](int r) { got[r] = p.ck[r]->load_latest(into[r]); });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(got[r]);
    EXPECT_EQ(got[r]->step, 4);
    EXPECT_EQ(got[r]->tier, Tier::kMemory) << got[r]->memory_fallback;
    EXPECT_EQ(got[r]->extra, "x" + std::to_string(r));
    EXPECT_EQ(got[r]->memory_from_rank, r == 1 ? 0 : -1);
    NamedTensors want = state(r, 4);
    for (size_t i = 0; i < want.size(); ++i) EXPECT_TRUE(at::equal(into[r][i].second, want[i].second)) << r;
  }
  // Rank 1 holds the step itself again.
  EXPECT_EQ(ckd::list_step_dirs(p.rank_dir(1)), std::vector<int64_t>{4});
  p.close(/*discard=*/true);
  EXPECT_TRUE(fs::is_empty(p.root(0)) && fs::is_empty(p.root(1)));
}

// The interleaving that made the test above flaky, held in place: rank 1's disk commit of step 2 is
// decided, but its writer has not yet retired the memory snapshots that step supersedes, when rank 0's
// memory save of step 4 is committed and its replica committed on rank 1. That replica is of this run and
// newer than step 2: the retirement keeps it. (It dropped it as another run's: rank 1 had made no memory
// snapshot yet, and its tier counted this run as its own only from its first one.)
TEST(PeerReplica, AReplicaThatArrivesBeforeTheHoldersFirstMemorySaveOutlivesItsDiskCommit) {
  TempDir d;
  Pair p(d);
  // Rank 1's writer stops where it reads rank 0's commit result for its first save (seq 0): after the
  // decision, before retire_superseded_memory.
  auto held = c10::make_intrusive<HeldStore>(p.store, "/save/0/result");
  p.rank_store[1] = held;
  p.open();
  std::thread rank1([&] {
    EXPECT_TRUE(p.ck[1]->save(2, state(1, 2)).wait());
    EXPECT_TRUE(p.ck[1]->save(4, state(1, 4), "x1", Tier::kMemory).wait());
  });
  // Rank 1 goes on and is joined however this scope ends (a failed ASSERT returns early).
  struct Join {
    HeldStore& held;
    std::thread& t;
    ~Join() {
      held.release();
      if (t.joinable()) t.join();
    }
  } join_rank1{*held, rank1};
  ASSERT_TRUE(p.ck[0]->save(2, state(0, 2)).wait());
  held->wait_until_held();
  // wait() returns once rank 1 has committed the replica (its acknowledgement).
  EXPECT_TRUE(p.ck[0]->save(4, state(0, 4), "x0", Tier::kMemory).wait());
  EXPECT_EQ(ckd::list_step_dirs(p.replica_shelf(1)), std::vector<int64_t>{4});
  held->release();
  rank1.join();  // its retirement has run
  EXPECT_EQ(ckd::list_step_dirs(p.replica_shelf(1)), std::vector<int64_t>{4})
      << "rank 1's disk commit of step 2 retired rank 0's replica of step 4 (of this same run)";
  EXPECT_EQ(ckd::list_step_dirs(p.replica_shelf(0)), std::vector<int64_t>{4});
  for (int r = 0; r < 2; ++r) EXPECT_EQ(p.ck[r]->replicas_sent(), 1);
  p.close(/*discard=*/true);
}

TEST(PeerReplica, ACorruptReplicaSendsBothRanksToTheDiskTier) {
  TempDir d;
  Pair p(d);
  p.open();
  p.both([&](int r) {
    ASSERT_TRUE(p.ck[r]->save(2, state(r, 2)).wait());
    ASSERT_TRUE(p.ck[r]->save(4, state(r, 4), {}, Tier::kMemory).wait());
  });
  p.close(false);
  std::string data = p.rank_dir(0) + "/replica-of-rank-1/step-4/rank-1.safetensors";
  flip_byte(data, *ckd::file_size(data) - 9);
  ettkit::detail::remove_tree(p.root(1));
  fs::create_directories(p.root(1));
  p.open();
  std::optional<LoadResult> got[2];
  NamedTensors into[2] = {zeros_like_state(), zeros_like_state()};
  p.both([&](int r) { got[r] = p.ck[r]->load_latest(into[r]); });
  for (int r = 0; r < 2; ++r) {
    ASSERT_TRUE(got[r]);
    EXPECT_EQ(got[r]->step, 2);
    EXPECT_EQ(got[r]->tier, Tier::kDisk);
    EXPECT_NE(got[r]->memory_fallback.find("did not come back from rank 0"), std::string::npos) << got[r]->memory_fallback;
    EXPECT_NE(got[r]->memory_fallback.find("XXH3"), std::string::npos) << got[r]->memory_fallback;
    EXPECT_TRUE(at::equal(into[r][0].second, state(r, 2)[0].second));
  }
  p.close(true);
}

TEST(PeerReplica, EnableChecksItsArguments) {
  TempDir d;
  {
    CheckpointerOptions o;
    o.directory = d.str() + "/single";
    o.use_current_recorder = false;
    AsyncCheckpointer one(o);
    auto box = std::make_shared<Mailbox>();
    EXPECT_THROW(one.enable_peer_replica(c10::make_intrusive<FakeP2PBackend>(0, 1, box), 1), InvalidArgument);
  }
  Pair p(d);
  p.open(/*replica=*/false);
  auto expect_refused = [&](int r, c10::intrusive_ptr<c10d::Backend> g, int rph, const std::string& words) {
    try {
      p.ck[r]->enable_peer_replica(std::move(g), rph);
      ADD_FAILURE() << "accepted: " << words;
    } catch (const InvalidArgument& e) {
      EXPECT_NE(std::string(e.what()).find(words), std::string::npos) << e.what();
    }
  };
  expect_refused(0, c10::make_intrusive<FakeP2PBackend>(1, 2, p.box), 1, "the process group has rank 1 of 2");
  expect_refused(0, c10::make_intrusive<FakeP2PBackend>(0, 3, p.box), 1, "rank 0 of 3");
  expect_refused(0, c10::make_intrusive<FakeP2PBackend>(0, 2, p.box), 0, "ranks_per_host=0");
  expect_refused(0, c10::make_intrusive<FakeP2PBackend>(0, 2, p.box), 2, "ranks_per_host=2");
  p.both([&](int r) { ASSERT_TRUE(p.ck[r]->save(1, state(r, 1)).wait()); });
  expect_refused(1, c10::make_intrusive<FakeP2PBackend>(1, 2, p.box), 1, "before the first save()");
  p.close(true);
}

TEST(PeerReplica, AHostileAnnouncementIsRefusedAndTheStreamStaysInStep) {
  // Rank 0 is a real receiver; the test plays rank 1, announcing snapshots by hand.
  TempDir d;
  auto store = c10::make_intrusive<c10d::HashStore>();
  auto box = std::make_shared<Mailbox>();
  std::string root = d.str() + "/node-0";
  fs::create_directories(root);
  ckd::MemoryTier tier(root, "job", d.str() + "/ck", 0, 0);
  ASSERT_FALSE(tier.try_lock());
  const std::string prefix = "t/replica/";
  ckd::PeerMonitor peers(store, "t/", 0, 2, 5.0);
  const std::string run = "0123456789abcdef";
  ckd::PeerReplica replica(c10::make_intrusive<FakeP2PBackend>(0, 2, box), store, prefix, run, &peers, 0, 2, 1, tier,
                           10.0);
  FakeP2PBackend rank1(1, 2, box);

  // A snapshot of rank 1: its two files, their digests, a manifest.
  std::string src = d.str() + "/src";
  fs::create_directories(src);
  std::string payload(3 << 20, 'p');
  std::string extra = "extra";
  ckd::Manifest m;
  m.step = 6;
  m.world_size = 2;
  m.metadata["ettkit.run_id"] = run;
  m.files["rank-1.safetensors"] = ckd::write_file_durably(src + "/a", {{payload.data(), payload.size()}});
  m.files["rank-1.extra"] = ckd::write_file_durably(src + "/b", {{extra.data(), extra.size()}});
  auto send = [&](const std::string& bytes) {
    std::vector<at::Tensor> t{at::from_blob(const_cast<char*>(bytes.data()), {static_cast<int64_t>(bytes.size())},
                                            at::kByte).clone()};
    rank1.send(t, 0, 0x4554);
  };
  auto put = [&](int k, const std::string& text) {
    store->set(prefix + "announce/1/" + std::to_string(k), std::vector<uint8_t>(text.begin(), text.end()));
  };
  auto text_of = [](const ckd::Manifest& man) {
    return nlohmann::json{{"manifest", ckd::encode_manifest(man)}}.dump();
  };
  auto announce = [&](int k, const ckd::Manifest& man) {
    put(k, text_of(man));
    // The files in the manifest's (name) order: rank-1.extra, then rank-1.safetensors.
    for (const auto& [name, dg] : man.files) send(dg.size == extra.size() ? extra : payload);
  };
  const std::string ack_prefix = prefix + "ack/1/";
  auto ack = [&](int k) {
    std::string key = ack_prefix + std::to_string(k);
    store->wait({key}, std::chrono::seconds(20));
    auto v = store->get(key);
    return std::string(v.begin(), v.end());
  };
  // A Store client that is not a rank writes announcement 0 (and sends no bytes: it is in no process
  // group); the receiver takes it, refuses it, and waits for the key again.
  auto hostile = [&](const std::string& text) {
    put(0, text);
    for (int i = 0; i < 2000 && store->check({prefix + "announce/1/0"}); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(5));  // until the receiver has taken it
    }
    ASSERT_FALSE(store->check({prefix + "announce/1/0"})) << "the receiver never took the announcement";
  };
  const std::string victim = d.str() + "/victim";
  fs::create_directories(victim);
  std::ofstream(victim + "/marker") << "the user's";
  std::string climb;
  for (int i = 0; i < 30; ++i) climb += "../";
  ckd::Manifest escaping_run = m;
  escaping_run.metadata["ettkit.run_id"] = "a/" + climb + victim.substr(1);
  ckd::Manifest escaping_name = m;
  escaping_name.files.clear();
  escaping_name.files["../../escaped"] = m.files["rank-1.extra"];
  escaping_name.files["rank-1.safetensors"] = m.files["rank-1.safetensors"];
  ckd::Manifest other_run = m;
  other_run.metadata["ettkit.run_id"] = "fedcba9876543210";
  ckd::Manifest other_world = m;
  other_world.world_size = 3;
  for (const std::string& text : {text_of(escaping_run), text_of(escaping_name), text_of(other_run),
                                  text_of(other_world), std::string("{not json"), std::string("[1, 2]"),
                                  std::string(R"({"manifest": 7})")}) {
    hostile(text);
  }
  // Refused, nothing acted on: no acknowledgement, nothing removed, moved or written anywhere.
  for (int i = 0; i < 2000 && replica.refused() < 7; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(5));
  ASSERT_EQ(replica.refused(), 7);
  EXPECT_FALSE(store->check({ack_prefix + "0"}));
  EXPECT_EQ(ckd::read_small_file(victim + "/marker"), "the user's");
  EXPECT_EQ(std::vector<std::string>{"marker"}, [&] {
    std::vector<std::string> names;
    for (const auto& e : fs::directory_iterator(victim)) names.push_back(e.path().filename().string());
    return names;
  }());
  EXPECT_FALSE(fs::exists(root + "/escaped"));
  EXPECT_FALSE(fs::exists(d.str() + "/escaped"));
  EXPECT_FALSE(fs::exists(tier.replica_dir(1)) && !fs::is_empty(tier.replica_dir(1)));
  // 1. Bytes that do not match the manifest's checksums: a well-formed announcement, received and refused.
  ckd::Manifest wrong = m;
  wrong.files["rank-1.safetensors"].chunks[0] = "0123456789abcdef";
  announce(0, wrong);
  EXPECT_NE(ack(0).find("XXH3"), std::string::npos) << ack(0);
  // 2. The next honest snapshot is received in step and committed.
  announce(1, m);
  EXPECT_EQ(ack(1), "");
  EXPECT_EQ(ckd::list_step_dirs(tier.replica_dir(1)), std::vector<int64_t>{6});
  EXPECT_EQ(ckd::read_small_file(tier.replica_dir(1) + "/step-6/rank-1.extra"), extra);
  EXPECT_EQ(replica.received(), 1);
  EXPECT_EQ(replica.failed(), 1);
  EXPECT_EQ(replica.refused(), 7);
  EXPECT_EQ(ckd::read_small_file(victim + "/marker"), "the user's");
  store->set(prefix + "done/1", std::vector<uint8_t>{'2'});
  replica.close();
}

TEST(PeerReplica, TheBudgetHoldsOwnSnapshotsAndReplicasTogetherOwnFirst) {
  const std::string kRun = "00000000000000aa";
  TempDir d;
  std::string root = d.str() + "/node";
  fs::create_directories(root);
  ckd::MemoryTier tier(root, "job", d.str() + "/ck", 0, /*budget_bytes=*/1000);
  ASSERT_FALSE(tier.try_lock());
  // A committed snapshot of `bytes` (the manifest's sizes are what the budget counts).
  auto commit = [&](const std::string& tmp, const std::string& shelf, int64_t step, uint64_t bytes) {
    ckd::Manifest m;
    m.step = step;
    m.world_size = 2;
    m.metadata["ettkit.run_id"] = kRun;
    m.files["rank-0.extra"] = ckd::write_file_durably(tmp + "/rank-0.extra", {{"x", 1}});
    m.files["rank-0.extra"].size = bytes;
    tier.commit_in(shelf, tmp, m);
  };
  commit(tier.begin(1, kRun, 600), tier.dir(), 1, 600);
  // 600 own + 500 replica > 1000: the replica is refused, the own snapshot stays.
  try {
    tier.begin_replica(1, 1, kRun, 500);
    ADD_FAILURE() << "a replica beyond the budget was accepted";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("raise the budget"), std::string::npos) << e.what();
  }
  EXPECT_EQ(ckd::list_step_dirs(tier.dir()), std::vector<int64_t>{1});
  // A replica that fits is kept.
  commit(tier.begin_replica(1, 1, kRun, 300), tier.replica_dir(1), 1, 300);
  EXPECT_EQ(ckd::list_step_dirs(tier.replica_dir(1)), std::vector<int64_t>{1});
  // The next own snapshot (750) does not fit next to the held 600 + 300: the held own one goes first, then,
  // as 300 + 750 still exceeds 1000, the replica (the partner still has its own copy).
  std::string tmp = tier.begin(2, kRun, 750);
  EXPECT_TRUE(ckd::list_step_dirs(tier.dir()).empty());
  EXPECT_TRUE(ckd::list_step_dirs(tier.replica_dir(1)).empty());
  commit(tmp, tier.dir(), 2, 750);
  EXPECT_EQ(ckd::list_step_dirs(tier.dir()), std::vector<int64_t>{2});
  // One that fits next to the replica keeps it: 250 + 700 <= 1000 once the held own one is retired.
  commit(tier.begin_replica(1, 2, kRun, 250), tier.replica_dir(1), 2, 250);
  commit(tier.begin(3, kRun, 700), tier.dir(), 3, 700);
  EXPECT_EQ(ckd::list_step_dirs(tier.replica_dir(1)), std::vector<int64_t>{2});
  EXPECT_EQ(ckd::list_step_dirs(tier.dir()), std::vector<int64_t>{3});
}
