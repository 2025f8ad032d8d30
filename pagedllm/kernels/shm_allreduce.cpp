/*
 * All-reduce (sum) of float32 vectors between tensor-parallel ranks on one
 * machine, through memory every rank has mapped (a file in /dev/shm).
 *
 *   slots  [2 (parity), size (ranks), capacity] float32   shared
 *   flags  [size] int64                                   shared: the last call each rank published
 *
 * Call k of every rank (k = its own flag + 1) uses the slots of parity k % 2:
 *
 *   rank r: copy x into slots[k % 2][r];  fence;  flags[r] = k
 *           wait until every flags[o] >= k
 *           x = slots[k % 2][0] + slots[k % 2][1] + ...     (rank order: every rank gets the same bits)
 *
 * Why two parities are enough: rank o publishes call k + 1 (into the other
 * parity) only after it has read call k, and it writes parity k % 2 again
 * at call k + 2, which it reaches only after seeing every rank publish k + 1,
 * i.e. after every rank finished reading call k.
 *
 * A peer that stops publishing is waited for at most timeout_s; a peer
 * process that has exited (or is a zombie) is noticed within ~20 ms.
 */
#include <errno.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include <chrono>

#include "kernels.h"

namespace {

/* a spin-wait hint: lets the sibling hyperthread run and saves power (no-op where none is known) */
inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
}

bool process_gone(int64_t pid) {
    if (pid <= 0) return false;
    if (kill((pid_t)pid, 0) == -1 && errno == ESRCH) return true;
    char path[64];
    snprintf(path, sizeof path, "/proc/%lld/stat", (long long)pid);
    FILE *f = fopen(path, "r");
    if (f == nullptr) return false;  // another machine's pid namespace: rely on the timeout
    char buf[512];
    const size_t len = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[len] = 0;
    const char *close = strrchr(buf, ')');  // "pid (comm) S ...": the state follows the last ')'
    return close != nullptr && close[1] == ' ' && (close[2] == 'Z' || close[2] == 'X');
}

}  // namespace

int shm_all_reduce_f32(float *x, int64_t n, float *slots, int64_t capacity, int64_t *flags, const int64_t *pids,
                       int rank, int size, double timeout_s, int num_threads) {
    const int64_t k = __atomic_load_n(&flags[rank], __ATOMIC_RELAXED) + 1;
    float *buf = slots + (k & 1) * size * capacity;
    memcpy(buf + rank * capacity, x, (size_t)n * sizeof(float));
    // a full fence: memcpy may use non-temporal stores, which a plain release store does not order
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    __atomic_store_n(&flags[rank], k, __ATOMIC_RELEASE);

    using clock = std::chrono::steady_clock;
    const auto start = clock::now();
    auto last_check = start;
    for (int o = 0; o < size; ++o) {
        uint64_t spins = 0;
        while (__atomic_load_n(&flags[o], __ATOMIC_ACQUIRE) < k) {
            spin_pause();
            if (++spins % 4096) continue;
            const auto now = clock::now();
            if (std::chrono::duration<double>(now - start).count() > timeout_s) return 4;
            if (std::chrono::duration<double>(now - last_check).count() > 0.02) {
                last_check = now;
                if (process_gone(pids[o])) return 5;
            }
            if (spins > (1u << 16)) sched_yield();  // a long wait: let a peer sharing this core run
        }
    }
    // the sum in rank order; threads only where the vector is long enough to pay for them
    const int threads = n >= (1 << 16) ? num_threads : 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t i = 0; i < n; ++i) {
        float s = buf[i];
        for (int r = 1; r < size; ++r) s += buf[r * capacity + i];
        x[i] = s;
    }
    return 0;
}
