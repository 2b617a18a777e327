#include "tensor.h"

#include <memory>
#include <mutex>
#include <stdexcept>
#include <unordered_map>

#include "runtime.h"
#include "sharding.h"

namespace jnntile {
namespace {

struct Registry {
  std::mutex mutex;
  std::unordered_map<int64_t, std::unique_ptr<TiledTensor>> tensors;
  int64_t next_id = 1;
};

Registry& registry() {
  static Registry* r = new Registry();
  return *r;
}

void unregister_locked(Registry& r, int64_t id, bool sync) {
  auto it = r.tensors.find(id);
  if (it == r.tensors.end()) return;
  int64_t grad_id = it->second->grad_id, copy_id = it->second->copy_id;
  // Asynchronous: StarPU unregisters each tile after the tasks that use it.
  // Synchronous (at stop, all tasks done): returns once StarPU's own requests
  // on the tile (write-backs to swap) finished; the data is dropped, not fetched.
  // The user data (tile states) goes away with the TiledTensor below: only
  // submissions look at it, and a freed tensor gets none.
  for (starpu_data_handle_t handle : it->second->tiles) {
    starpu_data_set_user_data(handle, nullptr);
    if (sync) starpu_data_unregister_no_coherency(handle);
    else starpu_data_unregister_submit(handle);
  }
  r.tensors.erase(it);
  if (grad_id >= 0) unregister_locked(r, grad_id, sync);
  if (copy_id >= 0) unregister_locked(r, copy_id, sync);
}

}  // namespace

size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::F32: return 4;
    case DType::I32: return 4;
    case DType::I64: return 8;
    case DType::BF16: return 2;
    case DType::U8: return 1;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::F32: return "float32";
    case DType::I32: return "int32";
    case DType::I64: return "int64";
    case DType::BF16: return "bfloat16";
    case DType::U8: return "uint8";
  }
  return "?";
}

int64_t TiledTensor::numel() const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

Index TiledTensor::tile_extent(const Index& coord) const {
  Index extent(shape.size());
  for (size_t a = 0; a < shape.size(); ++a)
    extent[a] = std::min(tile_shape[a], shape[a] - coord[a] * tile_shape[a]);
  return extent;
}

Index TiledTensor::tile_coord(int64_t linear) const {
  Index coord(grid.size());
  for (int a = int(grid.size()) - 1; a >= 0; --a) {
    coord[a] = linear % grid[a];
    linear /= grid[a];
  }
  return coord;
}

int64_t TiledTensor::tile_linear(const Index& coord) const {
  int64_t linear = 0;
  for (size_t a = 0; a < grid.size(); ++a) linear = linear * grid[a] + coord[a];
  return linear;
}

int64_t TiledTensor::tile_numel(int64_t linear) const {
  int64_t n = 1;
  for (int64_t e : tile_extent(tile_coord(linear))) n *= e;
  return n;
}

std::string TiledTensor::describe() const {
  return "tensor " + std::to_string(id) + " " + dtype_name(dtype) + " " + shape_str(shape) + " tiles " +
         shape_str(tile_shape);
}

int64_t tensor_create(const Index& shape, const Index& tile_shape, DType dtype) {
  require_runtime();
  if (shape.size() != tile_shape.size())
    throw std::invalid_argument("tile shape " + shape_str(tile_shape) + " has " +
                                std::to_string(tile_shape.size()) + " axes but shape " +
                                shape_str(shape) + " has " + std::to_string(shape.size()));
  for (size_t a = 0; a < shape.size(); ++a) {
    if (shape[a] <= 0)
      throw std::invalid_argument("shape " + shape_str(shape) + " has a non-positive axis " +
                                  std::to_string(a));
    if (tile_shape[a] <= 0)
      throw std::invalid_argument("tile shape " + shape_str(tile_shape) +
                                  " has a non-positive axis " + std::to_string(a));
  }
  auto tensor = std::make_unique<TiledTensor>();
  tensor->dtype = dtype;
  tensor->shape = shape;
  tensor->tile_shape = tile_shape;
  int64_t ntiles = 1;
  for (size_t a = 0; a < shape.size(); ++a) {
    // A tile larger than its axis is clipped: it is simply the whole axis.
    tensor->tile_shape[a] = std::min(tile_shape[a], shape[a]);
    tensor->grid.push_back((shape[a] + tensor->tile_shape[a] - 1) / tensor->tile_shape[a]);
    ntiles *= tensor->grid.back();
  }
  tensor->tiles.resize(ntiles);
  tensor->tile_states.reset(new TileState[ntiles]);
  // Kernels take tile extents from the tensor, never from StarPU's vector, so
  // a tile may be registered longer than it is: with direct-I/O swap every
  // tile is a whole number of pages (StarPU reads and writes it whole).
  const int64_t elem = int64_t(dtype_size(dtype)), align = int64_t(swap_io_alignment());
  for (int64_t t = 0; t < ntiles; ++t) {
    int64_t bytes = (tensor->tile_numel(t) * elem + align - 1) / align * align;
    starpu_vector_data_register(&tensor->tiles[t], -1, 0, uint32_t(bytes / elem), size_t(elem));
    tensor->tile_states[t].tensor = tensor.get();
    starpu_data_set_user_data(tensor->tiles[t], &tensor->tile_states[t]);
  }
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  tensor->id = r.next_id++;
  int64_t id = tensor->id;
  r.tensors.emplace(id, std::move(tensor));
  return id;
}

void tensor_free(int64_t id) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (!runtime_running()) return;
  unregister_locked(r, id, false);
}

void tensor_free_all(bool sync) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  while (!r.tensors.empty()) unregister_locked(r, r.tensors.begin()->first, sync);
}

TiledTensor& tensor_get(int64_t id) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto it = r.tensors.find(id);
  if (it == r.tensors.end())
    throw std::invalid_argument("tensor " + std::to_string(id) +
                                " does not exist: it was freed or the runtime was restarted");
  return *it->second;
}

bool tensor_exists(int64_t id) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.tensors.count(id) != 0;
}

int64_t tensor_grad(int64_t id) {
  TiledTensor& t = tensor_get(id);
  if (t.grad_id >= 0) return t.grad_id;
  int64_t grad_id = tensor_create(t.shape, t.tile_shape, t.dtype);
  t.grad_id = grad_id;
  return grad_id;
}

int64_t tensor_compute_copy(int64_t id, DType dtype) {
  TiledTensor& t = tensor_get(id);
  if (t.copy_id >= 0) {
    if (tensor_get(t.copy_id).dtype != dtype)
      throw std::invalid_argument(t.describe() + " has a compute copy in " + dtype_name(tensor_get(t.copy_id).dtype) +
                                  ", not " + dtype_name(dtype));
    return t.copy_id;
  }
  int64_t copy_id = tensor_create(t.shape, t.tile_shape, dtype);
  t.copy_id = copy_id;
  tensor_shard_like(copy_id, id);  // a sharded weight's owner converts and sends its copy
  return copy_id;
}

void tensor_swap_tiles(int64_t a, int64_t b) {
  TiledTensor &x = tensor_get(a), &y = tensor_get(b);
  if (x.dtype != y.dtype || x.shape != y.shape || x.tile_shape != y.tile_shape)
    throw std::invalid_argument("cannot swap the tiles of " + x.describe() + " and " + y.describe());
  std::swap(x.tiles, y.tiles);
  std::swap(x.tile_states, y.tile_states);
  for (TiledTensor* t : {&x, &y})
    for (int64_t i = 0; i < t->num_tiles(); ++i) t->tile_states[i].tensor = t;
}

namespace {
TileState* tile_state(starpu_data_handle_t handle) {
  return static_cast<TileState*>(starpu_data_get_user_data(handle));
}
}  // namespace

bool copy_is_fresh(starpu_data_handle_t copy, starpu_data_handle_t master) {
  TileState *c = tile_state(copy), *m = tile_state(master);
  return c != nullptr && m != nullptr && TileContent(c->content.load()) == TileContent::Valid &&
         c->copy_of_version.load() == m->version.load();
}

void mark_copy_fresh(starpu_data_handle_t copy, starpu_data_handle_t master) {
  TileState *c = tile_state(copy), *m = tile_state(master);
  if (c != nullptr && m != nullptr) c->copy_of_version.store(m->version.load());
}

void count_write(starpu_data_handle_t handle) {
  if (TileState* state = tile_state(handle)) state->version.fetch_add(1);
}

void check_readable(starpu_data_handle_t handle) {
  auto* state = static_cast<TileState*>(starpu_data_get_user_data(handle));
  if (state == nullptr) return;
  auto content = TileContent(state->content.load(std::memory_order_relaxed));
  if (content == TileContent::Valid) return;
  std::string what = state->tensor != nullptr ? state->tensor->describe() : std::string("a tensor");
  if (content == TileContent::Invalidated)
    throw std::invalid_argument(
        what + " was invalidated (its memory released, e.g. after its last use in a backward pass); it "
               "cannot be read until something writes it again. Read it inside the differentiated function, "
               "or pass keep_activations=True to jnntile.value_and_grad / jnntile.nn.value_and_grad");
  throw std::invalid_argument(what + " is read before anything wrote it (DESIGN invariant 3)");
}

void mark_written(starpu_data_handle_t handle) {
  auto* state = static_cast<TileState*>(starpu_data_get_user_data(handle));
  if (state != nullptr) state->content.store(uint8_t(TileContent::Valid), std::memory_order_relaxed);
}

void mark_invalidated(starpu_data_handle_t handle) {
  auto* state = static_cast<TileState*>(starpu_data_get_user_data(handle));
  if (state == nullptr) return;
  state->content.store(uint8_t(TileContent::Invalidated), std::memory_order_relaxed);
  state->version.fetch_add(1);
}

void tensor_invalidate(const TiledTensor& t) {
  for (starpu_data_handle_t handle : t.tiles) {
    starpu_data_invalidate_submit(handle);
    mark_invalidated(handle);
  }
  if (t.sharded_until_invalidated) tensor_unshard(const_cast<TiledTensor&>(t));
}

int64_t tensor_count() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  return int64_t(r.tensors.size());
}

}  // namespace jnntile
