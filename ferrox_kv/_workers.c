/* _workers.c -- the worker pool of _workers.h.  One mutex guards the queue
 * of jobs that still have units to hand out and the thread counts; units
 * are taken with an atomic counter, so the lock is held only to join or
 * leave a job.
 *
 * A caller whose helpers are still on its last units polls for them for up
 * to FX_WORKERS_SPIN_US microseconds in all (yielding the CPU between
 * polls) before it blocks: waking a blocked thread costs a futex wake and, on a
 * virtual machine whose idle vCPU has halted, tens of microseconds more, as
 * much as a decode's unit of work.  Idle pool threads do not spin: between
 * a model's attention calls they would take the cores torch computes on. */
#define _GNU_SOURCE /* dladdr */
#include <dlfcn.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <time.h>
#include "_workers.h"

#ifndef FX_WORKERS_SPIN_US
#define FX_WORKERS_SPIN_US 100
#endif

typedef struct fxw_job {
    fx_unit_fn *fn;
    void *ctx;
    ptrdiff_t n;            /* units */
    ptrdiff_t next;         /* atomic: the next unit to take */
    int slots;              /* atomic: slots handed out (the caller holds 0) */
    int max_slots;
    int helpers;            /* pool threads on this job (changed under the lock, read atomically) */
    struct fxw_job *link;   /* the queue (lock) */
} fxw_job;

static pthread_mutex_t fxw_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t fxw_wake = PTHREAD_COND_INITIALIZER;   /* pool threads: a job came */
static pthread_cond_t fxw_left = PTHREAD_COND_INITIALIZER;   /* callers: a helper left */
static fxw_job *fxw_queue;     /* jobs with units left to hand out (lock) */
static int fxw_count = 1;      /* threads a call may use, the caller included (atomic) */
static int fxw_alive;          /* pool threads created in this process (lock) */
static pthread_once_t fxw_once = PTHREAD_ONCE_INIT;

/* The OpenMP route (fx_workers_openmp): GNU OpenMP's GOMP_parallel and
   omp_get_thread_num of a runtime already loaded (atomic pointers, set
   once); fxw_forked: this process is a fork child, the route stays off;
   fxw_omp_here: the route is on for this thread. */
typedef void fxw_gomp_parallel_fn(void (*)(void *), void *, unsigned, unsigned);
typedef int fxw_omp_num_fn(void);
static fxw_gomp_parallel_fn *fxw_gomp_parallel;
static fxw_omp_num_fn *fxw_omp_num;
static int fxw_forked;
static __thread int fxw_omp_here;

static long long fxw_now_ns(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

/* Polls until *p != v (returns 1) or the monotonic clock passes end (0).
   Lock not held. */
static int fxw_spin_while(const int *p, int v, long long end)
{
    for (;;) {
        int i;
        for (i = 0; i < 64; i++) {
            if (__atomic_load_n(p, __ATOMIC_ACQUIRE) != v) return 1;
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#elif defined(__aarch64__)
            __asm__ __volatile__("yield");
#endif
        }
        if (fxw_now_ns() >= end) return 0;
        sched_yield(); /* a runnable thread on this CPU goes first */
    }
}

static void fxw_units(fxw_job *j, int slot)
{
    ptrdiff_t u;
    while ((u = __atomic_fetch_add(&j->next, 1, __ATOMIC_RELAXED)) < j->n) j->fn(j->ctx, u, slot);
}

/* First queued job that has units left and room for a helper; drops the
   jobs that have none left.  Lock held. */
static fxw_job *fxw_pick(void)
{
    fxw_job **pp = &fxw_queue, *j;
    while ((j = *pp) != NULL) {
        if (__atomic_load_n(&j->next, __ATOMIC_RELAXED) >= j->n) {
            *pp = j->link;
            continue;
        }
        if (j->helpers < j->max_slots - 1) return j;
        pp = &j->link;
    }
    return NULL;
}

static void *fxw_main(void *arg)
{
    const int index = (int)(ptrdiff_t)arg; /* 0-based among pool threads */
    pthread_mutex_lock(&fxw_lock);
    for (;;) {
        fxw_job *j = NULL;
        for (;;) {
            /* above the count (lowered since): exit, the highest index first,
               so that the indices of the threads alive stay 0 .. alive - 1 */
            if (index >= __atomic_load_n(&fxw_count, __ATOMIC_RELAXED) - 1) {
                if (index == fxw_alive - 1) {
                    fxw_alive--;
                    pthread_cond_broadcast(&fxw_wake);
                    pthread_mutex_unlock(&fxw_lock);
                    return NULL;
                }
            } else if ((j = fxw_pick()) != NULL) {
                break;
            }
            pthread_cond_wait(&fxw_wake, &fxw_lock);
        }
        __atomic_add_fetch(&j->helpers, 1, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&fxw_lock);
        fxw_units(j, __atomic_fetch_add(&j->slots, 1, __ATOMIC_RELAXED));
        pthread_mutex_lock(&fxw_lock);
        /* release: a spinning caller reads the outputs once it sees 0 */
        if (__atomic_sub_fetch(&j->helpers, 1, __ATOMIC_RELEASE) == 0) pthread_cond_broadcast(&fxw_left);
    }
}

/* fork: the parent's threads and jobs do not exist in the child. */
static void fxw_prefork(void) { pthread_mutex_lock(&fxw_lock); }
static void fxw_parent(void) { pthread_mutex_unlock(&fxw_lock); }
static void fxw_child(void)
{
    fxw_forked = 1; /* the parent's OpenMP team does not exist here */
    fxw_queue = NULL;
    fxw_alive = 0;
    pthread_cond_init(&fxw_wake, NULL);
    pthread_cond_init(&fxw_left, NULL);
    pthread_mutex_unlock(&fxw_lock);
}
static void fxw_init(void) { pthread_atfork(fxw_prefork, fxw_parent, fxw_child); }

/* Creates pool threads up to want (lock held); stops at the first failure,
   leaving the work to fewer threads. */
static void fxw_grow(int want)
{
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old); /* the new threads block every signal */
    while (fxw_alive < want) {
        pthread_t t;
        pthread_attr_t at;
        int rc;
        if (pthread_attr_init(&at) != 0) break;
        pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
        rc = pthread_create(&t, &at, fxw_main, (void *)(ptrdiff_t)fxw_alive);
        pthread_attr_destroy(&at);
        if (rc != 0) break;
        fxw_alive++;
    }
    pthread_sigmask(SIG_SETMASK, &old, NULL);
}

/* A job on the OpenMP route: every team thread takes units from one
   counter; joined counts the threads that took part. */
typedef struct {
    fx_unit_fn *fn;
    void *ctx;
    ptrdiff_t n, next;
    int joined;
} fxw_omp_job;

static void fxw_omp_body(void *arg)
{
    fxw_omp_job *o = (fxw_omp_job *)arg;
    const int slot = fxw_omp_num();
    ptrdiff_t u;
    __atomic_add_fetch(&o->joined, 1, __ATOMIC_RELAXED);
    while ((u = __atomic_fetch_add(&o->next, 1, __ATOMIC_RELAXED)) < o->n) o->fn(o->ctx, u, slot);
}

/* Both entry points in one object: a library's dependencies may hold
   another runtime's.  0 where dladdr cannot tell. */
static int fxw_same_object(void *a, void *b)
{
    Dl_info x, y;
    return dladdr(a, &x) != 0 && dladdr(b, &y) != 0 && x.dli_fbase == y.dli_fbase;
}

FX_API int fx_workers_openmp_load(const char *path)
{
#ifdef RTLD_NOLOAD
    void *h, *par, *num;
    int ok;
    pthread_once(&fxw_once, fxw_init);
    if (path == NULL || __atomic_load_n(&fxw_forked, __ATOMIC_RELAXED)) return 0;
    h = dlopen(path, RTLD_NOW | RTLD_NOLOAD); /* only a library already loaded */
    par = h ? dlsym(h, "GOMP_parallel") : NULL;
    num = h ? dlsym(h, "omp_get_thread_num") : NULL;
    ok = par != NULL && num != NULL && fxw_same_object(par, num);
    if (ok) {
        /* the first runtime's handle stays open (it is never unloaded under
           a job); one process routes to one runtime */
        pthread_mutex_lock(&fxw_lock);
        if (fxw_gomp_parallel == NULL) {
            __atomic_store_n(&fxw_omp_num, (fxw_omp_num_fn *)num, __ATOMIC_RELAXED);
            __atomic_store_n(&fxw_gomp_parallel, (fxw_gomp_parallel_fn *)par, __ATOMIC_RELEASE);
            h = NULL;
        } else {
            ok = (void *)fxw_gomp_parallel == par;
        }
        pthread_mutex_unlock(&fxw_lock);
    }
    if (h) dlclose(h);
    return ok;
#else
    (void)path;
    return 0;
#endif
}

FX_API int fx_workers_openmp(int on)
{
    fxw_omp_here = on && !__atomic_load_n(&fxw_forked, __ATOMIC_RELAXED)
                   && __atomic_load_n(&fxw_gomp_parallel, __ATOMIC_ACQUIRE) != NULL;
    return fxw_omp_here;
}

FX_API int fx_workers_openmp_on(void) { return fxw_omp_here; }

FX_API int fx_workers_run(fx_unit_fn *fn, void *ctx, ptrdiff_t n_units, int max_slots)
{
    fxw_job j;
    const int count = __atomic_load_n(&fxw_count, __ATOMIC_RELAXED);
    int used;
    if (max_slots > count) max_slots = count;
    if ((ptrdiff_t)max_slots > n_units) max_slots = (int)n_units;
    j.fn = fn;
    j.ctx = ctx;
    j.n = n_units;
    j.next = 0;
    j.slots = 1;
    j.max_slots = max_slots;
    j.helpers = 0;
    if (max_slots <= 1) {
        fxw_units(&j, 0);
        return 1;
    }
    if (fxw_omp_here && !__atomic_load_n(&fxw_forked, __ATOMIC_RELAXED)) {
        fxw_omp_job o = {fn, ctx, n_units, 0, 0};
        __atomic_load_n(&fxw_gomp_parallel, __ATOMIC_ACQUIRE)(fxw_omp_body, &o, (unsigned)max_slots, 0);
        return o.joined;
    }
    pthread_once(&fxw_once, fxw_init);
    pthread_mutex_lock(&fxw_lock);
    if (fxw_alive < count - 1) fxw_grow(count - 1);
    j.link = fxw_queue;
    fxw_queue = &j;
    pthread_cond_broadcast(&fxw_wake);
    pthread_mutex_unlock(&fxw_lock);

    fxw_units(&j, 0);

    pthread_mutex_lock(&fxw_lock);
    { /* no new helper may join once the job is off the queue */
        fxw_job **pp = &fxw_queue;
        while (*pp != NULL && *pp != &j) pp = &(*pp)->link;
        if (*pp == &j) *pp = j.link;
    }
    pthread_mutex_unlock(&fxw_lock);
    /* helpers on their last units (their count only falls now): poll until
       the deadline, then block.  Seeing 0 (acquire) makes their outputs
       visible; no helper touches j after its decrement. */
    {
        const long long end = fxw_now_ns() + 1000LL * FX_WORKERS_SPIN_US;
        int h;
        while ((h = __atomic_load_n(&j.helpers, __ATOMIC_ACQUIRE)) > 0 && fxw_spin_while(&j.helpers, h, end)) {
        }
        if (h > 0) {
            pthread_mutex_lock(&fxw_lock);
            while (__atomic_load_n(&j.helpers, __ATOMIC_RELAXED) > 0) pthread_cond_wait(&fxw_left, &fxw_lock);
            pthread_mutex_unlock(&fxw_lock);
        }
    }
    used = __atomic_load_n(&j.slots, __ATOMIC_RELAXED);
    return used < max_slots ? used : max_slots;
}

FX_API int fx_workers_set(int n)
{
    int old;
    pthread_once(&fxw_once, fxw_init); /* at import: a fork child knows it is one */
    pthread_mutex_lock(&fxw_lock);
    old = __atomic_exchange_n(&fxw_count, n < 1 ? 1 : n, __ATOMIC_RELAXED);
    pthread_cond_broadcast(&fxw_wake); /* threads above the new count exit */
    pthread_mutex_unlock(&fxw_lock);
    return old;
}
FX_API int fx_workers_get(void) { return __atomic_load_n(&fxw_count, __ATOMIC_RELAXED); }

FX_API int fx_workers_alive(void)
{
    int n;
    pthread_mutex_lock(&fxw_lock);
    n = fxw_alive;
    pthread_mutex_unlock(&fxw_lock);
    return n;
}
