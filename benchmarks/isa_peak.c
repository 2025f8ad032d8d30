/*
 * Peak multiply-accumulate rate of one core for each instruction the linear
 * kernels (ours and the peers') are built on: the ceiling that no GEMM on
 * this CPU passes, whoever wrote it.
 *
 *   gcc -O2 benchmarks/isa_peak.c -o /tmp/isa_peak && taskset -c 0 /tmp/isa_peak
 *
 * Each loop issues only independent instructions (12 accumulators, more
 * than latency x throughput on any x86 core), so it measures throughput.
 * The instructions are inline assembly: a compiler would hoist a product of
 * two loop constants out of the loop.
 * MACs counted per instruction:
 *   f32 FMA ymm (vfmadd231ps)                       8   (float32 GEMM, AVX2)
 *   int8 AVX2 (vpmaddubsw + vpmaddwd + vpaddd)     32   (8-bit activations, AVX2 without VNNI;
 *                                                        one MAC = u8 x s8, three instructions)
 *   int8 AVX2, 16-bit sums (vpmaddubsw + vpaddw)   32   (the same, the products of a run of inputs
 *                                                        added in 16-bit lanes and widened once per
 *                                                        run, as our AVX2 kernels do for 4- to 6-bit
 *                                                        weights: two instructions per 32 MACs)
 *   f32 FMA zmm                                    16   (float32 GEMM, AVX-512)
 *   bf16 dot zmm (vdpbf16ps)                       32   (bfloat16 GEMM, AVX512-BF16)
 *   int8 VNNI zmm (vpdpbusd)                       64   (8-bit activations, AVX512-VNNI)
 * Variants the CPU lacks are skipped (and say so).
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define ITERS 20000000L
#define NACC 12 /* the accumulators of REP12 */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* twelve accumulators c0..c11 as named variables (an array of them would live in memory) */
#define REP12(X, ...) X(0, __VA_ARGS__) X(1, __VA_ARGS__) X(2, __VA_ARGS__) X(3, __VA_ARGS__) \
    X(4, __VA_ARGS__) X(5, __VA_ARGS__) X(6, __VA_ARGS__) X(7, __VA_ARGS__) X(8, __VA_ARGS__) \
    X(9, __VA_ARGS__) X(10, __VA_ARGS__) X(11, __VA_ARGS__)
#define DECL(k, TYPE, INIT) TYPE c##k = INIT(k);
#define STEP(k, INSTR, REG) asm volatile(INSTR " %2, %1, %0" : "+" REG(c##k) : REG(a), REG(b));
#define FOLD(k, F) s += F(c##k);

/* NAME: ITERS rounds of one INSTR on each accumulator (TYPE, set by INIT) with the operands a and b (OPERANDS),
   in registers of class REG ("x": ymm, "v": zmm); returns the accumulators folded by F, so none is optimized away */
#define PEAK(NAME, TARGET, TYPE, INIT, OPERANDS, INSTR, REG, F) \
    __attribute__((target(TARGET))) static float NAME(void) {   \
        OPERANDS;                                               \
        REP12(DECL, TYPE, INIT)                                 \
        for (long i = 0; i < ITERS; i++) { REP12(STEP, INSTR, REG) } \
        float s = 0;                                            \
        REP12(FOLD, F)                                          \
        return s;                                               \
    }

#define PS256(k) _mm256_set1_ps((float)(k))
#define PS512(k) _mm512_set1_ps((float)(k))
#define EPI32_512(k) _mm512_set1_epi32(k)

PEAK(fma_ymm, "avx2,fma", __m256, PS256, __m256 a = _mm256_set1_ps(1.0001f); __m256 b = _mm256_set1_ps(0.9999f),
     "vfmadd231ps", "x", _mm256_cvtss_f32)
PEAK(fma_zmm, "avx512f", __m512, PS512, __m512 a = _mm512_set1_ps(1.0001f); __m512 b = _mm512_set1_ps(0.9999f),
     "vfmadd231ps", "v", _mm512_reduce_add_ps)
PEAK(bf16_zmm, "avx512f,avx512bf16", __m512, PS512,
     __m512i a = _mm512_set1_epi16(0x3f80); __m512i b = _mm512_set1_epi16(0x3f80), "vdpbf16ps", "v",
     _mm512_reduce_add_ps)
PEAK(vnni_zmm, "avx512f,avx512vnni", __m512i, EPI32_512,
     __m512i a = _mm512_set1_epi8(3); __m512i b = _mm512_set1_epi8(-2), "vpdpbusd", "v", _mm512_reduce_add_epi32)

/* AVX2's 8-bit dot product is three instructions (u8 x s8 pairs to int16, int16 pairs to int32, the sum);
   12 accumulators + 3 operands leave one of AVX2's 16 registers for the temporary */
__attribute__((target("avx2"))) static float int8_ymm(void) {
    __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2), one = _mm256_set1_epi16(1);
#define EPI32_256(k) _mm256_set1_epi32(k)
#define STEP3(k, unused) { __m256i t; asm volatile("vpmaddubsw %3, %2, %1\n\tvpmaddwd %4, %1, %1\n\tvpaddd %1, %0, %0" \
                                                   : "+x"(c##k), "=&x"(t) : "x"(a), "x"(b), "x"(one)); }
    REP12(DECL, __m256i, EPI32_256)
    for (long i = 0; i < ITERS; i++) { REP12(STEP3, 0) }
    float s = 0;
    REP12(FOLD, _mm256_cvtsi256_si32)
    return s;
}

/* vpmaddubsw's 16-bit pairs added in 16-bit lanes (vpaddw), the widening left out (one per run of 8 or so) */
__attribute__((target("avx2"))) static float int8_sum16_ymm(void) {
    __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2);
#define STEP2(k, unused) { __m256i t; asm volatile("vpmaddubsw %3, %2, %1\n\tvpaddw %1, %0, %0" \
                                                   : "+x"(c##k), "=&x"(t) : "x"(a), "x"(b)); }
    REP12(DECL, __m256i, EPI32_256)
    for (long i = 0; i < ITERS; i++) { REP12(STEP2, 0) }
    float s = 0;
    REP12(FOLD, _mm256_cvtsi256_si32)
    return s;
}

static void report(const char *name, int supported, float (*loop)(void), int macs_per_instr) {
    if (!supported) {
        printf("%-44s  not on this CPU\n", name);
        return;
    }
    double t0 = now();
    volatile float sink = loop();
    double dt = now() - t0;
    (void)sink;
    double instr = (double)ITERS * NACC;
    printf("%-44s  %6.2f G instr/s  %7.1f GMAC/s\n", name, instr / dt / 1e9, instr * macs_per_instr / dt / 1e9);
}

int main(void) {
    __builtin_cpu_init();
    int avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    int avx512 = __builtin_cpu_supports("avx512f");
    report("f32 FMA ymm (AVX2), 8 MAC", avx2, fma_ymm, 8);
    report("int8 maddubs+madd+add ymm (AVX2), 32 MAC", avx2, int8_ymm, 32);
    report("int8 maddubs+add16 ymm (AVX2), 32 MAC", avx2, int8_sum16_ymm, 32);
    report("f32 FMA zmm (AVX-512), 16 MAC", avx512, fma_zmm, 16);
    report("bf16 vdpbf16ps zmm (AVX512-BF16), 32 MAC", avx512 && __builtin_cpu_supports("avx512bf16"), bf16_zmm, 32);
    report("int8 vpdpbusd zmm (AVX512-VNNI), 64 MAC", avx512 && __builtin_cpu_supports("avx512vnni"), vnni_zmm, 64);
    return 0;
}
