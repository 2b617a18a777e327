// Data movement and initialisation: write, read, fill, random, copy.
#include "ops/values.h"

#include <algorithm>

#include "task.h"

namespace jnntile {
namespace {

struct HostCopyArgs {
  TileGeometry geo;
  void* array;
  size_t elem_size;
};

void copy_in_kernel(void** buffers, const HostCopyArgs& a) {
  copy_tile(a.geo, a.elem_size, true, tile_ptr<void>(buffers[0]), a.array);
}

void copy_out_kernel(void** buffers, const HostCopyArgs& a) {
  copy_tile(a.geo, a.elem_size, false, tile_ptr<void>(buffers[0]), a.array);
}

void add_in_kernel(void** buffers, const HostCopyArgs& a) {
  add_to_tile(a.geo, static_cast<const float*>(a.array), tile_ptr<float>(buffers[0]));
}

enum class Direction { Write, Add, Read };

// The tiles of `box` (every tile when it is empty), checked against t's grid.
TileBox checked_box(const TiledTensor& t, const TileBox& box) {
  if (box.lo.empty() && box.hi.empty()) return TileBox{Index(t.ndim(), 0), t.grid};
  bool fits = int(box.lo.size()) == t.ndim() && int(box.hi.size()) == t.ndim();
  for (int a = 0; fits && a < t.ndim(); ++a) fits = 0 <= box.lo[a] && box.lo[a] < box.hi[a] && box.hi[a] <= t.grid[a];
  if (!fits)
    throw std::invalid_argument("tiles from " + shape_str(box.lo) + " to " + shape_str(box.hi) +
                                " are not a block of " + t.describe() + ", whose grid is " + shape_str(t.grid));
  return box;
}

void host_copy(int64_t id, void* data, int64_t nbytes, Direction direction, const TileBox& requested) {
  require_runtime();
  ShardedOp op;  // a read of another rank's shard fetches it, when every rank reads (sharding.h)
  TiledTensor& t = tensor_get(id);
  TileBox box = checked_box(t, requested);
  // The box's first element and shape: the host array is the box alone, row-major.
  Index start(t.ndim()), extent(t.ndim());
  int64_t expected = int64_t(dtype_size(t.dtype));
  for (int a = 0; a < t.ndim(); ++a) {
    start[a] = box.lo[a] * t.tile_shape[a];
    extent[a] = std::min(box.hi[a] * t.tile_shape[a], t.shape[a]) - start[a];
    expected *= extent[a];
  }
  if (nbytes != expected)
    throw std::invalid_argument((requested.lo.empty() ? "" : "a block of tiles of ") + t.describe() + " holds " +
                                std::to_string(expected) + " bytes but the host array has " + std::to_string(nbytes));
  static starpu_codelet* in_cl = codelet<HostCopyArgs, copy_in_kernel>("copy_in");
  static starpu_codelet* out_cl = codelet<HostCopyArgs, copy_out_kernel>("copy_out");
  static starpu_codelet* add_cl = codelet<HostCopyArgs, add_in_kernel>("add_in");
  if (direction == Direction::Add && t.dtype != DType::F32)
    throw std::invalid_argument("only float32 tensors can be accumulated into: " + t.describe());
  // The box's tiles, row-major over the box.
  std::vector<int64_t> tiles;
  Index coord = box.lo;
  for (bool more = true; more;) {
    tiles.push_back(t.tile_linear(coord));
    more = false;
    for (int a = t.ndim() - 1; a >= 0 && !more; --a) {
      if (++coord[a] < box.hi[a]) more = true;
      else coord[a] = box.lo[a];
    }
  }
  // Check every tile first: a failure half-way would leave tasks copying into
  // a host array that the caller frees when the error reaches it.
  if (direction != Direction::Write)
    for (int64_t tile : tiles) check_readable(t.tiles[tile]);
  auto* group = new TaskGroup();
  for (int64_t tile : tiles) {
    HostCopyArgs args{tile_geometry(t, tile), data, dtype_size(t.dtype)};
    for (int a = 0; a < t.ndim(); ++a) {  // the tile's place in the box rather than in the tensor
      args.geo.shape[a] = extent[a];
      args.geo.offset[a] -= start[a];
    }
    switch (direction) {
      case Direction::Write: submit_task(in_cl, {{t.tiles[tile], STARPU_W}}, args, 0.0, group); break;
      case Direction::Add: submit_task(add_cl, {{t.tiles[tile], STARPU_RW}}, args, 0.0, group); break;
      case Direction::Read: submit_task(out_cl, {{t.tiles[tile], STARPU_R}}, args, 0.0, group); break;
    }
  }
  wait(group, direction == Direction::Read ? "reading a tensor" : "writing a host array into a tensor");
}

// ---- fill / random / copy ----------------------------------------------------

struct FillArgs {
  DType dtype;
  double value;
  int64_t n;
};

template <Device D>
void fill_kernel(void** buffers, const FillArgs& a) {
  switch (a.dtype) {
    case DType::F32: fill<D>(a.n, float(a.value), tile_ptr<float>(buffers[0])); break;
    case DType::I32: fill<D>(a.n, int32_t(a.value), tile_ptr<int32_t>(buffers[0])); break;
    case DType::I64: fill<D>(a.n, int64_t(a.value), tile_ptr<int64_t>(buffers[0])); break;
    case DType::BF16: fill<D>(a.n, from_float<bfloat16>(float(a.value)), tile_ptr<bfloat16>(buffers[0])); break;
    case DType::U8: fill<D>(a.n, uint8_t(a.value), tile_ptr<uint8_t>(buffers[0])); break;
  }
}

starpu_codelet* fill_codelet() {
  static starpu_codelet* cl = JNNTILE_CODELET(FillArgs, fill_kernel, "fill");
  return cl;
}

void fill_tensor(TiledTensor& t, double value) {
  for (int64_t tile = 0; tile < t.num_tiles(); ++tile)
    submit_task(fill_codelet(), {{t.tiles[tile], STARPU_W}}, FillArgs{t.dtype, value, t.tile_numel(tile)});
}

void fill_submit(const OpCall& call) { fill_tensor(call.tensor(0), attr<double>(call.attrs, "value")); }
JNNTILE_OP(fill, fill_submit);

struct RandomArgs {
  TileGeometry geo;
  int64_t n;
  uint64_t seed;
  bool normal, bf16;
  float a, b;
};

// A bfloat16 tile is drawn in float32 into StarPU scratch and rounded: the same values as a float32 draw
// rounded by `convert`, without a float32 tile that could be evicted to swap before its conversion.
template <Device D>
void random_kernel(void** buffers, const RandomArgs& r) {
  float* values = r.bf16 ? tile_ptr<float>(buffers[1]) : tile_ptr<float>(buffers[0]);
  fill_random<D>(r.geo, r.seed, r.normal, r.a, r.b, values);
  if (r.bf16) convert<D>(r.n, FloatType::F32, values, FloatType::BF16, tile_ptr<void>(buffers[0]));
}

void random_submit(const OpCall& call) {
  const ffi::Dictionary& attrs = call.attrs;
  TiledTensor& t = call.tensor(0);
  bool bf16 = t.dtype == DType::BF16;
  if (t.dtype != DType::F32 && !bf16) throw std::invalid_argument("random init needs float32 or bfloat16, got " + t.describe());
  // The seed comes as two uint32 inputs (high, low): data, so one compiled call serves every seed.
  uint64_t seed = (uint64_t(call.input_scalar(0)) << 32) | uint64_t(call.input_scalar(1));
  bool normal = attr<int64_t>(attrs, "normal") != 0;
  float a = float(attr<double>(attrs, "a")), b = float(attr<double>(attrs, "b"));
  static starpu_codelet* cl = JNNTILE_CODELET(RandomArgs, random_kernel, "random");
  for (int64_t tile = 0; tile < t.num_tiles(); ++tile) {
    int64_t n = t.tile_numel(tile);
    std::vector<Buffer> buffers{{t.tiles[tile], STARPU_W}};
    starpu_data_handle_t scratch = bf16 ? temporary_vector(n, sizeof(float)) : nullptr;
    if (bf16) buffers.push_back({scratch, STARPU_SCRATCH});
    submit_task(cl, buffers, RandomArgs{tile_geometry(t, tile), n, seed, normal, bf16, a, b});
    if (bf16) starpu_data_unregister_submit(scratch);
  }
}
JNNTILE_OP(random, random_submit);

struct ConvertArgs {
  int64_t n;
  FloatType from, to;
};

template <Device D>
void convert_kernel(void** buffers, const ConvertArgs& a) {
  convert<D>(a.n, a.from, tile_ptr<void>(buffers[0]), a.to, tile_ptr<void>(buffers[1]));
}

}  // namespace

void submit_zeros(starpu_data_handle_t dst, int64_t n) {
  submit_task(fill_codelet(), {{dst, STARPU_W}}, FillArgs{DType::F32, 0.0, n});
}

void submit_convert(starpu_data_handle_t src, FloatType from, starpu_data_handle_t dst, FloatType to, int64_t n) {
  static starpu_codelet* cl = JNNTILE_CODELET(ConvertArgs, convert_kernel, "convert");
  submit_task(cl, {{src, STARPU_R}, {dst, STARPU_W}}, ConvertArgs{n, from, to}, double(n));
}

namespace {

// ids [src, dst]: dst = src in dst's float type. Where dst is src's compute copy (tensor_compute_copy), the
// tiles already fresh (written by the optimizer update that wrote src, or by an earlier convert since src's
// last write) are skipped: a training step converts a weight once, at its first step or after a load.
void convert_submit(const OpCall& call) {
  const TiledTensor &src = call.tensor(0), &dst = call.tensor(1);
  FloatType from = float_type(src, "convert"), to = float_type(dst, "convert");
  check_same_tiling(src, dst, "convert");
  const bool copy = src.copy_id == dst.id;
  for (int64_t t = 0; t < src.num_tiles(); ++t) {
    if (copy && copy_is_fresh(dst.tiles[t], src.tiles[t])) continue;
    submit_convert(src.tiles[t], from, dst.tiles[t], to, src.tile_numel(t));
    if (copy) mark_copy_fresh(dst.tiles[t], src.tiles[t]);
  }
}
JNNTILE_OP(convert, convert_submit);

// Blocks the caller until the tasks already submitted on the given tensors' tiles have written them:
// one empty task reading each tile. For a call that must not be submitted early because StarPU would run
// it at once (a recomputation's inputs are ready long before it is needed: jnntile.remat). The watchdog
// turns a wait that cannot finish into an error.
struct NoArgs {};
void no_kernel(void**, const NoArgs&) {}

void wait_for_submit(const OpCall& call) {
  static starpu_codelet* cl = codelet<NoArgs, no_kernel>("wait_for");
  auto* group = new TaskGroup();
  for (size_t i = 0; i < call.ids.size(); ++i) {
    TiledTensor& t = call.tensor(i);
    for (starpu_data_handle_t handle : t.tiles) submit_task(cl, {{handle, STARPU_R}}, NoArgs{}, 0.0, group);
  }
  wait(group, "waiting for a gradient before recomputing a block (jnntile.remat)");
}
JNNTILE_OP(wait_for, wait_for_submit);

// ids [a, b]: exchanges the tiles of two tensors of one layout in the registry (tensor_swap_tiles): nothing
// is submitted and no data moves. A backward hands a dying output's gradient to an input whose gradient holds
// nothing yet this way, instead of copying it (ops/_ffi.py: accumulate).
void swap_tiles_submit(const OpCall& call) { tensor_swap_tiles(call.ids.at(0), call.ids.at(1)); }
JNNTILE_OP(swap_tiles, swap_tiles_submit);

// Marks every tile of the given tensors as holding nothing: StarPU frees their
// memory (in RAM and on disk) after the tasks already submitted on them, and
// never writes them back (DESIGN invariant 7). The next access must be a write.
// Ids of -1 are skipped.
void invalidate_submit(const OpCall& call) {
  for (size_t i = 0; i < call.ids.size(); ++i) {
    if (call.ids[i] < 0) continue;
    tensor_invalidate(call.tensor(i));
  }
}
JNNTILE_OP(invalidate, invalidate_submit);

// ---- FFI targets that move data between XLA buffers and tensors ----------------

ffi::Error write_impl(ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer array, ffi::RemainingArgs,
                      ffi::Result<ffi::BufferR0<ffi::F32>> token, int64_t accumulate) {
  try {
    host_copy(ids.typed_data()[0], array.untyped_data(), int64_t(array.size_bytes()),
              accumulate ? Direction::Add : Direction::Write, {});
  } catch (const std::exception& e) {
    return ffi::Error::InvalidArgument(e.what());
  }
  token->typed_data()[0] = 0.0f;
  return ffi::Error::Success();
}

ffi::Error read_impl(ffi::Buffer<ffi::S32> ids, ffi::RemainingArgs, ffi::Result<ffi::AnyBuffer> array) {
  try {
    host_copy(ids.typed_data()[0], array->untyped_data(), int64_t(array->size_bytes()), Direction::Read, {});
  } catch (const std::exception& e) {
    return ffi::Error::InvalidArgument(e.what());
  }
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(ffi_handler_write, write_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .RemainingArgs()
                                  .Ret<ffi::BufferR0<ffi::F32>>()
                                  .Attr<int64_t>("accumulate"));
static RegisterTarget register_write("jnntile_write", reinterpret_cast<void*>(ffi_handler_write));

XLA_FFI_DEFINE_HANDLER_SYMBOL(ffi_handler_read, read_impl,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::S32>>().RemainingArgs().Ret<ffi::AnyBuffer>());
static RegisterTarget register_read("jnntile_read", reinterpret_cast<void*>(ffi_handler_read));

void zero_grads(const std::vector<int64_t>& ids) {
  for (int64_t id : ids) fill_tensor(tensor_get(tensor_grad(id)), 0.0);
}

TileGeometry tile_geometry(const TiledTensor& t, int64_t linear) {
  if (t.ndim() > kMaxDims)
    throw std::invalid_argument(t.describe() + " has more than " + std::to_string(kMaxDims) +
                                " axes, which is unsupported");
  TileGeometry g{};
  g.ndim = t.ndim();
  Index coord = t.tile_coord(linear);
  Index extent = t.tile_extent(coord);
  for (int a = 0; a < g.ndim; ++a) {
    g.shape[a] = t.shape[a];
    g.offset[a] = coord[a] * t.tile_shape[a];
    g.extent[a] = extent[a];
  }
  return g;
}

void write_from_host(int64_t id, void* data, int64_t nbytes, const TileBox& box) {
  host_copy(id, data, nbytes, Direction::Write, box);
}
void add_from_host(int64_t id, void* data, int64_t nbytes) { host_copy(id, data, nbytes, Direction::Add, {}); }
void read_to_host(int64_t id, void* data, int64_t nbytes, const TileBox& box) {
  host_copy(id, data, nbytes, Direction::Read, box);
}

double OpCall::input_scalar(size_t i) const {
  if (i >= inputs.size()) throw std::invalid_argument("op needs extra input " + std::to_string(i));
  const ffi::AnyBuffer& b = inputs[i];
  switch (b.element_type()) {
    case ffi::DataType::F32: return double(*static_cast<const float*>(b.untyped_data()));
    case ffi::DataType::S32: return double(*static_cast<const int32_t*>(b.untyped_data()));
    case ffi::DataType::U32: return double(*static_cast<const uint32_t*>(b.untyped_data()));
    default: throw std::invalid_argument("extra input " + std::to_string(i) + " must be float32, int32 or uint32");
  }
}

void check_same_tiling(const TiledTensor& a, const TiledTensor& b, const char* op) {
  if (a.shape != b.shape || a.tile_shape != b.tile_shape)
    throw std::invalid_argument(std::string(op) + ": shapes or tiles differ: " + a.describe() +
                                " vs " + b.describe());
}

}  // namespace jnntile
