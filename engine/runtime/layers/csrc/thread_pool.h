/* The CPU kernels' thread pool (included by cpu_kernels.c), in place of OpenMP.
 *
 * Why not OpenMP: libgomp's idle threads either sleep at once (OMP_WAIT_POLICY=PASSIVE, which
 * the daemon sets so that spinning threads do not starve its other processes) or spin ~3 ms,
 * and the latter only while it manages no more threads than there are cores. In the engine
 * every thread that ever ran a torch op (the one that loaded the model, the scheduler thread)
 * keeps a team of its own, so libgomp throttles its spin to ~10 us and each of a decode step's
 * ~150 parallel regions paid a futex wake-up: 3.4 ms a step (bs 1) on the main thread became
 * 7.3 ms on the scheduler thread, 9.7 ms under PASSIVE.
 *
 * Here a job runs on the caller (thread 0) and nt - 1 workers. Workers spin for POOL_SPIN_NS
 * after a job (the gaps between the kernels of one step) and then sleep on a condition
 * variable (the gaps between steps, when the daemon's other processes want the cores). A job
 * can synchronise its threads with pool_barrier (it spins 50 us, then blocks on a futex when a
 * peer is late): the fused decode step is one job with a barrier between its phases.
 * One job at a time: callers on other threads queue on a mutex. A forked child starts with no
 * workers (pthread_atfork). Needs _GNU_SOURCE before the first system header (the includer's).
 */
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define POOL_MAX 64
#define POOL_SPIN_NS 200000   /* a worker's spin before it sleeps */
#define POOL_BLOCK_NS 50000   /* a barrier's spin before it blocks on a futex */
#define POOL_BLOCK_TIMEOUT_NS 1000000  /* each futex wait's timeout (a missed wake costs <= 1 ms) */

typedef void (*pool_job)(void *ctx, int tid, int nt);

typedef struct {
    pthread_mutex_t run_mu;   /* one job at a time */
    pthread_mutex_t mu;       /* guards sleeping on cv */
    pthread_cond_t cv;
    int nworkers;
    atomic_uint gen;          /* bumped per job; a worker runs the job when it changes */
    atomic_int busy;          /* workers still inside the current job */
    pool_job fn;
    void *ctx;
    int nt;                   /* threads of the current job, caller included */
    int64_t spin_ns;          /* how long workers spin for the next job after this one */
    atomic_int arrived;       /* barrier */
    atomic_uint phase;
    atomic_int sleepers;      /* threads blocked in block_on (wakes are skipped when none) */
} Pool;

static Pool pool = {.run_mu = PTHREAD_MUTEX_INITIALIZER, .mu = PTHREAD_MUTEX_INITIALIZER,
                    .cv = PTHREAD_COND_INITIALIZER};
static pthread_once_t pool_once = PTHREAD_ONCE_INIT;

static inline int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* Block until the 32-bit *addr no longer holds `seen` (or the timeout: callers re-check). The
 * sleepers count is raised first, so a waker that changed *addr either sees it or the kernel
 * sees the new value and does not sleep. */
static void block_on(void *addr, int seen) {
    atomic_fetch_add(&pool.sleepers, 1);
    const struct timespec ts = {0, POOL_BLOCK_TIMEOUT_NS};
    syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, seen, &ts, NULL, 0);
    atomic_fetch_sub(&pool.sleepers, 1);
}

static void wake_all(void *addr) {
    if (atomic_load(&pool.sleepers)) syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
}

static unsigned spawn_gen[POOL_MAX];  /* gen when worker i was made: its first job is the next */

static void *pool_worker(void *arg) {
    const int tid = (int)(intptr_t)arg;  /* 1 .. nworkers */
    unsigned seen = spawn_gen[tid];
    int64_t spin_ns = 0;
    for (;;) {
        int64_t t0 = 0;
        for (int i = 0; atomic_load_explicit(&pool.gen, memory_order_acquire) == seen; i++) {
            if ((i & 63) != 63) {
                _mm_pause();
                continue;
            }
            if (!t0) t0 = now_ns();
            if (now_ns() - t0 < spin_ns) continue;
            pthread_mutex_lock(&pool.mu);  /* the caller bumps gen under mu: no lost wake-up */
            while (atomic_load(&pool.gen) == seen) pthread_cond_wait(&pool.cv, &pool.mu);
            pthread_mutex_unlock(&pool.mu);
        }
        seen = atomic_load(&pool.gen);
        spin_ns = pool.spin_ns;
        if (tid < pool.nt) pool.fn(pool.ctx, tid, pool.nt);
        if (atomic_fetch_sub(&pool.busy, 1) == 1) wake_all(&pool.busy);
    }
    return NULL;
}

static void pool_after_fork(void) {  /* the child has no workers: start afresh */
    memset(&pool, 0, sizeof pool);
    pthread_mutex_init(&pool.run_mu, NULL);
    pthread_mutex_init(&pool.mu, NULL);
    pthread_cond_init(&pool.cv, NULL);
}

static int pool_cpus = 1;  /* CPUs this process may run on: more threads would only spin */

static void pool_init(void) {
    pthread_atfork(NULL, NULL, pool_after_fork);
    cpu_set_t set;
    pool_cpus = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 1;
    pool_cpus = pool_cpus < 1 ? 1 : pool_cpus;
}

/* Spin POOL_BLOCK_NS while *v != want (the usual wait: microseconds), then block on it. */
static inline void wait_until(atomic_int *v, int want) {
    int64_t t0 = 0;
    for (int i = 0, cur; (cur = atomic_load_explicit(v, memory_order_acquire)) != want; i++) {
        _mm_pause();
        if ((i & 63) != 63) continue;
        if (!t0) t0 = now_ns();
        else if (now_ns() - t0 > POOL_BLOCK_NS) block_on(v, cur);
    }
}

/* All nt threads of the running job meet here (sense by phase number). */
static void pool_barrier(int nt) {
    if (nt <= 1) return;
    const unsigned phase = atomic_load_explicit(&pool.phase, memory_order_acquire);
    if (atomic_fetch_add_explicit(&pool.arrived, 1, memory_order_acq_rel) == nt - 1) {
        atomic_store_explicit(&pool.arrived, 0, memory_order_relaxed);
        atomic_fetch_add(&pool.phase, 1);
        wake_all(&pool.phase);
        return;
    }
    int64_t t0 = 0;
    for (int i = 0; atomic_load_explicit(&pool.phase, memory_order_acquire) == phase; i++) {
        _mm_pause();
        if ((i & 63) != 63) continue;
        if (!t0) t0 = now_ns();
        else if (now_ns() - t0 > POOL_BLOCK_NS) block_on(&pool.phase, (int)phase);
    }
}

/* fn(ctx, tid, nt) on nt threads (tid 0 is the caller; no more than the CPUs the process may
 * use, and fewer if threads cannot be made);
 * returns when every thread is done. Then the workers spin spin_ns for the next job before they
 * sleep: POOL_SPIN_NS when more kernels follow at once (decode), 0 when torch's own OpenMP
 * threads run next (a dequantization before a dense GEMM) and a spinning worker would take
 * their core. */
static void pool_run(pool_job fn, void *ctx, int nt, int64_t spin_ns) {
    pthread_once(&pool_once, pool_init);
    nt = nt > pool_cpus ? pool_cpus : nt;
    nt = nt < 1 ? 1 : nt > POOL_MAX ? POOL_MAX : nt;
    if (nt == 1) {
        fn(ctx, 0, 1);
        return;
    }
    pthread_mutex_lock(&pool.run_mu);
    while (pool.nworkers < nt - 1) {
        pthread_t th;
        const int tid = pool.nworkers + 1;
        spawn_gen[tid] = atomic_load(&pool.gen);
        if (pthread_create(&th, NULL, pool_worker, (void *)(intptr_t)tid)) break;
        pthread_detach(th);
        pool.nworkers++;
    }
    if (nt > pool.nworkers + 1) nt = pool.nworkers + 1;
    if (nt == 1) {
        pthread_mutex_unlock(&pool.run_mu);
        fn(ctx, 0, 1);
        return;
    }
    pool.fn = fn, pool.ctx = ctx, pool.nt = nt, pool.spin_ns = spin_ns;
    atomic_store(&pool.arrived, 0);
    atomic_store(&pool.busy, pool.nworkers);
    pthread_mutex_lock(&pool.mu);
    atomic_fetch_add_explicit(&pool.gen, 1, memory_order_release);
    pthread_cond_broadcast(&pool.cv);
    pthread_mutex_unlock(&pool.mu);
    fn(ctx, 0, nt);
    wait_until(&pool.busy, 0);
    pthread_mutex_unlock(&pool.run_mu);
}

/* body(ctx, i0, i1) over [0, n) split into nt contiguous parts (spin_ns: see pool_run). */
typedef void (*range_body)(void *ctx, int64_t i0, int64_t i1);
typedef struct {
    range_body body;
    void *ctx;
    int64_t n;
} ForJob;

static void for_job(void *c, int tid, int nt) {
    const ForJob *f = c;
    const int64_t i0 = f->n * tid / nt, i1 = f->n * (tid + 1) / nt;
    if (i1 > i0) f->body(f->ctx, i0, i1);
}

static void pool_for(int64_t n, int nt, range_body body, void *ctx, int64_t spin_ns) {
    if (n <= 0) return;
    ForJob f = {body, ctx, n};
    pool_run(for_job, &f, (int64_t)nt > n ? (int)n : nt, spin_ns);
}
