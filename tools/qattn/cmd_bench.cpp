// `qattn bench`: times qattn alone (no PyTorch) over a grid of shapes, following
// docs/design.md, Measuring: random normal inputs, warm-up, CUDA events around every call, the
// median of many calls, input sets rotated when one set would sit in L2, and every
// configuration timed in two passes to show the noise. Prints a table (stdout) and
// optionally writes JSON in the same row format as bench/forward.py.
//
// Methods: "qattn" = end-to-end qattn_fwd (quantization + attention);
// "qattn_kernel" = qattn_fwd_attention_only on the workspace the forward filled;
// "qattn_auto" and "qattn_precise" = end-to-end qattn_fwd in those precision modes
// (--precision), timed on the same inputs as "qattn".
// host_us: the CPU time of one call (checks and enqueueing; the calls never wait for the
// GPU), the median over the timed calls: it bounds how fast a framework can issue calls
// at short N, where a call's GPU time is ~0.1 ms.
#include <fmt/core.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <ctime>
#include <fstream>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cli_checks.h"
#include "commands.h"
#include "device_info.h"
#include "api/bench_hooks.h"
#include "qattn/qattn.hpp"

namespace qattn::cli {
namespace {

struct BenchOptions {
  int batch = 4, heads = 32, heads_kv = 0;  // heads_kv 0 = heads
  std::vector<int> seq_lens{1024, 2048, 4096, 8192, 16384, 32768};
  std::vector<int> head_dims{64, 128};
  std::string causal = "both", dtype = "bf16", layout = "HND";
  int warmup = 10, iters = 30, passes = 2;
  bool kernel_only = true;
  std::string precision = "fast";  // fast, auto, precise or all
  std::string json_path, commit;
};

struct Row {
  std::string method;
  int batch, heads, heads_kv, n, d;
  bool causal;
  double ms, tops;
  std::vector<double> pass_ms;  // median of each pass
  double host_us;               // median CPU time of a call
};

[[maybe_unused]] double tera_ops(const Row& r) {
  const double ops = 4.0 * r.batch * r.heads * static_cast<double>(r.n) * r.n * r.d;
  return r.causal ? ops / 2 : ops;  // Nq == Nkv here
}

[[maybe_unused]] double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t m = v.size() / 2;
  return v.size() % 2 ? v[m] : 0.5 * (v[m - 1] + v[m]);
}

// A hand-rolled progress bar on stderr: redrawn in place on a terminal, one line per
// step otherwise (logs).
class [[maybe_unused]] Progress {
 public:
  explicit Progress(int total) : total_(total), tty_(isatty(STDERR_FILENO) != 0) {}
  void step(const std::string& what) {
    ++done_;
    constexpr int kWidth = 30;
    const int filled = total_ ? done_ * kWidth / total_ : kWidth;
    const std::string bar = std::string(filled, '#') + std::string(kWidth - filled, '-');
    fmt::print(stderr, "{}[{}] {}/{} {}{}", tty_ ? "\r\033[K" : "", bar, done_, total_, what,
               tty_ ? "" : "\n");
    if (tty_ && done_ == total_) fmt::print(stderr, "\n");
    std::fflush(stderr);
  }

 private:
  int total_, done_ = 0;
  bool tty_;
};

#if QATTN_HAVE_CUDA

void check(cudaError_t e, const char* what) {
  if (e != cudaSuccess)
    throw std::runtime_error(
        fmt::format("{}: {}: {}", what, cudaGetErrorName(e), cudaGetErrorString(e)));
}

template <typename T>
struct DeviceBuffer {
  T* ptr = nullptr;
  explicit DeviceBuffer(std::size_t count) {
    if (count) check(cudaMalloc(&ptr, count * sizeof(T)), "cudaMalloc");
  }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// Float to fp16/bf16 bits, round to nearest even (inputs are finite and small).
uint16_t to_bits16(float x, bool bf16) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  if (bf16) return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
  // fp16: normal range only (|x| < 65504, normals of N(0,1) are far from the limits);
  // subnormal results are flushed to zero, which N(0,1) hits with negligible chance.
  const uint32_t sign = (u >> 16) & 0x8000;
  const int exp = static_cast<int>((u >> 23) & 0xFF) - 127 + 15;
  if (exp <= 0) return static_cast<uint16_t>(sign);
  uint32_t mant = u & 0x7FFFFF;
  uint32_t h = (static_cast<uint32_t>(exp) << 10) | (mant >> 13);
  const uint32_t rest = mant & 0x1FFF;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) ++h;
  return static_cast<uint16_t>(sign | h);
}

// Random normal 16-bit values on the device: a pool of N(0,1) draws made once on the
// host, copied into each tensor in chunks that start at random offsets of the pool.
class RandomFill {
 public:
  RandomFill(bool bf16, uint64_t seed) : pool_(kPool), rng_(seed) {
    std::vector<uint16_t> host(kPool);
    std::normal_distribution<float> normal(0.f, 1.f);
    for (auto& h : host) h = to_bits16(normal(rng_), bf16);
    check(cudaMemcpy(pool_.ptr, host.data(), kPool * 2, cudaMemcpyHostToDevice), "cudaMemcpy");
  }
  void fill(uint16_t* dst, std::size_t count) {
    std::uniform_int_distribution<std::size_t> start(0, kPool / 2);
    for (std::size_t done = 0; done < count;) {
      const std::size_t n = std::min(count - done, kPool / 2);
      check(cudaMemcpy(dst + done, pool_.ptr + start(rng_), n * 2, cudaMemcpyDeviceToDevice),
            "cudaMemcpy");
      done += n;
    }
  }

 private:
  static constexpr std::size_t kPool = std::size_t{1} << 24;  // 16 Mi values (32 MiB)
  DeviceBuffer<uint16_t> pool_;
  std::mt19937_64 rng_;
};

struct Events {
  std::vector<cudaEvent_t> start, stop;
  explicit Events(int n) : start(n), stop(n) {
    for (int i = 0; i < n; ++i) {
      check(cudaEventCreate(&start[i]), "cudaEventCreate");
      check(cudaEventCreate(&stop[i]), "cudaEventCreate");
    }
  }
  ~Events() {
    for (auto e : start) cudaEventDestroy(e);
    for (auto e : stop) cudaEventDestroy(e);
  }
};

struct Config {
  int n, d;
  bool causal;
};

struct Timing {
  std::vector<double> pass_ms;  // GPU: the median of each pass
  double host_us;               // CPU: the median over all timed calls
};

// Times `call(i)` (i = call index) `iters` times after `warmup` calls.
template <typename Call>
Timing time_calls(const BenchOptions& o, cudaStream_t stream, Call&& call) {
  for (int i = 0; i < o.warmup; ++i) call(i);
  check(cudaStreamSynchronize(stream), "warm-up");
  std::vector<double> pass_ms, host_us;
  Events ev(o.iters);
  for (int pass = 0; pass < o.passes; ++pass) {
    for (int i = 0; i < o.iters; ++i) {
      check(cudaEventRecord(ev.start[i], stream), "cudaEventRecord");
      const auto t0 = std::chrono::steady_clock::now();
      call(i);
      const auto t1 = std::chrono::steady_clock::now();
      host_us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      check(cudaEventRecord(ev.stop[i], stream), "cudaEventRecord");
    }
    check(cudaStreamSynchronize(stream), "timed calls");
    std::vector<double> ms(o.iters);
    for (int i = 0; i < o.iters; ++i) {
      float t = 0;
      check(cudaEventElapsedTime(&t, ev.start[i], ev.stop[i]), "cudaEventElapsedTime");
      ms[i] = t;
    }
    pass_ms.push_back(median(ms));
  }
  return {pass_ms, median(host_us)};
}

std::vector<Row> run_config(const BenchOptions& o, const Config& c, std::size_t l2_bytes,
                            RandomFill& rnd, cudaStream_t stream) {
  const int hkv = o.heads_kv > 0 ? o.heads_kv : o.heads;
  const auto layout = o.layout == "NHD" ? Layout::kNHD : Layout::kHND;
  const bool bf16 = o.dtype == "bf16";
  const std::size_t q_elems = std::size_t{1} * o.batch * o.heads * c.n * c.d;
  const std::size_t kv_elems = std::size_t{1} * o.batch * hkv * c.n * c.d;
  const std::size_t set_bytes = (2 * q_elems + 2 * kv_elems) * 2;
  // Rotate through enough sets that the ones in flight cannot all stay in L2.
  const int sets = set_bytes >= 2 * l2_bytes
                       ? 1
                       : static_cast<int>(std::min<std::size_t>(16, 3 * l2_bytes / set_bytes + 1));

  struct Set {
    DeviceBuffer<uint16_t> q, k, v, o;
    Set(std::size_t nq, std::size_t nkv) : q(nq), k(nkv), v(nkv), o(nq) {}
  };
  std::vector<std::unique_ptr<Set>> data;
  std::vector<ForwardParams> params;
  for (int s = 0; s < sets; ++s) {
    data.push_back(std::make_unique<Set>(q_elems, kv_elems));
    rnd.fill(data.back()->q.ptr, q_elems);
    rnd.fill(data.back()->k.ptr, kv_elems);
    rnd.fill(data.back()->v.ptr, kv_elems);
    ForwardParams fp(bf16 ? DType::kBF16 : DType::kFP16, o.batch, o.heads, hkv, c.n, c.n, c.d);
    fp.q(data.back()->q.ptr, layout).k(data.back()->k.ptr, layout).v(data.back()->v.ptr, layout);
    fp.o(data.back()->o.ptr, layout).causal(c.causal);
    params.push_back(fp);
  }
  // The modes to time besides fast, and one workspace large enough for every mode.
  std::vector<std::pair<const char*, Precision>> modes;
  if (o.precision == "auto" || o.precision == "all") modes.emplace_back("qattn_auto", Precision::kAuto);
  if (o.precision == "precise" || o.precision == "all")
    modes.emplace_back("qattn_precise", Precision::kPrecise);
  std::size_t ws_bytes = 0;
  workspace_size(params[0], &ws_bytes).throw_if_error();
  for (const auto& m : modes) {
    ForwardParams fp = params[0];
    std::size_t bytes = 0;
    workspace_size(fp.precision(m.second), &bytes).throw_if_error();
    ws_bytes = std::max(ws_bytes, bytes);
  }
  DeviceBuffer<uint8_t> ws(ws_bytes);

  std::vector<Row> rows;
  auto add_row = [&](const char* method, const Timing& t) {
    Row r{method, o.batch, o.heads, hkv, c.n, c.d, c.causal, 0, 0, t.pass_ms, t.host_us};
    r.ms = *std::min_element(r.pass_ms.begin(), r.pass_ms.end());
    r.tops = tera_ops(r) / (r.ms * 1e-3) / 1e12;
    rows.push_back(r);
  };
  add_row("qattn", time_calls(o, stream, [&](int i) {
            forward(params[i % sets], ws.ptr, ws_bytes, stream).throw_if_error();
          }));
  if (o.kernel_only) {
    // The workspace holds the last set's quantized tensors; the kernel reads only it.
    const ForwardParams& last = params[(o.iters - 1) % sets];
    forward(last, ws.ptr, ws_bytes, stream).throw_if_error();
    add_row("qattn_kernel", time_calls(o, stream, [&](int) {
              forward_attention_only(last, ws.ptr, ws_bytes, stream).throw_if_error();
            }));
  }
  for (const auto& [method, mode] : modes) {
    std::vector<ForwardParams> in_mode = params;
    for (ForwardParams& fp : in_mode) fp.precision(mode);
    add_row(method, time_calls(o, stream, [&](int i) {
              forward(in_mode[i % sets], ws.ptr, ws_bytes, stream).throw_if_error();
            }));
  }
  check(cudaGetLastError(), "kernels");
  return rows;
}

#endif  // QATTN_HAVE_CUDA

[[maybe_unused]] std::string now_utc() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof(buf), "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

[[maybe_unused]] void print_table(const std::vector<Row>& rows) {
  fmt::print("{:<13} {:>3} {:>4} {:>4} {:>6} {:>4} {:>6} {:>10} {:>8} {:>7} {:>8}\n", "method", "B",
             "Hq", "Hkv", "N", "d", "causal", "ms", "TOPS", "noise", "host us");
  for (const Row& r : rows) {
    const auto [lo, hi] = std::minmax_element(r.pass_ms.begin(), r.pass_ms.end());
    fmt::print("{:<13} {:>3} {:>4} {:>4} {:>6} {:>4} {:>6} {:>10.4f} {:>8.1f} {:>6.1f}% {:>8.1f}\n",
               r.method, r.batch, r.heads, r.heads_kv, r.n, r.d, r.causal ? 1 : 0, r.ms, r.tops,
               100.0 * (*hi - *lo) / *lo, r.host_us);
  }
}

[[maybe_unused]] void write_json(const BenchOptions& o, const DeviceInfo& d,
                                 const std::vector<Row>& rows) {
  nlohmann::json env = {{"gpu", d.name},
                        {"sm_clock_mhz", d.sm_clock_mhz},
                        {"driver", cuda_version_string(d.driver_version)},
                        {"cuda", cuda_version_string(d.runtime_version)},
                        {"qattn", qattn_version_string()},
                        {"commit", o.commit},
                        {"date", now_utc()},
                        {"dtype", o.dtype},
                        {"layout", o.layout},
                        {"timing", fmt::format("CUDA events per call, median of {} calls after {} "
                                               "warm-up, best of {} passes; host_us: the median "
                                               "CPU time of a call over all passes",
                                               o.iters, o.warmup, o.passes)}};
  nlohmann::json out = {{"env", env}, {"rows", nlohmann::json::array()}};
  for (const Row& r : rows)
    out["rows"].push_back({{"method", r.method},
                           {"d", r.d},
                           {"causal", r.causal},
                           {"n", r.n},
                           {"batch", r.batch},
                           {"heads", r.heads},
                           {"heads_kv", r.heads_kv},
                           {"tops", r.tops},
                           {"ms", r.ms},
                           {"pass_ms", r.pass_ms},
                           {"host_us", r.host_us}});
  std::ofstream f(o.json_path);
  if (!f) throw std::runtime_error("cannot write " + o.json_path);
  f << out.dump(2) << "\n";
}

int run_bench(const BenchOptions& o) {
  const DeviceInfo d = query_device();
  if (d.device_count == 0) {
    fmt::print(stderr, "qattn bench: no GPU to measure: {}\n", d.no_device_reason);
    return 2;
  }
  if (!d.sage2_supported) {
    fmt::print(stderr, "qattn bench: {} (compute capability {}.{}) cannot run the sm_90a kernels\n",
               d.name, d.cc_major, d.cc_minor);
    return 2;
  }
#if QATTN_HAVE_CUDA
  std::vector<Config> configs;
  for (int dim : o.head_dims)
    for (int causal : {0, 1})
      if (o.causal == "both" || o.causal == std::to_string(causal))
        for (int n : o.seq_lens) configs.push_back({n, dim, causal == 1});

  cudaStream_t stream;
  check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
  RandomFill rnd(o.dtype == "bf16", 0x5A6E);
  Progress progress(static_cast<int>(configs.size()));
  std::vector<Row> rows;
  const std::size_t rows_per_config =
      1 + (o.kernel_only ? 1 : 0) + (o.precision == "all" ? 2 : o.precision == "fast" ? 0 : 1);
  for (const Config& c : configs) {
    for (Row& r : run_config(o, c, d.l2_bytes, rnd, stream)) rows.push_back(std::move(r));
    progress.step(fmt::format("d={} N={} causal={}: {:.1f} TOPS", c.d, c.n, c.causal ? 1 : 0,
                              rows[rows.size() - rows_per_config].tops));
  }
  cudaStreamDestroy(stream);
  fmt::print("{} ({} SMs, up to {} MHz), qattn {}, {} {}\n", d.name, d.sm_count, d.sm_clock_mhz,
             qattn_version_string(), o.dtype, o.layout);
  print_table(rows);
  if (!o.json_path.empty()) {
    write_json(o, d, rows);
    fmt::print("wrote {}\n", o.json_path);
  }
  return 0;
#else
  return 2;
#endif
}

}  // namespace

Runner add_bench(CLI::App& app) {
  auto* cmd =
      app.add_subcommand("bench", "Time the qattn forward on the GPU over a grid of shapes");
  auto o = std::make_shared<BenchOptions>();
  constexpr int kMaxInt = std::numeric_limits<int>::max();  // the C ABI's int fields
  cmd->add_option("--batch", o->batch, "Batch size")
      ->capture_default_str()
      ->check(integer_in(1, kMaxInt));
  cmd->add_option("--heads", o->heads, "Query heads")
      ->capture_default_str()
      ->check(integer_in(1, kMaxInt));
  cmd->add_option("--heads-kv", o->heads_kv, "Key/value heads (default: --heads)")
      ->check(integer_in(1, kMaxInt));
  add_int_list(cmd, "--seq-lens", o->seq_lens, "Sequence lengths (Nq = Nkv), comma-separated", 1,
               kMaxInt);
  add_int_list(cmd, "--head-dims", o->head_dims, "Head dims, comma-separated", 1, 256);
  cmd->add_option("--causal", o->causal, "Causal mask: 0, 1 or both")
      ->capture_default_str()
      ->check(CLI::IsMember({"0", "1", "both"}));
  cmd->add_option("--dtype", o->dtype, "Input type")
      ->capture_default_str()
      ->check(CLI::IsMember({"bf16", "fp16"}));
  cmd->add_option("--layout", o->layout, "Memory layout")
      ->capture_default_str()
      ->check(CLI::IsMember({"HND", "NHD"}));
  cmd->add_option("--warmup", o->warmup, "Warm-up calls per configuration")
      ->capture_default_str()
      ->check(integer_in(0, kMaxInt));
  cmd->add_option("--iters", o->iters, "Timed calls per pass")
      ->capture_default_str()
      ->check(integer_in(1, kMaxInt));
  cmd->add_option("--passes", o->passes, "Timed passes (the best median is reported)")
      ->capture_default_str()
      ->check(integer_in(1, kMaxInt));
  cmd->add_flag("!--no-kernel-only", o->kernel_only, "Skip the attention-kernel-only rows");
  cmd->add_option("--precision", o->precision,
                  "Also time these precision modes end to end: fast (none), auto, precise or all")
      ->capture_default_str()
      ->check(CLI::IsMember({"fast", "auto", "precise", "all"}));
  cmd->add_option("--json", o->json_path, "Write the rows and the environment to this file");
  cmd->add_option("--commit", o->commit, "Commit id to record in the JSON");
  return [o] { return run_bench(*o); };
}

}  // namespace qattn::cli
