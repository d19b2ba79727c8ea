// The accuracy bounds of a scheme, read from tests/tolerances/<scheme>.json: one table
// for the C++ and the Python suites, so the two cannot drift apart. The test binaries
// may run on another machine than the one that built them, so the folder is found as:
// $QATTN_TOLERANCES (the folder, or the .json file itself), else the source tree's
// tests/tolerances as configured (QATTN_TOLERANCES_DIR), else ./tests/tolerances (the
// repository root as working directory).
#pragma once

#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

namespace qattn::test {

struct Bound {
  double value = 0.0;
  std::string why;
};

struct Tolerances {
  std::string scheme, path;
  std::map<std::string, Bound> bounds;
  // The bound named `name`; throws naming the file when the table lacks it.
  double operator[](const std::string& name) const {
    auto it = bounds.find(name);
    if (it == bounds.end()) throw std::runtime_error(path + ": no bound '" + name + "'");
    return it->second.value;
  }
};

inline std::filesystem::path tolerances_file(const std::string& scheme) {
  namespace fs = std::filesystem;
  const std::string file = scheme + ".json";
  std::vector<fs::path> tried;
  if (const char* env = std::getenv("QATTN_TOLERANCES"); env != nullptr && *env != '\0') {
    const fs::path p(env);
    const fs::path candidate = p.extension() == ".json" ? p : p / file;
    if (fs::is_regular_file(candidate)) return candidate;
    // Set but wrong: say so rather than fall back to another table silently.
    throw std::runtime_error("QATTN_TOLERANCES=" + std::string(env) + ": no " + candidate.string());
  }
#ifdef QATTN_TOLERANCES_DIR
  tried.emplace_back(fs::path(QATTN_TOLERANCES_DIR) / file);
#endif
  tried.emplace_back(fs::path("tests") / "tolerances" / file);
  std::string list;
  for (const fs::path& p : tried) {
    if (fs::is_regular_file(p)) return p;
    list += " " + p.string();
  }
  throw std::runtime_error("no tolerance table for " + scheme + " (tried" + list +
                           "; set QATTN_TOLERANCES to tests/tolerances)");
}

// Loads (once per scheme) and checks the table: its "scheme" matches, every bound has a
// finite value and a reason.
inline const Tolerances& tolerances(const std::string& scheme) {
  static std::map<std::string, Tolerances> loaded;
  if (auto it = loaded.find(scheme); it != loaded.end()) return it->second;
  Tolerances t;
  t.path = tolerances_file(scheme).string();
  std::ifstream in(t.path);
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw std::runtime_error(t.path + ": " + e.what());
  }
  t.scheme = j.value("scheme", "");
  if (t.scheme != scheme) throw std::runtime_error(t.path + ": scheme is '" + t.scheme + "'");
  for (const auto& [name, b] : j.at("bounds").items()) {
    if (!b.contains("value") || !b["value"].is_number() || !b.contains("why"))
      throw std::runtime_error(t.path + ": bound '" + name + "' needs a number 'value' and a 'why'");
    t.bounds[name] = Bound{b["value"].get<double>(), b["why"].get<std::string>()};
  }
  return loaded.emplace(scheme, std::move(t)).first->second;
}

}  // namespace qattn::test
