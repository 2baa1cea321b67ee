// The error convention of tierzero's C++ bridges (shim.cpp, c10d.cpp): every extern "C"
// function returns 0, or -1 with the C++ exception's message in the caller's buffer
// `err` of `n` bytes. A function body between TZ_TRY and TZ_CATCH gets that for free.
#pragma once

#include <cstddef>
#include <cstring>
#include <exception>

namespace tz_bridge {
// Writes `what` (truncated, NUL-terminated) into `err`; returns -1.
inline int fail(char* err, size_t n, const char* what) {
  if (err != nullptr && n > 0) {
    std::strncpy(err, what, n - 1);
    err[n - 1] = '\0';
  }
  return -1;
}
}  // namespace tz_bridge

#define TZ_TRY try {
#define TZ_CATCH                                            \
  return 0;                                                 \
  }                                                         \
  catch (const std::exception& e) {                         \
    return tz_bridge::fail(err, n, e.what());               \
  }                                                         \
  catch (...) {                                             \
    return tz_bridge::fail(err, n, "unknown C++ exception"); \
  }
