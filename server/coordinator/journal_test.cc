// Tests for the coordinator journal: round trip, torn tails, bit flips, appends after recovery.
#include "server/coordinator/journal.h"

#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"

namespace moe {
namespace {

std::string FreshDir(const std::string& name) {
  const char* tmp = std::getenv("TEST_TMPDIR");
  const std::string dir = absl::StrCat(tmp ? tmp : "/tmp", "/", name, "_", ::getpid());
  std::remove(absl::StrCat(dir, "/coordinator.journal").c_str());
  return dir;
}

std::string ReadAll(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

void WriteAll(const std::string& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

v1::ClusterMap MapWithVersion(uint64_t version) {
  v1::ClusterMap map;
  map.set_version(version);
  map.set_num_physical(4);
  for (uint32_t r : {0u, 0u, 1u, 1u}) map.add_slot_to_rank(r);
  return map;
}

// Writes: map v3, shard 0, shard 1, load, map v5, shard 1 (new address). Returns the file
// sizes after each record so tests can cut inside a specific one.
std::vector<size_t> WriteSample(const std::string& dir) {
  std::vector<size_t> ends;
  JournalState state;
  auto journal = Journal::Open(dir, &state);
  EXPECT_TRUE(journal.ok()) << journal.status();
  const std::string path = (*journal)->path();
  auto mark = [&] { ends.push_back(ReadAll(path).size()); };
  EXPECT_TRUE((*journal)->AppendMap(MapWithVersion(3)).ok());
  mark();
  EXPECT_TRUE((*journal)->AppendShard({0, "shard-a", "127.0.0.1:1000", "fp-1"}).ok());
  mark();
  EXPECT_TRUE((*journal)->AppendShard({1, "shard-b", "127.0.0.1:1001", "fp-1"}).ok());
  mark();
  EXPECT_TRUE((*journal)->AppendLoad({{1, 2, 3, 40, 50, 60}, {7, 8}, {9}}).ok());
  mark();
  EXPECT_TRUE((*journal)->AppendMap(MapWithVersion(5)).ok());
  mark();
  EXPECT_TRUE((*journal)->AppendShard({1, "shard-c", "127.0.0.1:2002", "fp-1"}).ok());
  mark();
  return ends;
}

TEST(Crc32cTest, KnownVector) {
  // The CRC-32C check value for "123456789" (RFC 3720 / iSCSI).
  EXPECT_EQ(Crc32c("123456789"), 0xe3069283u);
}

TEST(JournalTest, RoundTripKeepsLatestOfEachKey) {
  const std::string dir = FreshDir("roundtrip");
  WriteSample(dir);
  JournalState state;
  auto journal = Journal::Open(dir, &state);
  ASSERT_TRUE(journal.ok()) << journal.status();
  EXPECT_EQ(state.records, 6u);
  EXPECT_TRUE(state.stop_reason.empty());
  ASSERT_TRUE(state.map.has_value());
  EXPECT_EQ(state.map->version(), 5u);
  EXPECT_EQ(state.map->slot_to_rank_size(), 4);
  ASSERT_EQ(state.shards.size(), 2u);
  EXPECT_EQ(state.shards[0].shard_id, "shard-a");
  EXPECT_EQ(state.shards[0].address, "127.0.0.1:1000");
  EXPECT_EQ(state.shards[0].model_fingerprint, "fp-1");
  EXPECT_EQ(state.shards[1].shard_id, "shard-c");
  EXPECT_EQ(state.shards[1].address, "127.0.0.1:2002");
  ASSERT_TRUE(state.load.has_value());
  EXPECT_EQ(state.load->slot, (std::vector<int64_t>{1, 2, 3, 40, 50, 60}));
  EXPECT_EQ(state.load->expert, (std::vector<int64_t>{7, 8}));
  EXPECT_EQ(state.load->shard, (std::vector<int64_t>{9}));
}

TEST(JournalTest, EmptyDirIsEmptyState) {
  JournalState state;
  auto journal = Journal::Open(FreshDir("empty"), &state);
  ASSERT_TRUE(journal.ok()) << journal.status();
  EXPECT_EQ(state.records, 0u);
  EXPECT_FALSE(state.map.has_value());
  EXPECT_TRUE(state.shards.empty());
  EXPECT_FALSE(state.load.has_value());
}

TEST(JournalTest, TornTailRecoversEverythingBeforeItAndAppendsAfter) {
  const std::string dir = FreshDir("torn");
  const std::vector<size_t> ends = WriteSample(dir);
  const std::string path = absl::StrCat(dir, "/coordinator.journal");
  // Cut in the middle of the 5th record (map v5): records 1-4 survive.
  const std::string bytes = ReadAll(path);
  WriteAll(path, bytes.substr(0, (ends[3] + ends[4]) / 2));
  {
    JournalState state;
    auto journal = Journal::Open(dir, &state);
    ASSERT_TRUE(journal.ok()) << journal.status();
    EXPECT_EQ(state.records, 4u);
    EXPECT_NE(state.stop_reason.find("torn"), std::string::npos) << state.stop_reason;
    ASSERT_TRUE(state.map.has_value());
    EXPECT_EQ(state.map->version(), 3u);
    EXPECT_EQ(state.shards[1].shard_id, "shard-b");
    ASSERT_TRUE(state.load.has_value());
    EXPECT_EQ(state.load->slot[5], 60);
    // The torn tail was cut off, so a new append lands right after record 4.
    EXPECT_EQ(ReadAll(path).size(), ends[3]);
    ASSERT_TRUE((*journal)->AppendMap(MapWithVersion(7)).ok());
  }
  JournalState state;
  auto journal = Journal::Open(dir, &state);
  ASSERT_TRUE(journal.ok());
  EXPECT_EQ(state.records, 5u);
  EXPECT_TRUE(state.stop_reason.empty()) << state.stop_reason;
  EXPECT_EQ(state.map->version(), 7u);
}

TEST(JournalTest, TornHeaderAlsoRecovers) {
  const std::string dir = FreshDir("tornheader");
  const std::vector<size_t> ends = WriteSample(dir);
  const std::string path = absl::StrCat(dir, "/coordinator.journal");
  WriteAll(path, ReadAll(path).substr(0, ends[1] + 5));  // 5 bytes into record 3's header
  auto state = ReplayJournal(path);
  ASSERT_TRUE(state.ok());
  EXPECT_EQ(state->records, 2u);
  EXPECT_EQ(state->good_bytes, ends[1]);
  EXPECT_EQ(state->shards.size(), 1u);
}

TEST(JournalTest, FlippedBitIsDetectedAndStopsReplayThere) {
  const std::string dir = FreshDir("bitflip");
  const std::vector<size_t> ends = WriteSample(dir);
  const std::string path = absl::StrCat(dir, "/coordinator.journal");
  std::string bytes = ReadAll(path);
  // Flip one bit in the payload of record 4 (the load snapshot): the last counter (shard 9)
  // changes value, which only the checksum can notice.
  bytes[ends[3] - 3] ^= 0x04;
  WriteAll(path, bytes);
  auto state = ReplayJournal(path);
  ASSERT_TRUE(state.ok());
  EXPECT_EQ(state->records, 3u);
  EXPECT_EQ(state->good_bytes, ends[2]);
  EXPECT_NE(state->stop_reason.find("checksum mismatch"), std::string::npos)
      << state->stop_reason;
  EXPECT_FALSE(state->load.has_value());
  EXPECT_EQ(state->map->version(), 3u);
  // Replay is read-only; Open truncates the corrupt part away.
  EXPECT_EQ(ReadAll(path).size(), bytes.size());
  JournalState opened;
  ASSERT_TRUE(Journal::Open(dir, &opened).ok());
  EXPECT_EQ(opened.records, 3u);
  EXPECT_EQ(ReadAll(path).size(), ends[2]);
}

}  // namespace
}  // namespace moe
