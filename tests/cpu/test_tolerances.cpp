// The shared tolerance tables (tests/tolerances/*.json) as the GPU tests read them:
// every table parses, names its scheme, and gives each bound a finite value and a
// reason; the SA2-8b bounds are the ones the GPU tests use, in a sane range; and
// QATTN_TOLERANCES points the loader elsewhere (or fails naming itself).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <unistd.h>

#include "tolerances.h"

namespace {

TEST(Tolerances, EveryTableHasValuesAndReasons) {
  namespace fs = std::filesystem;
  int tables = 0;
  for (const auto& entry : fs::directory_iterator(QATTN_TOLERANCES_DIR)) {
    if (entry.path().extension() != ".json") continue;
    ++tables;
    const std::string scheme = entry.path().stem().string();
    SCOPED_TRACE(entry.path().string());
    const auto& t = qattn::test::tolerances(scheme);
    EXPECT_EQ(t.scheme, scheme);
    EXPECT_FALSE(t.bounds.empty());
    for (const auto& [name, b] : t.bounds) {
      EXPECT_TRUE(std::isfinite(b.value)) << name;
      EXPECT_GE(b.why.size(), 20u) << name << ": the reason is missing or a stub";
    }
  }
  EXPECT_GE(tables, 1);
}

TEST(Tolerances, Sage2BoundsTheGpuTestsRead) {
  const auto& t = qattn::test::tolerances("sage2_8b");
  // CosSim: below 1, and above what a scheme with 8-bit Q·Kᵀ and FP8 P·V gives on
  // Gaussian inputs minus a margin (0.999 documented; far below it tests nothing).
  EXPECT_GT(t["cos_min"], 0.99);
  EXPECT_LT(t["cos_min"], 1.0);
  EXPECT_GT(t["rel_l1_max"], 0.0);
  EXPECT_LT(t["rel_l1_max"], 0.2);
  EXPECT_GT(t["lse_abs_max"], 0.0);
  EXPECT_LT(t["lse_abs_max"], 0.5);
  EXPECT_THROW(t["no_such_bound"], std::runtime_error);
}

TEST(Tolerances, EnvironmentVariableChoosesTheFolder) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("qattn_tol_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  {
    std::ofstream(dir / "demo.json")
        << R"({"scheme": "demo", "bounds": {"x": {"value": 0.5, "why": "a table for this test only"}}})";
  }
  ::setenv("QATTN_TOLERANCES", dir.c_str(), 1);
  EXPECT_EQ(qattn::test::tolerances("demo")["x"], 0.5);
  EXPECT_THROW(qattn::test::tolerances_file("sage2_8b"), std::runtime_error)
      << "a set QATTN_TOLERANCES without the table must fail, not fall back";
  ::unsetenv("QATTN_TOLERANCES");
  fs::remove_all(dir);
}

}  // namespace
