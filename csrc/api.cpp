// The ABI described at run time, from api.h's declarations: Python binds what `armserve_exports`
// lists with the argument types `armserve_signature` spells, so no signature is written twice.
#include <cstring>
#include <type_traits>

#include "api.h"

namespace {

template <class T>
constexpr char code() {
  if constexpr (std::is_void_v<T>) {
    return 'v';
  } else if constexpr (std::is_pointer_v<T>) {
    return std::is_same_v<std::remove_cv_t<std::remove_pointer_t<T>>, char> ? 's' : 'P';
  } else if constexpr (std::is_floating_point_v<T>) {
    return sizeof(T) == 4 ? 'f' : 'd';
  } else {
    static_assert(std::is_integral_v<T> || std::is_enum_v<T>, "unsupported parameter type");
    static_assert(sizeof(T) == 4 || sizeof(T) == 8, "integers are int32 or int64");
    return sizeof(T) == 8 ? 'l' : 'i';
  }
}

template <class R, class... A>
const char* signature(R (*)(A...)) {
  static const char s[] = {code<R>(), ':', code<A>()..., '\0'};
  return s;
}

struct Entry {
  const char* name;
  const char* sig;
};

#define ARMSERVE_ENTRY(fn) {#fn, signature(&fn)},
const Entry* entries(int* n) {
  static const Entry e[] = {ARMSERVE_EXPORTS(ARMSERVE_ENTRY)};
  *n = int(sizeof(e) / sizeof(e[0]));
  return e;
}
#undef ARMSERVE_ENTRY

}  // namespace

extern "C" {

const char* armserve_exports() {
#define ARMSERVE_NAME(fn) #fn ","
  static const char names[] = ARMSERVE_EXPORTS(ARMSERVE_NAME);
#undef ARMSERVE_NAME
  return names;
}

const char* armserve_signature(const char* name) {
  int n = 0;
  const Entry* e = entries(&n);
  for (int i = 0; i < n; ++i)
    if (!std::strcmp(e[i].name, name)) return e[i].sig;
  return nullptr;
}
}
