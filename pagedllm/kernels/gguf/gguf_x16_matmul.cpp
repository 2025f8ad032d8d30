/*
 * Matmuls over x16-interleaved GGUF blocks with 8-bit activations and
 * integer dot products (the layout and the sum: gguf_x16.h).
 *
 * A call first rounds its rows to int8, block by block, into the node's
 * scratch (the team shares the rows out), then the team shares the tiles of
 * 16 channels out; a thread runs X16_MR rows at a time against a tile, each
 * row keeping one vector of 16 channel sums (AVX-512; two of 8 on AVX2, one
 * float per channel in the scalar build):
 *
 *   for each block b:                     tile block: d[16] (m[16]) | chunks of 64 B
 *     isum[r] = 0                         row r's block b: qx[32] int8, dx, sx
 *     for each chunk: w = 64 B (+ nibbles split) ; isum[r] += dot4(w, broadcast qx[r][4 inputs])
 *     acc[r] = fma(float(isum[r] - o sx), d dx, acc[r])   (+ fma(m, dx sx, acc[r]) for Q4_1)
 *
 * The weights of one tile (18 blocks x 320 B for a 576-input Q4_1 row) stay
 * in L1 while the rows stream past; long inputs go in blocks of rows whose
 * int8 copies stay in L2.
 *
 * The vectors are simd.h's vq_* lanes (SIMD_Q_LANES channels: 16 on
 * AVX-512BW, 8 on AVX2, 1 in plain C); the weights were interleaved at load
 * by gguf_x16_repack.cpp.
 */
#include "gguf_x16.h"

#include <math.h>
#include <string.h>
#include <omp.h>
#include <unistd.h>

#include "../simd/simd.h"

/* lanes per vector (a tile's 16 channels in 16 / X16_VL parts) and rows per register tile */
#define X16_VL SIMD_Q_LANES
#if SIMD_Q_LANES == 16
#define X16_MR 8  /* 32 vector registers: a tile's loads and nibble splits shared by 8 rows */
#else
#define X16_MR 4
#endif
#define X16_Q8_OFFSET SIMD_Q8_OFFSET

/* the k-quants whose tiles ktile_rows sums (Q2_K and Q3_K have their own kernel, lktile_rows, and blocks of 32) */
static constexpr bool x16_ktile_type(int type) { return type == GGUF_Q4_K || type == GGUF_Q5_K || type == GGUF_Q6_K; }

/* inputs that share one activation grid dx: a k-quant's super-block (256: llama.cpp's Q8_K, so a super-block's
   runs sum in integers and its float work happens once), 32 for the other types (llama.cpp's Q8_0 / Q8_1) */
static int64_t x16_act_group(int type) { return x16_ktile_type(x16_base_type(type)) ? 256 : GGUF_BLOCK; }

/* ---- 8-bit activations ---- */

int64_t gguf_x16_scratch_bytes(int64_t rows, int64_t in_features) {
    const int64_t quants = (rows * in_features + 63) / 64 * 64;
    return quants + rows * (in_features / GGUF_BLOCK) * 24;
}

typedef struct {
    const int8_t *q;   /* [rows, k] */
    const float *d;    /* [rows, k / 32]: each block's dx */
    const int32_t *s;  /* [rows, k / 32]: each block's sx */
    const int32_t *h;  /* [rows, k / 32]: the sum of each block's first 16 quants (Q2_K / Q3_K's sub-blocks) */
    const float *ds;   /* [rows, k / 32]: dx * float(sx), the min terms' factor (Q4_1, Q5_1; Q4_K / Q5_K sum m sx in
                          integers), rounded once per row here rather than once per (row, tile): the same float */
    const int32_t *o;  /* [rows, k / 32, 2]: -32 times the sums of each block's first and last 16 quants, where
                          Q6_K's two sums of a run start (sum (q - 32) x in integers with no subtraction after) */
} QRows;

/* the parts of a scratch of `rows` rows of k inputs (gguf_x16_scratch_bytes) */
static QRows qrows_at(const void *scratch, int64_t rows, int64_t k) {
    const uint8_t *base = (const uint8_t *)scratch;
    const int64_t quants = (rows * k + 63) / 64 * 64, nb = rows * (k / GGUF_BLOCK);
    return {(const int8_t *)base, (const float *)(base + quants), (const int32_t *)(base + quants + 4 * nb),
            (const int32_t *)(base + quants + 8 * nb), (const float *)(base + quants + 12 * nb),
            (const int32_t *)(base + quants + 16 * nb)};
}

static QRows scratch_rows(const LinearNode *n, int64_t rows) { return qrows_at(n->scratch, rows, n->in_features); }

/* max |x| over n inputs (a multiple of 8): a NaN is skipped (max keeps its other operand, as fmaxf does), so
   the vector and the plain C code give the same float */
static inline float inputs_amax(const float *xb, int64_t n) {
#if SIMD_F32X8
    f32x8 m = f32x8_zero();
    for (int64_t i = 0; i < n; i += 8) m = f32x8_max(f32x8_abs(f32x8_load(xb + i)), m);
    return f32x8_hmax(m);
#else
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i++) amax = fmaxf(amax, fabsf(xb[i]));
    return amax;
#endif
}

/* one block of 32 inputs rounded to int8 on the grid dx (its group's max |x| / 127, x16_act_group): q =
   round(x / dx) (nearbyintf: half to even), clamped to [-127, 127]; *d = dx, *s = the sum of the 32 quants, *h
   that of the first 16. Every step is exact or one float operation per value in the same order, so the vector
   and the plain C code give the same integers in every build (a NaN input too: max and min keep their other
   operand, as fmaxf / fminf do) */
static inline void quantize_block(const float *xb, float dx, int8_t *q, float *d, int32_t *s, int32_t *h, float *ds,
                                  int32_t *o) {
    const float inv = dx > 0.0f ? 1.0f / dx : 0.0f;
#if SIMD_F32X8
    const f32x8 vinv = f32x8_set1(inv), lo = f32x8_set1(-127.0f), hi = f32x8_set1(127.0f);
    i32x8 qi[4];
    for (int i = 0; i < 4; i++)
        qi[i] = i32x8_from_f32(f32x8_min(f32x8_max(f32x8_round(f32x8_mul(f32x8_load(xb + 8 * i), vinv)), lo), hi));
    *h = i32x8_hsum(i32x8_add(qi[0], qi[1]));
    *s = *h + i32x8_hsum(i32x8_add(qi[2], qi[3]));
    *d = dx;
    *ds = dx * (float)*s;
    o[0] = -32 * *h, o[1] = -32 * (*s - *h);
    i8x32_store_i32(q, qi[0], qi[1], qi[2], qi[3]);
#else
    int32_t sum = 0;
    for (int i = 0; i < GGUF_BLOCK; i++) {
        float v = nearbyintf(xb[i] * inv);
        v = fminf(fmaxf(v, -127.0f), 127.0f);
        q[i] = (int8_t)v;
        sum += (int32_t)v;
        if (i == 15) *h = sum;
    }
    *d = dx;
    *s = sum;
    *ds = dx * (float)sum;
    o[0] = -32 * *h, o[1] = -32 * (sum - *h);
#endif
}

/* row `row` of a scratch's parts (qrows_at), writable */
typedef struct {
    int8_t *q;
    float *d;
    int32_t *s;
    int32_t *h;
    float *ds;
    int32_t *o;
} QRow;

static QRow qrow_of(const QRows &qr, int64_t k, int64_t row) {
    const int64_t nb = k / GGUF_BLOCK;
    return {(int8_t *)qr.q + row * k, (float *)qr.d + row * nb, (int32_t *)qr.s + row * nb, (int32_t *)qr.h + row * nb,
            (float *)qr.ds + row * nb, (int32_t *)qr.o + 2 * row * nb};
}

/* one row's k inputs as int8 blocks of 32 (quantize_block), on one grid per `group` inputs (32, or 256 for the
   k-quants: x16_act_group); every block of a group keeps the group's dx */
static void quantize_row(const float *x, int64_t k, int64_t group, const QRow &out) {
    for (int64_t g = 0; g < k; g += group) {
        const float dx = inputs_amax(x + g, group) / 127.0f;
        for (int64_t b = g / GGUF_BLOCK; b < (g + group) / GGUF_BLOCK; b++)
            quantize_block(x + b * GGUF_BLOCK, dx, out.q + b * GGUF_BLOCK, out.d + b, out.s + b, out.h + b, out.ds + b,
                           out.o + 2 * b);
    }
}

/* ---- the tile kernel ---- */

/* one run of 32 inputs of a non-linear 4-bit type (4 chunks of nibble pairs) against rows xq, xq + k, ...:
   each nibble looked up to its table value, stored as a Q8 weight is (the sign flipped: vq_table), and
   isum[r] += the integer dot products as run_sums sums Q8_0's quants (less SIMD_Q8_OFFSET sx, the caller's) */
template <int MR>
static inline __attribute__((always_inline)) void table_run_sums(vq_tab tab, const uint8_t *qs, const int8_t *xq,
                                                                 int64_t k, vq_int *isum) {
#if SIMD_Q_SUM16
    /* as run_sums' q8 branch: each looked-up byte (q + 128) two 4-bit digits, 8 chunks of 4 inputs summed in
       16 bits per digit, then widened; the digits are looked up from two tables (no split of the bytes) */
    vq_tab tab_lo, tab_hi;
    vq_table_digits(tab, &tab_lo, &tab_hi);
    vq_int lo16[MR], hi16[MR];
    for (int r = 0; r < MR; r++) lo16[r] = vq_zero(), hi16[r] = vq_zero();
    for (int u = 0; u < 4; u++) {
        const vq_int w = vq_load(qs + 64 * u);
        for (int e = 0; e < 2; e++) {  // the low nibbles are inputs 8u..8u + 3, the high ones 8u + 4..8u + 7
            const vq_int idx = e ? vq_nib_hi(w) : vq_nib_lo(w), lo = vq_lookup(tab_lo, idx), hi = vq_lookup(tab_hi, idx);
            for (int r = 0; r < MR; r++) {
                const vq_int x = vq_quad(xq + r * k + 8 * u + 4 * e);
                lo16[r] = vq_keep(vq_madd16(lo16[r], lo, x));  // chains kept chains (vq_keep)
                hi16[r] = vq_keep(vq_madd16(hi16[r], hi, x));
            }
        }
    }
    for (int r = 0; r < MR; r++) isum[r] = vq_widen16(vq_widen16(isum[r], lo16[r], 1), hi16[r], 16);
#else
    for (int u = 0; u < 4; u++) {
        const vq_int w = vq_load(qs + 64 * u), lo = vq_lookup(tab, vq_nib_lo(w)), hi = vq_lookup(tab, vq_nib_hi(w));
        for (int r = 0; r < MR; r++) {
            isum[r] = vq_dot_q8(isum[r], lo, vq_quad(xq + r * k + 8 * u));
            isum[r] = vq_dot_q8(isum[r], hi, vq_quad(xq + r * k + 8 * u + 4));
        }
    }
#endif
}

#if SIMD_Q_SUM16
/* MXFP4's offset on the 16-bit path: its values (|v| <= 12) looked up as v + 12 (vq_table_offset), one
   vpmaddubsw each, where a full int8 value takes two digits (table_run_sums) */
#define MXFP4_OFFSET 12
/* one MXFP4 run of 32 inputs against rows xq, xq + k, ...: isum[r] += sum (v + 12) x. 16-bit lanes hold 8
   products of at most 24 x 127 (24384 < 2^15): widened after each half run */
template <int MR>
static inline __attribute__((always_inline)) void mxfp4_run_sums(vq_tab tab, const uint8_t *qs, const int8_t *xq,
                                                                 int64_t k, vq_int *isum) {
    for (int half = 0; half < 2; half++) {
        vq_int acc16[MR];
        for (int r = 0; r < MR; r++) acc16[r] = vq_zero();
        for (int u = 2 * half; u < 2 * half + 2; u++) {
            const vq_int w = vq_load(qs + 64 * u), lo = vq_lookup(tab, vq_nib_lo(w)), hi = vq_lookup(tab, vq_nib_hi(w));
            for (int r = 0; r < MR; r++) {
                acc16[r] = vq_keep(vq_madd16(acc16[r], lo, vq_quad(xq + r * k + 8 * u)));  // chains kept (vq_keep)
                acc16[r] = vq_keep(vq_madd16(acc16[r], hi, vq_quad(xq + r * k + 8 * u + 4)));
            }
        }
        for (int r = 0; r < MR; r++) isum[r] = vq_widen16(isum[r], acc16[r], 1);
    }
}
#else
#define MXFP4_OFFSET X16_Q8_OFFSET
#endif

/* y[r0 + r][the lanes' channels of tile t] = acc[r] (+ bias; `partial`: acc[r] alone, a sum that a later slice
   of the inputs goes on with, see load_rows) */
template <int MR>
static inline __attribute__((always_inline)) void store_rows(const LinearNode *n, const vq_float *acc, int64_t t,
                                                             int64_t r0, int h, bool partial = false) {
    const int64_t c0 = t * X16_TILE + h * X16_VL, cols = n->out_features;
    for (int r = 0; r < MR; r++) {
        const vq_float v = n->bias && !partial ? vq_fadd(acc[r], vq_fload(n->bias + c0)) : acc[r];
        vq_fstore(n->y + (r0 + r) * cols + c0, v);
    }
}

/* acc[r] = the partial sum store_rows left in y[r0 + r] (an exact float32 round trip: the sum goes on with the
   same operations in the same order as in one pass) */
template <int MR>
static inline __attribute__((always_inline)) void load_rows(const LinearNode *n, vq_float *acc, int64_t t, int64_t r0,
                                                            int h) {
    const int64_t c0 = t * X16_TILE + h * X16_VL, cols = n->out_features;
    for (int r = 0; r < MR; r++) acc[r] = vq_fload(n->y + (r0 + r) * cols + c0);
}

/* sub-block j's 6-bit scale and min of the lanes' channels: S = the tile's S[12][16] + the lanes' first
   channel (gguf_k_scale_min, for X16_VL channels at once) */
static inline __attribute__((always_inline)) void k_scale_min(const uint8_t *S, int j, vq_int *scale, vq_int *min) {
    if (j < 4) {
        *scale = vq_and1(vq_lanes_u8(S + 16 * j), 63);
        *min = vq_and1(vq_lanes_u8(S + 16 * (j + 4)), 63);
        return;
    }
    const vq_int low = vq_lanes_u8(S + 16 * (j + 4)), top_s = vq_lanes_u8(S + 16 * (j - 4)), top_m = vq_lanes_u8(S + 16 * j);
    *scale = vq_or(vq_and1(low, 15), vq_sll(vq_srl(top_s, 6), 4));
    *min = vq_or(vq_srl(low, 4), vq_sll(vq_srl(top_m, 6), 4));
}

/* chunk u of a k-quant run (qs: its low 4 bits, qh: the bits above) as unsigned weights: lo for its inputs
   8u..8u + 3, hi for 8u + 4..8u + 7 (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63) */
template <int TYPE>
static inline __attribute__((always_inline)) void kchunk_weights(const uint8_t *qs, const uint8_t *qh, int u,
                                                                 vq_int *lo, vq_int *hi) {
    const vq_int w = vq_load(qs + 64 * u);
    *lo = vq_nib_lo(w), *hi = vq_nib_hi(w);
    if (TYPE == GGUF_Q5_K) {
        const vq_int top = vq_load(qh);
        *lo = vq_or(*lo, vq_shl4(vq_bits(top, u, 1)));
        *hi = vq_or(*hi, vq_shl4(vq_bits(top, u + 4, 1)));
    } else if (TYPE == GGUF_Q6_K) {
        const vq_int top = vq_load(qh + 64 * (u / 2));
        *lo = vq_or(*lo, vq_shl4(vq_bits(top, 4 * (u % 2), 3)));
        *hi = vq_or(*hi, vq_shl4(vq_bits(top, 4 * (u % 2) + 2, 3)));
    }
}

/* the rows' int8 inputs xq, xq + k, ... as MR pointers, each held in a register: a row's input is then its
   pointer plus a constant. Left to itself GCC keeps every (row, input) offset of a run on the stack and loads
   one for each broadcast (64 loads a run for 8 rows) */
template <int MR>
static inline __attribute__((always_inline)) void row_pointers(const int8_t *xq, int64_t k, const int8_t **xr) {
    for (int r = 0; r < MR; r++) {
        xr[r] = xq + r * k;
        __asm__("" : "+r"(xr[r]));  // opaque: not folded back into xq + offset
    }
}

/* chunks u0, u0 + 1 of a k-quant run against rows xr[0..MR) (row_pointers; the run's inputs at xr[r] + xo):
   isum[r] += the integer dot products of their 16 inputs */
template <int MR, int TYPE>
static inline __attribute__((always_inline)) void kchunks(const uint8_t *qs, const uint8_t *qh, int u0,
                                                          const int8_t *const *xr, int64_t xo, vq_int *isum) {
    for (int u = u0; u < u0 + 2; u++) {
        vq_int lo, hi;
        kchunk_weights<TYPE>(qs, qh, u, &lo, &hi);
        for (int r = 0; r < MR; r++) {
            isum[r] = vq_dot_u4(isum[r], lo, vq_quad(xr[r] + xo + 8 * u));
            isum[r] = vq_dot_u4(isum[r], hi, vq_quad(xr[r] + xo + 8 * u + 4));
        }
    }
}

#if SIMD_Q_SUM16
/* chunks [u0, u1) of a k-quant run against rows xq, xq + k, ...: ssum[r] += m times their integer dot
   products, summed first in 16-bit lanes (vpmaddubsw's pairs, no vpmaddwd per product) and widened once by
   the channels' scale m (vq_pair16's form): the same integers as m times kchunks' sums. The 16-bit lanes
   hold 2 (u1 - u0) products of a weight and |x| <= 127: Q4_K 8 x 2 x 15 x 127 = 30480 (a run), Q5_K
   4 x 2 x 31 x 127 = 31496 (half a run), Q6_K 2 x 2 x 63 x 127 = 32004 (a chunk), each < 2^15 */
template <int MR, int TYPE>
static inline __attribute__((always_inline)) void kchunks16(const uint8_t *qs, const uint8_t *qh, int u0, int u1,
                                                            const int8_t *xq, int64_t k, vq_int m, vq_int *ssum) {
    vq_int lo[4], hi[4];  // the chunks' weights, split once for every row (at most 8 registers)
    for (int u = u0; u < u1; u++) kchunk_weights<TYPE>(qs, qh, u, &lo[u - u0], &hi[u - u0]);
    for (int r = 0; r < MR; r++) {  // a row's products added one after another (vq_keep), into one register
        const int8_t *xr = xq + r * k;
        vq_int acc16 = vq_zero();
        for (int u = u0; u < u1; u++) {
            acc16 = vq_keep(vq_madd16(acc16, lo[u - u0], vq_quad(xr + 8 * u)));
            acc16 = vq_keep(vq_madd16(acc16, hi[u - u0], vq_quad(xr + 8 * u + 4)));
        }
        ssum[r] = vq_widen16_by(ssum[r], acc16, m);
    }
}
#endif

/* one run of 32 inputs of a tile's lanes against rows xq, xq + k, ...: isum[r] += the integer dot products,
   from 8 chunks of signed 8-bit quants (q8, the sign flipped as stored) or 4 chunks of nibble pairs */
template <int MR>
static inline __attribute__((always_inline)) void run_sums(bool q8, const uint8_t *qs, const int8_t *xq, int64_t k,
                                                           vq_int *isum) {
#if SIMD_Q_SUM16
    /* vpmaddubsw without VNNI: a run's 8 products per lane pair add up in 16 bits and widen once. Nibbles
       (Q4_0, Q4_1, GROUP_I4) as a Q4_K run's (kchunks16); a q8 weight (stored q + 128, SIMD_Q8_OFFSET) is two
       4-bit digits, 16 hi + lo, each summed so and widened apart */
    if (!q8) {
        kchunks16<MR, GGUF_Q4_K>(qs, qs, 0, 4, xq, k, vq_pair16(vq_set1(1)), isum);
        return;
    }
    vq_int lo16[MR], hi16[MR];
    for (int r = 0; r < MR; r++) lo16[r] = vq_zero(), hi16[r] = vq_zero();
    for (int u = 0; u < 8; u++) {
        const vq_int w = vq_load(qs + 64 * u), lo = vq_nib_lo(w), hi = vq_nib_hi(w);
        for (int r = 0; r < MR; r++) {
            const vq_int x = vq_quad(xq + r * k + 4 * u);
            lo16[r] = vq_keep(vq_madd16(lo16[r], lo, x));  // chains kept chains (vq_keep), not trees that spill
            hi16[r] = vq_keep(vq_madd16(hi16[r], hi, x));
        }
    }
    for (int r = 0; r < MR; r++) isum[r] = vq_widen16(vq_widen16(isum[r], lo16[r], 1), hi16[r], 16);
#else
    if (q8) {
        for (int u = 0; u < 8; u++) {
            const vq_int w = vq_load(qs + 64 * u);
            for (int r = 0; r < MR; r++) isum[r] = vq_dot_q8(isum[r], w, vq_quad(xq + r * k + 4 * u));
        }
        return;
    }
    for (int u = 0; u < 4; u++) {
        const vq_int w = vq_load(qs + 64 * u), lo = vq_nib_lo(w), hi = vq_nib_hi(w);
        for (int r = 0; r < MR; r++) {
            isum[r] = vq_dot_u4(isum[r], lo, vq_quad(xq + r * k + 8 * u));
            isum[r] = vq_dot_u4(isum[r], hi, vq_quad(xq + r * k + 8 * u + 4));
        }
    }
#endif
}

/* a k-quant run j of rows [r0, r0 + MR) against the lanes of a tile super-block (qs, qh: the run's bits; sc:
   Q6_K's scales of the lanes, S: Q4_K / Q5_K's packed scales and mins; the rows' inputs at xq, xq + k, ...
   for the 16-bit path, at xr[r] + xo for kchunks): ssum[r] += the run's integer sum scaled per channel
   (gguf_x16.h: Q4_K / Q5_K s_j isum, Q6_K sc_2j (isum_lo - 32 sx_lo) + sc_2j+1 (isum_hi - 32 sx_hi)); *min:
   Q4_K / Q5_K's 6-bit mins m_j of the lanes */
template <int MR, int TYPE>
static inline __attribute__((always_inline)) void krun_sums(const QRows &qr, const uint8_t *qs, const uint8_t *qh,
                                                            const uint8_t *sc, const uint8_t *S, int j,
                                                            const int8_t *xq, int64_t k,
                                                            const int8_t *const *xr, int64_t xo, int64_t i0,
                                                            int64_t nb, vq_int *ssum, vq_int *min) {
    if (TYPE == GGUF_Q6_K) {
        const vq_int sc_lo = vq_lanes_s8(sc + 16 * (2 * j)), sc_hi = vq_lanes_s8(sc + 16 * (2 * j + 1));
#if SIMD_Q_SUM16
        for (int r = 0; r < MR; r++) {  // sc_lo (-32 sx_lo) + sc_hi (-32 sx_hi), then the chunks' products
            const int32_t *o = qr.o + 2 * (i0 + r * nb);
            ssum[r] = vq_add(ssum[r], vq_add(vq_mul(vq_set1(o[0]), sc_lo), vq_mul(vq_set1(o[1]), sc_hi)));
        }
        const vq_int m_lo = vq_pair16(sc_lo), m_hi = vq_pair16(sc_hi);
        for (int u = 0; u < 4; u++) kchunks16<MR, TYPE>(qs, qh, u, u + 1, xq, k, u < 2 ? m_lo : m_hi, ssum);
#else
        vq_int isum[MR], isum_hi[MR];  // from -32 sx of each half: the sums of (q - 32) x (the same integers)
        for (int r = 0; r < MR; r++) {
            const int32_t *o = qr.o + 2 * (i0 + r * nb);
            isum[r] = vq_set1(o[0]), isum_hi[r] = vq_set1(o[1]);
        }
        kchunks<MR, TYPE>(qs, qh, 0, xr, xo, isum);  // chunks 0, 1 are the first 16 inputs, 2, 3 the last
        kchunks<MR, TYPE>(qs, qh, 2, xr, xo, isum_hi);
        for (int r = 0; r < MR; r++) ssum[r] = vq_add(ssum[r], vq_add(vq_mul(isum[r], sc_lo), vq_mul(isum_hi[r], sc_hi)));
#endif
        return;
    }
    vq_int scale;
    k_scale_min(S, j, &scale, min);
#if SIMD_Q_SUM16
    const vq_int m = vq_pair16(scale);
    if (TYPE == GGUF_Q4_K) {
        kchunks16<MR, TYPE>(qs, qh, 0, 4, xq, k, m, ssum);
    } else {
        kchunks16<MR, TYPE>(qs, qh, 0, 2, xq, k, m, ssum);
        kchunks16<MR, TYPE>(qs, qh, 2, 4, xq, k, m, ssum);
    }
#else
    vq_int isum[MR];
    for (int r = 0; r < MR; r++) isum[r] = vq_zero();
    kchunks<MR, TYPE>(qs, qh, 0, xr, xo, isum);
    kchunks<MR, TYPE>(qs, qh, 2, xr, xo, isum);
    for (int r = 0; r < MR; r++) ssum[r] = vq_add(ssum[r], vq_mul(isum[r], scale));
#endif
}

/* rows [r0, r0 + MR) against tile t, lanes [h * X16_VL, (h + 1) * X16_VL) of its 16 channels; TYPE the
   ggml type */
template <int MR, int TYPE>
static inline __attribute__((always_inline)) void tile_rows(const LinearNode *n, const QRows &qr, int64_t t,
                                                            int64_t r0, int h) {
    constexpr int type = TYPE;
    const int64_t k = n->in_features, nb = k / GGUF_BLOCK, block_bytes = gguf_block_bytes(type);
    const uint8_t *tile = (const uint8_t *)n->weight + t * X16_TILE * nb * block_bytes;
    const int head = tile_head_bytes(type), lane_bytes = 4 * X16_VL;
    const int32_t offset = type == GGUF_Q4_0 ? 8 : (type == GGUF_Q5_0 ? 16 : (type == GGUF_Q8_0 ? X16_Q8_OFFSET : 0));
    vq_float acc[MR];
    for (int r = 0; r < MR; r++) acc[r] = vq_fzero();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = tile + b * X16_TILE * block_bytes, *qs = blk + head + lane_bytes * h;
        vq_int isum[MR];
        for (int r = 0; r < MR; r++) isum[r] = vq_zero();
#if SIMD_Q_SUM16
        const vq_int ones = vq_pair16(vq_set1(1));  // 16-bit sums widened as they are (kchunks16)
        if constexpr (TYPE == GGUF_Q5_0 || TYPE == GGUF_Q5_1) {  // nibbles and fifth bits as a Q5_K run's
            kchunks16<MR, GGUF_Q5_K>(qs, qs + 256, 0, 2, qr.q + r0 * k + b * 32, k, ones, isum);
            kchunks16<MR, GGUF_Q5_K>(qs, qs + 256, 2, 4, qr.q + r0 * k + b * 32, k, ones, isum);
        } else
#endif
        if constexpr (TYPE == GGUF_Q5_0 || TYPE == GGUF_Q5_1) {  // nibbles and fifth bits as a Q5_K run's
            const int8_t *xr[MR];
            row_pointers<MR>(qr.q + r0 * k + b * 32, k, xr);
            kchunks<MR, GGUF_Q5_K>(qs, qs + 256, 0, xr, 0, isum);
            kchunks<MR, GGUF_Q5_K>(qs, qs + 256, 2, xr, 0, isum);
        } else {
            run_sums<MR>(type == GGUF_Q8_0, qs, qr.q + r0 * k + b * 32, k, isum);
        }
        const vq_float d = vq_fhalves(blk + 2 * X16_VL * h);
        for (int r = 0; r < MR; r++) {
            const int64_t i = (r0 + r) * nb + b;
            const vq_int sum = offset ? vq_sub1(isum[r], offset * qr.s[i]) : isum[r];
            acc[r] = vq_ffma(vq_fcvt(sum), vq_fmul(d, vq_fset1(qr.d[i])), acc[r]);
        }
        if (gguf_has_min(type)) {
            const vq_float m = vq_fhalves(blk + 32 + 2 * X16_VL * h);
            for (int r = 0; r < MR; r++) {
                const int64_t i = (r0 + r) * nb + b;
                acc[r] = vq_ffma(m, vq_fset1(qr.ds[i]), acc[r]);
            }
        }
    }
    store_rows<MR>(n, acc, t, r0, h);
}

/* IQ4_NL / MXFP4: rows [r0, r0 + MR) against tile t, lanes [h * X16_VL, (h + 1) * X16_VL), a block of 32
   inputs at a time: its looked-up quants summed in integers, scaled by the block's d (MXFP4: 2^(e - 128))
   times dx, as Q8_0's */
template <int MR, int TYPE>
static inline __attribute__((always_inline)) void ttile_rows(const LinearNode *n, const QRows &qr, int64_t t,
                                                             int64_t r0, int h) {
    const int64_t k = n->in_features, nb = k / GGUF_BLOCK, block_bytes = gguf_block_bytes(TYPE);
    const uint8_t *tile = (const uint8_t *)n->weight + t * X16_TILE * nb * block_bytes;
    const int head = tile_head_bytes(TYPE), lane_bytes = 4 * X16_VL;
#if SIMD_Q_SUM16
    const vq_tab tab = TYPE == GGUF_MXFP4 ? vq_table_offset(KVALUES_MXFP4, MXFP4_OFFSET) : vq_table(gguf_kvalues(TYPE));
#else
    const vq_tab tab = vq_table(gguf_kvalues(TYPE));
#endif
    const int32_t offset = TYPE == GGUF_MXFP4 ? MXFP4_OFFSET : X16_Q8_OFFSET;
    vq_float acc[MR];
    for (int r = 0; r < MR; r++) acc[r] = vq_fzero();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t *blk = tile + b * X16_TILE * block_bytes;
        vq_int isum[MR];
        for (int r = 0; r < MR; r++) isum[r] = vq_zero();
#if SIMD_Q_SUM16
        if constexpr (TYPE == GGUF_MXFP4)
            mxfp4_run_sums<MR>(tab, blk + head + lane_bytes * h, qr.q + r0 * k + b * 32, k, isum);
        else
#endif
            table_run_sums<MR>(tab, blk + head + lane_bytes * h, qr.q + r0 * k + b * 32, k, isum);
        const vq_float d = TYPE == GGUF_MXFP4 ? vq_fe8m0(blk + X16_VL * h) : vq_fhalves(blk + 2 * X16_VL * h);
        for (int r = 0; r < MR; r++) {
            const int64_t i = (r0 + r) * nb + b;
            const vq_int sum = offset ? vq_sub1(isum[r], offset * qr.s[i]) : isum[r];
            acc[r] = vq_ffma(vq_fcvt(sum), vq_fmul(d, vq_fset1(qr.d[i])), acc[r]);
        }
    }
    store_rows<MR>(n, acc, t, r0, h);
}

/* IQ4_XS: rows [r0, r0 + MR) against tile t, lanes [h * X16_VL, (h + 1) * X16_VL), a run of 32 inputs at a
   time as an IQ4_NL block's, its integer sum times the run's scale ls - 32 (exact: |product| < 2^24), then
   float(...) d dx */
template <int MR>
static inline __attribute__((always_inline)) void xtile_rows(const LinearNode *n, const QRows &qr, int64_t t,
                                                             int64_t r0, int h) {
    const int64_t k = n->in_features, nb = k / GGUF_BLOCK, nsb = k / 256, sb_bytes = gguf_block_bytes(GGUF_IQ4_XS);
    const uint8_t *tile = (const uint8_t *)n->weight + t * X16_TILE * nsb * sb_bytes;
    const int lane_bytes = 4 * X16_VL;
    const vq_tab tab = vq_table(KVALUES_IQ4NL);
    vq_float acc[MR];
    for (int r = 0; r < MR; r++) acc[r] = vq_fzero();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = tile + sb * X16_TILE * sb_bytes, *S = blk + IQ4XS_SCALES + X16_VL * h;
        const vq_float d = vq_fhalves(blk + 2 * X16_VL * h);
        for (int j = 0; j < 8; j++) {
            vq_int isum[MR];
            for (int r = 0; r < MR; r++) isum[r] = vq_zero();
            table_run_sums<MR>(tab, blk + iq4xs_run_offset(j) + lane_bytes * h, qr.q + r0 * k + sb * 256 + 32 * j,
                               k, isum);
            // gguf_iq4_xs_scale for the lanes: low 4 bits from scales_l (S[2..6)), high 2 from scales_h (S[0..2))
            const vq_int low = vq_and1(vq_srl(vq_lanes_u8(S + 16 * (2 + j / 2)), 4 * (j % 2)), 15);
            const vq_int high = vq_and1(vq_srl(vq_lanes_u8(S + 16 * (j / 4)), 2 * (j % 4)), 3);
            const vq_int ls = vq_add(vq_or(low, vq_sll(high, 4)), vq_set1(-32));
            for (int r = 0; r < MR; r++) {
                const int64_t i = (r0 + r) * nb + sb * 8 + j;
                const vq_int sum = X16_Q8_OFFSET ? vq_sub1(isum[r], X16_Q8_OFFSET * qr.s[i]) : isum[r];
                acc[r] = vq_ffma(vq_fcvt(vq_mul(sum, ls)), vq_fmul(d, vq_fset1(qr.d[i])), acc[r]);
            }
        }
    }
    store_rows<MR>(n, acc, t, r0, h);
}

/* bytes ahead of the run being summed that each run asks for (prefetch) */
#ifndef X16_PREFETCH_BYTES
#define X16_PREFETCH_BYTES 2048
#endif

/* Ask for the bytes X16_PREFETCH_BYTES ahead of run j of a tile super-block (blk, tile_bytes long): an eighth
   of a super-block's lines per run, so its 8 runs cover the stream ahead once */
static inline __attribute__((always_inline)) void x16_prefetch_run(const uint8_t *blk, int64_t tile_bytes, int j) {
    const int64_t per_run = tile_bytes / 8;
    for (int64_t l = 0; l < per_run; l += 64) simd_prefetch_l1(blk + X16_PREFETCH_BYTES + j * per_run + l);
}

/* whether ktile_rows keeps each run's mins, in 16-bit pairs, from the run (AVX-512's 32 registers) or unpacks
   them again after the super-block's runs (AVX2's 16: four more live vectors spill the run sums, -17% at 64
   rows where unpacking again is +6-10%) */
#if SIMD_Q_SUM16
#define X16_CARRY_MINS 0
#else
#define X16_CARRY_MINS 1
#endif

/* The k-quants (Q4_K, Q5_K, Q6_K): rows [r0, r0 + MR) against tile t, lanes [h * X16_VL, (h + 1) * X16_VL). A
   row's super-block of 256 inputs shares one grid dx (x16_act_group, llama.cpp's Q8_K), so the super-block sums
   in integers and its float work happens once, not once per run of 32 (an fma costs about one vpdpbusd on Zen 4,
   docs/performance.md):
   - isacc[r] = the sum over its 8 runs of each run's scaled integer sum (gguf_x16.h: Q4_K / Q5_K s_j isum_j,
     Q6_K sc_2j (isum_lo - 32 sx_lo) + sc_2j+1 (isum_hi - 32 sx_hi));
   - Q4_K / Q5_K: imin[r] = sum_j m_j sx_j, the 6-bit mins times the runs' sums of quants;
   - y += float(isacc) (d dx) + float(imin) (-dmin dx).
   Super-blocks [sb0, sb1) only (a slice of the tile that stays in L1 while every row of the block passes,
   ktile_slice): the sum starts from the previous slice's, left in y, unless sb0 is 0; `first`: these rows are
   the slice's first pass (its lines are asked for ahead) */
template <int MR, int TYPE>
static inline __attribute__((always_inline)) void ktile_rows(const LinearNode *n, const QRows &qr, int64_t t,
                                                             int64_t r0, int h, int64_t sb0, int64_t sb1, bool first) {
    constexpr int type = TYPE;
    const int64_t k = n->in_features, nb = k / GGUF_BLOCK, nsb = k / 256, sb_bytes = gguf_block_bytes(type);
    const uint8_t *tile = (const uint8_t *)n->weight + t * X16_TILE * nsb * sb_bytes;
    const int lane_bytes = 4 * X16_VL;
    vq_float acc[MR];
    if (sb0 == 0)
        for (int r = 0; r < MR; r++) acc[r] = vq_fzero();
    else
        load_rows<MR>(n, acc, t, r0, h);
    const int8_t *xr[MR];
    row_pointers<MR>(qr.q + r0 * k, k, xr);
    for (int64_t sb = sb0; sb < sb1; sb++) {
        const uint8_t *blk = tile + sb * X16_TILE * sb_bytes;
        vq_int isacc[MR], min_pairs[4];  // min_pairs[p]: runs 2p and 2p + 1's mins, a 16-bit pair per lane
        for (int r = 0; r < MR; r++) isacc[r] = vq_zero();
        for (int j = 0; j < 8; j++) {
            if (h == 0 && first) x16_prefetch_run(blk, X16_TILE * sb_bytes, j);  // the slice's first pass
            const uint8_t *qs = blk + kq_qs_offset(type, j) + lane_bytes * h;
            const uint8_t *qh = blk + kq_qh_offset(type, j) + lane_bytes * h;
            vq_int min = vq_zero();  // Q4_K / Q5_K: this run's mins (krun_sums)
            krun_sums<MR, TYPE>(qr, qs, qh, blk + 32 + X16_VL * h, blk + 64 + X16_VL * h, j,
                                qr.q + r0 * k + sb * 256 + 32 * j, k, xr, sb * 256 + 32 * j, r0 * nb + sb * 8 + j, nb,
                                isacc, &min);
            if (X16_CARRY_MINS && type != GGUF_Q6_K)
                min_pairs[j / 2] = j % 2 ? vq_or(min_pairs[j / 2], vq_sll(min, 16)) : min;
        }
        const vq_float d = vq_fhalves(blk + 2 * X16_VL * h);
        const int64_t i0 = r0 * nb + sb * 8;  // row r0's first block of this super-block (row r: i0 + r nb)
        if (type == GGUF_Q6_K) {
            for (int r = 0; r < MR; r++)
                acc[r] = vq_ffma(vq_fcvt(isacc[r]), vq_fmul(d, vq_fset1(qr.d[i0 + r * nb])), acc[r]);
            continue;
        }
        for (int p = 0; !X16_CARRY_MINS && p < 4; p++) {  // unpacked again: registers kept for the runs
            vq_int scale, m_lo, m_hi;
            k_scale_min(blk + 64 + X16_VL * h, 2 * p, &scale, &m_lo);
            k_scale_min(blk + 64 + X16_VL * h, 2 * p + 1, &scale, &m_hi);
            min_pairs[p] = vq_or(m_lo, vq_sll(m_hi, 16));
        }
        // imin in 16-bit pairs of runs (vpdpwssd / vpmaddwd): m_j < 64 and |sx_j| <= 32 x 127 fit int16
        vq_int imin[MR];
        for (int r = 0; r < MR; r++) {
            const int32_t *sx = qr.s + i0 + r * nb;
            imin[r] = vq_zero();
            for (int p = 0; p < 4; p++)
                imin[r] = vq_madd_pairs(imin[r], min_pairs[p],
                                        vq_set1((int32_t)(((uint32_t)sx[2 * p] & 0xffffu) | ((uint32_t)sx[2 * p + 1] << 16))));
        }
        const vq_float neg_dmin = vq_fmul(vq_fhalves(blk + 32 + 2 * X16_VL * h), vq_fset1(-1.0f));
        for (int r = 0; r < MR; r++) {
            const vq_float dx = vq_fset1(qr.d[i0 + r * nb]);
            acc[r] = vq_ffma(vq_fcvt(isacc[r]), vq_fmul(d, dx), acc[r]);
            acc[r] = vq_ffma(vq_fcvt(imin[r]), vq_fmul(neg_dmin, dx), acc[r]);
        }
    }
    store_rows<MR>(n, acc, t, r0, h, sb1 < nsb);
}

/* GROUP_I8 / GROUP_I4: rows [r0, r0 + MR) against tile t, lanes [h * X16_VL, (h + 1) * X16_VL), a group at a
   time: its runs summed in integers, scaled by each run's dx into one float per channel, then by the group's
   scale (gguf_x16.h) */
template <int MR, int TYPE>
static inline __attribute__((always_inline)) void gtile_rows(const LinearNode *n, const QRows &qr, int64_t t,
                                                             int64_t r0, int h) {
    const int64_t k = n->in_features, nb = k / GGUF_BLOCK, group = n->group_size, num_groups = k / group;
    const int64_t num_runs = group / GGUF_BLOCK, group_bytes = group_block_bytes(TYPE, group);
    const uint8_t *tile = (const uint8_t *)n->weight + t * X16_TILE * num_groups * group_bytes;
    const int lane_bytes = 4 * X16_VL;
    vq_float acc[MR];
    for (int r = 0; r < MR; r++) acc[r] = vq_fzero();
    for (int64_t g = 0; g < num_groups; g++) {
        const uint8_t *blk = tile + g * X16_TILE * group_bytes;
        vq_float gacc[MR];
        float xsum[MR];  // GROUP_I4: the group's sum of the rounded inputs, sum_j dx_j sx_j
        for (int r = 0; r < MR; r++) gacc[r] = vq_fzero(), xsum[r] = 0.0f;
        for (int64_t j = 0; j < num_runs; j++) {
            const uint8_t *qs = blk + group_head_bytes(TYPE) + group_run_bytes(TYPE) * j + lane_bytes * h;
            const int64_t b = g * num_runs + j;
            vq_int isum[MR];
            for (int r = 0; r < MR; r++) isum[r] = vq_zero();
            run_sums<MR>(TYPE == GROUP_I8, qs, qr.q + r0 * k + b * 32, k, isum);
            for (int r = 0; r < MR; r++) {
                const int64_t i = (r0 + r) * nb + b;
                const vq_int sum = TYPE == GROUP_I8 && X16_Q8_OFFSET ? vq_sub1(isum[r], X16_Q8_OFFSET * qr.s[i]) : isum[r];
                gacc[r] = vq_ffma(vq_fcvt(sum), vq_fset1(qr.d[i]), gacc[r]);
                if (TYPE == GROUP_I4) xsum[r] = fmaf(qr.d[i], (float)qr.s[i], xsum[r]);  // fmaf: one rounding in every build
            }
        }
        const vq_float scale = vq_fload((const float *)(blk + 4 * X16_VL * h));
        for (int r = 0; r < MR; r++) acc[r] = vq_ffma(gacc[r], scale, acc[r]);
        if (TYPE == GROUP_I4) {
            const vq_float min = vq_fload((const float *)(blk + 64 + 4 * X16_VL * h));
            for (int r = 0; r < MR; r++) acc[r] = vq_ffma(min, vq_fset1(xsum[r]), acc[r]);
        }
    }
    store_rows<MR>(n, acc, t, r0, h);
}

/* Q3_K sub-block s's 6-bit scale less 32 for the lanes' channels (S: the tile's S[12][16] + the lanes' first
   channel): low 4 bits in the nibbles of bytes 0..7, high 2 in pairs of bytes 8..11 */
static inline __attribute__((always_inline)) vq_int q3k_scale(const uint8_t *S, int s) {
    const vq_int low = s < 8 ? vq_and1(vq_lanes_u8(S + 16 * s), 15) : vq_srl(vq_lanes_u8(S + 16 * (s - 8)), 4);
    const vq_int high = vq_and1(vq_srl(vq_lanes_u8(S + 16 * (8 + s % 4)), 2 * (s / 4)), 3);
    return vq_add(vq_or(low, vq_sll(high, 4)), vq_set1(-32));
}

/* Q2_K / Q3_K: rows [r0, r0 + MR) against tile t, lanes [h * X16_VL, (h + 1) * X16_VL), a 32-input run (two
   sub-blocks of 16) at a time, summed in integers per sub-block and scaled as gguf_x16.h writes */
template <int MR, int TYPE>
static inline __attribute__((always_inline)) void lktile_rows(const LinearNode *n, const QRows &qr, int64_t t,
                                                              int64_t r0, int h) {
    const int64_t k = n->in_features, nb = k / GGUF_BLOCK, nsb = k / 256, sb_bytes = gguf_block_bytes(TYPE);
    const uint8_t *tile = (const uint8_t *)n->weight + t * X16_TILE * nsb * sb_bytes;
    const int lane_bytes = 4 * X16_VL;
    vq_float acc[MR];
    for (int r = 0; r < MR; r++) acc[r] = vq_fzero();
    for (int64_t sb = 0; sb < nsb; sb++) {
        const uint8_t *blk = tile + sb * X16_TILE * sb_bytes;
        const vq_float d = vq_fhalves(blk + 2 * X16_VL * h);
        const vq_float neg_dmin = TYPE == GGUF_Q2_K ? vq_fmul(vq_fhalves(blk + 32 + 2 * X16_VL * h), vq_fset1(-1.0f)) : vq_fzero();
        for (int j = 0; j < 8; j++) {
            const uint8_t *run = blk + lk_run_offset(TYPE, j) + lane_bytes * h;
            vq_int isum_lo[MR], isum_hi[MR];  // over the run's first 16 inputs (sub-block 2j), its last 16
            for (int r = 0; r < MR; r++) isum_lo[r] = vq_zero(), isum_hi[r] = vq_zero();
            const int8_t *xq = qr.q + r0 * k + sb * 256 + 32 * j;
            const vq_int w0 = vq_load(run), w1 = vq_load(run + 64);
            const vq_int top = TYPE == GGUF_Q3_K ? vq_load(run + 128) : vq_zero();
            for (int u = 0; u < 8; u++) {
                vq_int q = vq_bits(u < 4 ? w0 : w1, 2 * (u % 4), 3);
                if (TYPE == GGUF_Q3_K) q = vq_or(q, vq_shl2(vq_bits(top, u, 1)));
                for (int r = 0; r < MR; r++) {
                    vq_int *isum = u < 4 ? isum_lo : isum_hi;
                    isum[r] = vq_dot_u4(isum[r], q, vq_quad(xq + r * k + 4 * u));
                }
            }
            if (TYPE == GGUF_Q3_K) {
                const uint8_t *S = blk + 32 + X16_VL * h;
                const vq_int sc_lo = q3k_scale(S, 2 * j), sc_hi = q3k_scale(S, 2 * j + 1);
                for (int r = 0; r < MR; r++) {
                    const int64_t i = (r0 + r) * nb + sb * 8 + j;
                    const int32_t sx_lo = qr.h[i], sx_hi = qr.s[i] - qr.h[i];
                    const vq_int sum = vq_add(vq_mul(vq_sub1(isum_lo[r], 4 * sx_lo), sc_lo), vq_mul(vq_sub1(isum_hi[r], 4 * sx_hi), sc_hi));
                    acc[r] = vq_ffma(vq_fcvt(sum), vq_fmul(d, vq_fset1(qr.d[i])), acc[r]);
                }
            } else {
                const uint8_t *sc = blk + 64 + X16_VL * h;
                const vq_int b_lo = vq_lanes_u8(sc + 16 * (2 * j)), b_hi = vq_lanes_u8(sc + 16 * (2 * j + 1));
                const vq_int sc_lo = vq_and1(b_lo, 15), sc_hi = vq_and1(b_hi, 15), m_lo = vq_srl(b_lo, 4), m_hi = vq_srl(b_hi, 4);
                for (int r = 0; r < MR; r++) {
                    const int64_t i = (r0 + r) * nb + sb * 8 + j;
                    const int32_t sx_lo = qr.h[i], sx_hi = qr.s[i] - qr.h[i];
                    const vq_float dx = vq_fset1(qr.d[i]);
                    const vq_int sum = vq_add(vq_mul(isum_lo[r], sc_lo), vq_mul(isum_hi[r], sc_hi));
                    const vq_int mins = vq_add(vq_mul(m_lo, vq_set1(sx_lo)), vq_mul(m_hi, vq_set1(sx_hi)));
                    acc[r] = vq_ffma(vq_fcvt(sum), vq_fmul(d, dx), acc[r]);
                    acc[r] = vq_ffma(vq_fcvt(mins), vq_fmul(neg_dmin, dx), acc[r]);
                }
            }
        }
    }
    store_rows<MR>(n, acc, t, r0, h);
}

/* rows [r0, r0 + MR) against tile t, lanes [h * X16_VL, (h + 1) * X16_VL): the k-quants over super-blocks
   [sb0, sb1) (ktile_rows), the other types over all their inputs (one slice) */
template <int MR, int TYPE>
static inline __attribute__((always_inline)) void rows_against_tile(const LinearNode *n, const QRows &qr, int64_t t,
                                                                    int64_t r0, int h, int64_t sb0, int64_t sb1,
                                                                    bool first) {
    if constexpr (x16_ktile_type(TYPE))
        ktile_rows<MR, TYPE>(n, qr, t, r0, h, sb0, sb1, first);
    else if constexpr (TYPE == GROUP_I8 || TYPE == GROUP_I4)
        gtile_rows<MR, TYPE>(n, qr, t, r0, h);
    else if constexpr (TYPE == GGUF_Q2_K || TYPE == GGUF_Q3_K)
        lktile_rows<MR, TYPE>(n, qr, t, r0, h);
    else if constexpr (TYPE == GGUF_IQ4_NL || TYPE == GGUF_MXFP4)
        ttile_rows<MR, TYPE>(n, qr, t, r0, h);
    else if constexpr (TYPE == GGUF_IQ4_XS)
        xtile_rows<MR>(n, qr, t, r0, h);
    else
        tile_rows<MR, TYPE>(n, qr, t, r0, h);
}

/* bytes of a k-quant tile's slice that every row of a block meets in L1 (ktile_rows): a tile of 16 channels of
   a long input (Q6_K at 8192 inputs: 105 KiB) is cut into slices of about this size, else each pass of
   X16_MR rows would read it again from L2 */
#define X16_SLICE_BYTES (32 * 1024)

/* super-blocks per slice of a tile of `type` over `k` inputs (all of them for the types that are not sliced):
   the fewest slices of at most X16_SLICE_BYTES, of equal length but the last */
static int64_t ktile_slice(int type, int64_t k) {
    if (!x16_ktile_type(type)) return k;  // more than any count of blocks
    const int64_t nsb = k / 256, tile_bytes = X16_TILE * nsb * gguf_block_bytes(type);
    const int64_t slices = (tile_bytes + X16_SLICE_BYTES - 1) / X16_SLICE_BYTES;
    return (nsb + slices - 1) / slices;
}

/* rows [row0, row0 + m) against tile t, a slice of its inputs at a time (ktile_slice), every row per slice; in
   one slice where one pass of X16_MR rows takes them all (no later pass would find the slice in L1) */
template <int TYPE>
static void tile_team_rows(const LinearNode *n, const QRows &qr, int64_t t, int64_t row0, int64_t m) {
    const int64_t nsb = n->in_features / 256;
    const int64_t slice = m > X16_MR ? ktile_slice(TYPE, n->in_features) : n->in_features;
    for (int h = 0; h < X16_TILE / X16_VL; h++) {
        for (int64_t sb0 = 0;; sb0 += slice) {
            const int64_t sb1 = sb0 + slice < nsb ? sb0 + slice : nsb;
            int64_t r = row0;
            for (; r + X16_MR <= row0 + m; r += X16_MR) rows_against_tile<X16_MR, TYPE>(n, qr, t, r, h, sb0, sb1, r == row0);
            switch (row0 + m - r) {
#if X16_MR > 4
                case 7: rows_against_tile<7, TYPE>(n, qr, t, r, h, sb0, sb1, r == row0); break;
                case 6: rows_against_tile<6, TYPE>(n, qr, t, r, h, sb0, sb1, r == row0); break;
                case 5: rows_against_tile<5, TYPE>(n, qr, t, r, h, sb0, sb1, r == row0); break;
                case 4: rows_against_tile<4, TYPE>(n, qr, t, r, h, sb0, sb1, r == row0); break;
#endif
                case 3: rows_against_tile<3, TYPE>(n, qr, t, r, h, sb0, sb1, r == row0); break;
                case 2: rows_against_tile<2, TYPE>(n, qr, t, r, h, sb0, sb1, r == row0); break;
                case 1: rows_against_tile<1, TYPE>(n, qr, t, r, h, sb0, sb1, r == row0); break;
                default: break;
            }
            if (sb1 >= nsb) break;  // the last slice (the only one for the types that are not sliced)
        }
    }
}

/* bytes of int8 rows per block (a block's copies stay in L2 across the tiles, x16_block_rows):
   three quarters of this core's L2 as the C library reports it (the weights pass through L1 in slices), 192 KiB
   where it reports none; a block of more rows reads each weight from memory fewer times */
static int64_t x16_block_bytes() {
    static const int64_t bytes = [] {
#ifdef _SC_LEVEL2_CACHE_SIZE
        const long l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#else
        const long l2 = 0;  // a C library that does not say (not glibc)
#endif
        const int64_t three_quarters = l2 > 0 ? (int64_t)l2 / 4 * 3 : 192 * 1024;
        return three_quarters < 192 * 1024 ? 192 * 1024 : (three_quarters > 1536 * 1024 ? 1536 * 1024 : three_quarters);
    }();
    return bytes;
}

/* rows [row0, row0 + m) of qr against tile t, the kernel of the node's type */
static void type_tile_rows(const LinearNode *n, const QRows &qr, int64_t t, int64_t row0, int64_t m) {
    switch (x16_base_type(n->weight_type)) {
        case GGUF_Q4_0: tile_team_rows<GGUF_Q4_0>(n, qr, t, row0, m); break;
        case GGUF_Q4_1: tile_team_rows<GGUF_Q4_1>(n, qr, t, row0, m); break;
        case GGUF_Q5_0: tile_team_rows<GGUF_Q5_0>(n, qr, t, row0, m); break;
        case GGUF_Q5_1: tile_team_rows<GGUF_Q5_1>(n, qr, t, row0, m); break;
        case GGUF_Q8_0: tile_team_rows<GGUF_Q8_0>(n, qr, t, row0, m); break;
        case GGUF_Q4_K: tile_team_rows<GGUF_Q4_K>(n, qr, t, row0, m); break;
        case GGUF_Q5_K: tile_team_rows<GGUF_Q5_K>(n, qr, t, row0, m); break;
        case GGUF_Q2_K: tile_team_rows<GGUF_Q2_K>(n, qr, t, row0, m); break;
        case GGUF_Q3_K: tile_team_rows<GGUF_Q3_K>(n, qr, t, row0, m); break;
        case GROUP_I8: tile_team_rows<GROUP_I8>(n, qr, t, row0, m); break;
        case GROUP_I4: tile_team_rows<GROUP_I4>(n, qr, t, row0, m); break;
        case GGUF_IQ4_NL: tile_team_rows<GGUF_IQ4_NL>(n, qr, t, row0, m); break;
        case GGUF_IQ4_XS: tile_team_rows<GGUF_IQ4_XS>(n, qr, t, row0, m); break;
        case GGUF_MXFP4: tile_team_rows<GGUF_MXFP4>(n, qr, t, row0, m); break;
        default: tile_team_rows<GGUF_Q6_K>(n, qr, t, row0, m); break;
    }
}

/* rows per block of a long input: a block's int8 copies stay in L2 (k bytes and, of the 24 per 32 inputs
   the scratch keeps, the 16 or so that one type's kernel reads) */
static int64_t x16_block_rows(int64_t k) {
    const int64_t block_rows = x16_block_bytes() / (k + 16 * (k / GGUF_BLOCK)) / X16_MR * X16_MR;
    return block_rows < X16_MR ? X16_MR : block_rows;
}

/* tiles a thread of the team takes at a time against a batch of rows (compute-bound): about 16 chunks per
   thread, taken as threads free up, so that a core slowed by another load (a shared host, a hyperthread's
   sibling) leaves its chunks to the others instead of holding back the whole call. Which thread sums a tile
   does not change its bits */
static int64_t x16_tile_chunk(int64_t num_tiles) {
    const int64_t chunk = num_tiles / (16 * (int64_t)omp_get_num_threads());
    return chunk > 1 ? chunk : 1;
}

void gguf_x16_linear_team(const LinearNode *n, int64_t rows) {
    const int64_t k = n->in_features, num_tiles = n->out_features / X16_TILE;
    const QRows qr = scratch_rows(n, rows);
    const int64_t group = x16_act_group(n->weight_type);
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; r++) quantize_row(n->x + r * k, k, group, qrow_of(qr, k, r));
    const int64_t block_rows = x16_block_rows(k);
    for (int64_t row0 = 0; row0 < rows; row0 += block_rows) {
        const int64_t m = rows - row0 < block_rows ? rows - row0 : block_rows;
        if (m < X16_MR) {  // a few rows (memory-bound, short): a static split, no thread waits on a late one
#pragma omp for schedule(static)
            for (int64_t t = 0; t < num_tiles; t++) type_tile_rows(n, qr, t, row0, m);
        } else {
            const int64_t chunk = x16_tile_chunk(num_tiles);
#pragma omp for schedule(dynamic, chunk)
            for (int64_t t = 0; t < num_tiles; t++) type_tile_rows(n, qr, t, row0, m);
        }
    }
}

/* ---- the pieces of a grouped-expert matmul (gguf_moe_linear.cpp) ---- */

void gguf_x16_quantize_row(const float *x, int64_t k, int type, void *scratch, int64_t rows, int64_t row) {
    quantize_row(x, k, x16_act_group(type), qrow_of(qrows_at(scratch, rows, k), k, row));
}

void gguf_x16_copy_row(const void *src, int64_t src_rows, int64_t src_row, void *dst, int64_t dst_rows,
                       int64_t dst_row, int64_t k) {
    const QRows from = qrows_at(src, src_rows, k), to = qrows_at(dst, dst_rows, k);
    const int64_t nb = k / GGUF_BLOCK;
    memcpy((int8_t *)to.q + dst_row * k, from.q + src_row * k, (size_t)k);
    memcpy((float *)to.d + dst_row * nb, from.d + src_row * nb, (size_t)nb * sizeof(float));
    memcpy((int32_t *)to.s + dst_row * nb, from.s + src_row * nb, (size_t)nb * sizeof(int32_t));
    memcpy((int32_t *)to.h + dst_row * nb, from.h + src_row * nb, (size_t)nb * sizeof(int32_t));
    memcpy((float *)to.ds + dst_row * nb, from.ds + src_row * nb, (size_t)nb * sizeof(float));
    memcpy((int32_t *)to.o + 2 * dst_row * nb, from.o + 2 * src_row * nb, (size_t)nb * 2 * sizeof(int32_t));
}

void gguf_x16_tiles(const LinearNode *n, const void *scratch, int64_t rows, int64_t row0, int64_t m, int64_t t0,
                    int64_t t1) {
    const QRows qr = qrows_at(scratch, rows, n->in_features);
    const int64_t block_rows = x16_block_rows(n->in_features);
    for (int64_t r = row0; r < row0 + m; r += block_rows)
        for (int64_t t = t0; t < t1; t++) type_tile_rows(n, qr, t, r, row0 + m - r < block_rows ? row0 + m - r : block_rows);
}
