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
 *     threads take the units at once.  The route never starts a runtime,
 *     and is off in a fork child (its team belongs to the parent).
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

/* Routes this thread's later jobs to the GNU OpenMP runtime at path (a
   library already loaded: nothing is loaded here); NULL routes them back to
   the pool.  Returns 1 when the route is on, 0 when it is off (NULL, no
   such library loaded, no GOMP_parallel in it, another runtime than the
   one this process routed to first, a fork child, or no dlopen). */
FX_API int fx_workers_openmp(const char *path);

/* Threads a call may use, the caller included (>= 1); returns the old
   count.  Lowering it ends the pool threads above the new count (each once
   the job it is on has no units left to hand out). */
FX_API int fx_workers_set(int n);
FX_API int fx_workers_get(void);

/* Pool threads alive in this process (tests). */
FX_API int fx_workers_alive(void);

#endif /* FX_WORKERS_H */
