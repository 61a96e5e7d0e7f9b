/* The CPU kernels' thread pool: the calling thread never waits for a worker to wake up.
 *
 * An OpenMP parallel region hands each thread its share and ends at a barrier, so every region
 * costs at least one wake-up of a sleeping thread (tens of microseconds on a VM), and a thread
 * that lost its core to another process holds up the whole region. A decode step of a small
 * model is ~150 regions of 20-100 us of work each, so with sleeping threads (OMP_WAIT_POLICY=
 * PASSIVE, which Pagoda sets so that a busy machine does not collapse) the wake-ups cost more
 * than the second core gives, and with spinning ones (ACTIVE) a busy machine collapses.
 *
 * Here a job is a body that every participant runs and that claims its work items itself
 * (an atomic counter in the kernel's context), so any number of participants, arriving at any
 * time, split the work: the caller starts at once and does everything that no worker has taken
 * by then. It waits only for workers that entered the body, for at most the item each is
 * running. Workers spin for a short while after a job (the next one of a decode step usually
 * follows within microseconds) and then sleep on a condition variable; a worker that arrives
 * after the job ended does nothing.
 *
 *     pagoda_parallel_run(body, ctx, nthreads): body(ctx, thread) on the caller (thread 0)
 *     and on workers 1 .. nthreads - 1 that arrive in time; returns when every body returned.
 *
 * One pool per process (this library is loaded once; the kernels' libraries call it through
 * the pointer the loader gives them); it is re-made after a fork. */
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#include <unistd.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() ((void)0)
#endif

#define POOL_ABI 1
#define MAX_WORKERS 255

typedef void (*pool_body)(void *ctx, int thread);

static struct {
    pthread_mutex_t mu;
    pthread_cond_t cv;
    uint64_t gen;      /* job generation, atomic: a worker runs each generation at most once */
    uint64_t closed;   /* the last generation that takes no more workers, atomic */
    int busy;          /* workers inside a body, atomic */
    int sleepers;      /* workers waiting on cv, atomic */
    pool_body body;    /* the job, written before gen */
    void *ctx;
    int job_threads;
    int workers;       /* threads started */
    pid_t pid;         /* the process they were started in */
    int64_t spin_ns;   /* how long a worker spins for the next job before sleeping */
} P = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0, 0, 0, 0, NULL, NULL, 0, 0, 0,
       100000};

static pthread_mutex_t start_mu = PTHREAD_MUTEX_INITIALIZER;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

#define LOAD(x) __atomic_load_n(&(x), __ATOMIC_SEQ_CST)
#define STORE(x, v) __atomic_store_n(&(x), (v), __ATOMIC_SEQ_CST)
#define ADD(x, v) __atomic_add_fetch(&(x), (v), __ATOMIC_SEQ_CST)

/* Waits for a generation after `seen`: spins for spin_ns, then sleeps. */
static uint64_t wait_job(uint64_t seen) {
    const int64_t until = now_ns() + P.spin_ns;
    for (int i = 0;; i++) {
        uint64_t g = LOAD(P.gen);
        if (g != seen) return g;
        CPU_RELAX();
        if ((i & 63) == 63 && now_ns() > until) break;
    }
    pthread_mutex_lock(&P.mu);
    ADD(P.sleepers, 1);
    uint64_t g;
    while ((g = LOAD(P.gen)) == seen) pthread_cond_wait(&P.cv, &P.mu);
    ADD(P.sleepers, -1);
    pthread_mutex_unlock(&P.mu);
    return g;
}

static void *worker_main(void *arg) {
    const int id = (int)(intptr_t)arg;
    uint64_t seen = LOAD(P.gen);
    for (;;) {
        const uint64_t g = wait_job(seen);
        seen = g;
        /* Enter, then check the job still takes workers: with the caller's close-then-count in
         * the other order (both sequentially consistent), either it counts this worker and
         * waits for it, or this worker sees the job closed and leaves without touching it. */
        ADD(P.busy, 1);
        if (LOAD(P.closed) != g && LOAD(P.gen) == g && id < P.job_threads) P.body(P.ctx, id);
        ADD(P.busy, -1);
    }
    return NULL;
}

/* Starts workers up to `n` (in this process: after a fork the child has none). */
static void ensure_workers(int n) {
    if (n > MAX_WORKERS) n = MAX_WORKERS;
    pthread_mutex_lock(&start_mu);
    if (P.pid != getpid()) { /* a forked child: the parent's workers are not here */
        pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
        pthread_cond_t cv = PTHREAD_COND_INITIALIZER;
        P.mu = mu;
        P.cv = cv;
        P.workers = 0;
        P.busy = P.sleepers = 0;
        P.pid = getpid();
    }
    while (P.workers < n) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, worker_main, (void *)(intptr_t)(P.workers + 1));
        pthread_attr_destroy(&attr);
        if (rc != 0) break; /* fewer workers: the caller does their share */
        P.workers++;
    }
    pthread_mutex_unlock(&start_mu);
}

int pagoda_pool_abi(void) { return POOL_ABI; }

/* How long a worker spins for the next job before it sleeps (default 100 us). */
void pagoda_pool_set_spin_ns(int64_t ns) { P.spin_ns = ns < 0 ? 0 : ns; }

/* Threads started so far (for tests). */
int pagoda_pool_workers(void) { return P.pid == getpid() ? P.workers : 0; }

/* Runs one job; not reentrant (the kernels call it from one thread at a time, and a body does
 * not start another job). */
void pagoda_parallel_run(pool_body body, void *ctx, int nthreads) {
    if (nthreads <= 1) {
        body(ctx, 0);
        return;
    }
    if (P.pid != getpid() || P.workers < nthreads - 1) ensure_workers(nthreads - 1);
    P.body = body;
    P.ctx = ctx;
    P.job_threads = nthreads;
    const uint64_t g = LOAD(P.gen) + 1;
    STORE(P.gen, g);
    if (LOAD(P.sleepers) > 0) {
        pthread_mutex_lock(&P.mu);
        pthread_cond_broadcast(&P.cv);
        pthread_mutex_unlock(&P.mu);
    }
    body(ctx, 0);
    STORE(P.closed, g);
    /* Workers inside the body finish the item each holds; one that lost its core gets this
     * one through the yield. */
    for (int i = 0; LOAD(P.busy) != 0; i++) {
        if (i < 4096) CPU_RELAX();
        else sched_yield();
    }
}
