// Durable coordinator state: a checksummed, append-only journal file.
//
// Purpose: lets a restarted moe_coordinator resume with the last committed cluster map version,
// the shard registry (rank -> shard id / address / model fingerprint) and the cumulative expert
// load totals. Callers: the coordinator main (Open + replay at start) and the cluster state
// owner (Append* whenever a map is committed, a shard registers, or a load snapshot is taken).
//
// Why a journal rather than SQLite: the state is tiny and written in whole records; an
// append-only file needs no new dependency, each record is one write() followed by fdatasync()
// (atomic enough: a crash can only leave a torn *tail*), and recovery is simple: replay records
// in order, stop at the first record whose framing or CRC-32C does not check out, and truncate
// the file there so new appends continue after the last good record. Later records for the same
// key (map, rank, load) supersede earlier ones, so replay folds the log into a JournalState.
//
// Record framing (little-endian): u32 magic "MJR1" | u8 type | u32 payload length |
// u32 CRC-32C of (type, length, payload) | payload.
//
// Thread-safety: Journal is thread-safe (one internal mutex serializes appends).
// Ownership: Journal owns its file descriptor; it is closed in the destructor.
#ifndef MOE_SERVER_COORDINATOR_JOURNAL_H_
#define MOE_SERVER_COORDINATOR_JOURNAL_H_

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "moe/v1/coordinator.pb.h"

namespace moe {

// A shard as the registry knew it. Restored shards are known but not alive until they
// heartbeat (or re-register) again.
struct JournalShard {
  uint32_t rank = 0;
  std::string shard_id;
  std::string address;
  std::string model_fingerprint;
};

// Cumulative routed-token counts, layer-major: per physical slot [L * P], per logical expert
// [L * E] and per shard rank [L * S] (the last two cannot be rebuilt from slot counts once the
// placement has changed, so they are kept too).
struct JournalLoad {
  std::vector<int64_t> slot;
  std::vector<int64_t> expert;
  std::vector<int64_t> shard;
};

// What replay recovered.
struct JournalState {
  std::optional<v1::ClusterMap> map;  // the last committed map
  std::map<uint32_t, JournalShard> shards;  // by rank
  std::optional<JournalLoad> load;  // the last load snapshot
  uint64_t records = 0;  // good records replayed
  uint64_t good_bytes = 0;  // file offset just after the last good record
  // Empty when the whole file replayed cleanly; otherwise why replay stopped early.
  std::string stop_reason;
};

// CRC-32C (Castagnoli), exposed for tests.
uint32_t Crc32c(absl::string_view data, uint32_t crc = 0);

// Reads the journal at `path` without modifying it. A missing file is an empty state.
absl::StatusOr<JournalState> ReplayJournal(const std::string& path);

class Journal {
 public:
  // Replays `dir`/coordinator.journal into *recovered, truncates any torn or corrupt tail
  // (logging why), and opens the file for appends. Creates `dir` if needed.
  // REQUIRES: recovered != nullptr.
  static absl::StatusOr<std::unique_ptr<Journal>> Open(const std::string& dir,
                                                       JournalState* recovered);
  ~Journal();
  Journal(const Journal&) = delete;
  Journal& operator=(const Journal&) = delete;

  // Each appends one record and makes it durable (fdatasync) before returning.
  absl::Status AppendMap(const v1::ClusterMap& map);
  absl::Status AppendShard(const JournalShard& shard);
  absl::Status AppendLoad(const JournalLoad& load);

  const std::string& path() const { return path_; }

 private:
  Journal(std::string path, int fd) : path_(std::move(path)), fd_(fd) {}
  absl::Status AppendRecord(uint8_t type, absl::string_view payload);

  const std::string path_;
  absl::Mutex mu_;
  int fd_ ABSL_GUARDED_BY(mu_);
};

}  // namespace moe

#endif  // MOE_SERVER_COORDINATOR_JOURNAL_H_
