"""threadpoolctl support: ``threadpool_info()`` lists ferrox_kv's worker
pool, and ``threadpool_limits(n)`` limits it (through ``set_num_threads``)
as it limits BLAS and OpenMP.

Rules
  - Importing ferrox_kv never imports threadpoolctl (about a fifth of
    ferrox_kv's own import time).  If threadpoolctl is already imported, the
    controller is registered at once; otherwise a finder on ``sys.meta_path``
    waits for its first import, registers the controller right after the
    module has run, and removes itself.
  - threadpoolctl finds libraries by file name; the controller claims only
    the extension module that ferrox_kv imported (``ferrox_kv._core``), never
    another package's ``_core`` module: it names a symbol only ferrox_kv's
    core exports (``check_symbols``), and its constructor never raises on
    another library (threadpoolctl before 3.8 does not catch that).
"""
import os
import sys

_registered = False


def _controller_class(threadpoolctl):
    import ferrox_kv

    core = os.path.realpath(ferrox_kv._core.__file__)

    class FerroxKvController(threadpoolctl.LibController):
        """ferrox_kv's attention threads (``ferrox_kv.set_num_threads``)."""

        user_api = "ferrox_kv"
        internal_api = "ferrox_kv"
        filename_prefixes = (os.path.basename(core).split(".")[0] + ".",)
        # exported by Cython for the module ferrox_kv._core alone
        check_symbols = ("__pyx_module_is_main_ferrox_kv___core",)

        def get_version(self):
            # called by the constructor, for any library with the file name
            return ferrox_kv.__version__ if os.path.realpath(self.filepath) == core else None

        def get_num_threads(self):
            return ferrox_kv.get_num_threads()

        def set_num_threads(self, num_threads):
            return ferrox_kv.set_num_threads(int(num_threads))

    return FerroxKvController


def _register(threadpoolctl):
    global _registered
    if _registered or not hasattr(threadpoolctl, "register"):
        return  # threadpoolctl < 3.5 has no register(): nothing to do
    threadpoolctl.register(_controller_class(threadpoolctl))
    _registered = True


class _Loader:
    """Runs threadpoolctl's own loader, then registers the controller."""

    def __init__(self, loader):
        self._loader = loader

    def __getattr__(self, name):
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        _register(module)


class _Finder:
    """On sys.meta_path until threadpoolctl is first imported."""

    def find_spec(self, name, path=None, target=None):
        if name != "threadpoolctl":
            return None
        _remove_finder()
        import importlib.util

        spec = importlib.util.find_spec(name)
        if spec is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Loader(spec.loader)
        return spec


_finder = _Finder()


def _remove_finder():
    try:
        sys.meta_path.remove(_finder)
    except ValueError:
        pass


def install():
    """Register the controller now if threadpoolctl is imported, else on
    its first import."""
    module = sys.modules.get("threadpoolctl")
    if module is not None:
        _register(module)
    elif _finder not in sys.meta_path:
        sys.meta_path.insert(0, _finder)
