"""ggml tensor types and their dequantization to float32, bit-for-bit as ggml-quants.c.

This module owns the ggml type codes (`GGMLType`), the block geometry of every type a GGUF file
may hold (`GGML_BLOCK_SIZES`, enough to skip types we cannot read), and `dequantize`, which turns
a tensor's raw bytes into float32 following each type's block layout (F32/F16/BF16, Q4_0, Q4_1,
Q5_0, Q5_1, Q8_0 and the k-quants Q4_K, Q5_K, Q6_K). It needs numpy only; the `gguf` package is
the test oracle, never imported here.
"""

from __future__ import annotations

import numpy as np

QK_K = 256  # super-block size of the k-quants


class GGMLType:
    F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
    Q4_K, Q5_K, Q6_K, BF16 = 12, 13, 14, 30
    NAMES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
             10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
             17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
             23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
             30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}  # fmt: skip


# ggml type -> (elements per block, bytes per block); the sizes of every type we can at least skip.
GGML_BLOCK_SIZES: dict[int, tuple[int, int]] = {
    0: (1, 4), 1: (1, 2), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24), 8: (32, 34),
    9: (32, 40), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210),
    15: (256, 292), 16: (256, 66), 17: (256, 74), 18: (256, 98), 19: (256, 50), 20: (32, 18),
    21: (256, 110), 22: (256, 82), 23: (256, 136), 24: (1, 1), 25: (1, 2), 26: (1, 4),
    27: (1, 8), 28: (1, 8), 29: (256, 56), 30: (1, 2), 34: (256, 54), 35: (256, 66), 39: (32, 17),
}  # fmt: skip


# --------------------------------------------------------------------------------------------
# Dequantization: each function maps blocks [n_blocks, bytes_per_block] uint8 to
# [n_blocks, elements_per_block] float32, bit-for-bit as ggml's dequantize_row_* does.
# --------------------------------------------------------------------------------------------


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).astype(np.float32)  # [n, 1]


def _low_high_nibbles(qs: np.ndarray) -> np.ndarray:
    # qs [n, 16] -> [n, 32]: element j is the low nibble of byte j, element j+16 its high nibble.
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _high_bits(qh: np.ndarray, count: int) -> np.ndarray:
    # qh [n, 4] little-endian uint32 -> [n, count] bits, bit j for element j.
    return np.unpackbits(np.ascontiguousarray(qh), axis=-1, bitorder="little")[:, :count]


def _dequant_q4_0(b: np.ndarray) -> np.ndarray:
    q = _low_high_nibbles(b[:, 2:]).astype(np.int8) - 8
    return _f16(b[:, :2]) * q.astype(np.float32)


def _dequant_q4_1(b: np.ndarray) -> np.ndarray:
    q = _low_high_nibbles(b[:, 4:]).astype(np.float32)
    return _f16(b[:, :2]) * q + _f16(b[:, 2:4])


def _dequant_q5_0(b: np.ndarray) -> np.ndarray:
    q = _low_high_nibbles(b[:, 6:]) | (_high_bits(b[:, 2:6], 32) << 4)
    return _f16(b[:, :2]) * (q.astype(np.int8) - 16).astype(np.float32)


def _dequant_q5_1(b: np.ndarray) -> np.ndarray:
    q = _low_high_nibbles(b[:, 8:]) | (_high_bits(b[:, 4:8], 32) << 4)
    return _f16(b[:, :2]) * q.astype(np.float32) + _f16(b[:, 2:4])


def _dequant_q8_0(b: np.ndarray) -> np.ndarray:
    return _f16(b[:, :2]) * np.ascontiguousarray(b[:, 2:]).view(np.int8).astype(np.float32)


def _k_scale_min(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    # get_scale_min_k4: 8 six-bit scales and 8 six-bit mins packed in 12 bytes.
    q = scales.astype(np.uint8)
    sc = np.concatenate([q[:, 0:4] & 63, (q[:, 8:12] & 0x0F) | ((q[:, 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([q[:, 4:8] & 63, (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)  # [n, 8] each


def _dequant_q4_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qs = b[:, 16:144].reshape(n, 4, 1, 32)  # 4 chunks of 64 values: low nibbles then high
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32).astype(np.float32)
    return ((d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]).reshape(n, QK_K)


def _dequant_q5_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    d, dmin = _f16(b[:, 0:2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qh = b[:, 16:48].reshape(n, 1, 32)  # bit i of qh[l] is the 5th bit of sub-block i, value l
    ql = b[:, 48:176].reshape(n, 4, 1, 32)
    q = np.concatenate([ql & 0x0F, ql >> 4], axis=2).reshape(n, 8, 32)
    shifts = np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    q = (q | (((qh >> shifts) & 1) << 4)).astype(np.float32)
    return ((d * sc)[:, :, None] * q - (dmin * mn)[:, :, None]).reshape(n, QK_K)


def _dequant_q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32)  # [half, 32-byte group, l]
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)  # [n, 16]
    d = _f16(b[:, 208:210])
    # Per 128-value half: q1 = ql[l] lo | qh bits 0-1, q2 = ql[l+32] lo | bits 2-3,
    # q3 = ql[l] hi | bits 4-5, q4 = ql[l+32] hi | bits 6-7.
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # [n, 2, 4, 32]: q1, q2, q3, q4
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = ((low | (high << 4)).astype(np.int8) - 32).astype(np.float32).reshape(n, 16, 16)
    return ((d * scales)[:, :, None] * q).reshape(n, QK_K)


_DEQUANTIZERS = {
    GGMLType.Q4_0: _dequant_q4_0,
    GGMLType.Q4_1: _dequant_q4_1,
    GGMLType.Q5_0: _dequant_q5_0,
    GGMLType.Q5_1: _dequant_q5_1,
    GGMLType.Q8_0: _dequant_q8_0,
    GGMLType.Q4_K: _dequant_q4_k,
    GGMLType.Q5_K: _dequant_q5_k,
    GGMLType.Q6_K: _dequant_q6_k,
}
SUPPORTED_GGML_TYPES = (GGMLType.F32, GGMLType.F16, GGMLType.BF16, *_DEQUANTIZERS)


def dequantize(data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """Raw tensor bytes (uint8) of `ggml_type` -> float32 array of `shape` (HF order)."""
    raw = np.asarray(data, dtype=np.uint8).reshape(-1)
    if ggml_type == GGMLType.F32:
        out = raw.view(np.float32).copy()
    elif ggml_type == GGMLType.F16:
        out = raw.view(np.float16).astype(np.float32)
    elif ggml_type == GGMLType.BF16:
        out = (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    elif ggml_type in _DEQUANTIZERS:
        _, type_size = GGML_BLOCK_SIZES[ggml_type]
        out = _DEQUANTIZERS[ggml_type](raw.reshape(-1, type_size))
    else:
        name = GGMLType.NAMES.get(ggml_type, str(ggml_type))
        raise ValueError(f"ggml type {name} is not supported")
    return out.reshape(shape)
