"""Causal attention against plain jnp softmax attention with a causal mask."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import BFLOAT16_TOL, check_op
from conftest import causal_attention_reference as reference
from conftest import rel_err, tasks_run

import jnntile
from jnntile.ops import attention, elementwise, gemm, reduce

# Every test runs with the CPU kernels, then with the CUDA ones where a GPU is present.
pytestmark = pytest.mark.usefixtures("placement")

B, T, H, D = 2, 12, 3, 8
TILINGS = {  # qkv tile shapes (tb, tt, 1, th, D)
    "one_tile": (B, T, 1, H, D),
    "seq_tiles": (B, 4, 1, H, D),
    "uneven_seq": (B, 5, 1, H, D),  # T = 5 + 5 + 2
    "batch_heads_seq_tiles": (1, 4, 1, 1, D),
    "uneven_heads_seq": (1, 5, 1, 2, D),  # H = 2 + 1
    "batch_uneven_heads_seq": (B, 5, 1, 2, D),  # several batch rows and heads per tile, uneven H and T
}
# Rows longer than the 32 lanes of a CUDA warp (keys per tile and D), several
# batch rows and heads per tile.
LONG_SHAPE = (2, 70, 3, 40)  # B, T, H, D
LONG_TILINGS = {
    "long_one_tile": (2, 70, 1, 3, 40),
    "long_uneven": (2, 36, 1, 2, 40),  # T = 36 + 34, H = 2 + 1
}

# Query tiles longer than the CPU kernel's 128-row causal chunks (xla_ffi/kernels/cpu/attention.cc): the
# diagonal pairs in several chunks, the last one short, beside a pair every row sees whole.
CHUNKED_SHAPE = (1, 300, 2, 16)
CHUNKED_TILINGS = {
    "chunked_one_tile": (1, 300, 1, 2, 16),  # chunks of 128, 128, 44 rows
    "chunked_uneven": (1, 160, 1, 1, 16),  # T = 160 + 140, H = 1 + 1
}


def make_data(seed=0, shape=(B, T, H, D), groups=1):
    """qkv (B, T, G + 2, H, D) and a weight shaped like the output."""
    rng = np.random.default_rng(seed)
    b, t, h, d = shape
    # Scaled so that the running max changes between key tiles.
    qkv = (2.0 * rng.standard_normal((b, t, groups + 2, h, d))).astype(np.float32)
    weight = rng.standard_normal(shape if groups == 1 else (b, t, groups, h, d)).astype(np.float32)
    return qkv, weight


def check_values_and_gradients(qkv, weight, tiles, jit):
    x = jnntile.from_array(qkv, tiles)

    def f(x):
        out = attention.causal_attention(x)
        assert out.shape == weight.shape
        assert out.tile_shape == (tiles[:2] + tiles[3:] if x.shape[2] == 3 else tiles)
        return jnp.sum(jnntile.to_array(out) * weight)

    vg = jnntile.value_and_grad(f)
    value, grad = (jax.jit(vg) if jit else vg)(x)
    ref_value, ref_grad = jax.value_and_grad(lambda z: jnp.sum(reference(z) * weight))(qkv)
    assert grad.id == x.id
    assert abs(float(value) - float(ref_value)) <= 1e-5 * abs(float(ref_value))
    assert rel_err(jnntile.grad_of(grad).numpy(), ref_grad) <= 1e-5


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("tiling", TILINGS)
def test_values_and_gradients(tiling, jit):
    check_values_and_gradients(*make_data(), TILINGS[tiling], jit)


@pytest.mark.parametrize("tiling", LONG_TILINGS)
def test_rows_longer_than_a_warp(tiling):
    check_values_and_gradients(*make_data(seed=3, shape=LONG_SHAPE), LONG_TILINGS[tiling], jit=True)


@pytest.mark.parametrize("tiling", CHUNKED_TILINGS)
def test_causal_attention_in_row_chunks(tiling):
    check_values_and_gradients(*make_data(seed=5, shape=CHUNKED_SHAPE), CHUNKED_TILINGS[tiling], jit=True)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("groups", [2, 3])
@pytest.mark.parametrize("tiling", ["one_tile", "uneven_seq", "uneven_heads_seq", "batch_uneven_heads_seq"])
def test_grouped_query_attention(tiling, groups, jit):
    # G query heads per key/value head: a task reads the queries of the whole group with one key and value tile.
    check_values_and_gradients(*make_data(seed=4, groups=groups), TILINGS[tiling], jit)


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("tiling", ["one_tile", "uneven_seq", "batch_uneven_heads_seq"])
def test_bfloat16(tiling, groups):
    """bfloat16 qkv, output and gradients; scores, softmax and the sums over key tiles in float32, rounded to
    bfloat16 once, as the reference computes attention of the bfloat16 qkv in float32."""
    qkv, _ = make_data(seed=5, groups=groups)

    def mixed_reference(z):
        return reference(z.astype(jnp.float32)).astype(jnp.bfloat16)

    check_op(attention.causal_attention, mixed_reference, [qkv], [TILINGS[tiling]], jit=True, dtype="bfloat16",
             tol=BFLOAT16_TOL)


# head_dim 64, which the fused GPU steps take (kernels/cuda/attention.cu), with sequences and tiles that are
# not multiples of their 64-row blocks.
FUSED_SHAPE = (2, 150, 3, 64)
FUSED_TILINGS = {
    "fused_one_tile": (2, 150, 1, 3, 64),  # query and key blocks of 64, 64 and 22 rows
    "fused_uneven": (1, 70, 1, 2, 64),  # T = 70 + 70 + 10, H = 2 + 1: pairs off the diagonal, short tiles
}


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "cublas"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("tiling", FUSED_TILINGS)
def test_bfloat16_steps_of_head_dim_64(placement, restore_runtime, tiling, groups, fused):
    """With the runtime setting fused_attention (the default), bfloat16 steps of head_dim 64 take codelets of
    their own: on a GPU the fused kernels, on a CPU worker its usual bfloat16 steps (in one head's scratch).
    Without it, the GPU multiplies them with cuBLAS. Both against the same mixed-precision reference as the
    other bfloat16 steps (test_bfloat16)."""
    jnntile.runtime.stop()
    jnntile.runtime.configure(fused_attention=fused)
    qkv, _ = make_data(seed=6, shape=FUSED_SHAPE, groups=groups)

    def mixed_reference(z):
        return reference(z.astype(jnp.float32)).astype(jnp.bfloat16)

    check_op(attention.causal_attention, mixed_reference, [qkv], [FUSED_TILINGS[tiling]], jit=True,
             dtype="bfloat16", tol=BFLOAT16_TOL)
    codelets = jnntile.runtime.stats()["codelets"]
    for step in ("attention_forward_step", "attention_backward_step"):
        ran, other = (f"{step}_fused", step) if fused else (step, f"{step}_fused")
        assert codelets[ran]["tasks"] > 0 and other not in codelets, step
        if placement == "cuda":
            assert codelets[ran]["cuda_tasks"] == codelets[ran]["tasks"], step


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tiling", ["one_tile", "uneven_seq", "batch_uneven_heads_seq"])
def test_gradient_of_qkv_used_twice(tiling, dtype):
    """The second attention's backward adds to the dqkv the first one wrote. In bfloat16 the first one's
    steps start each tile's float32 sums at zero (dqkv holds nothing yet: no fill), the second one's widen
    each tile they touch first, and both round the sums into the tile where they touch it last; in float32
    both accumulate into the filled gradient."""
    qkv, _ = make_data(seed=6)

    def mixed_reference(z):
        return (2.0 * reference(z.astype(jnp.float32))).astype(z.dtype)

    def twice(x):
        return elementwise.add(attention.causal_attention(x), attention.causal_attention(x))

    check_op(twice, mixed_reference, [qkv], [TILINGS[tiling]], jit=True, dtype=dtype,
             tol=BFLOAT16_TOL if dtype == "bfloat16" else 1e-5)


def test_grouped_query_attention_equals_multi_head_attention_over_repeated_keys_and_values():
    # The definition: query head g of group h attends as multi-head attention would with h's keys and values.
    qkv, _ = make_data(seed=5, groups=2)
    out = attention.causal_attention(jnntile.from_array(qkv, (1, 5, 1, 2, D))).numpy()
    for g in range(2):
        mha = attention.causal_attention(jnntile.from_array(np.ascontiguousarray(qkv[:, :, [g, 2, 3]]),
                                                            (1, 5, 1, 2, D))).numpy()
        np.testing.assert_array_equal(out[:, :, g], mha)


@pytest.mark.parametrize("tiling", TILINGS)
def test_forward_values(tiling):
    qkv, _ = make_data(seed=1)
    out = attention.causal_attention(jnntile.from_array(qkv, TILINGS[tiling]))
    assert rel_err(out.numpy(), reference(qkv)) <= 1e-5


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
def test_after_projection(jit):
    """qkv made by a matmul (as c_attn does): the gradient flows on into x and w."""
    rng = np.random.default_rng(2)
    C = 16
    x_val = rng.standard_normal((B, T, C)).astype(np.float32)
    w_val = (0.3 * rng.standard_normal((C, 3, H, D))).astype(np.float32)
    x = jnntile.from_array(x_val, (1, 5, 8))
    w = jnntile.from_array(w_val, (8, 1, 2, D))

    def f(x, w):
        return jnntile.to_array(reduce.sumsq(attention.causal_attention(gemm.matmul(x, w))))

    vg = jnntile.value_and_grad(f, argnums=(0, 1))
    value, (gx, gw) = (jax.jit(vg) if jit else vg)(x, w)

    def ref(x, w):
        return jnp.sum(reference(jnp.einsum("btc,cshd->btshd", x, w)) ** 2)

    ref_value, (ref_gx, ref_gw) = jax.value_and_grad(ref, argnums=(0, 1))(x_val, w_val)
    assert abs(float(value) - float(ref_value)) <= 1e-5 * abs(float(ref_value))
    assert rel_err(jnntile.grad_of(gx).numpy(), ref_gx) <= 1e-5
    assert rel_err(jnntile.grad_of(gw).numpy(), ref_gw) <= 1e-5


def test_bad_inputs():
    good = np.zeros((B, T, 3, H, D), np.float32)
    with pytest.raises(TypeError, match="must be float32"):
        attention.causal_attention(jnntile.from_array(good.astype(np.int32), (B, 4, 1, H, D)))
    with pytest.raises(ValueError, match=r"shape \(B, T, G \+ 2, H, D\)"):
        attention.causal_attention(jnntile.from_array(np.zeros((B, T, 3 * H * D), np.float32), (B, 4, 24)))
    with pytest.raises(ValueError, match=r"shape \(B, T, G \+ 2, H, D\)"):
        attention.causal_attention(jnntile.from_array(np.zeros((B, T, 2, H, D), np.float32), (B, 4, 1, H, D)))
    with pytest.raises(ValueError, match=r"1 on axis 2 .* use tile_shape \(2, 4, 1, 3, 8\)"):
        attention.causal_attention(jnntile.from_array(good, (B, 4, 3, H, D)))
    with pytest.raises(ValueError, match="head dimension D=8 whole"):
        attention.causal_attention(jnntile.from_array(good, (B, 4, 1, H, 4)))
    with pytest.raises(TypeError, match="jnntile Tensor"):
        attention.causal_attention(good)


# ---- packed batches (document masking) ------------------------------------------------------------------

# Examples of different lengths in a row, boundaries inside and across the sequence tiles of TILINGS (4 and 5),
# then padding (id 0); the second row one long example and a short one.
SEGMENTS = np.array([[1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 0, 0],
                     [1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2]], np.int32)


def masked_reference(qkv, segments=SEGMENTS):
    """Softmax attention where query t sees keys s <= t of its own segment, in plain jnp."""
    groups = qkv.shape[2] - 2
    q, k, v = qkv[:, :, :groups], qkv[:, :, groups], qkv[:, :, groups + 1]
    t = qkv.shape[1]
    same = segments[:, :, None] == segments[:, None, :]  # (B, q, k)
    mask = (jnp.tril(jnp.ones((t, t), bool))[None] & same)[:, None, None]
    scores = jnp.einsum("bqghd,bkhd->bghqk", q, k) / np.sqrt(qkv.shape[-1])
    out = jnp.einsum("bghqk,bkhd->bqghd", jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1), v)
    return out[:, :, 0] if groups == 1 else out


def masked_attention(tiles, segments=SEGMENTS):
    return lambda x: attention.causal_attention(x, attention.documents(segments, tiles[:2]))


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("tiling", TILINGS)
def test_document_masking_values_and_gradients(tiling, groups):
    qkv, _ = make_data(seed=7, groups=groups)
    tiles = TILINGS[tiling]
    check_op(masked_attention(tiles), masked_reference, [qkv], [tiles], jit=True)


@pytest.mark.parametrize("tiling", ["one_tile", "uneven_seq", "batch_uneven_heads_seq"])
def test_document_masking_bfloat16(tiling):
    qkv, _ = make_data(seed=8)

    def mixed_reference(z):
        return masked_reference(z.astype(jnp.float32)).astype(jnp.bfloat16)

    tiles = TILINGS[tiling]
    check_op(masked_attention(tiles), mixed_reference, [qkv], [tiles], jit=True, dtype="bfloat16",
             tol=BFLOAT16_TOL)


def test_document_masking_segment_starts():
    np.testing.assert_array_equal(attention.segment_starts(SEGMENTS),
                                  [[0, 0, 0, 3, 3, 3, 3, 3, 8, 8, 10, 10], [0] * 7 + [7] * 5])


def _step_tasks(fn):
    """The forward and backward step tasks that fn() ran."""
    before = tasks_run()
    fn()
    after = tasks_run()
    return [after[name] - before[name] for name in ("attention_forward_step", "attention_backward_step")]


def test_document_masking_skips_pairs_outside_every_example():
    """Query tiles 1 and 2 of a row whose second example starts at key tile 1 run no step with key tile 0:
    4 pairs forward and backward instead of the causal 6. One example per row runs the causal 6, as plain
    attention does, with the same values bit for bit."""
    qkv, _ = make_data(seed=9, shape=(1, 12, 2, 8))
    tiles = (1, 4, 1, 2, 8)

    def run(op):
        x = jnntile.from_array(qkv, tiles)
        vg = jnntile.value_and_grad(lambda x: jnp.sum(jnntile.to_array(op(x)) ** 2))
        result = {}

        def step():
            value, grad = vg(x)
            result.update(value=float(value), grad=jnntile.grad_of(grad).numpy())
        result["tasks"] = _step_tasks(step)
        return result

    packed = run(masked_attention(tiles, np.array([[1] * 4 + [2] * 8], np.int32)))
    assert packed["tasks"] == [4, 4]
    whole = run(masked_attention(tiles, np.ones((1, 12), np.int32)))
    plain = run(attention.causal_attention)
    assert whole["tasks"] == plain["tasks"] == [6, 6]
    assert whole["value"] == plain["value"]
    np.testing.assert_array_equal(whole["grad"], plain["grad"])


def test_document_masking_bad_starts():
    tiles = TILINGS["seq_tiles"]
    x = jnntile.from_array(make_data()[0], tiles)
    with pytest.raises(ValueError, match=r"documents\(segments, \(2, 4\)\)"):
        attention.causal_attention(x, attention.documents(SEGMENTS, (2, 5)))
    with pytest.raises(TypeError, match="segments must be an integer"):
        attention.documents(SEGMENTS.astype(np.float32), (2, 4))
