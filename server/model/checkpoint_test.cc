// Checkpoint directories: single file, sharded with an index (opened lazily), malformed indexes.
#include "server/model/checkpoint.h"

#include <cstring>
#include <thread>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/model/test_util.h"

namespace moe::model {
namespace {

using ::testing::ElementsAre;
using testing::FreshDir;
using ::testing::HasSubstr;
using testing::WriteFile;

// Writes a file holding U8 tensors named `names`, tensor k filled with byte `first + k`.
void WriteU8File(const std::string& path, const std::vector<std::string>& names, uint8_t first) {
  SafetensorsWriter writer;
  for (size_t k = 0; k < names.size(); ++k) {
    ASSERT_TRUE(writer
                    .Add(names[k], SafetensorsDType::kU8, {4},
                         std::vector<uint8_t>(4, static_cast<uint8_t>(first + k)))
                    .ok());
  }
  ASSERT_TRUE(writer.Write(path).ok());
}

uint8_t FirstByte(const Checkpoint& checkpoint, const std::string& name) {
  absl::StatusOr<SafetensorsTensor> t = checkpoint.Get(name);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? t->data[0] : 0;
}

TEST(CheckpointTest, SingleFile) {
  const std::string dir = FreshDir("single");
  WriteU8File(dir + "/model.safetensors", {"x", "y"}, 10);
  absl::StatusOr<std::shared_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_THAT((*checkpoint)->TensorNames(), ElementsAre("x", "y"));
  EXPECT_THAT((*checkpoint)->file_names(), ElementsAre("model.safetensors"));
  EXPECT_TRUE((*checkpoint)->Contains("y"));
  EXPECT_FALSE((*checkpoint)->Contains("z"));
  EXPECT_EQ(FirstByte(**checkpoint, "x"), 10);
  EXPECT_EQ(FirstByte(**checkpoint, "y"), 11);
  absl::StatusOr<SafetensorsTensor> missing = (*checkpoint)->Get("z");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr(dir));
  EXPECT_THAT(missing.status().message(), HasSubstr("'z'"));
}

TEST(CheckpointTest, EmptyDirectoryIsNotFound) {
  absl::StatusOr<std::shared_ptr<Checkpoint>> checkpoint = Checkpoint::Open(FreshDir("empty"));
  EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kNotFound);
}

TEST(CheckpointTest, CorruptSingleFileFailsAtOpen) {
  const std::string dir = FreshDir("corrupt_single");
  WriteFile(dir + "/model.safetensors", "short");
  EXPECT_EQ(Checkpoint::Open(dir).status().code(), absl::StatusCode::kDataLoss);
}

constexpr char kTwoFileIndex[] = R"({
  "metadata": {"total_size": 12},
  "weight_map": {"a.0": "part-a.safetensors", "a.1": "part-a.safetensors",
                 "b.0": "part-b.safetensors"}
})";

TEST(CheckpointTest, ShardedWithIndexOpensFilesLazily) {
  const std::string dir = FreshDir("sharded");
  WriteU8File(dir + "/part-a.safetensors", {"a.0", "a.1"}, 20);
  WriteFile(dir + "/part-b.safetensors", "bad");
  WriteFile(dir + "/model.safetensors.index.json", kTwoFileIndex);
  absl::StatusOr<std::shared_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok()) << checkpoint.status();
  EXPECT_THAT((*checkpoint)->TensorNames(), ElementsAre("a.0", "a.1", "b.0"));
  EXPECT_THAT((*checkpoint)->file_names(), ElementsAre("part-a.safetensors", "part-b.safetensors"));
  // part-b is broken, but nothing in it has been asked for yet.
  EXPECT_EQ(FirstByte(**checkpoint, "a.1"), 21);
  absl::StatusOr<SafetensorsTensor> b = (*checkpoint)->Get("b.0");
  EXPECT_EQ(b.status().code(), absl::StatusCode::kDataLoss);
  EXPECT_THAT(b.status().message(), HasSubstr("part-b.safetensors"));

  // A repaired file is picked up by the next Get: failures are not cached.
  WriteU8File(dir + "/part-b.safetensors", {"b.0"}, 30);
  EXPECT_EQ(FirstByte(**checkpoint, "b.0"), 30);
}

TEST(CheckpointTest, IndexPointingAtWrongOrMissingFile) {
  const std::string dir = FreshDir("wrong_file");
  WriteU8File(dir + "/part-a.safetensors", {"a.0"}, 1);  // a.1 is not there
  WriteFile(dir + "/model.safetensors.index.json", kTwoFileIndex);
  absl::StatusOr<std::shared_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok());
  absl::StatusOr<SafetensorsTensor> a1 = (*checkpoint)->Get("a.1");
  EXPECT_EQ(a1.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(a1.status().message(), HasSubstr("places it in that file"));
  EXPECT_EQ((*checkpoint)->Get("b.0").status().code(), absl::StatusCode::kNotFound);
}

TEST(CheckpointTest, IndexWinsOverSingleFile) {
  const std::string dir = FreshDir("both");
  WriteU8File(dir + "/model.safetensors", {"a.0"}, 5);
  WriteU8File(dir + "/part-a.safetensors", {"a.0", "a.1"}, 7);
  WriteU8File(dir + "/part-b.safetensors", {"b.0"}, 9);
  WriteFile(dir + "/model.safetensors.index.json", kTwoFileIndex);
  absl::StatusOr<std::shared_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok());
  EXPECT_EQ(FirstByte(**checkpoint, "a.0"), 7);
}

TEST(CheckpointTest, MalformedIndexes) {
  const struct {
    const char* label;
    const char* index;
    const char* message;
  } cases[] = {
      {"not json", "{", "not a JSON object"},
      {"array", "[]", "not a JSON object"},
      {"no weight_map", R"({"metadata": {}})", "weight_map"},
      {"weight_map array", R"({"weight_map": []})", "weight_map"},
      {"parent dir", R"({"weight_map": {"t": "../x.safetensors"}})", "weight_map[\"t\"]"},
      {"sub dir", R"({"weight_map": {"t": "a/x.safetensors"}})", "weight_map[\"t\"]"},
      {"dot dot", R"({"weight_map": {"t": ".."}})", "weight_map[\"t\"]"},
      {"empty name", R"({"weight_map": {"t": ""}})", "weight_map[\"t\"]"},
      {"number", R"({"weight_map": {"t": 3}})", "weight_map[\"t\"]"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.label);
    const std::string dir = FreshDir("bad_index");
    WriteFile(dir + "/model.safetensors.index.json", c.index);
    absl::StatusOr<std::shared_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
    EXPECT_EQ(checkpoint.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_THAT(checkpoint.status().message(), HasSubstr(c.message));
  }
}

TEST(CheckpointTest, ConcurrentGetsOpenEachFileOnce) {
  const std::string dir = FreshDir("concurrent");
  WriteU8File(dir + "/part-a.safetensors", {"a.0", "a.1"}, 40);
  WriteU8File(dir + "/part-b.safetensors", {"b.0"}, 50);
  WriteFile(dir + "/model.safetensors.index.json", kTwoFileIndex);
  absl::StatusOr<std::shared_ptr<Checkpoint>> checkpoint = Checkpoint::Open(dir);
  ASSERT_TRUE(checkpoint.ok());
  std::vector<std::thread> threads;
  std::vector<const uint8_t*> seen(8);
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      absl::StatusOr<SafetensorsTensor> x = (*checkpoint)->Get(t % 2 ? "a.0" : "b.0");
      seen[t] = x.ok() ? x->data : nullptr;
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < 8; ++t) {
    ASSERT_NE(seen[t], nullptr);
    EXPECT_EQ(seen[t], seen[t % 2]);  // one mapping per file
    EXPECT_EQ(seen[t][0], t % 2 ? 40 : 50);
  }
}

TEST(ReadSmallFileTest, LimitsAndErrors) {
  const std::string dir = FreshDir("small");
  WriteFile(dir + "/f", "hello");
  absl::StatusOr<std::string> text = ReadSmallFile(dir + "/f", 5);
  ASSERT_TRUE(text.ok());
  EXPECT_EQ(*text, "hello");
  EXPECT_EQ(ReadSmallFile(dir + "/f", 4).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ReadSmallFile(dir + "/g", 4).status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE(RegularFileExists(dir + "/f"));
  EXPECT_FALSE(RegularFileExists(dir));
}

}  // namespace
}  // namespace moe::model
