/* AMX-BF16 tiles for the CPU GEMMs (Intel Xeon from Sapphire Rapids on): the OS grant, the
 * tile configuration and the product of up to 32 rows of x by 32 columns of packed weights
 * over all of K. Included by gemm_amx.h (the packed bf16 GEMM) and quant_gemm.c (the GGUF
 * blocks, dequantized a panel at a time), when the build has -mamx-tile -mamx-bf16.
 *
 * A tdpbf16ps multiplies a 16 x 32 bf16 tile of x (16 rows, 64 bytes each) by a B tile of 16
 * pairs of K by 16 columns (64 bytes a row: each column's (k, k+1) pair, the VNNI layout of
 * `pagoda.kernels.cpu.gemm.pack_weight`'s panels) into a 16 x 16 fp32 accumulator tile: 16K
 * multiply-adds in one instruction, ~8x what vdpbf16ps does on 512-bit registers.
 *
 * Linux hands out AMX state only to a process that asks (arch_prctl ARCH_REQ_XCOMP_PERM);
 * `amx_usable` asks once. A thread loads the configuration (`amx_configure`) before its first
 * tile instruction and releases it (`_tile_release`) when done. */
#pragma once
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef INLINE
#define INLINE static inline __attribute__((always_inline))
#endif

#define AMX_ROWS 16 /* rows of an A or accumulator tile */
#define AMX_KB 32 /* K values of an A tile (64 bytes a row), 16 pairs of a B tile */
#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

static int amx_state; /* 0: not asked yet, 1: granted, -1: refused */

static int amx_usable(void) {
    int s = __atomic_load_n(&amx_state, __ATOMIC_ACQUIRE);
    if (s == 0) {
        s = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : -1;
        __atomic_store_n(&amx_state, s, __ATOMIC_RELEASE);
    }
    return s > 0;
}

typedef struct {
    uint8_t palette_id, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} __attribute__((packed, aligned(64))) AmxConfig;

/* Tiles 0-3: accumulators (rows x 16 fp32); 4, 5: x rows (16 x 32 bf16); 6, 7: weight pairs
 * (16 pairs x 16 columns x 2 bf16). All 16 rows by 64 bytes. */
static void amx_configure(void) {
    AmxConfig c;
    memset(&c, 0, sizeof c);
    c.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        c.colsb[t] = 64;
        c.rows[t] = AMX_ROWS;
    }
    _tile_loadconfig(&c);
}

/* Accumulator tiles of rows x0 (and x1: MA = 2) by panels w0 (and w1: NB = 2) over `kb`
 * blocks of 32 K values, into acc[i * NB + j] (16 x 16 fp32 each, rows 64 bytes apart). x
 * rows are xs0 / xs1 elements apart; a panel's K block i is 16 pair rows at w + i * 512. The
 * last block comes from tail0 / tail1 instead where `tail` is set (the pairs past K2 zeroed).
 * MA and NB are compile-time constants at every call site (tile numbers are immediates). */
INLINE void amx_product(const uint16_t *x0, int64_t xs0, const uint16_t *x1, int64_t xs1,
                        const uint16_t *w0, const uint16_t *w1, int64_t kb, int tail,
                        const uint16_t *tail0, const uint16_t *tail1, const int MA, const int NB,
                        float acc[4][AMX_ROWS * 16]) {
    _tile_zero(0);
    if (NB > 1) _tile_zero(1);
    if (MA > 1) _tile_zero(2);
    if (MA > 1 && NB > 1) _tile_zero(3);
    for (int64_t i = 0; i < kb; i++) {
        const int last = tail && i == kb - 1;
        const uint16_t *b0 = last ? tail0 : w0 + i * AMX_KB * 16;
        const uint16_t *b1 = last ? tail1 : w1 + i * AMX_KB * 16;
        _tile_loadd(4, x0 + i * AMX_KB, xs0 * 2);
        _tile_loadd(6, b0, 64);
        _tile_dpbf16ps(0, 4, 6);
        if (NB > 1) {
            _tile_loadd(7, b1, 64);
            _tile_dpbf16ps(1, 4, 7);
        }
        if (MA > 1) {
            _tile_loadd(5, x1 + i * AMX_KB, xs1 * 2);
            _tile_dpbf16ps(2, 5, 6);
            if (NB > 1) _tile_dpbf16ps(3, 5, 7);
        }
    }
    _tile_stored(0, acc[0], 64);
    if (NB > 1) _tile_stored(1, acc[1], 64);
    if (MA > 1) _tile_stored(2, acc[NB], 64);
    if (MA > 1 && NB > 1) _tile_stored(3, acc[3], 64);
}
