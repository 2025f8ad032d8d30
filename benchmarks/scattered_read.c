/*
 * Memory read rate for the access pattern of paged decode attention: short
 * contiguous runs (a block of one layer's K or V) scattered over a large
 * array, read one run at a time or several side by side.
 *
 *   gcc -O2 -march=native -fopenmp benchmarks/scattered_read.c -o /tmp/scattered_read
 *   OMP_NUM_THREADS=2 /tmp/scattered_read [run_floats=3072] [streams=1]
 *
 * 3072 floats = 12 KiB = one 16-token block of SmolLM2 (3 KV heads x 64).
 * streams = S: each thread reads S runs interleaved 8 floats at a time.
 * Runs of 2^24 floats (64 MiB) are close to a plain sequential read.
 */
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

/* Sum S runs read side by side, 8 floats of each in turn. S is a constant at
   each call site (see main), so the accumulators stay in registers. */
static inline __attribute__((always_inline)) float sum_side_by_side(const float *const *runs, size_t run, const int S) {
    __m256 acc[16];
    for (int k = 0; k < S; k++) acc[k] = _mm256_setzero_ps();
    for (size_t i = 0; i < run; i += 8)
        for (int k = 0; k < S; k++) acc[k] = _mm256_add_ps(acc[k], _mm256_load_ps(runs[k] + i));
    float total = 0.0f;
    for (int k = 0; k < S; k++) total += _mm256_cvtss_f32(acc[k]);
    return total;
}

int main(int argc, char **argv) {
    const size_t n = (size_t)1 << 28; /* 1 GiB of floats */
    const size_t run = argc > 1 ? (size_t)atol(argv[1]) : 3072;
    const int streams = argc > 2 ? atoi(argv[2]) : 1;
    if (run < 8 || run % 8 || run > n / 16 || (streams != 1 && streams != 2 && streams != 4 && streams != 8 && streams != 16)) {
        fprintf(stderr, "run_floats: a multiple of 8 up to 2^24; streams: 1, 2, 4, 8 or 16\n");
        return 2;
    }
    float *a = aligned_alloc(64, n * sizeof(float));
    const size_t num_runs = n / run;
    size_t *order = malloc(num_runs * sizeof(size_t));
    if (a == NULL || order == NULL) return 1;
    for (size_t i = 0; i < num_runs; i++) order[i] = i;
    srand(1);
    for (size_t i = num_runs - 1; i > 0; i--) {
        const size_t j = (size_t)rand() % (i + 1), t = order[i];
        order[i] = order[j];
        order[j] = t;
    }
#pragma omp parallel for
    for (size_t i = 0; i < n; i++) a[i] = 1.0f;
    const size_t limit = num_runs / (size_t)streams * (size_t)streams; /* whole groups of runs */
    for (int rep = 0; rep < 3; rep++) {
        const double start = omp_get_wtime();
        float sink = 0.0f;
#pragma omp parallel for reduction(+ : sink) schedule(static)
        for (size_t c = 0; c < limit; c += (size_t)streams) {
            const float *runs[16];
            for (int k = 0; k < streams; k++) runs[k] = a + order[c + k] * run;
            switch (streams) { /* constants, so each case is unrolled */
            case 1: sink += sum_side_by_side(runs, run, 1); break;
            case 2: sink += sum_side_by_side(runs, run, 2); break;
            case 4: sink += sum_side_by_side(runs, run, 4); break;
            case 8: sink += sum_side_by_side(runs, run, 8); break;
            default: sink += sum_side_by_side(runs, run, 16); break;
            }
        }
        const double secs = omp_get_wtime() - start;
        const size_t bytes = limit * run * sizeof(float);
        printf("%d threads, runs of %zu floats, %d side by side: %.1f GB/s (%g)\n", omp_get_max_threads(), run,
               streams, (double)bytes / secs / 1e9, sink);
    }
    free(order);
    free(a);
    return 0;
}
