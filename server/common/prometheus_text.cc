#include "server/common/prometheus_text.h"

#include <cstdint>
#include <limits>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace moe::testing {
namespace {

bool IsNameChar(char c, bool first) {
  return absl::ascii_isalpha(c) || c == '_' || c == ':' || (!first && absl::ascii_isdigit(c));
}

// Consumes a metric or label name from the front of `s`.
std::optional<std::string> TakeName(absl::string_view& s) {
  size_t n = 0;
  while (n < s.size() && IsNameChar(s[n], n == 0)) ++n;
  if (n == 0) return std::nullopt;
  std::string name(s.substr(0, n));
  s.remove_prefix(n);
  return name;
}

// Consumes a double-quoted label value with the format's escapes (\\, \", \n).
std::optional<std::string> TakeQuoted(absl::string_view& s) {
  if (s.empty() || s[0] != '"') return std::nullopt;
  std::string out;
  for (size_t i = 1; i < s.size(); ++i) {
    const char c = s[i];
    if (c == '"') {
      s.remove_prefix(i + 1);
      return out;
    }
    if (c != '\\') {
      out.push_back(c);
      continue;
    }
    if (++i == s.size()) return std::nullopt;
    switch (s[i]) {
      case '\\':
        out.push_back('\\');
        break;
      case '"':
        out.push_back('"');
        break;
      case 'n':
        out.push_back('\n');
        break;
      default:
        return std::nullopt;
    }
  }
  return std::nullopt;
}

// Prometheus' own parser (Go's ParseFloat) takes Inf and NaN in any case, and prometheus-cpp
// writes "Nan"; so does this one.
bool ParseValue(absl::string_view text, double* value) {
  absl::string_view unsigned_text = text;
  const bool negative = absl::ConsumePrefix(&unsigned_text, "-");
  if (!negative) absl::ConsumePrefix(&unsigned_text, "+");
  if (absl::EqualsIgnoreCase(unsigned_text, "inf")) {
    *value = negative ? -std::numeric_limits<double>::infinity()
                      : std::numeric_limits<double>::infinity();
  } else if (absl::EqualsIgnoreCase(unsigned_text, "nan")) {
    *value = std::numeric_limits<double>::quiet_NaN();
  } else {
    return absl::SimpleAtod(text, value);
  }
  return true;
}

// Parses `{name="value",...}` from the front of `s`, allowing a trailing comma.
bool TakeLabels(absl::string_view& s, std::map<std::string, std::string>* labels) {
  if (s.empty() || s[0] != '{') return true;
  s.remove_prefix(1);
  while (true) {
    if (!s.empty() && s[0] == '}') {
      s.remove_prefix(1);
      return true;
    }
    std::optional<std::string> name = TakeName(s);
    if (!name || s.empty() || s[0] != '=') return false;
    s.remove_prefix(1);
    std::optional<std::string> value = TakeQuoted(s);
    if (!value || labels->count(*name) > 0) return false;
    (*labels)[*name] = *value;
    if (!s.empty() && s[0] == ',') s.remove_prefix(1);
  }
}

absl::StatusOr<PromSample> ParseSampleLine(absl::string_view line) {
  const absl::Status bad = absl::InvalidArgumentError(absl::StrCat("bad sample line: ", line));
  PromSample sample;
  absl::string_view rest = line;
  std::optional<std::string> name = TakeName(rest);
  if (!name) return bad;
  sample.name = *name;
  if (!TakeLabels(rest, &sample.labels)) return bad;
  std::vector<absl::string_view> fields =
      absl::StrSplit(absl::StripAsciiWhitespace(rest), ' ', absl::SkipEmpty());
  // A value, optionally followed by a timestamp in milliseconds.
  if (fields.empty() || fields.size() > 2 || !ParseValue(fields[0], &sample.value)) return bad;
  int64_t timestamp = 0;
  if (fields.size() == 2 && !absl::SimpleAtoi(fields[1], &timestamp)) return bad;
  return sample;
}

}  // namespace

absl::StatusOr<PromScrape> ParsePrometheusText(absl::string_view text) {
  PromScrape scrape;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    line = absl::StripTrailingAsciiWhitespace(line);
    if (line.empty()) continue;
    if (line[0] == '#') {
      std::vector<absl::string_view> words = absl::StrSplit(line, ' ', absl::SkipEmpty());
      if (words.size() >= 4 && words[1] == "TYPE") {
        scrape.types[std::string(words[2])] = std::string(words[3]);
      }
      continue;
    }
    absl::StatusOr<PromSample> sample = ParseSampleLine(line);
    if (!sample.ok()) return sample.status();
    scrape.samples.push_back(*std::move(sample));
  }
  return scrape;
}

std::vector<const PromSample*> PromScrape::Find(
    absl::string_view name, const std::map<std::string, std::string>& labels) const {
  std::vector<const PromSample*> found;
  for (const PromSample& s : samples) {
    if (s.name != name) continue;
    bool match = true;
    for (const auto& [key, value] : labels) {
      auto it = s.labels.find(key);
      if (it == s.labels.end() || it->second != value) {
        match = false;
        break;
      }
    }
    if (match) found.push_back(&s);
  }
  return found;
}

std::optional<double> PromScrape::Value(absl::string_view name,
                                        const std::map<std::string, std::string>& labels) const {
  std::vector<const PromSample*> found = Find(name, labels);
  if (found.size() != 1) return std::nullopt;
  return found[0]->value;
}

double PromScrape::Sum(absl::string_view name,
                       const std::map<std::string, std::string>& labels) const {
  double sum = 0;
  for (const PromSample* s : Find(name, labels)) sum += s->value;
  return sum;
}

}  // namespace moe::testing
