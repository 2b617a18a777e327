// Numbers in messages, for every layer (the runtime's watchdog, distributed's waits, the tensor registry).
//
// Messages are built from strings and std::to_string, not iostreams: on a GPU
// machine whose build linked its own copy of libstdc++, formatting a number
// through an ostream crashed in the locale's facets (an error message became a
// segfault).
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

namespace jnntile {

// "(64, 48)", "(3,)": shapes, tile grids and tile coordinates in messages.
inline std::string shape_str(const std::vector<int64_t>& shape) {
  std::string out = "(";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + (shape.size() == 1 ? ",)" : ")");
}

// Seconds with one decimal.
inline std::string seconds_str(double seconds) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", seconds);
  return text;
}

}  // namespace jnntile
