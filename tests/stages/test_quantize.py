"""Block-wise quantization (zerojax.stages._quantize) against its definition, written out in numpy:
per block, scale = max|x| / qmax and every value comes back within scale / 2; zeros are exact;
extreme magnitudes stay within the bound; a block holding inf or nan comes back non-finite."""
import jax.numpy as jnp
import numpy as np
import pytest

from zerojax.stages import _quantize as Q

QMAX = {8: 127, 4: 7}


def np_bound(x, block):
    """Per value: the largest magnitude of its block (numpy, float64)."""
    c = x.shape[-1]
    b = min(block, c)
    amax = np.zeros_like(x, dtype=np.float64)
    for start in range(0, c, b):
        sl = slice(start, min(start + b, c))
        amax[..., sl] = np.max(np.abs(x[..., sl].astype(np.float64)), axis=-1, keepdims=True)
    return amax


def round_trip(x, bits, block, dtype=jnp.float32):
    payload = Q.encode(jnp.asarray(x), bits, block)
    assert payload.dtype == jnp.uint8
    assert payload.shape == x.shape[:-1] + (Q.payload_size(x.shape[-1], bits, block),)
    return np.asarray(Q.decode(payload, bits, block, x.shape[-1], dtype)).astype(np.float64)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("c,block", [(1000, 64), (37, 256), (512, 512), (129, 16), (1, 8)])
def test_round_trip_error_within_half_a_scale_per_block(bits, c, block):
    rng = np.random.default_rng(c + block + bits)
    # rows of very different magnitudes, heavy tails inside each row
    x = (rng.standard_t(3, size=(3, c)) * np.array([[1e-3], [1.0], [1e3]])).astype(np.float32)
    y = round_trip(x, bits, block)
    scale = np_bound(x, block) / QMAX[bits]
    err = np.abs(y - x.astype(np.float64))
    assert np.all(err <= scale / 2 * (1 + 1e-5) + 1e-30), float(np.max(err / np.maximum(scale, 1e-30)))
    # the bound is not vacuous: the largest value of every block comes back exactly
    assert np.allclose(np.max(np.abs(y)), np.max(np.abs(x)), rtol=1e-6)


@pytest.mark.parametrize("bits", [8, 4])
def test_zeros_are_exact(bits):
    x = np.zeros((2, 300), np.float32)
    x[1, ::7] = np.linspace(-3, 5, len(x[1, ::7]))
    y = round_trip(x, bits, 64)
    assert np.all(y[0] == 0.0)  # a block of zeros
    assert np.all(y[1][x[1] == 0] == 0.0)  # zeros inside blocks that hold other values


@pytest.mark.parametrize("bits", [8, 4])
def test_extreme_magnitudes(bits):
    big = np.float32(3.0e38)  # near float32's largest
    x = np.array([[big, -big, big / 3, 1.0, 0.0, -2.5e38, 1e38, 7.0],
                  [1e-30, -3e-31, 2e-30, 0.0, 5e-31, -1e-30, 1e-31, 2e-31],
                  [1e30, 1e-30, -1e30, 1.0, 0.0, 3.0, -1e29, 2e29]], np.float32)
    y = round_trip(x, bits, 8)
    assert np.all(np.isfinite(y))
    scale = np_bound(x, 8) / QMAX[bits]
    assert np.all(np.abs(y - x.astype(np.float64)) <= scale / 2 * (1 + 1e-5))
    assert y[0, 0] == pytest.approx(float(big), rel=1e-6) and y[1, 0] == pytest.approx(1e-30, rel=1e-5)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_values_make_their_block_non_finite(bits, bad):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 64)).astype(np.float32)
    x[0, 20] = bad  # block 1 (16..31) of row 0
    y = round_trip(x, bits, 16)
    assert not np.any(np.isfinite(y[0, 16:32]))  # the whole block: an overflow is not hidden
    ok = np.ones(64, bool)
    ok[16:32] = False
    assert np.all(np.isfinite(y[0, ok])) and np.all(np.isfinite(y[1]))
    scale = np_bound(x[1:], 16) / QMAX[bits]
    assert np.all(np.abs(y[1] - x[1]) <= scale[0] / 2 * (1 + 1e-5))


def test_bf16_rows_come_back_in_bf16_within_the_bound_plus_rounding():
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(4, 200)), jnp.bfloat16)
    y = Q.decode(Q.encode(x, 8, 32), 8, 32, 200, jnp.bfloat16)
    assert y.dtype == jnp.bfloat16
    xf = np.asarray(x, np.float64)
    scale = np_bound(xf, 32) / 127
    # bf16 keeps 8 significant bits: rounding the dequantized value adds up to 2**-9 of it
    assert np.all(np.abs(np.asarray(y, np.float64) - xf) <= scale / 2 + np.abs(xf) * 2**-8 + 1e-30)


@pytest.mark.parametrize("bits,c,block", [(8, 1024, 256), (4, 1024, 256), (8, 1000, 256), (4, 7, 256), (8, 1, 4)])
def test_payload_layout(bits, c, block):
    nb = -(-c // min(block, c))
    b = min(block, c)
    ints = nb * b if bits == 8 else -(-(nb * b) // 2)
    assert Q.payload_size(c, bits, block) == ints + 4 * nb
    # against 16-bit values, 8 bits move about half and 4 bits about a quarter
    if c % block == 0:
        assert Q.wire_ratio(c, bits, block, 2) <= {8: 0.51, 4: 0.26}[bits]


def test_leading_dims_are_kept_and_rows_independent():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 3, 50)).astype(np.float32)
    whole = round_trip(x, 4, 16)
    for i in range(2):
        for j in range(3):
            assert np.array_equal(whole[i, j], round_trip(x[i, j][None], 4, 16)[0])


def test_bits_other_than_4_or_8_are_refused():
    with pytest.raises(ValueError, match="4, 8"):
        Q.qmax(2)
