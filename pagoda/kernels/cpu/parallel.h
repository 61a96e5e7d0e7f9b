/* Parallel ranges for the CPU kernel libraries: the pool (pool.c) the loader hands over
 * (`*_set_parallel_run`), else an OpenMP region. Included by the ops library (simd.h) and the
 * ggml numerics. */
#pragma once
#include <stdint.h>

/* Items [0, n) go out in runs of `chunk`, each claimed by whichever thread comes next (an
 * atomic counter), so a thread that arrives late, or not at all, only does less of the work.
 * With the pool the caller starts at once instead of waking OpenMP's sleeping threads (the
 * other kernels' jobs run through the same pool, whose workers spin between jobs: an OpenMP
 * region between two of them waits for its thread to get the core a pool worker spins on). */
typedef void (*pool_body)(void *ctx, int thread);
typedef void (*parallel_run_fn)(pool_body body, void *ctx, int nthreads);
static parallel_run_fn parallel_run;

typedef void (*range_fn)(void *ctx, int64_t begin, int64_t end);

typedef struct {
    range_fn fn;
    void *ctx;
    int64_t n, chunk;
    _Alignas(64) int64_t next; /* atomic, on a line of its own */
} RangeJob;

static void range_body(void *p, int thread) {
    RangeJob *j = p;
    (void)thread;
    for (;;) {
        const int64_t b = __atomic_fetch_add(&j->next, j->chunk, __ATOMIC_RELAXED);
        if (b >= j->n) return;
        j->fn(j->ctx, b, b + j->chunk < j->n ? b + j->chunk : j->n);
    }
}

/* fn(ctx, begin, end) over [0, n) on nthreads threads, in runs of about a quarter of a
 * thread's share (at least `min_chunk` items). */
static void parallel_range(range_fn fn, void *ctx, int64_t n, int64_t min_chunk, int nthreads) {
    if (n <= 0) return;
    int64_t chunk = (n + 4 * (int64_t)nthreads - 1) / (4 * (int64_t)nthreads);
    if (chunk < min_chunk) chunk = min_chunk;
    if (nthreads <= 1 || chunk >= n) {
        fn(ctx, 0, n);
        return;
    }
    RangeJob j = {fn, ctx, n, chunk, 0};
    if (parallel_run) {
        parallel_run(range_body, &j, nthreads);
        return;
    }
#pragma omp parallel num_threads(nthreads)
    range_body(&j, 0);
}
