// qattn: accuracy report (CPU), device info, and a GPU benchmark.
#include <fmt/core.h>

#include <exception>

#include "commands.h"

int main(int argc, char** argv) {
  CLI::App app{"qattn: low-bit attention (SageAttention family)"};
  app.require_subcommand(1);
  std::vector<std::pair<CLI::App*, qattn::cli::Runner>> commands;
  auto add = [&](auto adder) {
    auto before = app.get_subcommands({}).size();
    auto run = adder(app);
    auto subs = app.get_subcommands({});
    commands.emplace_back(subs.size() > before ? subs.back() : nullptr, std::move(run));
  };
  add(qattn::cli::add_accuracy);
  add(qattn::cli::add_info);
  add(qattn::cli::add_bench);
  CLI11_PARSE(app, argc, argv);
  try {
    for (auto& [sub, run] : commands)
      if (sub != nullptr && sub->parsed()) return run();
  } catch (const std::exception& e) {
    fmt::print(stderr, "qattn: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
