"""The parallel launchers: kernels.batchnorm's work items on Numba's pool or on PyTorch's team.

A launcher runs ``item(i, *args)`` for items ``0..n-1`` of one kernel (``reduce_runs(n,
*args)``, ...: the names of :data:`bngrad.kernels.LAUNCHERS`) on a team of threads. One
compiled function per item and argument types serves two pools:

- :data:`numba_pool`, for NumPy calls in a process without PyTorch: Numba's threading layer
  (TBB, thread- and fork-safe; bngrad._threads), through ``numba_parallel_for``, the entry
  point Numba's own ``prange`` loops call;
- :data:`torch_team`, for ``bngrad.torch``'s calls and NumPy calls in a process that has
  imported PyTorch: the GNU OpenMP team PyTorch's own operators use, through
  ``GOMP_parallel`` in the libgomp PyTorch loaded (bngrad._gomp says when). Two pools that
  each spin after their work take the cores from each other between a PyTorch operator and a
  bngrad call (issue 12).

Each launcher is an ``njit`` function of the item's arguments, compiled per argument types as
any Numba function; inside it, :func:`_run_items` emits the parallel region itself:

- an *outlined function* ``void f(void *record)`` in the launcher's own LLVM module (so Numba's
  disk cache keeps it, relocated like any call): it claims chunks of items from atomic
  counters in the record (below) and runs ``item(i, *args)`` for each, the arguments being
  the launcher's own Numba values (arrays as Numba's array structures: any dtype, ndim,
  layout, None), stored once in the record on the launching thread's stack;
- the launch: ``GOMP_parallel(f, record, team, 0)`` through the address of the entry point in
  PyTorch's libgomp, a run-time argument, never a constant compiled in; or, where that
  address is 0, ``numba_parallel_for`` over ``team`` slots whose every task calls ``f``
  (Numba's layer starts the team's threads; each claims items until none is left). With a
  team of one (or a single item) the items run on the calling thread and no pool is called
  at all.

Each thread starts on its own contiguous share of the items (share ``t % shares`` for thread
number ``t``, ``shares`` being the team's size, at most 64: ``omp_get_thread_num`` on PyTorch's
team, the layer's ``get_thread_id`` on Numba's pool), claiming chunks of ``n // (8 shares)``
items (at least 1) from that share's counter; when its share is done it claims what is left of
the others'. The second passes (``kernels.batchnorm.LAST_TO_FIRST``) take each share's chunks,
and the items in a chunk, last to first: the rows a first pass read last are the ones still in
cache. A thread so keeps the same rows from one launch to the next (and to PyTorch's own
elementwise operators, which split statically too), where they are still in its core's cache:
an elementwise pass over 401,408 float32 elements whose halves swapped threads every call took
87 us against 47 us (2026-12-01, 2-core EPYC). And a thread preempted by another process holds
up nobody: the others take its share (a plain static split waited for it, 2.1x TBB's time at
(32, 64, 784) on 2 loaded cores). Which thread runs an item cannot change a bit: items write
only their own outputs, and the launch returns when all are done (the pool's closing barrier
orders their writes before the caller's reads).

These launchers replaced ``prange`` loops over the same items: a ``prange`` launcher cost about
1.5 s of compile per signature (Numba's parfor passes, and a gufunc that optimises the item's
code once more), this one about 0.8 s, and one serves both pools.

Numba keys a cached function on its own source file; these launchers inline the items of
kernels/batchnorm.py and the maths of _ops.py and _elements.py, so their cache stamp includes
those files' contents (kernels._cache, and :func:`_stamped` for batchnorm.py): an edit there
recompiles them instead of leaving stale code behind.

Team size: the region's thread count (``bngrad._threads.thread_count``, i.e. the caller's
``num_threads``: ``torch.get_num_threads()`` under bngrad.torch). On PyTorch's team, 1 in a
process forked after bngrad._gomp was imported (a GNU OpenMP team does not survive fork();
serial, same bits, never a hang: see bngrad._gomp).
"""

from __future__ import annotations

import os
import types as types_
from typing import Any, Callable

import numba
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.core.caching import NullCache
from numba.extending import intrinsic

from .. import _gomp
from . import batchnorm as _items
from ._cache import HERE, lock_cache_files, sources_stamp

__all__ = ["LAUNCHERS", "numba_pool", "torch_team"]

#: The launchers' names: each runs kernels.batchnorm's ``<name>_item`` (``transpose_item`` for
#: ``transpose_last_two``).
LAUNCHERS = ("reduce_runs", "reduce_short", "reduce_lanes", "elementwise_runs",
             "elementwise_lanes", "backward_fused", "backward_fused_short", "forward_fused",
             "forward_fused_short", "copy_rows", "transpose_last_two")

# Chunks per share: enough that a thread preempted mid-launch leaves most of its share to the
# others, few enough that a chunk still spans neighbouring items.
_CHUNKS_PER_THREAD = 8


def _worker(item: Any) -> Callable:
    """``worker(lo, hi, args)``: items lo..hi-1 of ``item`` (compiled inside the launcher; hi-1
    down to lo where kernels.batchnorm.last_to_first says), named after the item.

    Numba names a compiled function by its qualified name, its argument types and a counter of
    the process that compiled it, and links functions of one name as one. Every item's worker
    has the same code: under one name, two items with the same argument types, compiled in
    two processes whose counters agreed, left two different functions of one name in the disk
    cache, and a process that loaded both ran the first item's worker for the second (the
    ``fused_short`` forward running the ``fused`` forward's items: channels left unwritten,
    found 2026-12-04). Named after the item, each worker's name is its own."""
    if _items.last_to_first(item):
        def worker(lo, hi, args):
            for i in range(hi - 1, lo - 1, -1):
                item(i, *args)
    else:
        def worker(lo, hi, args):
            for i in range(lo, hi):
                item(i, *args)
    worker.__qualname__ = f"_worker.<locals>.{item.py_func.__name__}_worker"
    return worker


def _numba_parallel_for(builder, outlined, record, team):
    """Call ``outlined(record)`` on ``team`` threads of Numba's pool: its threading layer's
    ``parallel_for(fn, args, dims, steps, data, inner_ndim, array_count, threads)`` over
    ``team`` slots (no arrays), whose every task calls ``outlined``. A task that finds the
    counter drained returns at once, so however the layer splits the slots, every item runs
    once. The symbol is Numba's, registered when its layer starts (:func:`_start_layer`)."""
    module = builder.module
    i64, i8p = ir.IntType(64), ir.IntType(8).as_pointer()
    task_t = ir.FunctionType(ir.VoidType(), [i8p.as_pointer(), i64.as_pointer(),
                                             i64.as_pointer(), i8p])
    task = ir.Function(module, task_t, name=module.get_unique_name("bngrad_pool_task"))
    task.linkage = "internal"
    tb = ir.IRBuilder(task.append_basic_block("entry"))
    tb.call(outlined, [task.args[3]])
    tb.ret_void()
    parallel_for = cgutils.get_or_insert_function(
        module, ir.FunctionType(ir.VoidType(), [i8p] * 5 + [i64] * 3), "numba_parallel_for")
    dims = cgutils.alloca_once_value(builder, team)
    steps = cgutils.alloca_once_value(builder, ir.Constant(i64, 0))
    no_args = cgutils.alloca_once_value(builder, ir.Constant(i8p, None))
    builder.call(parallel_for, [builder.bitcast(task, i8p), builder.bitcast(no_args, i8p),
                                builder.bitcast(dims, i8p), builder.bitcast(steps, i8p),
                                record, ir.Constant(i64, 0), ir.Constant(i64, 0), team])


# Partitions of the items: each thread of a team starts on its own contiguous share (part
# ``thread number % _MAX_PARTS``), then helps with the others' (see _run_items).
_MAX_PARTS = 64
# A part's counter on a cache line of its own: threads claiming from different parts do not
# contend.
_COUNTER_STRIDE = 8  # int64s


def _thread_number(builder, thread_num):
    """The calling thread's number in its team (int64): ``thread_num()`` (an address, e.g.
    libgomp's ``omp_get_thread_num``), or where that is 0 Numba's layer's ``get_thread_id``
    (registered with the layer, as ``numba_parallel_for``)."""
    i32, i64 = ir.IntType(32), ir.IntType(64)
    fn_t = ir.FunctionType(i32, [])
    by_address = builder.icmp_signed("!=", thread_num, ir.Constant(i64, 0))
    with builder.if_else(by_address) as (given, numbas):
        with given:
            t_given = builder.call(builder.inttoptr(thread_num, fn_t.as_pointer()), [])
            block_given = builder.block
        with numbas:
            t_numba = builder.call(cgutils.get_or_insert_function(builder.module, fn_t,
                                                                  "get_thread_id"), [])
            block_numba = builder.block
    t = builder.phi(i32)
    t.add_incoming(t_given, block_given)
    t.add_incoming(t_numba, block_numba)
    t = builder.sext(t, i64)
    return builder.select(builder.icmp_signed("<", t, ir.Constant(i64, 0)), ir.Constant(i64, 0),
                          t)


@intrinsic
def _run_items(typingctx, item, parallel, thread_num, team, n, args):
    """Run ``item(i, *args)`` for i in 0..n-1 on a team of ``team`` threads: PyTorch's OpenMP
    team, started by ``GOMP_parallel`` at address ``parallel`` (``thread_num``: the address of
    its ``omp_get_thread_num``), or where ``parallel`` is 0 Numba's pool; serially on this
    thread when team or n <= 1.

    ``item`` is an njit function (a global, so that it is part of the compiled code); ``args``
    a tuple of its arguments after the item number.
    """
    if not isinstance(item, types.Dispatcher) or not isinstance(args, types.BaseTuple):
        return None
    _start_layer()  # the compiled code calls numba_parallel_for, which the layer registers
    sig = types.none(item, parallel, thread_num, team, n, args)
    worker = _worker(item.dispatcher)
    worker_sig = types.none(types.int64, types.int64, args)

    def codegen(context, builder, signature, llargs):
        _, parallel_v, thread_num_v, team_v, n_v, args_v = llargs
        args_v = _items.borrowed_codegen(context, builder, args, args_v)
        i64, i32, i8p = ir.IntType(64), ir.IntType(32), ir.IntType(8).as_pointer()
        zero, one = ir.Constant(i64, 0), ir.Constant(i64, 1)
        # caching=False: Numba's subroutine cache is keyed on the code object, which every
        # item's worker shares.
        cres = context.compile_subroutine(builder, worker, worker_sig, caching=False)
        module = builder.module
        team_v = builder.sext(team_v, i64) if team_v.type.width < 64 else team_v
        n_v = builder.sext(n_v, i64) if n_v.type.width < 64 else n_v

        # The record the team reads: {n, parts, chunk, thread_num, args, counters}: part u
        # holds items u*n/parts .. (u+1)*n/parts - 1, claimed a chunk at a time by an atomic
        # add on its counter, so that every item runs once whoever claims it.
        counters_t = ir.ArrayType(ir.ArrayType(i64, _COUNTER_STRIDE), _MAX_PARTS)
        record_t = ir.LiteralStructType([i64, i64, i64, i64, context.get_value_type(args),
                                         counters_t])
        outlined = ir.Function(module, ir.FunctionType(ir.VoidType(), [i8p]),
                               name=module.get_unique_name("bngrad_team_outlined"))
        outlined.linkage = "internal"
        ob = ir.IRBuilder(outlined.append_basic_block("entry"))
        record = ob.bitcast(outlined.args[0], record_t.as_pointer())
        total, parts, chunk, thread_fn = (ob.load(cgutils.gep_inbounds(ob, record, 0, k))
                                          for k in range(4))
        fn_args = ob.load(cgutils.gep_inbounds(ob, record, 0, 4))
        home = ob.urem(_thread_number(ob, thread_fn), parts)
        # for k in 0..parts-1: part u = (home + k) % parts; claim its chunks until it is done
        k_ptr = cgutils.alloca_once_value(ob, zero)
        next_part, claim, run, done = (outlined.append_basic_block(name)
                                       for name in ("next_part", "claim", "run", "done"))
        ob.branch(next_part)
        ob.position_at_end(next_part)
        k = ob.load(k_ptr)
        ob.cbranch(ob.icmp_signed("<", k, parts), claim, done)
        ob.position_at_end(claim)
        u = ob.add(home, ob.load(k_ptr))
        u = ob.select(ob.icmp_signed(">=", u, parts), ob.sub(u, parts), u)
        start = ob.sdiv(ob.mul(u, total), parts)
        stop = ob.sdiv(ob.mul(ob.add(u, one), total), parts)
        counter = cgutils.gep_inbounds(ob, record, 0, 5, u, 0)
        lo = ob.add(start, ob.atomic_rmw("add", counter, chunk, "monotonic"))
        with ob.if_then(ob.icmp_signed(">=", lo, stop)):
            ob.store(ob.add(ob.load(k_ptr), one), k_ptr)
            ob.branch(next_part)
        ob.branch(run)
        ob.position_at_end(run)
        hi = ob.add(lo, chunk)
        hi = ob.select(ob.icmp_signed(">", hi, stop), stop, hi)
        if _items.last_to_first(item.dispatcher):  # the part's chunks mirrored: last first
            mirror = ob.add(start, stop)
            lo, hi = ob.sub(mirror, hi), ob.sub(mirror, lo)
        # The status is dropped: an item cannot raise (no bounds checks; the kernels divide
        # only by sizes >= 1), and there is no Python on a team thread to receive it.
        context.call_internal_no_propagate(ob, cres.fndesc, worker_sig, [lo, hi, fn_args])
        ob.branch(claim)
        ob.position_at_end(done)
        ob.ret_void()

        serial = builder.or_(builder.icmp_signed("<=", team_v, one),
                             builder.icmp_signed("<=", n_v, one))
        with builder.if_else(serial) as (on_this_thread, on_team):
            with on_this_thread:
                context.call_internal_no_propagate(builder, cres.fndesc, worker_sig,
                                                   [zero, n_v, args_v])
            with on_team:
                parts_v = builder.select(builder.icmp_signed(">", team_v,
                                                             ir.Constant(i64, _MAX_PARTS)),
                                         ir.Constant(i64, _MAX_PARTS), team_v)
                per_thread = builder.sdiv(n_v, builder.mul(parts_v,
                                                           ir.Constant(i64, _CHUNKS_PER_THREAD)))
                chunk_v = builder.select(builder.icmp_signed("<", per_thread, one), one,
                                         per_thread)
                record_p = cgutils.alloca_once(builder, record_t)
                for slot, value in enumerate((n_v, parts_v, chunk_v, thread_num_v, args_v)):
                    builder.store(value, cgutils.gep_inbounds(builder, record_p, 0, slot))
                with cgutils.for_range(builder, parts_v) as loop:
                    builder.store(zero, cgutils.gep_inbounds(builder, record_p, 0, 5,
                                                             loop.index, 0))
                record_v = builder.bitcast(record_p, i8p)
                torch_team = builder.icmp_signed("!=", parallel_v, ir.Constant(i64, 0))
                with builder.if_else(torch_team) as (on_torch, on_numba):
                    with on_torch:
                        gomp_t = ir.FunctionType(ir.VoidType(), [i8p, i8p, i32, i32])
                        builder.call(builder.inttoptr(parallel_v, gomp_t.as_pointer()),
                                     [builder.bitcast(outlined, i8p), record_v,
                                      builder.trunc(team_v, i32), ir.Constant(i32, 0)])
                    with on_numba:
                        _numba_parallel_for(builder, outlined, record_v, team_v)
        return context.get_dummy_value()

    return sig, codegen


def _stamped(dispatcher: Any) -> Any:
    """``dispatcher`` (cache=True), its disk cache also stale when kernels/batchnorm.py changes.

    kernels._cache's locator adds _ops.py and _elements.py to the stamp of every function in
    this package; these launchers also inline the items of batchnorm.py, a file of their own.
    Where this Numba keeps the stamp elsewhere, caching is turned off (correct, slower to
    start) rather than risking stale kernels.
    """
    stamp = sources_stamp((os.path.join(HERE, "batchnorm.py"),))
    try:
        cache_file = dispatcher._cache._cache_file
        cache_file._source_stamp = (cache_file._source_stamp, stamp)
    except AttributeError:
        dispatcher._cache = NullCache()
    return dispatcher


_JIT: dict[str, Any] = dict(cache=True, nogil=True)


@intrinsic
def _region_threads(typingctx):
    """Numba's thread-local thread count, which bngrad._threads.thread_count sets from the
    caller's ``num_threads``: the threading layer's ``get_num_threads``, called by its symbol
    name as Numba's own parallel loops call it (``numba.get_num_threads()`` in compiled code
    goes through a ctypes pointer, which Numba will not cache; from Python it costs 2-6 us)."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(32), []),
                                            "get_num_threads")
        return builder.sext(builder.call(fn, []), ir.IntType(64))
    return types.int64(), codegen


@njit(**_JIT)
def _team(serial):
    """Threads a launch asks for: 1 if ``serial``, else the region's count."""
    return 1 if serial else _region_threads()


# One jitted launcher per item function; ``*args`` keeps them independent of the items'
# signatures (they pass through unchanged). Written out, not made by a factory: Numba's disk
# cache keys a function on its name and source line, which a factory's closures would share.

@_stamped
@njit(**_JIT)
def _reduce_runs(parallel, thread_num, serial, n, *args):
    _run_items(_items.reduce_runs_item, parallel, thread_num, _team(serial), n, args)


@_stamped
@njit(**_JIT)
def _reduce_short(parallel, thread_num, serial, n, *args):
    _run_items(_items.reduce_short_item, parallel, thread_num, _team(serial), n, args)


@_stamped
@njit(**_JIT)
def _reduce_lanes(parallel, thread_num, serial, n, *args):
    _run_items(_items.reduce_lanes_item, parallel, thread_num, _team(serial), n, args)


@_stamped
@njit(**_JIT)
def _elementwise_runs(parallel, thread_num, serial, n, *args):
    _run_items(_items.elementwise_runs_item, parallel, thread_num, _team(serial), n, args)


@_stamped
@njit(**_JIT)
def _elementwise_lanes(parallel, thread_num, serial, n, *args):
    _run_items(_items.elementwise_lanes_item, parallel, thread_num, _team(serial), n, args)


@_stamped
@njit(**_JIT)
def _backward_fused(parallel, thread_num, serial, n, *args):
    _run_items(_items.backward_fused_item, parallel, thread_num, _team(serial), n, args)


@_stamped
@njit(**_JIT)
def _backward_fused_short(parallel, thread_num, serial, n, *args):
    _run_items(_items.backward_fused_short_item, parallel, thread_num, _team(serial), n, args)


@_stamped
@njit(**_JIT)
def _forward_fused(parallel, thread_num, serial, n, *args):
    _run_items(_items.forward_fused_item, parallel, thread_num, _team(serial), n, args)


@_stamped
@njit(**_JIT)
def _forward_fused_short(parallel, thread_num, serial, n, *args):
    _run_items(_items.forward_fused_short_item, parallel, thread_num, _team(serial), n, args)


@_stamped
@njit(**_JIT)
def _copy_rows(parallel, thread_num, serial, n, *args):
    _run_items(_items.copy_rows_item, parallel, thread_num, _team(serial), n, args)


@_stamped
@njit(**_JIT)
def _transpose_last_two(parallel, thread_num, serial, n, *args):
    _run_items(_items.transpose_item, parallel, thread_num, _team(serial), n, args)


_layer_ready = False


def _start_layer() -> None:
    """Make Numba register its threading layer's symbols (``get_num_threads``,
    ``numba_parallel_for``), which the compiled launchers call by name, before the first one is
    loaded: normally done already by bngrad._threads.thread_count, around every parallel
    launch."""
    global _layer_ready
    numba.get_num_threads()
    _layer_ready = True


def _pool(torch_team: bool) -> tuple[int, int, bool]:
    """``(parallel, thread_num, serial)`` of a launch on PyTorch's team (``torch_team``) or
    Numba's pool, as :func:`_run_items`'s callers take them. Starts Numba's layer first (the
    compiled code calls its symbols). A process forked after bngrad._gomp was imported runs
    PyTorch's team's launches serially (module docstring)."""
    if not _layer_ready:
        _start_layer()
    if torch_team:
        return _gomp.parallel_address(), _gomp.thread_num_address(), _gomp.forked()
    return 0, 0, False


def team(torch_team: bool, threads: int) -> tuple[int, int, int]:
    """``(parallel, thread_num, team)``: what :func:`_run_items` takes to run items on
    ``threads`` threads of PyTorch's team (``torch_team``) or Numba's pool, for the compiled
    calls that launch their own passes (kernels.batchnorm's one-call passes); as the
    launchers below, one thread in a process forked after bngrad._gomp was imported."""
    parallel, thread_num, serial = _pool(torch_team)
    return parallel, thread_num, 1 if serial else threads


def _launchers(torch_team: bool) -> types_.SimpleNamespace:
    """The launchers of one pool: ``name(n, *args)`` runs items 0..n-1 of that kernel."""
    def launcher(jitted: Any, name: str) -> Callable[..., None]:
        def launch(n: int, *args: Any) -> None:
            jitted(*_pool(torch_team), n, *args)
        launch.__name__ = launch.__qualname__ = name
        launch.__doc__ = (f"``{name}``'s work items 0..n-1 on "
                          f"{'PyTorch' if torch_team else 'Numba'}'s threads (see the module "
                          "docstring)" + ("; requires ``bngrad._gomp.available()``."
                                          if torch_team else "."))
        return launch
    return types_.SimpleNamespace(**{name: launcher(globals()["_" + name], name)
                                     for name in LAUNCHERS})


#: Launchers on Numba's pool (NumPy calls) and on PyTorch's OpenMP team (bngrad.torch's).
numba_pool = _launchers(torch_team=False)
torch_team = _launchers(torch_team=True)


lock_cache_files(globals())  # (kernels._cache: safe between processes)
