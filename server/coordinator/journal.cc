// Implementation of the coordinator journal; see journal.h for the format and why.
#include "server/coordinator/journal.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "glog/logging.h"

namespace moe {
namespace {

constexpr uint32_t kMagic = 0x31524a4d;  // "MJR1" read as little-endian bytes.
constexpr size_t kHeaderBytes = 13;  // magic(4) type(1) length(4) crc(4)
constexpr uint32_t kMaxPayload = 256u << 20;  // a sanity bound against garbage lengths
constexpr char kFileName[] = "coordinator.journal";

enum RecordType : uint8_t { kMapRecord = 1, kShardRecord = 2, kLoadRecord = 3 };

const std::array<uint32_t, 256>& CrcTable() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

void PutU32(std::string* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutU64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutString(std::string* out, absl::string_view s) {
  PutU32(out, static_cast<uint32_t>(s.size()));
  out->append(s.data(), s.size());
}

// Bounds-checked little-endian reader over one payload.
class Reader {
 public:
  explicit Reader(absl::string_view data) : data_(data) {}
  bool U32(uint32_t* v) {
    uint64_t w;
    if (!Fixed(4, &w)) return false;
    *v = static_cast<uint32_t>(w);
    return true;
  }
  bool U64(uint64_t* v) { return Fixed(8, v); }
  bool String(std::string* s) {
    uint32_t n;
    if (!U32(&n) || n > data_.size() - pos_) return false;
    s->assign(data_.data() + pos_, n);
    pos_ += n;
    return true;
  }
  bool done() const { return pos_ == data_.size(); }

 private:
  bool Fixed(int bytes, uint64_t* v) {
    if (data_.size() - pos_ < static_cast<size_t>(bytes)) return false;
    *v = 0;
    for (int i = 0; i < bytes; ++i) {
      *v |= static_cast<uint64_t>(static_cast<uint8_t>(data_[pos_ + i])) << (8 * i);
    }
    pos_ += bytes;
    return true;
  }
  absl::string_view data_;
  size_t pos_ = 0;
};

uint32_t ReadU32(const char* p) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(p[i])) << (8 * i);
  return v;
}

// Applies one checked record to *state; false when its payload does not decode.
bool ApplyRecord(uint8_t type, absl::string_view payload, JournalState* state) {
  switch (type) {
    case kMapRecord: {
      v1::ClusterMap map;
      if (!map.ParseFromArray(payload.data(), static_cast<int>(payload.size()))) return false;
      state->map = std::move(map);
      return true;
    }
    case kShardRecord: {
      Reader r(payload);
      JournalShard shard;
      if (!r.U32(&shard.rank) || !r.String(&shard.shard_id) || !r.String(&shard.address) ||
          !r.String(&shard.model_fingerprint) || !r.done()) {
        return false;
      }
      state->shards[shard.rank] = std::move(shard);
      return true;
    }
    case kLoadRecord: {
      Reader r(payload);
      JournalLoad load;
      for (std::vector<int64_t>* v : {&load.slot, &load.expert, &load.shard}) {
        uint32_t n;
        if (!r.U32(&n) || n > payload.size() / 8) return false;
        v->resize(n);
        for (int64_t& c : *v) {
          uint64_t u;
          if (!r.U64(&u)) return false;
          c = static_cast<int64_t>(u);
        }
      }
      if (!r.done()) return false;
      state->load = std::move(load);
      return true;
    }
    default:
      return false;
  }
}

// Folds the records in `data` into a state, stopping at the first bad one.
JournalState ReplayBytes(absl::string_view data) {
  JournalState state;
  size_t pos = 0;
  while (pos < data.size()) {
    if (data.size() - pos < kHeaderBytes) {
      state.stop_reason = absl::StrCat("torn record header at offset ", pos);
      break;
    }
    const char* h = data.data() + pos;
    const uint32_t magic = ReadU32(h);
    const uint8_t type = static_cast<uint8_t>(h[4]);
    const uint32_t length = ReadU32(h + 5);
    const uint32_t crc = ReadU32(h + 9);
    if (magic != kMagic || length > kMaxPayload) {
      state.stop_reason = absl::StrCat("bad record framing at offset ", pos);
      break;
    }
    if (data.size() - pos - kHeaderBytes < length) {
      state.stop_reason = absl::StrCat("torn record payload at offset ", pos);
      break;
    }
    const absl::string_view payload(h + kHeaderBytes, length);
    uint32_t want = Crc32c(absl::string_view(h + 4, 5));
    want = Crc32c(payload, want);
    if (want != crc) {
      state.stop_reason = absl::StrCat("checksum mismatch in record at offset ", pos);
      break;
    }
    if (!ApplyRecord(type, payload, &state)) {
      state.stop_reason = absl::StrCat("undecodable record (type ", type, ") at offset ", pos);
      break;
    }
    pos += kHeaderBytes + length;
    ++state.records;
    state.good_bytes = pos;
  }
  return state;
}

absl::Status ErrnoStatus(absl::string_view what, const std::string& path) {
  return absl::InternalError(absl::StrCat(what, " ", path, ": ", std::strerror(errno)));
}

}  // namespace

uint32_t Crc32c(absl::string_view data, uint32_t crc) {
  const auto& table = CrcTable();
  crc = ~crc;
  for (char ch : data) crc = table[(crc ^ static_cast<uint8_t>(ch)) & 0xff] ^ (crc >> 8);
  return ~crc;
}

absl::StatusOr<JournalState> ReplayJournal(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return JournalState{};
  std::ostringstream bytes;
  bytes << in.rdbuf();
  if (in.bad()) return absl::InternalError(absl::StrCat("cannot read ", path));
  return ReplayBytes(bytes.str());
}

absl::StatusOr<std::unique_ptr<Journal>> Journal::Open(const std::string& dir,
                                                       JournalState* recovered) {
  if (::mkdir(dir.c_str(), 0755) != 0 && errno != EEXIST) {
    return ErrnoStatus("cannot create state dir", dir);
  }
  const std::string path = absl::StrCat(dir, "/", kFileName);
  absl::StatusOr<JournalState> state = ReplayJournal(path);
  if (!state.ok()) return state.status();
  const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoStatus("cannot open journal", path);
  if (!state->stop_reason.empty()) {
    LOG(WARNING) << "journal " << path << ": replay stopped (" << state->stop_reason << ") after "
                 << state->records << " good records; truncating to " << state->good_bytes
                 << " bytes";
  }
  // Drop a torn or corrupt tail so the next append starts right after the last good record.
  if (::ftruncate(fd, static_cast<off_t>(state->good_bytes)) != 0 ||
      ::lseek(fd, 0, SEEK_END) < 0) {
    const absl::Status status = ErrnoStatus("cannot truncate journal", path);
    ::close(fd);
    return status;
  }
  LOG(INFO) << "journal " << path << ": replayed " << state->records << " records (map version "
            << (state->map ? state->map->version() : 0) << ", " << state->shards.size()
            << " known shards)";
  *recovered = *std::move(state);
  return std::unique_ptr<Journal>(new Journal(path, fd));
}

Journal::~Journal() {
  absl::MutexLock lock(&mu_);
  if (fd_ >= 0) ::close(fd_);
}

absl::Status Journal::AppendMap(const v1::ClusterMap& map) {
  return AppendRecord(kMapRecord, map.SerializeAsString());
}

absl::Status Journal::AppendShard(const JournalShard& shard) {
  std::string payload;
  PutU32(&payload, shard.rank);
  PutString(&payload, shard.shard_id);
  PutString(&payload, shard.address);
  PutString(&payload, shard.model_fingerprint);
  return AppendRecord(kShardRecord, payload);
}

absl::Status Journal::AppendLoad(const JournalLoad& load) {
  std::string payload;
  for (const std::vector<int64_t>* v : {&load.slot, &load.expert, &load.shard}) {
    PutU32(&payload, static_cast<uint32_t>(v->size()));
    for (int64_t c : *v) PutU64(&payload, static_cast<uint64_t>(c));
  }
  return AppendRecord(kLoadRecord, payload);
}

absl::Status Journal::AppendRecord(uint8_t type, absl::string_view payload) {
  if (payload.size() > kMaxPayload) return absl::InvalidArgumentError("journal record too large");
  std::string record;
  record.reserve(kHeaderBytes + payload.size());
  PutU32(&record, kMagic);
  record.push_back(static_cast<char>(type));
  PutU32(&record, static_cast<uint32_t>(payload.size()));
  uint32_t crc = Crc32c(absl::string_view(record.data() + 4, 5));
  PutU32(&record, Crc32c(payload, crc));
  record.append(payload.data(), payload.size());
  absl::MutexLock lock(&mu_);
  const off_t start = ::lseek(fd_, 0, SEEK_END);
  if (start < 0) return ErrnoStatus("cannot seek journal", path_);
  size_t written = 0;
  while (written < record.size()) {
    const ssize_t n = ::write(fd_, record.data() + written, record.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const absl::Status status = ErrnoStatus("cannot append to journal", path_);
      // Cut a partial record off so later appends do not land behind a torn one.
      if (::ftruncate(fd_, start) != 0) LOG(ERROR) << "cannot cut partial record in " << path_;
      return status;
    }
    written += static_cast<size_t>(n);
  }
  if (::fdatasync(fd_) != 0) return ErrnoStatus("cannot sync journal", path_);
  return absl::OkStatus();
}

}  // namespace moe
