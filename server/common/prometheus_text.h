// A parser of the Prometheus text exposition format (version 0.0.4) for tests that scrape
// /metrics: samples with their labels and values, plus the TYPE lines. It is written from the
// format's description, independently of prometheus-cpp's serializer, so a test that parses what
// the server wrote checks the real wire text.
//
// Callers: metrics tests. Thread-safety: pure functions and an immutable result.
// Ownership: results own their strings.
#ifndef MOE_SERVER_COMMON_PROMETHEUS_TEXT_H_
#define MOE_SERVER_COMMON_PROMETHEUS_TEXT_H_

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace moe::testing {

struct PromSample {
  std::string name;  // including _bucket / _sum / _count suffixes
  std::map<std::string, std::string> labels;
  double value = 0;
};

struct PromScrape {
  std::vector<PromSample> samples;
  std::map<std::string, std::string> types;  // family name -> counter | gauge | histogram | ...

  // Samples named `name` whose labels include every pair of `labels`.
  std::vector<const PromSample*> Find(absl::string_view name,
                                      const std::map<std::string, std::string>& labels = {}) const;
  // The one value of Find(name, labels); nullopt when there is none or more than one.
  std::optional<double> Value(absl::string_view name,
                              const std::map<std::string, std::string>& labels = {}) const;
  // Sum of the values of Find(name, labels) (0 when none match).
  double Sum(absl::string_view name, const std::map<std::string, std::string>& labels = {}) const;
};

// INVALID_ARGUMENT naming the line for anything that is not a comment, a blank line or a
// well-formed sample.
absl::StatusOr<PromScrape> ParsePrometheusText(absl::string_view text);

}  // namespace moe::testing

#endif  // MOE_SERVER_COMMON_PROMETHEUS_TEXT_H_
