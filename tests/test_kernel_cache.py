"""Numba's disk cache of the kernels follows the sources they inline (bngrad.kernels._cache)."""

import os
import subprocess
import sys
import textwrap

from numba.core.caching import CacheImpl

import bngrad.kernels  # noqa: F401  (installs the locator)
from bngrad.kernels import _cache, batchnorm


def _locator(dispatcher):
    return dispatcher._cache._impl.locator


def test_kernels_are_stamped_with_the_inlined_sources():
    locator = _locator(batchnorm.reduce_runs_serial)
    assert isinstance(locator, _cache.InlinedSourcesLocator)
    paths = tuple(os.path.join(_cache.HERE, name) for name in _cache.INLINED)
    assert locator.get_source_stamp()[1] == _cache.sources_stamp(paths)
    assert locator.get_cache_path()  # the wrapped locator still answers the rest


def test_the_stamp_changes_with_any_inlined_file(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("x = 1\n")
    b.write_text("y = 1\n")
    before = _cache.sources_stamp((str(a), str(b)))
    b.write_text("y = 2\n")
    assert _cache.sources_stamp((str(a), str(b))) != before


def test_functions_elsewhere_keep_numbas_own_locator(tmp_path):
    module = tmp_path / "elsewhere.py"
    module.write_text("")
    assert _cache.InlinedSourcesLocator.from_function(None, str(module)) is None
    assert CacheImpl._locator_classes.count(_cache.InlinedSourcesLocator) == 1


def test_an_edit_to_an_inlined_file_recompiles(tmp_path):
    """A copy of the kernels package whose _ops.py changes after a first, cached compile: the
    second process must see the change (before kernels._cache it kept the stale kernel)."""
    package = tmp_path / "pkg"
    kernels_dir = os.path.dirname(batchnorm.__file__)
    code = textwrap.dedent("""
        import sys
        sys.path.insert(0, sys.argv[1])
        from numba import njit
        from kernels_copy import _cache
        _cache.install()
        from kernels_copy._ops import take
        @njit(cache=True)
        def first(a):
            return take(a, 0)
        import numpy as np
        print(first(np.arange(3.0) + 1))
        """)
    (package / "kernels_copy").mkdir(parents=True)
    source = open(os.path.join(kernels_dir, "_cache.py")).read()
    (package / "kernels_copy" / "_cache.py").write_text(source)
    (package / "kernels_copy" / "__init__.py").write_text("")
    for inlined in _cache.INLINED:  # the other stamped files, empty
        (package / "kernels_copy" / inlined).write_text("")
    ops = "from numba.extending import overload\n\ndef take(a, i):\n    pass\n\n" \
          "@overload(take, inline='always')\ndef _take(a, i):\n    return lambda a, i: a[i]{}\n"
    (package / "kernels_copy" / "_ops.py").write_text(ops.format(""))
    script = package / "kernels_copy" / "user.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}  # the in-tree cache

    def run():
        return subprocess.run([sys.executable, str(script), str(package)], env=env,
                              capture_output=True, text=True, check=True).stdout.strip()
    assert run() == "1.0"
    assert run() == "1.0"  # from the cache
    (package / "kernels_copy" / "_ops.py").write_text(ops.format(" * 10"))
    assert run() == "10.0"


def test_every_cached_kernel_reads_and_writes_its_cache_under_a_lock():
    from bngrad._bench import floor
    from bngrad.kernels import _launch
    cached = [v for module in (batchnorm, _launch, floor) for v in vars(module).values()
              if getattr(getattr(v, "_cache", None), "_cache_file", None) is not None]
    assert len(cached) > 50
    for dispatcher in cached:
        assert isinstance(dispatcher._cache._cache_file, _cache.LockedCacheFile), dispatcher


def test_a_save_waits_for_another_process_holding_the_lock(tmp_path):
    """Two processes saving new signatures of one function at once could give both the same
    data file (kernels._cache); a save waits while the lock is held elsewhere (a separate open
    file description, as another process's), then completes, and the entry loads."""
    import fcntl
    import threading
    import time
    cache_file = _cache.LockedCacheFile(str(tmp_path), "kernel-1.py311", "stamp")
    cache_file.save("first", b"one")  # creates the index, and the lock file
    done = threading.Event()
    with open(os.path.join(str(tmp_path), "kernel-1.py311.nbi.lock"), "a") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        saver = threading.Thread(target=lambda: (cache_file.save("second", b"two"), done.set()))
        saver.start()
        time.sleep(0.3)
        assert not done.is_set(), "saved while another holder had the lock"
        fcntl.flock(other, fcntl.LOCK_UN)
    saver.join(timeout=10)
    assert done.is_set()
    assert cache_file.load("first") == b"one" and cache_file.load("second") == b"two"


def _item_name(launcher: str) -> str:
    """The kernels.batchnorm item a launcher of kernels._launch.LAUNCHERS runs."""
    return ("transpose" if launcher == "transpose_last_two" else launcher) + "_item"


def test_each_items_worker_has_a_name_of_its_own():
    """Numba names a compiled function by its qualified name, argument types and a per-process
    counter, and links functions of one name as one: workers sharing one name let a process
    that loaded two cached launchers run one item's worker for another's (kernels._launch)."""
    from bngrad.kernels import _launch
    items = [getattr(batchnorm, _item_name(name)) for name in _launch.LAUNCHERS]
    names = [_launch._worker(item).__qualname__ for item in items]
    assert len(set(names)) == len(items)
    for item, name in zip(items, names):
        assert item.py_func.__name__ in name


def test_cached_launchers_call_only_their_own_items_worker():
    """Against the disk cache itself: every cached launcher's code names the worker of its
    own item, and no other (run after a call that loads or compiles two launchers whose
    items take the same argument types: the fused and fused_short forwards)."""
    import re

    import numpy as np

    import bngrad
    from bngrad.kernels import _launch
    rng = np.random.default_rng(0)
    for shape in ((2, 16, 16, 16), (2, 32, 7, 7)):  # the fused path, then fused_short
        bngrad.batch_norm_relu_forward(rng.standard_normal(shape, dtype=np.float32),
                                       num_threads=2)
    checked = 0
    for name in _launch.LAUNCHERS:
        dispatcher = getattr(_launch, "_" + name)
        cache_file = dispatcher._cache._cache_file
        folder = os.path.dirname(cache_file._index_path)
        own = _item_name(name) + "_worker"
        for entry in cache_file._load_index().values():  # this source's entries only
            with open(os.path.join(folder, entry), "rb") as f:
                workers = set(re.findall(rb"_launch7_worker12_3clocals_3e\d+(\w+?_worker)B",
                                         f.read()))
            assert workers == {own.encode()}, (entry, workers)
            checked += 1
    assert checked >= 2
