"""Torch dequantizers against gguf-py's numpy ones (`gguf.quants.dequantize`), bit for bit.

Blocks are built valid (random codes, sane f16 scales), taken from gguf-py's own quantizer
where it has one, taken from the real Gemma 3 270M file, and also fully random (NaN-aware).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

from retrograd.errors import GGUFError, UnsupportedError
from retrograd.gguf import GGUFFile
from retrograd.model.dequant import SUPPORTED, check_supported, dequantize, dequantize_rows

T = GGMLQuantizationType
QUANTIZED = sorted(SUPPORTED - {T.F32, T.F16, T.BF16})

# byte offsets of the f16 scales in each block (IQ1_M spreads its d over four nibbles)
F16_FIELDS = {
    T.Q4_0: (0,), T.Q4_1: (0, 2), T.Q5_0: (0,), T.Q5_1: (0, 2), T.Q8_0: (0,),
    T.Q2_K: (80, 82), T.Q3_K: (108,), T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,),
    T.IQ2_XXS: (0,), T.IQ2_XS: (0,), T.IQ2_S: (0,), T.IQ3_XXS: (0,), T.IQ3_S: (0,),
    T.IQ1_S: (0,), T.IQ4_NL: (0,), T.IQ4_XS: (0,), T.TQ1_0: (52,), T.TQ2_0: (64,),
    T.IQ1_M: (), T.MXFP4: (), T.NVFP4: (),
}  # fmt: skip


def gguf_py(raw: np.ndarray, qtype: T) -> torch.Tensor:
    """The oracle: gguf-py's dequantization of (rows, bytes_per_row) as float32 torch."""
    with np.errstate(all="ignore"):
        out = quants.dequantize(raw, qtype)
    return torch.from_numpy(np.ascontiguousarray(out, dtype=np.float32))


def assert_bits_equal(got: torch.Tensor, want: torch.Tensor) -> None:
    """Same shape, same float32 bits (so -0.0 != 0.0); NaNs must match as NaNs."""
    assert got.dtype == torch.float32 and got.shape == want.shape
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    g, w = got.contiguous().view(torch.int32), want.view(torch.int32)
    bad = (g != w) & ~nan
    assert not bad.any(), f"{int(bad.sum())} values differ, first at {bad.nonzero()[0].tolist()}"


def sane_f16(rng: np.random.Generator, n: int) -> np.ndarray:
    """n random finite f16 values with random signs, spread over magnitudes 2^-14 .. 2."""
    mag = 2.0 ** rng.uniform(-14, 1, n) * rng.choice([-1.0, 1.0], n)
    return mag.astype(np.float16)


def valid_blocks(qtype: T, rows: int, blocks: int, seed: int = 0) -> np.ndarray:
    """(rows, blocks * type_size) bytes: random codes, finite f16 scales."""
    rng = np.random.default_rng(seed)
    per_block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows * blocks, size), dtype=np.uint8)
    for off in F16_FIELDS[qtype]:
        raw[:, off : off + 2] = sane_f16(rng, rows * blocks).view(np.uint8).reshape(-1, 2)
    if qtype == T.IQ1_M:  # d's four nibbles sit in the top of bytes 49, 51, 53, 55
        d = sane_f16(rng, rows * blocks).view(np.uint16).astype(np.uint32)
        for i, byte in enumerate((49, 51, 53, 55)):
            raw[:, byte] = (raw[:, byte] & 0x0F) | (((d >> (4 * i)) & 0x0F) << 4).astype(np.uint8)
    return raw.reshape(rows, blocks * size)


def run(raw: np.ndarray, qtype: T, **kw) -> torch.Tensor:
    per_block, size = GGML_QUANT_SIZES[qtype]
    shape = (raw.shape[0], raw.shape[1] // size * per_block)
    return dequantize(torch.from_numpy(raw), qtype, shape, **kw)


# -- bit-exactness -------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_valid_blocks_match_gguf_py(qtype):
    for rows, blocks, seed in ((4, 3, 0), (1, 1, 1), (7, 5, 2)):
        raw = valid_blocks(qtype, rows, blocks, seed)
        want = gguf_py(raw, qtype)
        assert not torch.isnan(want).any()  # the blocks really are valid
        assert_bits_equal(run(raw, qtype), want)


@pytest.mark.parametrize("qtype", sorted(SUPPORTED), ids=lambda t: t.name)
def test_random_bytes_match_gguf_py(qtype):
    """Every bit pattern, f16 infinities and NaNs included."""
    per_block, size = GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(7)
    raw = rng.integers(0, 256, size=(6, max(4, 64 // per_block) * size), dtype=np.uint8)
    want = gguf_py(raw, qtype) if qtype != T.F32 else torch.from_numpy(raw.view(np.float32))
    assert_bits_equal(run(raw, qtype), want)


QUANTIZABLE = [T.F16, T.BF16, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0, T.TQ1_0, T.TQ2_0, T.MXFP4]


@pytest.mark.parametrize("qtype", QUANTIZABLE, ids=lambda t: t.name)
def test_gguf_py_quantized_weights(qtype):
    rng = np.random.default_rng(3)
    weights = rng.standard_normal((8, 512), dtype=np.float32) * 0.05
    weights[:, ::97] *= 40  # outliers set the block scales
    raw = np.ascontiguousarray(quants.quantize(weights, qtype)).view(np.uint8)
    assert_bits_equal(run(raw, qtype), gguf_py(raw, qtype))


def test_every_type_gguf_py_dequantizes_is_supported():
    """A gguf-py upgrade with a new type fails here until it gets a kernel or a refusal."""
    for qtype in T:
        per_block, size = GGML_QUANT_SIZES[qtype]
        try:
            quants.dequantize(np.zeros((1, size), dtype=np.uint8), qtype)
        except NotImplementedError:
            assert qtype not in SUPPORTED
        else:
            assert qtype in SUPPORTED, qtype.name


@pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
def test_real_model_tensors(gemma_path):
    """Gemma 3 270M Q4_K_M: F32, Q5_0, Q4_K, Q6_K, Q8_0 tensors from the file."""
    f = GGUFFile(gemma_path)
    names = [
        "output_norm.weight",
        "blk.0.attn_q.weight",
        "blk.0.attn_v.weight",
        "blk.0.attn_output.weight",
        "blk.0.ffn_down.weight",
    ]
    seen = set()
    for name in names:
        t = f.tensor(name)
        seen.add(t.ggml_type)
        raw = t.data.reshape(t.shape[0] if len(t.shape) > 1 else 1, -1)
        got = dequantize(torch.from_numpy(t.data), t.ggml_type, t.shape, name=name)
        assert_bits_equal(got.reshape(raw.shape[0], -1), gguf_py(raw, t.ggml_type))
    assert seen == {T.F32, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K}

    emb = f.tensor("token_embd.weight")  # (262144, 640) Q8_0: never dequantized whole here
    raw = emb.data.reshape(emb.shape[0], -1)
    data = torch.from_numpy(emb.data)
    got = dequantize_rows(data, emb.ggml_type, emb.shape, slice(1000, 1040))
    assert_bits_equal(got, gguf_py(raw[1000:1040], emb.ggml_type))
    ids = torch.tensor([[2, 262143], [106, 2]])
    got = dequantize_rows(data, emb.ggml_type, emb.shape, ids)
    want = gguf_py(raw[ids.reshape(-1).numpy()], emb.ggml_type).reshape(2, 2, -1)
    assert_bits_equal(got, want)


# -- shapes, dtypes, devices ---------------------------------------------------------------


def test_shape_and_dtype():
    raw = valid_blocks(T.Q4_K, 6, 2)
    full = run(raw, T.Q4_K)  # (6, 512)
    data = torch.from_numpy(raw)  # any shape of bytes will do
    got = dequantize(data, T.Q4_K, (2, 3, 512))
    assert_bits_equal(got, full.reshape(2, 3, 512))
    got = dequantize(data.reshape(-1), T.Q4_K, (6, 512), torch.bfloat16)
    assert got.dtype == torch.bfloat16 and torch.equal(got, full.to(torch.bfloat16))
    assert dequantize(data[:0], T.Q4_K, (0, 512)).shape == (0, 512)


@pytest.mark.parametrize("qtype", [T.F32, T.F16, T.BF16], ids=lambda t: t.name)
def test_float_types_keep_their_dtype_without_copy(qtype):
    values = torch.randn(3, 8)
    native = {T.F32: torch.float32, T.F16: torch.float16, T.BF16: torch.bfloat16}[qtype]
    data = values.to(native).view(torch.uint8).reshape(-1)
    got = dequantize(data, qtype, (3, 8), native)
    assert got.dtype == native and got.data_ptr() == data.data_ptr()
    assert torch.equal(dequantize(data, qtype, (3, 8)), values.to(native).float())
    odd = torch.cat((torch.zeros(1, dtype=torch.uint8), data))[1:]  # unaligned start
    assert torch.equal(dequantize(odd, qtype, (3, 8), native), values.to(native))


@pytest.mark.parametrize("qtype", sorted(SUPPORTED), ids=lambda t: t.name)
def test_meta_device(qtype):
    """Shapes and devices only: every table and constant is made on data's device."""
    per_block, size = GGML_QUANT_SIZES[qtype]
    data = torch.empty(4 * 3 * size, dtype=torch.uint8, device="meta")
    got = dequantize(data, qtype, (4, 3 * per_block), torch.bfloat16)
    assert got.device.type == "meta" and got.shape == (4, 3 * per_block)
    assert got.dtype == torch.bfloat16


@pytest.mark.parametrize("qtype", QUANTIZED, ids=lambda t: t.name)
def test_unaligned_and_strided_bytes(qtype):
    """Blocks whose bytes start at an odd offset, or rows picked with a step."""
    per_block, size = GGML_QUANT_SIZES[qtype]
    raw = valid_blocks(qtype, 5, 2)
    want = run(raw, qtype)
    padded = torch.cat((torch.zeros(1, dtype=torch.uint8), torch.from_numpy(raw).reshape(-1)))
    assert_bits_equal(dequantize(padded[1:], qtype, (5, 2 * per_block)), want)
    rows = torch.from_numpy(raw)[::2]
    assert_bits_equal(dequantize(rows, qtype, (3, 2 * per_block)), want[::2])


# -- dequantize_rows -----------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q5_0, T.Q4_K, T.IQ2_XS, T.F16], ids=lambda t: t.name)
def test_rows_equal_slices_of_the_whole(qtype):
    per_block, size = GGML_QUANT_SIZES[qtype]
    if qtype == T.F16:
        raw = np.random.default_rng(0).standard_normal((9, 64)).astype(np.float16).view(np.uint8)
    else:
        raw = valid_blocks(qtype, 9, 2)
    shape = (9, raw.shape[1] // size * per_block)
    data = torch.from_numpy(raw).reshape(-1)
    full = dequantize(data, qtype, shape)
    for rows in (slice(2, 7), slice(None, None, 3), slice(-2, None), slice(8, 1, -3)):
        want = full[list(range(9))[rows]]
        assert torch.equal(dequantize_rows(data, qtype, shape, rows), want)
    ids = torch.tensor([[8, 0, 3], [3, 3, 1]], dtype=torch.int32)
    assert torch.equal(dequantize_rows(data, qtype, shape, ids), full[ids.long()])
    one = dequantize_rows(data, qtype, shape, torch.tensor([4]), torch.bfloat16)
    assert torch.equal(one, full[4:5].to(torch.bfloat16))


def test_rows_of_a_3d_tensor():
    raw = valid_blocks(T.Q8_0, 6, 2)
    data = torch.from_numpy(raw)
    full = dequantize(data, T.Q8_0, (2, 3, 64))
    got = dequantize_rows(data, T.Q8_0, (2, 3, 64), torch.tensor([5, 0]))
    assert torch.equal(got, full.reshape(6, 64)[[5, 0]])


# -- refusals and errors -------------------------------------------------------------------

REFUSED = sorted(set(T) - SUPPORTED)


def test_refused_types_are_the_expected_ones():
    assert {T.Q8_1, T.Q8_K, T.I8, T.I16, T.I32, T.I64, T.F64} <= set(REFUSED)
    for qtype in [T.Q4_K, T.IQ1_M, T.MXFP4, T.BF16, T.F32]:
        check_supported(qtype)
        check_supported(int(qtype), "x")


@pytest.mark.parametrize("qtype", REFUSED, ids=lambda t: t.name)
def test_refused_types_raise_naming_type_and_tensor(qtype):
    with pytest.raises(
        UnsupportedError, match=rf"^blk\.0\.ffn_up\.weight: ggml type {qtype.name} "
    ):
        check_supported(qtype, "blk.0.ffn_up.weight")
    per_block, size = GGML_QUANT_SIZES[qtype]
    data = torch.zeros(size, dtype=torch.uint8)
    with pytest.raises(UnsupportedError, match=rf"^ggml type {qtype.name} is not supported"):
        dequantize(data, qtype, (per_block,))
    with pytest.raises(UnsupportedError, match=rf"^emb: ggml type {qtype.name} "):
        dequantize_rows(data, qtype, (1, per_block), slice(0, 1), name="emb")


def test_unknown_type_number():
    with pytest.raises(UnsupportedError, match=r"w: unknown ggml type 999"):
        dequantize(torch.zeros(4, dtype=torch.uint8), 999, (4,), name="w")


def test_bad_geometry_names_the_tensor():
    data = torch.zeros(34 * 3, dtype=torch.uint8)
    with pytest.raises(GGUFError, match=r"^w: 102 torch.uint8 values do not hold a Q8_0 tensor"):
        dequantize(data, T.Q8_0, (2, 64), name="w")
    with pytest.raises(GGUFError, match=r"^w: row of 48 is not a multiple of the Q8_0 block"):
        dequantize(data, T.Q8_0, (2, 48), name="w")
    with pytest.raises(GGUFError, match=r"do not hold"):
        dequantize(data.float(), T.Q8_0, (3, 32))
