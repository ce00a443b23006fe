/* _workers.h -- the core's worker threads: a call splits its work into
 * units, runs them on the calling thread and on whichever pool threads are
 * free, and returns when every unit is done.
 *
 * Rules
 *   - The pool holds at most fx_workers_get() - 1 threads, created lazily,
 *     shared by every caller: 16 callers at once still run on at most that
 *     many pool threads, and a caller that finds none free runs its units
 *     itself.  Which thread runs a unit never changes the result: a unit
 *     writes only its own outputs.
 *   - Pool threads never touch Python: they run C unit functions only, with
 *     every signal blocked.  A caller releases the GIL before it calls in.
 *   - fork: the child starts with no pool threads and no queued work (they
 *     belong to the parent); its next call creates threads anew.
 *   - The OpenMP route (fx_workers_openmp): on a thread that also runs
 *     torch's parallel regions, a job runs on that thread's OpenMP team
 *     instead (GOMP_parallel of the runtime torch loaded, max_slots
 *     threads).  Those threads spin for milliseconds after each of torch's
 *     regions, so a pool thread would wait for their core; the team's own
 *     threads take the units at once.  The team is the calling thread's
 *     own (the runtime creates it on a thread's first region, with that
 *     thread's signal mask), so the pool's bound does not cover it: route
 *     only threads that run torch's operators, whose team exists anyway.
 *     The core routes the main thread's split calls once torch is
 *     imported (where most programs run torch's operators; one that runs
 *     none gets the team torch would make, at ferrox_kv's first split
 *     call) when they ask for no more threads than torch's count, and
 *     ferrox_kv.hf the thread that runs a model's forward.
 *     The call waits for every team thread, even one whose core is busy.
 *     The route never loads a runtime, and is off in a fork child (its
 *     team belongs to the parent; the fork handlers are registered by
 *     fx_workers_set, at import).
 */
#ifndef FX_WORKERS_H
#define FX_WORKERS_H

#include <stddef.h>
#include "_conv.h"

/* One unit of a job: slot is the running thread's index in this job, in
   [0, max_slots): 0 for the caller, so a unit can use per-slot scratch. */
typedef void fx_unit_fn(void *ctx, ptrdiff_t unit, int slot);

/* Runs fn(ctx, u, slot) for every u in [0, n_units), on the caller and at
   most max_slots - 1 pool threads.  Returns the number of threads that
   joined the job (1: the caller alone); one that joined as the units ran
   out may have run none. */
FX_API int fx_workers_run(fx_unit_fn *fn, void *ctx, ptrdiff_t n_units, int max_slots);

/* Finds GOMP_parallel and omp_get_thread_num through the library at path,
   already loaded (nothing is loaded here), or its dependencies (torch's
   libtorch_cpu reaches the runtime torch runs on); both must come from one
   object.  One process routes to one runtime: returns 1 when this one is
   (now or already) the process's, 0 otherwise (no such library loaded, the
   entry points missing or in two objects, another runtime already chosen,
   a fork child, no dlopen). */
FX_API int fx_workers_openmp_load(const char *path);

/* Routes this thread's later jobs to the loaded runtime's team (on != 0)
   or to the pool; returns whether the route is on (off without a loaded
   runtime and in a fork child). */
FX_API int fx_workers_openmp(int on);

/* Whether this thread's jobs take the route now. */
FX_API int fx_workers_openmp_on(void);

/* Threads a call may use, the caller included (>= 1); returns the old
   count.  Lowering it ends the pool threads above the new count (each once
   the job it is on has no units left to hand out). */
FX_API int fx_workers_set(int n);
FX_API int fx_workers_get(void);

/* Pool threads alive in this process (tests). */
FX_API int fx_workers_alive(void);

#endif /* FX_WORKERS_H */
