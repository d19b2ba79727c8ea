// Subcommands of the qattn CLI. Each registers its options on the app and returns
// the function that runs it (exit code: 0 ok, non-zero with a message on stderr).
#pragma once

#include <CLI/CLI.hpp>
#include <functional>

namespace qattn::cli {

using Runner = std::function<int()>;

Runner add_accuracy(CLI::App& app);  // cmd_accuracy.cpp
Runner add_info(CLI::App& app);      // cmd_info.cpp
Runner add_bench(CLI::App& app);     // cmd_bench.cpp

}  // namespace qattn::cli
