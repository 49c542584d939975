// The disk tier's commit vote over a c10d Store (src/checkpoint/commit.h): rank 0 gathers every other
// rank's file digests; a rank that failed or whose copy was torn makes rank 0 refuse the step with the
// right kind; the result rank 0 publishes reaches the other ranks as the same kind of error; a vote that is
// not what report() writes is CorruptData, not a crash or a silent commit.
#include "checkpoint/commit.h"

#include <gtest/gtest.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <memory>
#include <string>
#include <vector>

#include "ettkit/checkpoint/checkpointer.h"
#include "ettkit/common/error.h"

namespace ettkit::checkpoint::detail {
namespace {

constexpr const char* kRun = "ck/";
constexpr const char* kSave = "ck/save/7/";

/// `world` ranks' monitors over one in-process Store, and a vote per rank for the save of step 7.
struct Job {
  explicit Job(int world) : store(c10::make_intrusive<c10d::HashStore>()) {
    for (int r = 0; r < world; ++r) {
      monitors.push_back(std::make_unique<PeerMonitor>(store, kRun, r, world, 5.0));
      votes.push_back(std::make_unique<CommitVote>(*store, *monitors.back(), kSave, 7, 5.0));
    }
  }
  ~Job() {
    for (auto& m : monitors) m->close(true);
  }
  CommitVote& vote(int r) { return *votes[static_cast<size_t>(r)]; }
  void set(const std::string& key, const std::string& value) {
    store->set(key, std::vector<uint8_t>(value.begin(), value.end()));
  }
  c10::intrusive_ptr<c10d::HashStore> store;
  std::vector<std::unique_ptr<PeerMonitor>> monitors;
  std::vector<std::unique_ptr<CommitVote>> votes;
};

FileDigest digest(uint64_t size, const std::string& xxh3) { return {size, xxh3, 32u << 20, {xxh3}}; }

template <class E, class F>
std::string thrown(F fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  return "(nothing of that kind thrown)";
}

}  // namespace

TEST(CommitVote, RankZeroGathersEveryRanksDigestsAndTheOthersSeeTheCommit) {
  Job job(3);
  job.vote(1).report(1, {{"rank-1.safetensors", digest(100, "00000000000000a1")}, {"rank-1.extra", digest(3, "00000000000000e1")}});
  job.vote(2).report(2, {{"rank-2.safetensors", digest(200, "00000000000000a2")}, {"rank-2.extra", digest(4, "00000000000000e2")}});
  auto files = job.vote(0).gather(3);
  ASSERT_EQ(files.size(), 4u);
  EXPECT_EQ(files.at("rank-2.safetensors").size, 200u);
  EXPECT_EQ(files.at("rank-2.safetensors").xxh3, "00000000000000a2");
  EXPECT_EQ(files.at("rank-1.extra").chunk_bytes, 32u << 20);
  EXPECT_EQ(files.at("rank-1.extra").chunks, std::vector<std::string>{"00000000000000e1"});
  job.vote(0).publish_ok();
  job.vote(1).await_result();
  job.vote(2).await_result();
}

TEST(CommitVote, ATornRankRefusesTheStepAsTornOnEveryRank) {
  Job job(3);
  job.vote(1).report(1, {{"rank-1.safetensors", digest(100, "00000000000000a1")},
                         {"rank-1.extra", digest(3, "00000000000000e1")}});
  job.vote(2).report_failure(2, std::make_exception_ptr(TornSnapshot("'w' changed while copied", "f", 1)));
  std::exception_ptr refused;
  try {
    job.vote(0).gather(3);
  } catch (const TornSnapshot& e) {
    EXPECT_NE(std::string(e.what()).find("rank 2: 'w' changed while copied"), std::string::npos) << e.what();
    refused = std::current_exception();
  }
  ASSERT_TRUE(refused);
  job.vote(0).publish_failure(refused);
  std::string m = thrown<TornSnapshot>([&] { job.vote(1).await_result(); });
  EXPECT_NE(m.find("checkpoint step 7 was refused by the commit vote: rank 2: 'w' changed"), std::string::npos) << m;
}

TEST(CommitVote, AFailedRankAndALostPeerKeepTheirKinds) {
  Job job(2);
  job.vote(1).report_failure(1, std::make_exception_ptr(IoError("writing 'rank-1.safetensors' failed: No space left", "f", 1)));
  std::string m = thrown<IoError>([&] { job.vote(0).gather(2); });
  EXPECT_NE(m.find("checkpoint step 7: rank 1 failed: writing 'rank-1.safetensors' failed: No space left"), std::string::npos) << m;
  job.vote(0).publish_failure(std::make_exception_ptr(PeerLost("rank 3 stopped its heartbeat", "f", 1)));
  m = thrown<PeerLost>([&] { job.vote(1).await_result(); });
  EXPECT_NE(m.find("rank 0: rank 3 stopped its heartbeat"), std::string::npos) << m;
  // Any other error of rank 0's: the step was not committed, and why.
  Job other(2);
  other.vote(0).publish_failure(std::make_exception_ptr(CorruptData("manifest write failed", "f", 1)));
  m = thrown<IoError>([&] { other.vote(1).await_result(); });
  EXPECT_NE(m.find("checkpoint step 7 was not committed by rank 0: manifest write failed"), std::string::npos) << m;
}

TEST(CommitVote, HostileVotesAreCorruptDataNotACommit) {
  for (const char* vote : {"not json", "[1, 2]", R"({"files": 3})", R"({"other": {}})",
                           R"({"files": {"rank-1.safetensors": {"xxh3": "00000000000000a1"}}})",
                           R"({"files": {"rank-1.safetensors": {"size": -1, "xxh3": "00000000000000a1"}}})",
                           R"({"files": {"rank-1.safetensors": {"size": 1, "xxh3": 5}}})"}) {
    Job job(2);
    job.set(std::string(kSave) + "rank/1", vote);
    std::string m = thrown<CorruptData>([&] { job.vote(0).gather(2); });
    EXPECT_NE(m.find("rank 1"), std::string::npos) << vote << ": " << m;
  }
  // Digests that report() never writes: a file name that is not rank 1's own (a path in it, another rank's
  // file, one file too many or too few), a checksum that is not hex, chunks that do not cover the size. Each
  // would go into the manifest that loaders open files by.
  const std::string ok = R"({"size": 3, "xxh3": "00000000000000e1"})";
  const std::string data = R"("rank-1.safetensors": {"size": 3, "xxh3": "00000000000000a1"})";
  for (const std::string& files :
       {R"("../../victim": )" + ok + ", " + data, R"("rank-2.extra": )" + ok + ", " + data,
        R"("rank-1.extra": )" + ok + ", " + data + R"(, "rank-1.other": )" + ok, data,
        R"("rank-1.extra": {"size": 3, "xxh3": "../../x"}, )" + data,
        R"("rank-1.extra": {"size": 3, "xxh3": "00000000000000e1", "chunk_bytes": 1048576, "chunks": []}, )" + data,
        R"("rank-1.extra": {"size": 3, "xxh3": "00000000000000e1", "chunk_bytes": 1, )"
        R"("chunks": ["0000000000000001"]}, )" + data}) {
    Job job(2);
    job.set(std::string(kSave) + "rank/1", "{\"files\": {" + files + "}}");
    std::string m = thrown<CorruptData>([&] { job.vote(0).gather(2); });
    EXPECT_NE(m.find("rank 1"), std::string::npos) << files << ": " << m;
  }
  // A result rank 0 never wrote in its own shape still fails the wait with what it says.
  Job job(2);
  job.set(std::string(kSave) + "result", "garbage");
  std::string m = thrown<IoError>([&] { job.vote(1).await_result(); });
  EXPECT_NE(m.find("was not committed by rank 0: garbage"), std::string::npos) << m;
}

}  // namespace ettkit::checkpoint::detail
