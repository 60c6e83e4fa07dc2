// Work items dealt to threads in shares of equal work (paged_decode.cpp, causal_attend.cpp): `done[k]` is the work
// in the items before item k, done.back() all of it. An item goes to the share its middle falls in, so each share
// is a run of whole items, the runs in item order and covering them all.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace ster_kernels {

class Shares {
 public:
  Shares(const std::vector<int64_t>& done, int64_t threads)
      : parts_(std::max<int64_t>(1, std::min<int64_t>(threads, (int64_t)done.size() - 1))),
        all_(done.back()),
        middle_(done.size() - 1) {
    for (size_t k = 0; k < middle_.size(); ++k) middle_[k] = done[k] + done[k + 1];  // twice the middle: integers
  }
  int64_t parts() const { return parts_; }
  // the first item of `share` (share == parts(): one past the last item)
  int64_t first(int64_t share) const {
    return std::lower_bound(middle_.begin(), middle_.end(), 2 * all_ * share / parts_) - middle_.begin();
  }

 private:
  int64_t parts_, all_;
  std::vector<int64_t> middle_;
};

}  // namespace ster_kernels
