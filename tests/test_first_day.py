"""A Horovod user's first day: mpitrainrun runs `python` from its own
environment when none is activated and quiets TensorFlow's start-up lines;
--check-build suggests the versions the README pins; Horovod's TF2 elastic
names and Keras 2 era calls work on Keras 3 with mpitrain's optimizer."""

import os
import re
import subprocess
import sys
import types

import numpy as np
import pytest

from mpitrain.launcher import check_build, endings, run
from tests.mpi_harness import ROOT, job_environment, mpi_test

TF_ENV = {"TF_CPP_MIN_LOG_LEVEL": "2"}
VENV_BIN = os.path.dirname(sys.executable)


def readme():
    with open(os.path.join(ROOT, "README.md")) as page:
        return page.read()


def test_mpitrainrun_runs_a_plain_python_of_its_environment_when_none_is_activated():
    path = os.pathsep.join(folder for folder in os.environ["PATH"].split(os.pathsep)
                           if folder != VENV_BIN and os.path.isdir(folder))
    job = subprocess.run(
        [os.path.join(VENV_BIN, "mpitrainrun"), "-np", "2", "python",
         "examples/numpy_softmax_regression.py"],
        cwd=ROOT, env={**job_environment(), "PATH": path},
        capture_output=True, text=True, timeout=120)
    assert job.returncode == 0, job.stderr
    assert "weights identical on all 2 ranks: True" in job.stdout


def test_the_ranks_get_tensorflows_log_level_unless_the_user_set_one(capsys):
    environ = {k: v for k, v in job_environment().items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    assert run.main(["--dry-run", "-np", "2", "python", "train.py"], environ) == 0
    assert "TF_CPP_MIN_LOG_LEVEL=2 " in capsys.readouterr().out
    environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
    assert run.main(["--dry-run", "-np", "2", "python", "train.py"], environ) == 0
    assert "TF_CPP_MIN_LOG_LEVEL" not in capsys.readouterr().out


def test_check_build_suggests_the_versions_the_readme_installs():
    text = readme()
    for install in (check_build.INSTALL_TORCH, check_build.INSTALL_TENSORFLOW):
        package, version = re.search(r"pip install ([\w-]+)==([\d.]+)", install).groups()
        assert f"{package}=={version}" in text, install
    # The README's CPU-only forms install torch so (with -c constraints.txt first).
    assert check_build.INSTALL_TORCH.removeprefix("pip install ") in text
    line, _ = check_build._framework("TensorFlow", "no_such_framework", [],
                                     check_build.INSTALL_TENSORFLOW)
    assert line.endswith("; pip install tensorflow-cpu==2.21.0"), line


@mpi_test(np=(2,), env=TF_ENV, timeout=180)
def test_horovods_keras2_era_compile_and_variables_calls_work_on_keras3():
    import keras
    import mpitrain.tensorflow.keras as hvd
    keras.utils.set_random_seed(hvd.rank())       # different start on every rank
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
    opt = hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9))
    model.compile(optimizer=opt, loss="mse", experimental_run_tf_function=False)
    x = np.full((4, 3), hvd.rank() + 1.0, np.float32)
    model.fit(x, np.zeros((4, 2), np.float32), epochs=2, verbose=0,
              callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0)])
    kernels = hvd.allgather_object(model.get_weights()[0])
    assert all(np.array_equal(kernels[0], kernel) for kernel in kernels)
    assert [v.path for v in opt.variables()] == [v.path for v in opt.variables]
    assert len(opt.variables()) >= 3                 # iterations, lr, momentum
    with pytest.raises(TypeError, match="a Keras 2 argument: drop it, or run Keras 2 "
                       r"with .* TF_USE_LEGACY_KERAS=1"):
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse",
                      experimental_run_tf_function=False)


@mpi_test(np=(2, 3), env=TF_ENV, timeout=180)
def test_horovods_tensorflow_elastic_names_restore_and_sync_variables():
    import tensorflow as tf
    import mpitrain.tensorflow as hvd
    weights = tf.Variable([float(hvd.rank())] * 3)
    state = hvd.elastic.TensorFlowState([weights], batch=0)
    state.sync()                                       # rank 0's values everywhere
    assert weights.numpy().tolist() == [0.0] * 3
    state.commit()
    weights.assign([5.0] * 3)
    state.batch = 7
    state.restore()
    assert weights.numpy().tolist() == [0.0] * 3 and state.batch == 0
    assert hvd.elastic.run is __import__(
        "mpitrain.tensorflow.keras.elastic", fromlist=["run"]).run
    assert hvd.elastic.TensorFlowKerasState.__name__ == "TensorFlowKerasState"
    with pytest.raises(ValueError, match="TF1 sessions"):
        hvd.elastic.TensorFlowState([weights], session=object())


def test_keras2s_optimizer_variables_call_works_on_plain_keras3_optimizers():
    # Horovod's tensorflow2_synthetic_benchmark.py calls opt.variables() on a
    # plain Keras optimizer; importing mpitrain.tensorflow makes that work.
    pytest.importorskip("tensorflow")
    import keras
    import mpitrain.tensorflow  # noqa: F401
    for opt in (keras.optimizers.SGD(0.1, momentum=0.9),
                keras.optimizers.LossScaleOptimizer(keras.optimizers.Adam())):
        opt.build([keras.Variable(np.ones(2, np.float32))])
        assert [v.path for v in opt.variables()] == [v.path for v in opt.variables]
        assert len(opt.variables()) >= 3             # iterations, lr, a slot


@mpi_test(np=(2, 3), env=TF_ENV, timeout=180)
def test_horovods_tf2_elastic_example_runs_with_only_its_import_changed():
    # The shape of Horovod's tensorflow2_mnist_elastic.py, on random images.
    import tensorflow as tf
    import mpitrain.tensorflow as hvd
    images = tf.random.uniform([64, 8, 8, 1], seed=hvd.rank())
    labels = tf.random.uniform([64], maxval=10, dtype=tf.int64, seed=hvd.rank())
    dataset = tf.data.Dataset.from_tensor_slices((images, labels)).repeat().batch(8)
    model = tf.keras.Sequential([tf.keras.layers.Flatten(), tf.keras.layers.Dense(10)])
    loss = tf.losses.SparseCategoricalCrossentropy(from_logits=True)
    opt = tf.optimizers.Adam(0.001 * hvd.size())

    @tf.function
    def training_step(images, labels, allreduce=True):
        with tf.GradientTape() as tape:
            loss_value = loss(labels, model(images, training=True))
        if allreduce:
            tape = hvd.DistributedGradientTape(tape)
        grads = tape.gradient(loss_value, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss_value

    for images, labels in dataset.take(1):
        training_step(images, labels, allreduce=False)

    @hvd.elastic.run
    def train(state):
        start_batch = state.batch
        for batch_idx, (images, labels) in enumerate(dataset.skip(state.batch).take(6)):
            state.batch = start_batch + batch_idx
            training_step(images, labels)
            if state.batch % 2 == 0:
                state.commit()

    state = hvd.elastic.TensorFlowKerasState(model, opt, batch=0)
    state.register_reset_callbacks([lambda: None])
    train(state)
    assert state.batch == 5
    kernels = hvd.allgather_object(model.get_weights()[0])
    assert all(np.array_equal(kernels[0], kernel) for kernel in kernels)


WARMUP_SCRIPT = """
import keras, numpy as np
import mpitrain.tensorflow.keras as hvd
hvd.init()
model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
model.compile(optimizer=hvd.DistributedOptimizer(keras.optimizers.SGD(0.1, momentum=0.9)),
              loss="mse")
warmup = hvd.callbacks.LearningRateWarmupCallback(0.1, warmup_epochs=1, verbose=1)
model.fit(np.ones((8, 3)), np.ones((8, 1)), batch_size=4, epochs=1, verbose=0,
          callbacks=[hvd.callbacks.BroadcastGlobalVariablesCallback(0), warmup])
"""


@pytest.mark.parametrize("nprocs", [2, 3])
def test_the_callbacks_messages_come_once_from_rank_0(nprocs, tmp_path):
    pytest.importorskip("tensorflow")
    script = tmp_path / "warmup.py"
    script.write_text(WARMUP_SCRIPT)
    job = subprocess.run([os.path.join(VENV_BIN, "mpitrainrun"), "-np", str(nprocs),
                          sys.executable, str(script)], cwd=ROOT, env=job_environment(TF_ENV),
                         capture_output=True, text=True, timeout=300)
    assert job.returncode == 0, job.stderr
    finished = [line for line in job.stdout.splitlines() if "learning rate warmup" in line]
    assert finished == ["[1,0]<stdout>: Epoch 1: finished gradual learning rate warmup "
                        "to 0.1."], job.stdout
    skipped = [line for line in job.stderr.splitlines()
               if "momentum_correction is skipped" in line]
    assert len(skipped) == 1 and skipped[0].startswith("[1,0]<stderr>: "), job.stderr


NOTICES = ("import sys\n"
           "sys.stderr.write('WARNING: All log messages before absl::InitializeLog() "
           "is called are written to STDERR\\n')\n"
           "sys.stderr.write('I0000 00:00:1795475723.538430   24940 port.cc:153] oneDNN "
           "custom operations are on. You may see slightly different numerical results "
           "due to floating-point round-off errors.\\n')\n"
           "sys.stderr.write('rank says: oneDNN custom operations are on. is my line\\n')\n")


@pytest.mark.parametrize("level,shown", [(None, False), ("0", True)])
def test_tensorflows_start_up_notices_go_unless_info_lines_are_asked_for(level, shown,
                                                                         tmp_path):
    script = tmp_path / "notices.py"
    script.write_text(NOTICES)
    env = {k: v for k, v in job_environment().items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    if level is not None:
        env["TF_CPP_MIN_LOG_LEVEL"] = level
    job = subprocess.run([os.path.join(VENV_BIN, "mpitrainrun"), "-np", "2",
                          sys.executable, str(script)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert job.returncode == 0, job.stderr
    lines = sorted(job.stderr.splitlines())
    mine = [f"[1,{rank}]<stderr>: rank says: oneDNN custom operations are on. is my line"
            for rank in range(2)]
    assert [line for line in lines if "my line" in line] == mine
    notices = [line for line in lines if "absl::InitializeLog" in line
               or "port.cc:153] oneDNN" in line]
    assert len(notices) == (4 if shown else 0), job.stderr


def test_mpitrain_tensorflow_and_hvd_elastic_export_no_helper_modules():
    # dir(hvd) and tab completion show a user the API, not the numpy that
    # mpitrain's own code imports.
    hvd = pytest.importorskip("mpitrain.tensorflow")
    import mpitrain.tensorflow.elastic
    for module in (hvd, mpitrain.tensorflow.elastic):
        leaked = [name for name, value in vars(module).items()
                  if not name.startswith("_") and isinstance(value, types.ModuleType)
                  and not value.__name__.startswith("mpitrain.")]
        assert not leaked, f"{module.__name__} exports {leaked}"


def test_the_sharded_example_leaves_another_users_checkpoint_alone_and_its_own_nowhere(
        tmp_path):
    # Every run saved /tmp/sharded_digits.pt before: a second user's run
    # overwrote the first's (or failed, where it could not).
    others = tmp_path / "sharded_digits.pt"
    others.write_bytes(b"another user's checkpoint")
    job = subprocess.run(
        [os.path.join(VENV_BIN, "mpitrainrun"), "-np", "2", sys.executable,
         "examples/pytorch_sharded_digits.py", "--epochs", "1"],
        cwd=ROOT, env=job_environment({"TMPDIR": str(tmp_path)}), capture_output=True,
        text=True, timeout=120)
    assert job.returncode == 0, job.stderr
    assert ("loaded by a plain torch.optim.Adam; saved and deleted (--checkpoint PATH "
            "keeps it)") in job.stdout
    assert others.read_bytes() == b"another user's checkpoint"
    assert [name for name in os.listdir(tmp_path) if "sharded_digits" in name] == [
        "sharded_digits.pt"]


def test_a_keras_example_without_tensorflow_says_what_installs_it():
    # The README's first command installs no TensorFlow; the Keras examples
    # then ended with "rank 1 exited with code 1" after the traceback of
    # `import keras`, and no word on what to install. Python without its
    # site-packages (-S) has no keras either.
    job = subprocess.run(
        [os.path.join(VENV_BIN, "mpitrainrun"), "-np", "2", sys.executable, "-S",
         "examples/keras_digits.py"],
        cwd=ROOT, env=job_environment(), capture_output=True, text=True, timeout=120)
    assert job.returncode == 1
    assert "ModuleNotFoundError: No module named 'keras'" in job.stderr
    assert job.stderr.splitlines()[-1].endswith(
        "; keras is not installed here: it comes with TensorFlow (pip install "
        "tensorflow-cpu==2.21.0; docs/installing.md); the job ended with exit code 1"), job.stderr


def test_a_module_missing_after_init_gets_the_same_word_on_what_installs_it():
    # A rank that imports torch only after init() fails through mpitrain's
    # hook, and its report names the exception.
    report = ("Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n"
              "    import torch\nModuleNotFoundError: No module named 'torch'\n")
    assert endings.summary(1, {1: report}, []) == (
        "rank 1 failed with ModuleNotFoundError: No module named 'torch' (traceback above); "
        "torch is not installed here: it comes with PyTorch (pip install torch==2.13.0+cpu "
        "--extra-index-url https://download.pytorch.org/whl/cpu; docs/installing.md); the job "
        "ended with exit code 1")
