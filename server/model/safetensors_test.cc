// Safetensors reader/writer: round trips for every dtype, hand-built files read back, and a table
// of hostile files (plus truncation and mutation sweeps) that must come back as errors.
#include "server/model/safetensors.h"

#include <cstring>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "server/model/test_util.h"

namespace moe::model {
namespace {

using testing::FreshDir;
using ::testing::HasSubstr;
using testing::ReadFile;
using testing::WriteFile;

// A safetensors file built by hand: little-endian length, header text, data.
std::string RawFile(const std::string& header, const std::string& data) {
  std::string out(8, '\0');
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out + header + data;
}

std::string RawLength(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(n >> (8 * i));
  return out;
}

struct DTypeCase {
  SafetensorsDType dtype;
  const char* name;
  int64_t size;
  bool has_kernel_dtype;
  DType kernel_dtype;
};

const DTypeCase kDTypeCases[] = {
    {SafetensorsDType::kU8, "U8", 1, true, DType::kU8},
    {SafetensorsDType::kI8, "I8", 1, false, DType::kU8},
    {SafetensorsDType::kBF16, "BF16", 2, true, DType::kBF16},
    {SafetensorsDType::kF16, "F16", 2, false, DType::kU8},
    {SafetensorsDType::kF32, "F32", 4, true, DType::kF32},
    {SafetensorsDType::kF8E4M3, "F8_E4M3", 1, true, DType::kE4M3},
    {SafetensorsDType::kI32, "I32", 4, true, DType::kI32},
    {SafetensorsDType::kI64, "I64", 8, true, DType::kI64},
    {SafetensorsDType::kBool, "BOOL", 1, true, DType::kBool},
};

TEST(SafetensorsDTypeTest, NamesSizesAndKernelDTypes) {
  for (const DTypeCase& c : kDTypeCases) {
    SCOPED_TRACE(c.name);
    EXPECT_EQ(SafetensorsDTypeName(c.dtype), c.name);
    EXPECT_EQ(SafetensorsDTypeSize(c.dtype), c.size);
    absl::StatusOr<SafetensorsDType> parsed = ParseSafetensorsDType(c.name);
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, c.dtype);
    absl::StatusOr<DType> kernel = ToDType(c.dtype);
    EXPECT_EQ(kernel.ok(), c.has_kernel_dtype);
    if (c.has_kernel_dtype) {
      EXPECT_EQ(*kernel, c.kernel_dtype);
      EXPECT_EQ(FromDType(c.kernel_dtype), c.dtype);
    }
  }
  EXPECT_EQ(ParseSafetensorsDType("F64").status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseSafetensorsDType("u8").status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(SafetensorsTest, RoundTripEveryDType) {
  const std::string path = FreshDir("roundtrip") + "/t.safetensors";
  SafetensorsWriter writer;
  std::vector<std::vector<uint8_t>> payloads;
  for (const DTypeCase& c : kDTypeCases) {
    std::vector<uint8_t> bytes(2 * 3 * c.size);
    for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<uint8_t>(i * 37 + c.size);
    payloads.push_back(bytes);
    ASSERT_TRUE(writer.Add(absl::StrCat("t.", c.name), c.dtype, {2, 3}, bytes).ok());
  }
  ASSERT_TRUE(writer.Add("scalar", SafetensorsDType::kF32, {}, {0, 0, 0x80, 0x3f}).ok());
  ASSERT_TRUE(writer.Add("empty", SafetensorsDType::kI64, {0, 4}, {}).ok());
  ASSERT_TRUE(writer.Write(path).ok());

  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->TensorNames().size(), std::size(kDTypeCases) + 2);
  for (size_t k = 0; k < std::size(kDTypeCases); ++k) {
    const DTypeCase& c = kDTypeCases[k];
    SCOPED_TRACE(c.name);
    absl::StatusOr<SafetensorsTensor> t = (*file)->Get(absl::StrCat("t.", c.name));
    ASSERT_TRUE(t.ok()) << t.status();
    EXPECT_EQ(t->dtype, c.dtype);
    EXPECT_EQ(t->shape, Shape({2, 3}));
    EXPECT_EQ(t->NumElements(), 6);
    EXPECT_EQ(std::vector<uint8_t>(t->bytes().begin(), t->bytes().end()), payloads[k]);
    // The writer aligns every tensor to its element size.
    EXPECT_EQ(reinterpret_cast<uintptr_t>(t->data) % c.size, 0u);
    absl::StatusOr<TensorView> view = t->View();
    ASSERT_EQ(view.ok(), c.has_kernel_dtype);
    if (c.has_kernel_dtype) {
      EXPECT_EQ(view->dtype, c.kernel_dtype);
      EXPECT_EQ(view->data, t->data);
    }
  }
  absl::StatusOr<SafetensorsTensor> scalar = (*file)->Get("scalar");
  ASSERT_TRUE(scalar.ok());
  EXPECT_TRUE(scalar->shape.empty());
  float one;
  std::memcpy(&one, scalar->data, 4);
  EXPECT_EQ(one, 1.f);
  absl::StatusOr<SafetensorsTensor> empty = (*file)->Get("empty");
  ASSERT_TRUE(empty.ok());
  EXPECT_EQ(empty->NumElements(), 0);
  EXPECT_EQ(empty->num_bytes, 0);

  // The header length is a multiple of 8 and the header is followed by the data only.
  const std::string raw = ReadFile(path);
  uint64_t header_len = 0;
  for (int i = 7; i >= 0; --i) header_len = (header_len << 8) | static_cast<uint8_t>(raw[i]);
  EXPECT_EQ(header_len % 8, 0u);
  EXPECT_EQ(raw.size(), 8 + header_len + writer.data_bytes());
}

TEST(SafetensorsTest, ReadsHandBuiltFile) {
  const std::string path = FreshDir("handbuilt") + "/h.safetensors";
  const float values[2] = {1.f, -2.5f};
  std::string data(reinterpret_cast<const char*>(values), sizeof(values));
  data += "\x07\x09";
  WriteFile(path, RawFile(R"({"__metadata__": {"format": "pt"},
      "b": {"dtype": "U8", "shape": [2], "data_offsets": [8, 10]},
      "a": {"dtype": "F32", "shape": [1, 2], "data_offsets": [0, 8]}}   )",
                          data));
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->TensorNames(), (std::vector<std::string>{"a", "b"}));
  absl::StatusOr<SafetensorsTensor> a = (*file)->Get("a");
  ASSERT_TRUE(a.ok());
  float read[2];
  std::memcpy(read, a->data, sizeof(read));
  EXPECT_EQ(read[0], 1.f);
  EXPECT_EQ(read[1], -2.5f);
  absl::StatusOr<SafetensorsTensor> b = (*file)->Get("b");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->data[0], 7);
  EXPECT_EQ(b->data[1], 9);
  absl::StatusOr<SafetensorsTensor> missing = (*file)->Get("c");
  EXPECT_EQ(missing.status().code(), absl::StatusCode::kNotFound);
  EXPECT_THAT(missing.status().message(), HasSubstr(path));
  EXPECT_THAT(missing.status().message(), HasSubstr("'c'"));
}

// The in-memory entry point reads a hand-built image in place: tensors point into the buffer.
TEST(SafetensorsTest, FromBufferReadsInPlace) {
  const std::string image =
      RawFile(R"({"b": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]}})", "\x01\x02\x03");
  const auto* base = reinterpret_cast<const uint8_t*>(image.data());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file =
      SafetensorsFile::FromBuffer("in-memory", absl::MakeConstSpan(base, image.size()));
  ASSERT_TRUE(file.ok()) << file.status();
  EXPECT_EQ((*file)->path(), "in-memory");
  EXPECT_EQ((*file)->file_size(), static_cast<int64_t>(image.size()));
  absl::StatusOr<SafetensorsTensor> b = (*file)->Get("b");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->data, base + image.size() - 3);
  EXPECT_EQ(b->shape, Shape{3});
  EXPECT_EQ(b->data[2], 3);
}

struct HostileCase {
  const char* label;
  std::string bytes;
  absl::StatusCode code;
  const char* message;  // substring the error must contain
};

std::string Entry(const std::string& fields) {
  return RawFile("{\"w\": {" + fields + "}}", std::string(8, 'x'));
}

std::vector<HostileCase> HostileCases() {
  const auto kInvalid = absl::StatusCode::kInvalidArgument;
  const auto kDataLoss = absl::StatusCode::kDataLoss;
  return {
      {"empty file", "", kDataLoss, "shorter than the 8-byte header length"},
      {"seven bytes", std::string(7, '\0'), kDataLoss, "shorter"},
      {"header longer than file", RawLength(64) + "{}", kDataLoss, "larger than the rest"},
      {"header over limit", RawLength((uint64_t{100} << 20) + 1) + "{}", kInvalid, "exceeds"},
      {"header length all ones", RawLength(~uint64_t{0}) + "{}", kInvalid, "exceeds"},
      {"bad json", RawFile("{\"w\": ", ""), kInvalid, "not valid JSON"},
      {"empty header", RawFile("", ""), kInvalid, "not valid JSON"},
      {"json array", RawFile("[1, 2]", ""), kInvalid, "not a JSON object"},
      {"invalid utf8", RawFile("{\"\xff\": 1}", ""), kInvalid, "not valid JSON"},
      {"entry not object", RawFile("{\"w\": 3}", ""), kInvalid, "'w': entry is not an object"},
      {"missing offsets", Entry(R"("dtype": "U8", "shape": [8])"), kInvalid, "data_offsets"},
      {"unknown dtype", Entry(R"("dtype": "Q4", "shape": [8], "data_offsets": [0, 8])"), kInvalid,
       "'Q4'"},
      {"dtype not string", Entry(R"("dtype": 1, "shape": [8], "data_offsets": [0, 8])"), kInvalid,
       "dtype"},
      {"negative dim", Entry(R"("dtype": "U8", "shape": [-1, 8], "data_offsets": [0, 8])"),
       kInvalid, "negative dimension"},
      {"fractional dim", Entry(R"("dtype": "U8", "shape": [2.5], "data_offsets": [0, 8])"),
       kInvalid, "bad dimension"},
      {"shape not array", Entry(R"("dtype": "U8", "shape": 8, "data_offsets": [0, 8])"), kInvalid,
       "not an array"},
      {"rank 17", Entry(R"("dtype": "U8", "shape": [1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,1,8],
                          "data_offsets": [0, 8])"),
       kInvalid, "rank 17"},
      {"element count overflow",
       Entry(R"("dtype": "F32", "shape": [4611686018427387904, 4], "data_offsets": [0, 8])"),
       kInvalid, "more bytes than fit"},
      {"offsets past end", Entry(R"("dtype": "U8", "shape": [16], "data_offsets": [0, 16])"),
       kDataLoss, "reach past"},
      {"huge offsets",
       Entry(
           R"("dtype": "U8", "shape": [1], "data_offsets": [18446744073709551614, 18446744073709551615])"),
       kInvalid, "data_offsets"},
      {"begin after end", Entry(R"("dtype": "U8", "shape": [0], "data_offsets": [8, 0])"), kInvalid,
       "end before they begin"},
      {"negative offset", Entry(R"("dtype": "U8", "shape": [8], "data_offsets": [-1, 7])"),
       kInvalid, "data_offsets"},
      {"three offsets", Entry(R"("dtype": "U8", "shape": [8], "data_offsets": [0, 4, 8])"),
       kInvalid, "data_offsets"},
      {"size mismatch", Entry(R"("dtype": "F32", "shape": [3], "data_offsets": [0, 8])"), kInvalid,
       "needs 12 bytes but data_offsets span 8"},
      {"deep nesting",
       RawFile("{\"w\": " + std::string(200000, '[') + std::string(200000, ']') + "}", ""),
       kInvalid, "entry is not an object"},
      {"duplicate name",
       RawFile(R"({"w": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                   "w": {"dtype": "U8", "shape": [1], "data_offsets": [1, 2]}})",
               "ab"),
       kInvalid, "'w' appears twice"},
  };
}

TEST(SafetensorsTest, HostileFilesAreErrors) {
  const std::string dir = FreshDir("hostile");
  int n = 0;
  for (const HostileCase& c : HostileCases()) {
    SCOPED_TRACE(c.label);
    const std::string path = absl::StrCat(dir, "/f", n++, ".safetensors");
    WriteFile(path, c.bytes);
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
    ASSERT_FALSE(file.ok());
    EXPECT_EQ(file.status().code(), c.code) << file.status();
    EXPECT_THAT(file.status().message(), HasSubstr(path));
    EXPECT_THAT(file.status().message(), HasSubstr(c.message));
    // The same bytes in memory fail the same way.
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> in_memory = SafetensorsFile::FromBuffer(
        "buffer",
        absl::MakeConstSpan(reinterpret_cast<const uint8_t*>(c.bytes.data()), c.bytes.size()));
    ASSERT_FALSE(in_memory.ok());
    EXPECT_EQ(in_memory.status().code(), c.code) << in_memory.status();
    EXPECT_THAT(in_memory.status().message(), HasSubstr("buffer"));
    EXPECT_THAT(in_memory.status().message(), HasSubstr(c.message));
  }
}

TEST(SafetensorsTest, MissingFileAndDirectory) {
  const std::string dir = FreshDir("missing");
  EXPECT_EQ(SafetensorsFile::Open(dir + "/nope.safetensors").status().code(),
            absl::StatusCode::kNotFound);
  EXPECT_EQ(SafetensorsFile::Open(dir).status().code(), absl::StatusCode::kInvalidArgument);
}

// A valid file cut at every length is an error at every length (each cut removes data bytes).
TEST(SafetensorsTest, EveryTruncationIsAnError) {
  const std::string dir = FreshDir("truncate");
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("a", SafetensorsDType::kF32, {3}, std::vector<uint8_t>(12, 1)).ok());
  ASSERT_TRUE(writer.Add("b", SafetensorsDType::kU8, {5}, std::vector<uint8_t>(5, 2)).ok());
  ASSERT_TRUE(writer.Write(dir + "/full.safetensors").ok());
  const std::string full = ReadFile(dir + "/full.safetensors");
  for (size_t len = 0; len < full.size(); ++len) {
    const std::string path = dir + "/cut.safetensors";
    WriteFile(path, full.substr(0, len));
    absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
    EXPECT_FALSE(file.ok()) << "length " << len;
  }
}

// Single-byte corruptions of the header never crash; whatever still opens stays in bounds.
TEST(SafetensorsTest, HeaderMutationsNeverEscapeTheFile) {
  const std::string dir = FreshDir("mutate");
  SafetensorsWriter writer;
  ASSERT_TRUE(
      writer.Add("alpha", SafetensorsDType::kBF16, {2, 2}, std::vector<uint8_t>(8, 3)).ok());
  ASSERT_TRUE(writer.Add("beta", SafetensorsDType::kU8, {3}, std::vector<uint8_t>(3, 4)).ok());
  ASSERT_TRUE(writer.Write(dir + "/ok.safetensors").ok());
  const std::string original = ReadFile(dir + "/ok.safetensors");
  const size_t header_end = original.size() - 11;
  const std::string path = dir + "/m.safetensors";
  for (size_t pos = 0; pos < header_end; ++pos) {
    for (char replacement : {'9', '-', '"', '{', ']', ',', '\xff', '\0', ' '}) {
      std::string mutated = original;
      mutated[pos] = replacement;
      WriteFile(path, mutated);
      absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
      if (!file.ok()) continue;
      for (const std::string& name : (*file)->TensorNames()) {
        absl::StatusOr<SafetensorsTensor> t = (*file)->Get(name);
        ASSERT_TRUE(t.ok());
        if (t->num_bytes == 0) continue;
        EXPECT_LE(t->num_bytes, (*file)->file_size() - 8);
        // Reading the first and last byte faults if a pointer escaped the mapping.
        volatile uint8_t first = t->data[0], last = t->data[t->num_bytes - 1];
        (void)first;
        (void)last;
      }
    }
  }
}

TEST(SafetensorsWriterTest, RejectsBadTensors) {
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("x", SafetensorsDType::kU8, {2}, {1, 2}).ok());
  EXPECT_THAT(writer.Add("x", SafetensorsDType::kU8, {2}, {1, 2}).message(), HasSubstr("twice"));
  EXPECT_EQ(writer.Add("y", SafetensorsDType::kF32, {2}, {1, 2}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(writer.Add("z", SafetensorsDType::kU8, {-1}, {}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(writer.Add("__metadata__", SafetensorsDType::kU8, {1}, {1}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(writer.Add("", SafetensorsDType::kU8, {1}, {1}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(writer.Add("a\"b", SafetensorsDType::kU8, {1}, {1}).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(writer.size(), 1u);
  EXPECT_EQ(writer.data_bytes(), 2);
  EXPECT_FALSE(writer.Write("/nonexistent-dir/x.safetensors").ok());
}

TEST(SafetensorsWriterTest, AddsViews) {
  const std::string path = FreshDir("views") + "/v.safetensors";
  HostTensor t(DType::kE4M3, {2, 2});
  for (int i = 0; i < 4; ++i) t.data<uint8_t>()[i] = static_cast<uint8_t>(0x38 + i);
  SafetensorsWriter writer;
  ASSERT_TRUE(writer.Add("scales", t.view()).ok());
  ASSERT_TRUE(writer.Write(path).ok());
  absl::StatusOr<std::unique_ptr<SafetensorsFile>> file = SafetensorsFile::Open(path);
  ASSERT_TRUE(file.ok());
  absl::StatusOr<SafetensorsTensor> read = (*file)->Get("scales");
  ASSERT_TRUE(read.ok());
  EXPECT_EQ(read->dtype, SafetensorsDType::kF8E4M3);
  EXPECT_EQ(std::vector<uint8_t>(read->bytes().begin(), read->bytes().end()),
            (std::vector<uint8_t>{0x38, 0x39, 0x3a, 0x3b}));
}

}  // namespace
}  // namespace moe::model
