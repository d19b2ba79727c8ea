// Option checks shared by the qattn subcommands. CLI11 validators see each value as
// typed, before conversion, so these reject what CLI11's own conversion would take
// silently ("-1" for an unsigned seed wraps to 2^64 - 1) and state ranges in digits a
// reader can read (CLI11's PositiveNumber prints DBL_MAX in full). List options are
// parsed here too: CLI11 drops the empty entry of "1,,2" before any validator sees it.
#pragma once

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <CLI/CLI.hpp>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

namespace qattn::cli {

// Parses a whole decimal integer (optional '-', digits, nothing else) into `out`.
inline bool parse_integer(const std::string& s, long long& out) {
  if (s.empty() || s.size() > 20) return false;
  std::size_t i = s[0] == '-' ? 1 : 0;
  if (i == s.size()) return false;
  for (std::size_t j = i; j < s.size(); ++j)
    if (s[j] < '0' || s[j] > '9') return false;
  errno = 0;
  char* end = nullptr;
  out = std::strtoll(s.c_str(), &end, 10);
  return errno == 0 && end == s.c_str() + s.size();
}

// Parses a finite decimal number (what strtod takes, whole string, no inf/nan).
inline bool parse_finite(const std::string& s, double& out) {
  if (s.empty() || std::isspace(static_cast<unsigned char>(s[0]))) return false;
  char* end = nullptr;
  errno = 0;
  out = std::strtod(s.c_str(), &end);
  return errno == 0 && end == s.c_str() + s.size() && std::isfinite(out);
}

inline std::string range_text(long long lo, long long hi) { return fmt::format("[{}, {}]", lo, hi); }

// An integer in [lo, hi].
inline CLI::Validator integer_in(long long lo, long long hi) {
  return CLI::Validator(
      [lo, hi](std::string& s) -> std::string {
        long long v = 0;
        if (!parse_integer(s, v) || v < lo || v > hi)
          return fmt::format("must be an integer in {}, got '{}'", range_text(lo, hi), s);
        return {};
      },
      fmt::format("INT in {}", range_text(lo, hi)));
}

// A non-negative integer that fits 64 bits (a seed): digits only, so "-1" is refused.
inline CLI::Validator uint64_value() {
  return CLI::Validator(
      [](std::string& s) -> std::string {
        const std::string why = fmt::format(
            "must be an integer in [0, {}], got '{}'", std::numeric_limits<std::uint64_t>::max(), s);
        if (s.empty() || s.size() > 20) return why;
        for (char ch : s)
          if (ch < '0' || ch > '9') return why;
        errno = 0;
        char* end = nullptr;
        std::strtoull(s.c_str(), &end, 10);
        return errno == 0 ? std::string() : why;
      },
      "UINT64");
}

// Splits a comma-separated list; every entry must be non-empty.
inline std::vector<std::string> split_list(const std::string& option, const std::string& s) {
  std::vector<std::string> parts;
  std::size_t begin = 0;
  while (true) {
    const std::size_t comma = s.find(',', begin);
    parts.push_back(s.substr(begin, comma == std::string::npos ? std::string::npos : comma - begin));
    if (parts.back().empty())
      throw CLI::ValidationError(option, fmt::format("empty entry in the list '{}'", s));
    if (comma == std::string::npos) return parts;
    begin = comma + 1;
  }
}

// A comma-separated list of integers, each in [lo, hi], into `target`.
inline CLI::Option* add_int_list(CLI::App* app, const std::string& name, std::vector<int>& target,
                                 const std::string& description, int lo, int hi) {
  return app
      ->add_option_function<std::string>(
          name,
          [name, &target, lo, hi](const std::string& s) {
            std::vector<int> out;
            for (const std::string& p : split_list(name, s)) {
              long long v = 0;
              if (!parse_integer(p, v) || v < lo || v > hi)
                throw CLI::ValidationError(
                    name, fmt::format("entries must be integers in {}, got '{}'", range_text(lo, hi), p));
              out.push_back(static_cast<int>(v));
            }
            target = std::move(out);
          },
          description)
      ->default_str(fmt::format("{}", fmt::join(target, ",")))
      ->type_name(fmt::format("INT,... in {}", range_text(lo, hi)));
}

// A comma-separated list of finite numbers greater than zero, into `target`.
inline CLI::Option* add_positive_list(CLI::App* app, const std::string& name,
                                      std::vector<double>& target, const std::string& description) {
  return app
      ->add_option_function<std::string>(
          name,
          [name, &target](const std::string& s) {
            std::vector<double> out;
            for (const std::string& p : split_list(name, s)) {
              double v = 0;
              if (!parse_finite(p, v) || v <= 0.0)
                throw CLI::ValidationError(
                    name, fmt::format("entries must be finite numbers > 0, got '{}'", p));
              out.push_back(v);
            }
            target = std::move(out);
          },
          description)
      ->default_str(fmt::format("{}", fmt::join(target, ",")))
      ->type_name("FLOAT,...");
}

}  // namespace qattn::cli
