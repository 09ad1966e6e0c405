// A small parser for the Prometheus text exposition format (0.0.4), so the
// metrics tests check samples by name, labels and value rather than by
// substring: a substring match would pass on a wrong bucket or a stray label.
#pragma once

#include <cmath>
#include <cstdlib>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace layerserve::testing {

struct Sample {
  std::string name;
  std::map<std::string, std::string> labels;
  double value = 0;
};

struct Exposition {
  std::vector<Sample> samples;
  std::map<std::string, std::string> types;  // family name -> "counter", "histogram", ...
  std::vector<std::string> errors;           // lines that did not parse

  // The value of the one sample with exactly this name and these labels.
  std::optional<double> Find(std::string_view name,
                             const std::map<std::string, std::string>& labels) const {
    for (const Sample& s : samples) {
      if (s.name == name && s.labels == labels) return s.value;
    }
    return std::nullopt;
  }

  // The `le` bounds of a histogram series, in exposition order, +Inf excluded.
  std::vector<double> BucketBounds(std::string_view family,
                                   const std::map<std::string, std::string>& labels) const {
    std::vector<double> bounds;
    const std::string bucket = std::string(family) + "_bucket";
    for (const Sample& s : samples) {
      if (s.name != bucket) continue;
      auto rest = s.labels;
      auto le = rest.find("le");
      if (le == rest.end()) continue;
      const std::string bound = le->second;
      rest.erase(le);
      if (rest != labels || bound == "+Inf") continue;
      bounds.push_back(std::strtod(bound.c_str(), nullptr));
    }
    return bounds;
  }

  // The cumulative count of the bucket whose bound equals `le` (to 1e-12
  // relative), or nullopt.
  std::optional<double> BucketCount(std::string_view family,
                                    const std::map<std::string, std::string>& labels,
                                    double le) const {
    const std::string bucket = std::string(family) + "_bucket";
    for (const Sample& s : samples) {
      if (s.name != bucket) continue;
      auto rest = s.labels;
      auto it = rest.find("le");
      if (it == rest.end() || it->second == "+Inf") continue;
      const double bound = std::strtod(it->second.c_str(), nullptr);
      rest.erase(it);
      if (rest == labels && std::abs(bound - le) <= 1e-12 * std::abs(le)) return s.value;
    }
    return std::nullopt;
  }
};

inline Exposition ParseExposition(std::string_view text) {
  Exposition out;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string_view::npos) eol = text.size();
    std::string_view line = text.substr(pos, eol - pos);
    pos = eol + 1;
    if (line.empty()) continue;
    if (line.rfind("# TYPE ", 0) == 0) {
      std::string_view rest = line.substr(7);
      const size_t sp = rest.find(' ');
      if (sp == std::string_view::npos) {
        out.errors.emplace_back(line);
        continue;
      }
      out.types[std::string(rest.substr(0, sp))] = std::string(rest.substr(sp + 1));
      continue;
    }
    if (line[0] == '#') continue;
    Sample sample;
    size_t i = line.find_first_of("{ ");
    if (i == std::string_view::npos) {
      out.errors.emplace_back(line);
      continue;
    }
    sample.name = std::string(line.substr(0, i));
    bool ok = true;
    if (line[i] == '{') {
      ++i;
      while (ok && i < line.size() && line[i] != '}') {
        const size_t eq = line.find("=\"", i);
        if (eq == std::string_view::npos) {
          ok = false;
          break;
        }
        std::string key(line.substr(i, eq - i));
        std::string value;
        size_t j = eq + 2;
        for (; j < line.size() && line[j] != '"'; ++j) {
          if (line[j] == '\\' && j + 1 < line.size()) {
            ++j;
            value.push_back(line[j] == 'n' ? '\n' : line[j]);
          } else {
            value.push_back(line[j]);
          }
        }
        if (j >= line.size()) {
          ok = false;
          break;
        }
        sample.labels[key] = value;
        i = j + 1;
        if (i < line.size() && line[i] == ',') ++i;
      }
      if (i >= line.size()) ok = false;
      ++i;  // past '}'
    }
    if (ok) {
      while (i < line.size() && line[i] == ' ') ++i;
      const std::string value(line.substr(i, line.find(' ', i) - i));
      char* end = nullptr;
      sample.value = std::strtod(value.c_str(), &end);
      ok = !value.empty() && end == value.c_str() + value.size();
    }
    if (!ok) {
      out.errors.emplace_back(line);
      continue;
    }
    out.samples.push_back(std::move(sample));
  }
  return out;
}

}  // namespace layerserve::testing
