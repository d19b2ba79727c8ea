// The kernel families of this build, in the order the registry tries them: a family
// that is faster where several accept a call comes first.
#include <array>

#include "api/family.h"
#include "families/kv_cache.h"
#include "families/merge.h"
#include "families/precise_fwd.h"
#include "families/sage2_auto.h"
#include "families/sage2_fwd.h"
#include "families/sage2_wide.h"
#include "families/sage3_fwd.h"
#include "families/sagebwd.h"

namespace qattn::api {

std::span<const ForwardFamily* const> forward_families() {
  static const std::array<const ForwardFamily*, 5> kAll{
      &families::sage2_fwd_sm90(), &families::sage2_wide_sm90(), &families::sage3_fwd_sm90(),
      &families::precise_fwd_sm90(), &families::sage2_auto_sm90()};
  return kAll;
}

std::span<const BackwardFamily* const> backward_families() {
  static const std::array<const BackwardFamily*, 1> kAll{&families::sagebwd_sm90()};
  return kAll;
}

std::span<const MergeFamily* const> merge_families() {
  static const std::array<const MergeFamily*, 1> kAll{&families::merge_sm90()};
  return kAll;
}

std::span<const KvCacheFamily* const> kv_cache_families() {
  static const std::array<const KvCacheFamily*, 1> kAll{&families::kv_cache_sm90()};
  return kAll;
}

}  // namespace qattn::api
