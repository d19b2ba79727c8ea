// Declaration of the merge of partial attention outputs (qattn_merge): its architectures
// and its launch (src/cuda/merge/). Host C++ in every build; the launch exists only
// where the CUDA kernels are built.
#include "families/merge.h"

#include <array>

#if QATTN_HAVE_CUDA
#include "cuda/merge/launch.h"
#endif

namespace qattn::families {
namespace {

constexpr std::array<api::Arch, 1> kArchs{{{9, 0}}};  // the library's sm_90a build

#if QATTN_HAVE_CUDA
int launch(const qattn_merge_params& p, void* stream) { return merge::launch_merge(p, stream); }
constexpr auto kLaunch = &launch;
#else
constexpr decltype(api::MergeFamily::launch) kLaunch = nullptr;
#endif

constexpr api::MergeFamily kFamily{.name = "merge_sm90", .archs = kArchs, .launch = kLaunch};

}  // namespace

const api::MergeFamily& merge_sm90() { return kFamily; }

}  // namespace qattn::families
