#pragma once

namespace asyncside {

// A short description of the native build: which platform paths were compiled in.
inline const char* build_info() {
  return "asyncside-native"
#if defined(__linux__)
         " io_uring"
#endif
#if defined(ASYNCSIDE_CUDA)
         " cuda"
#endif
#if defined(ASYNCSIDE_METAL)
         " metal"
#endif
      ;
}

}  // namespace asyncside
