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
 *   f32 FMA zmm                                    16   (float32 GEMM, AVX-512)
 *   bf16 dot zmm (vdpbf16ps)                       32   (bfloat16 GEMM, AVX512-BF16)
 *   int8 VNNI zmm (vpdpbusd)                       64   (8-bit activations, AVX512-VNNI)
 * Variants the CPU lacks are skipped (and say so).
 */
#include <immintrin.h>
#include <stdio.h>
#include <time.h>

#define ITERS 20000000L
#define NACC 12 /* REP12 */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

/* twelve accumulators as named variables (an array of them would live in memory) */
#define REP12(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11)

/* every loop returns a value built from its accumulators, so none is optimized away */
__attribute__((target("avx2,fma"))) static float fma_ymm(void) {
    __m256 a = _mm256_set1_ps(1.0001f), b = _mm256_set1_ps(0.9999f);
#define DECL(k) __m256 c##k = _mm256_set1_ps((float)k);
#define STEP(k) asm volatile("vfmadd231ps %2, %1, %0" : "+x"(c##k) : "x"(a), "x"(b));
#define SUM(k) s += _mm256_cvtss_f32(c##k);
    REP12(DECL)
    for (long i = 0; i < ITERS; i++) { REP12(STEP) }
    float s = 0;
    REP12(SUM)
    return s;
#undef DECL
#undef STEP
#undef SUM
}

__attribute__((target("avx2"))) static float int8_ymm(void) {
    __m256i a = _mm256_set1_epi8(3), b = _mm256_set1_epi8(-2), one = _mm256_set1_epi16(1);
    /* 12 accumulators + 3 operands leave one of AVX2's 16 registers for the temporaries */
#define DECL(k) __m256i c##k = _mm256_set1_epi32(k);
#define STEP(k) { __m256i t; asm volatile("vpmaddubsw %3, %2, %1\n\tvpmaddwd %4, %1, %1\n\tvpaddd %1, %0, %0" \
                                          : "+x"(c##k), "=&x"(t) : "x"(a), "x"(b), "x"(one)); }
#define SUM(k) s += _mm256_cvtsi256_si32(c##k);
    REP12(DECL)
    for (long i = 0; i < ITERS; i++) { REP12(STEP) }
    int s = 0;
    REP12(SUM)
    return (float)s;
#undef DECL
#undef STEP
#undef SUM
}

__attribute__((target("avx512f"))) static float fma_zmm(void) {
    __m512 a = _mm512_set1_ps(1.0001f), b = _mm512_set1_ps(0.9999f);
#define DECL(k) __m512 c##k = _mm512_set1_ps((float)k);
#define STEP(k) asm volatile("vfmadd231ps %2, %1, %0" : "+v"(c##k) : "v"(a), "v"(b));
#define SUM(k) s += _mm512_reduce_add_ps(c##k);
    REP12(DECL)
    for (long i = 0; i < ITERS; i++) { REP12(STEP) }
    float s = 0;
    REP12(SUM)
    return s;
#undef DECL
#undef STEP
#undef SUM
}

__attribute__((target("avx512f,avx512bf16"))) static float bf16_zmm(void) {
    __m512i a = _mm512_set1_epi16(0x3f80), b = _mm512_set1_epi16(0x3f80);
#define DECL(k) __m512 c##k = _mm512_set1_ps((float)k);
#define STEP(k) asm volatile("vdpbf16ps %2, %1, %0" : "+v"(c##k) : "v"(a), "v"(b));
#define SUM(k) s += _mm512_reduce_add_ps(c##k);
    REP12(DECL)
    for (long i = 0; i < ITERS; i++) { REP12(STEP) }
    float s = 0;
    REP12(SUM)
    return s;
#undef DECL
#undef STEP
#undef SUM
}

__attribute__((target("avx512f,avx512vnni"))) static float vnni_zmm(void) {
    __m512i a = _mm512_set1_epi8(3), b = _mm512_set1_epi8(-2);
#define DECL(k) __m512i c##k = _mm512_set1_epi32(k);
#define STEP(k) asm volatile("vpdpbusd %2, %1, %0" : "+v"(c##k) : "v"(a), "v"(b));
#define SUM(k) s += _mm512_reduce_add_epi32(c##k);
    REP12(DECL)
    for (long i = 0; i < ITERS; i++) { REP12(STEP) }
    int s = 0;
    REP12(SUM)
    return (float)s;
#undef DECL
#undef STEP
#undef SUM
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
    report("f32 FMA zmm (AVX-512), 16 MAC", avx512, fma_zmm, 16);
    report("bf16 vdpbf16ps zmm (AVX512-BF16), 32 MAC", avx512 && __builtin_cpu_supports("avx512bf16"), bf16_zmm, 32);
    report("int8 vpdpbusd zmm (AVX512-VNNI), 64 MAC", avx512 && __builtin_cpu_supports("avx512vnni"), vnni_zmm, 64);
    return 0;
}
