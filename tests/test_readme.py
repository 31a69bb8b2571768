"""The README's commands: the first trains the digits example on 2 ranks
through mpitrainrun, the second is exactly what CI runs, their CPU-only forms
differ from them in the torch build alone, and the extras they install
exist. The times the docs give for the suite and the image build are each
stated in one place, which the others link to."""

import importlib.metadata
import os
import re
import shlex
import subprocess
import sys

from mpitrain.launcher import run
from tests.mpi_harness import ROOT, job_environment

# What a CPU-only form has instead of its command's torch pin: the CPU build,
# which only PyTorch's own index has.
CPU_TORCH = "torch==2.13.0+cpu"
CPU_INDEX = " --extra-index-url https://download.pytorch.org/whl/cpu"


def readme_text():
    with open(os.path.join(ROOT, "README.md")) as page:
        return page.read()


def readme_commands():
    return re.findall(r"```sh\n(.+?)\n```", readme_text(), re.S)


def installed_extras():
    """The extras of the installed mpitrain (the test command installs it with -e)."""
    return set(importlib.metadata.metadata("mpitrain").get_all("Provides-Extra"))


def set_up_commands():
    """{(trains or tests, CPU-only form or not): the README's command}."""
    found = {}
    for command in readme_commands():
        if command.startswith("python3 -m venv .venv && "):
            kind = "tests" if command.endswith("pytest -q") else "trains"
            found[kind, CPU_TORCH in command] = command
    assert set(found) == {(kind, cpu) for kind in ("trains", "tests")
                          for cpu in (False, True)}, found
    return found


def test_the_first_command_trains_the_digits_on_two_ranks():
    train = readme_commands()[0]
    assert train == set_up_commands()["trains", False]
    assert train.endswith("mpitrainrun -np 2 .venv/bin/python examples/pytorch_digits.py")


def test_ci_runs_the_readme_test_command():
    tests = set_up_commands()["tests", False]
    assert tests in open(os.path.join(ROOT, ".ci", "run")).read()


def test_each_cpu_only_form_differs_from_its_command_in_the_torch_build_alone():
    commands = set_up_commands()
    for kind in ("trains", "tests"):
        cpu = commands[kind, True]
        # The index goes with the first install, the one of torch.
        first_install = cpu.split(" && ")[1]
        assert CPU_TORCH in first_install and first_install.endswith(CPU_INDEX), cpu
        assert cpu.replace(CPU_INDEX, "").replace(CPU_TORCH, "torch==2.13.0") \
            == commands[kind, False]


def test_the_extras_the_commands_install_exist():
    for command in readme_commands():
        for extras in re.findall(r"-e '\.\[([\w,-]+)\]'", command):
            assert set(extras.split(",")) <= installed_extras(), extras


def test_the_launcher_runs_the_numpy_example_on_two_ranks():
    launcher = os.path.join(os.path.dirname(sys.executable), "mpitrainrun")
    result = subprocess.run(
        [launcher, "-np", "2", sys.executable, "examples/numpy_softmax_regression.py"],
        cwd=ROOT, env=job_environment(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "weights identical on all 2 ranks: True" in result.stdout
    accuracy = float(re.search(r"test accuracy: ([0-9.]+)", result.stdout).group(1))
    assert accuracy > 0.6


def test_the_two_machine_command_gives_the_remote_ranks_this_environments_python(capsys):
    (line,) = [line for line in "\n".join(readme_commands()).splitlines()
               if "# two machines" in line]
    launcher, *args = shlex.split(line, comments=True)
    assert launcher == ".venv/bin/mpitrainrun" and args[-2:] == ["python", "train.py"]
    assert run.main(["--dry-run"] + args, job_environment()) == 0
    mpirun_line = capsys.readouterr().out
    assert "--host node1:4,node2:4" in mpirun_line
    # Remote ranks start with their own login PATH unless mpirun passes this one on.
    assert "-x PATH " in mpirun_line


def test_the_readme_gives_the_suites_size_as_it_is():
    # The time and memory the README states were measured on this many tests;
    # once the suite has grown or shrunk by a quarter they are stale.
    stated = int(re.search(r"(\d+) tests took about", open(os.path.join(ROOT, "README.md"))
                           .read()).group(1))
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT, env=job_environment({"TF_CPP_MIN_LOG_LEVEL": "2"}), capture_output=True,
        text=True, timeout=600)
    count = int(re.search(r"^(\d+) tests collected", collected.stdout, re.M).group(1))
    assert abs(count - stated) <= count / 4, (
        f"the README gives the suite's time and memory for {stated} tests, but pytest "
        f"collects {count}: measure the suite again and update the README")


def sentences(page):
    """The sentences of a page of the docs (list items and table rows too)."""
    with open(os.path.join(ROOT, page)) as text:
        blocks = re.split(r"\n\s*\n|\n(?=- |\| )", text.read())
    return [sentence for block in blocks
            for sentence in re.split(r"(?<=[.;])\s+", " ".join(block.split()))]


# A time given as a figure ("about 34 minutes", "3 min 40 s", "about 10
# more"); a limit ("under 45 minutes") is not one.
DURATION = re.compile(r"(?<!under )\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)? (?:minutes?|min|s|hours?)\b"
                      r"|\babout \d+(?:\.\d+)?\b(?! ?(?:GB|GiB|MB|KiB|%|tests))")
# The pages that give the set-up's times: each time with its date and
# machine, and each of the figures below on its page alone.
SETUP_PAGES = ["README.md", "docs/installing.md", "docs/docker.md"]
# Each figure: the one page that states it, and what a sentence that gives it
# again elsewhere talks about.
FIGURES = {
    "the suite's time": ("README.md", re.compile(r"\bsuite\b|\btests took\b|\bCI\b")),
    "the image's build time": ("docs/docker.md",
                               re.compile(r"\bimages?\b.*\bbuil[dt]|\bbuil[dt].*\bimages?\b")),
}


def test_every_time_the_set_up_pages_give_has_its_date_and_machine():
    # docker.md gave the suite's time as "about 18 today".
    for page in SETUP_PAGES:
        for sentence in sentences(page):
            # What something took, not a setting ("after 60 s").
            if DURATION.search(sentence) and re.search(r"\b(took|takes?|adds?)\b", sentence):
                assert re.search(r"\b20\d\d-\d\d-\d\d\b", sentence) and "2-core" in sentence, (
                    f"{page} gives a time without its date and machine: {sentence}")


def test_the_suites_and_the_images_times_are_stated_in_one_place_each():
    # README.md said the image build adds "about 5" minutes, docker.md "3
    # minutes plus about 10" and "15 minutes"; the suite took "about 34" in
    # one and "about 18" in the other.
    for figure, (home, topic) in FIGURES.items():
        assert [sentence for sentence in sentences(home)
                if topic.search(sentence) and DURATION.search(sentence)], (
            f"{home} no longer gives {figure}")
        for page in SETUP_PAGES:
            again = [sentence for sentence in sentences(page)
                     if page != home and topic.search(sentence) and DURATION.search(sentence)]
            assert not again, f"{page} gives {figure} again instead of linking to {home}: {again}"
    assert "(docs/docker.md#how-long-a-build-takes)" in readme_text()
    assert "\n### How long a build takes\n" in open(os.path.join(ROOT, "docs", "docker.md")).read()
